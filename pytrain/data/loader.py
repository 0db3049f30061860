"""`TokenLoader`: batches from a token-shard dataset, filled by Rust threads into a ring
of (pinned, where CUDA is present) host buffers, exposed to Python without a copy.

    loader = TokenLoader("data/ds", seq_len=1024, batch_size=8)
    for batch in loader:
        gpu = batch.to("cuda")     # non-blocking copy; the slot is released when it is done
        ...

A mixture of datasets takes names, weights (shares of tokens) and optional stages:

    loader = TokenLoader({"web": "data/web", "code": "data/code"},
                         weights={"web": 0.7, "code": 0.3},
                         stages=[(5000, {"web": 0.5, "code": 0.5})])  # from global batch 5000

A slot is written by Rust only while it is free; the consumer gets it, reads it (or
copies it to the GPU) and releases it. `state_dict()` is a handful of integers per
source, the same on every rank at a step boundary; loading it (on any number of ranks)
yields exactly the batches an uninterrupted run would have produced next."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

from pytrain import _loader
from pytrain._loader import StateError
from pytrain.config import LoaderConfig, location, location_name
from pytrain.data.batch import CopyEvent, HostBatch

__all__ = ["TokenLoader"]


class TokenLoader:
    """Iterable of `HostBatch` over a token-shard dataset; see the module docstring.

    The loader tracks every slot it hands out: a batch is the consumer's until it calls
    `release()` or `to(device)`; after `to()` on CUDA the loader itself releases the slot
    once the copy has landed. A consumer therefore cannot leak a slot by copying batches
    to a device, early stops included, and `close()` (or leaving a `with` block) waits for
    copies in flight and gives everything back."""

    def __init__(
        self,
        path: str | Path | Mapping[str, str | Path],
        config: LoaderConfig | None = None,
        *,
        weights: Mapping[str, float] | None = None,
        stages: Sequence[tuple[int, Mapping[str, float]]] = (),
        **overrides,
    ):
        config = config or LoaderConfig()
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(config)})
        if unknown:
            raise TypeError(f"TokenLoader has no option {unknown[0]!r}")
        self.config = dataclasses.replace(config, **overrides)
        sources = dict(path) if isinstance(path, Mapping) else {location_name(path): path}
        self.sources = {name: location(p) for name, p in sources.items()}
        self.names = list(self.sources)
        self.path = self.sources[self.names[0]]
        cache = self.config.cache_dir or None
        self.datasets = [
            _loader.Dataset(str(p), cache_dir=cache, cache_gb=self.config.cache_gb)
            for p in self.sources.values()
        ]
        self.dataset = self.datasets[0]  # a mixture's sources share one vocabulary
        self._schedule = self._mixture(weights, stages)
        self._inner: _loader.Loader | None = None
        self._state: dict | None = None
        # Seconds the consumer was blocked, kept across restarts (the Rust loader's own
        # count starts at 0 with its threads): waiting on copies to land, and on the ring
        # of the loaders that ran before this one.
        self._copy_wait_s = 0.0
        self._ring_wait_before_s = 0.0
        self._start()

    def _mixture(self, weights, stages) -> list[tuple[int, list[float]]] | None:
        """The Rust schedule: (first global item, weight per source) per stage. Stage starts
        are given in global batches (all ranks' batches counted: step x grad_accum x
        world size); an item is a row in pack mode."""
        if len(self.names) == 1 and weights is None and not stages:
            return None
        if weights is None:
            raise ValueError(f"a mixture of {', '.join(self.names)} needs weights")

        def row(w: Mapping[str, float], where: str) -> list[float]:
            extra = sorted(set(w) - set(self.names))
            if extra:
                raise ValueError(
                    f"{where}: no dataset named {extra[0]!r} (have {', '.join(self.names)})"
                )
            return [float(w.get(n, 0.0)) for n in self.names]

        per_batch = self.config.batch_size if self.config.mode == "pack" else 1
        out = [(0, row(weights, "weights"))]
        for start, w in sorted(stages, key=lambda s: s[0]):
            if start <= 0:
                raise ValueError(
                    f"stage at batch {start}: stages after the first start at a batch > 0"
                )
            out.append((int(start) * per_batch, row(w, f"stage at batch {start}")))
        return out

    def _slot_elems(self) -> int:
        return max(rows * (seq + 1) for rows, seq in self.config.batch_shapes())

    def _start(self) -> None:
        c = self.config
        pin = torch.cuda.is_available() if c.pin_memory is None else c.pin_memory
        n = self._slot_elems()
        if self._inner is not None:
            self._retire(self._inner)
        # Fresh slot memory on every (re)start: batches still held from an earlier start
        # keep their own memory and are never overwritten.
        token_dtype = torch.uint16 if self.dataset.dtype == "uint16" else torch.int32
        self._slots = [
            (
                torch.empty(n, dtype=token_dtype, pin_memory=pin),
                torch.empty(n, dtype=torch.int32, pin_memory=pin),
            )
            for _ in range(c.slots)
        ]
        self._view_cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._held: set[int] = set()  # slots handed out and not yet given back
        self._keep = max(1, c.slots - 1)  # the consumer may hold all slots but one
        self._landing: deque[tuple[HostBatch, CopyEvent]] = deque()  # copies in flight
        self._inner = None  # stop the old threads before starting new ones
        self._inner = _loader.Loader(
            self.datasets, self._slots, c, schedule=self._schedule, state=self._state
        )

    def __iter__(self) -> Iterator[HostBatch]:
        return self

    def __next__(self) -> HostBatch:
        if self._inner is None:
            raise StopIteration
        # The consumer may hold all slots but one: the one the loader threads fill next.
        self._reclaim(self._keep)
        got = self._inner.next()
        if got is None:
            raise StopIteration
        t, d = self._views(got.slot, got.rows, got.width)
        self._held.add(got.slot)
        return HostBatch(
            t, d, got.epoch, got.doc_tokens, got.pad_tokens, got.pieces, got.slot, self, self._inner
        )

    def _views(self, slot: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, width) views of a slot's arrays, made once per slot and shape: a batch
        costs no tensor creation (it was a sixth of the loader's CPU time)."""
        key = (slot, rows, width)
        if key not in self._view_cache:
            n = rows * width
            tokens, docs = self._slots[slot]
            self._view_cache[key] = (tokens[:n].view(rows, width), docs[:n].view(rows, width))
        return self._view_cache[key]

    # ---- slot life ----------------------------------------------------------------------
    def _release(self, hb: HostBatch) -> None:
        # A batch of an earlier start has its own slot memory and its threads are gone.
        if self._inner is not None and hb._inner is self._inner:
            self._held.discard(hb._slot)
            self._inner.release(hb._slot)

    def _defer(self, hb: HostBatch, landed: CopyEvent) -> None:
        """The slot of `hb` is being copied; release it once `landed` says so."""
        self._landing.append((hb, landed))

    def _reclaim(self, keep: int) -> None:
        """Releases the slots whose copies have landed, then waits for the oldest copies
        until the consumer holds fewer than `keep` slots (0: every copy, as on close).
        Copies land in the order they were queued (one side stream)."""
        while self._landing and self._landing[0][1].query():
            self._release(self._landing.popleft()[0])
        while self._landing and len(self._held) >= keep:
            hb, landed = self._landing.popleft()
            t0 = time.perf_counter()
            landed.synchronize()
            self._copy_wait_s += time.perf_counter() - t0
            self._release(hb)

    def _retire(self, inner: _loader.Loader) -> None:
        """Before `inner` stops (a restart or close): waits for every copy in flight and
        keeps its ring wait, whose count goes with its threads."""
        self._reclaim(keep=0)
        self._ring_wait_before_s += inner.stats()["wait_s"]

    @property
    def held_slots(self) -> int:
        """Slots handed to the consumer and not yet given back (copies in flight included)."""
        return len(self._held)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the next batch starts: per source (by name) its epoch, block, item and
        tokens taken, plus dataset/config fingerprints. At a step boundary (every rank has
        taken the same number of batches) it is the same on every rank."""
        state = dict(self._running().state())
        state["names"] = list(self.names)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restarts so the next batch is the one after `state` was saved, on this rank of
        this world size (which may differ from the saving run's). Raises StateError if a
        dataset or the batch-shaping settings changed."""
        names = state.get("names")
        # A single dataset may be moved or renamed; a mixture's sources are matched by name.
        if names is not None and list(names) != self.names and len(names) + len(self.names) > 2:
            raise StateError(
                f"the state was saved for datasets {', '.join(names)}; this loader reads {', '.join(self.names)}"
            )
        self._state = {k: v for k, v in state.items() if k != "names"}
        self._start()

    @property
    def epoch(self) -> int:
        """Epoch of the first source (of the only one, for a single dataset)."""
        return int(self._running().state()["sources"][0]["epoch"])

    def stats(self) -> dict:
        """Totals of this rank: batches, tokens (tokens_by_source by name), documents,
        skipped frames; epochs_by_source from the position; the seconds the consumer was
        blocked: wait_s, the sum of ring_wait_s (no batch ready in the ring) and
        copy_wait_s (a slot's copy to the device had not landed). The batches' counts are
        those of the running loader; the waits cover every start of this one."""
        inner = self._running()
        s = dict(inner.stats())
        s["ring_wait_s"] = self._ring_wait_before_s + s["wait_s"]
        s["copy_wait_s"] = self._copy_wait_s
        s["wait_s"] = s["ring_wait_s"] + s["copy_wait_s"]
        s["tokens_by_source"] = dict(zip(self.names, s["tokens_by_source"], strict=True))
        srcs = inner.state()["sources"]
        s["epochs_by_source"] = {n: int(p["epoch"]) for n, p in zip(self.names, srcs, strict=True)}
        return s

    def waited_s(self) -> float:
        """Seconds the consumer has been blocked so far (stats' wait_s)."""
        ring = self._inner.stats()["wait_s"] if self._inner is not None else 0.0
        return self._ring_wait_before_s + ring + self._copy_wait_s

    def _running(self) -> _loader.Loader:
        if self._inner is None:  # only between stopping old threads and starting new ones
            raise RuntimeError("the loader is not running")
        return self._inner

    @property
    def n_tokens(self) -> int:
        return self.dataset.n_tokens

    def close(self) -> None:
        """Waits for copies in flight, then stops the loader threads."""
        if self._inner is not None:
            self._retire(self._inner)
            self._inner.shutdown()  # joins the threads without the GIL
        self._inner = None

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
