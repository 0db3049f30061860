"""`TokenLoader`: batches from a token-shard dataset, filled by Rust threads into a ring
of (pinned, where CUDA is present) host buffers, exposed to Python without a copy.

    loader = TokenLoader("data/ds", seq_len=1024, batch_size=8)
    for batch in loader:
        gpu = batch.to("cuda")     # non-blocking copy; the slot is released when it is done
        ...

A slot is written by Rust only while it is free; the consumer gets it, reads it (or
copies it to the GPU) and releases it. `state_dict()` is a handful of integers; loading
it yields exactly the batches an uninterrupted run would have produced next."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from pytrain import _loader
from pytrain.config import LoaderConfig
from pytrain.data.batch import CopyEvent, HostBatch

__all__ = ["TokenLoader"]


class TokenLoader:
    """Iterable of `HostBatch` over a token-shard dataset; see the module docstring.

    The loader tracks every slot it hands out: a batch is the consumer's until it calls
    `release()` or `to(device)`; after `to()` on CUDA the loader itself releases the slot
    once the copy has landed. A consumer therefore cannot leak a slot by copying batches
    to a device, early stops included, and `close()` (or leaving a `with` block) waits for
    copies in flight and gives everything back."""

    def __init__(self, path: str | Path, config: LoaderConfig | None = None, **overrides):
        self.path = Path(path)
        config = config or LoaderConfig()
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(config)})
        if unknown:
            raise TypeError(f"TokenLoader has no option {unknown[0]!r}")
        self.config = dataclasses.replace(config, **overrides)
        self.dataset = _loader.Dataset(str(self.path))
        self._inner: _loader.Loader | None = None
        self._state: dict | None = None
        self._start()

    def _slot_elems(self) -> int:
        return max(rows * (seq + 1) for rows, seq in self.config.batch_shapes())

    def _start(self) -> None:
        c = self.config
        pin = torch.cuda.is_available() if c.pin_memory is None else c.pin_memory
        n = self._slot_elems()
        if self._inner is not None:
            self._reclaim(keep=0)
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
        self._inner = _loader.Loader(self.dataset, self._slots, c, state=self._state)

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
            landed.synchronize()
            self._release(hb)

    @property
    def held_slots(self) -> int:
        """Slots handed to the consumer and not yet given back (copies in flight included)."""
        return len(self._held)

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the next batch starts: a few integers plus dataset/config fingerprints."""
        return dict(self._running().state())

    def load_state_dict(self, state: dict) -> None:
        """Restarts so the next batch is the one after `state` was saved. Raises
        StateError if the dataset or the batch-shaping settings changed."""
        self._state = dict(state)
        self._start()

    @property
    def epoch(self) -> int:
        return int(self._running().state()["epoch"])

    def stats(self) -> dict:
        return dict(self._running().stats())

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
            self._reclaim(keep=0)
        self._inner = None

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
