"""Batches: `HostBatch` (a loader slot on the host, no copy), `DeviceBatch` (its tensors
on the device, with positions, loss mask and document segments derived there), and
`DeviceFeed`, the one place that copies batches to the device, prefetches the next
step's micro-batches and releases slots once their copies have landed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pytrain import _loader

__all__ = [
    "position_ids", "loss_mask", "token_ids", "cu_seqlens",
    "HostBatch", "DeviceBatch", "DeviceFeed", "FeedTime", "CopyEvent",
]  # fmt: skip


def position_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position ids of (rows, width) document ids: 0, 1, ... from the first token of each
    run of equal ids (a piece of one document), 0 on padding (-1). Same definition as
    `rust_loader::rows::position_ids`; a few small kernels on the GPU."""
    rows, width = doc_ids.shape
    idx = torch.arange(width, dtype=torch.int32, device=doc_ids.device).expand(rows, width)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, 0).cummax(dim=1).values
    return torch.where(doc_ids >= 0, idx - first, 0)


def loss_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """True at t when token t+1 is the next token of the same piece, so the prediction
    made at t is trained; False at a piece's last token, the row's last token and on
    padding. Same definition as `rust_loader::rows::loss_mask`."""
    mask = torch.zeros_like(doc_ids, dtype=torch.bool)
    mask[:, :-1] = (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    return mask


def token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """int32 ids from slot tokens (uint16 or int32). uint16 goes through an int16 view,
    whose conversion every torch backend implements, and the sign bits are masked off."""
    if tokens.dtype == torch.uint16:
        return tokens.view(torch.int16).to(torch.int32) & 0xFFFF
    return tokens.to(torch.int32)


def cu_seqlens(doc_ids: np.ndarray) -> np.ndarray:
    """int32 segment offsets of a (rows, width) array of document ids: a segment starts at
    every row start and wherever the id changes (padding runs are segments of their own,
    so they never mix with a document). Padded with the total to a power-of-two length,
    so a run sees a handful of shapes rather than one per document count. Computed on the
    host from the slot's ids, so the device never syncs to find them (FA4 reads them)."""
    rows, width = doc_ids.shape
    starts = np.ones((rows, width), dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = np.flatnonzero(starts)
    out = np.full(1 << len(idx).bit_length(), rows * width, dtype=np.int32)
    out[: len(idx)] = idx
    return out


@dataclass
class HostBatch:
    """A batch in a loader slot. `tokens` (the dataset's dtype: uint16 or int32) and
    `doc_ids` (int32, -1 on padding) are views of the slot (no copy): valid until
    `release()`. Rows hold seq_len+1 tokens: inputs are [:, :-1], targets [:, 1:].
    `position_ids` and `loss_mask` are derived from `doc_ids` (on the host here; `.to()`
    derives them on the device, after a copy of tokens and doc ids only).

    `HostBatch.synthetic()` makes one that belongs to no loader (compile warm-up)."""

    tokens: torch.Tensor
    doc_ids: torch.Tensor
    epoch: int
    doc_tokens: int
    pad_tokens: int
    pieces: int
    """Runs of one document in the batch; each one's last token has no target."""
    _slot: int = -1
    _owner: SlotOwner | None = None
    _inner: _loader.Loader | None = None
    """The loader threads that filled the slot (a restart starts new ones)."""

    @staticmethod
    def synthetic(rows: int, seq_len: int, vocab: int, generator: torch.Generator) -> HostBatch:
        """A batch of random ids, one document per row, shaped and typed like a loader
        slot's (int32 tokens, int32 doc ids): compiled graphs see what training will."""
        tokens = torch.randint(
            0, vocab, (rows, seq_len + 1), dtype=torch.int32, generator=generator
        )
        doc_ids = torch.zeros(rows, seq_len + 1, dtype=torch.int32)
        return HostBatch(tokens, doc_ids, 0, rows * (seq_len + 1), 0, rows)

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.tokens[:, 1:]

    @property
    def position_ids(self) -> torch.Tensor:
        return position_ids(self.doc_ids)

    @property
    def loss_mask(self) -> torch.Tensor:
        return loss_mask(self.doc_ids)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Document segments of the input positions (see `cu_seqlens`)."""
        return torch.from_numpy(cu_seqlens(self.doc_ids[:, :-1].numpy()))

    @property
    def loss_tokens(self) -> int:
        """Targets that count in the loss (where the loss mask is true), known without
        reading the batch: every document token but each piece's last."""
        return self.doc_tokens - self.pieces

    def release(self) -> None:
        """Gives the slot back to the loader; the views must not be used afterwards.
        Releasing twice is harmless."""
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner._release(self)

    def to(self, device: torch.device | str, segments: bool = False) -> DeviceBatch:
        """Copies to `device` and hands the slot back: on the CPU at once; on CUDA the copy
        is non-blocking (pinned memory, a side stream) and the loader releases the slot
        when the copy has landed (checked at its next batch, or waited for when it needs
        the slot). Either way the caller has nothing left to release.
        `segments`: also the document segments (only FA4 reads them; host work per batch)."""
        out, landed = _copy(self, torch.device(device), segments)
        if landed is None or self._owner is None:
            self.release()
        else:
            owner, self._owner = self._owner, None
            owner._defer(self, landed)
        return out


class CopyEvent(Protocol):
    """What `_copy` returns for a copy still in flight (torch.cuda.Event has both)."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


# What this module needs of a loader, said here so that the dependency runs one way:
# pytrain.data.loader (TokenLoader) imports this module and satisfies both.
class SlotOwner(Protocol):
    """Where a HostBatch's slot goes back: at once, or when its copy has landed."""

    def _release(self, hb: HostBatch) -> None: ...
    def _defer(self, hb: HostBatch, landed: CopyEvent) -> None: ...


class BatchSource(Protocol):
    """What DeviceFeed reads: host batches, and the position after those handed out."""

    def __next__(self) -> HostBatch: ...
    def waited_s(self) -> float: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


def _copy(
    hb: HostBatch, device: torch.device, segments: bool
) -> tuple[DeviceBatch, CopyEvent | None]:
    """The device batch and, for an asynchronous copy, the event that marks its landing
    (None: the slot may be reused now). Tests replace this to simulate a copy in flight."""
    if device.type == "cpu":
        return DeviceBatch.of(hb, lambda t: t.clone(), segments), None
    # Copy on a side stream, so the copy (and the host work before it) overlaps the
    # compute already queued; the compute stream waits for the copy before using it.
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    compute = torch.cuda.current_stream(device)
    side = _copy_stream(device)
    with torch.cuda.stream(side):
        out = DeviceBatch.of(hb, lambda t: t.to(device, non_blocking=True), segments)
        done = torch.cuda.Event()
        done.record(side)
    compute.wait_event(done)
    for t in (out.input_ids, out.targets, out.position_ids, out.doc_ids, out.loss_mask):
        t.record_stream(compute)  # memory made on the side stream, used on compute
    if out.cu_seqlens is not None:
        out.cu_seqlens.record_stream(compute)
    return out, done


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


@dataclass
class DeviceBatch:
    """A batch on the training device; model-ready views plus the loss mask. It holds no
    loader slot: the data layer released (or will release) the slot it came from."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    loss_mask: torch.Tensor
    epoch: int
    doc_tokens: int
    pad_tokens: int
    loss_tokens: int = -1
    """Targets counted by the loss, computed on the host (no device sync to read it);
    -1: unknown (a hand-made batch), counted from the mask."""
    cu_seqlens: torch.Tensor | None = None
    """int32 document segments of the flattened inputs (see `cu_seqlens`)."""

    @staticmethod
    def of(b: HostBatch, move, segments: bool = False) -> DeviceBatch:
        """Moves tokens and doc ids with `move`, then derives the rest where they landed."""
        ids = token_ids(move(b.tokens))
        doc_ids = move(b.doc_ids)
        return DeviceBatch(
            input_ids=ids[:, :-1],
            targets=ids[:, 1:].long(),
            position_ids=position_ids(doc_ids)[:, :-1],
            doc_ids=doc_ids[:, :-1],
            loss_mask=loss_mask(doc_ids)[:, :-1],
            cu_seqlens=move(b.cu_seqlens) if segments else None,
            epoch=b.epoch,
            doc_tokens=b.doc_tokens,
            pad_tokens=b.pad_tokens,
            loss_tokens=b.loss_tokens,
        )


@dataclass(frozen=True)
class FeedTime:
    """The host's seconds spent getting micro-batches: `wait_s` blocked on the loader (no
    batch ready in its ring, or a slot's earlier copy not landed; the loader's own
    `stats()["wait_s"]` counts the same), `host_s` in all (the wait, taking the batches
    and queueing their copies and derived tensors: host work that overlaps the device's
    queued work unless the host falls behind it)."""

    wait_s: float = 0.0
    host_s: float = 0.0

    def __add__(self, other: FeedTime) -> FeedTime:
        return FeedTime(self.wait_s + other.wait_s, self.host_s + other.host_s)


class DeviceFeed:
    """Micro-batches of a `TokenLoader` on a device: the one place that copies batches
    to the device (on a side stream, with document segments when the attention reads
    them), fetches the next step's batches while the current step runs, and knows the
    loader state that matches the batches consumed so far (prefetched ones excluded).

        with DeviceFeed(loader, device) as feed:
            for b in feed: ...            # DeviceBatch; nothing to release
            batches, spent = feed.take(4)   # spent: FeedTime

    Slots are released by the loader as copies land; `close()` waits for the copies in
    flight and closes the loader (on every path, exceptions included, under `with`)."""

    def __init__(self, loader: BatchSource, device: torch.device | str, segments: bool = False):
        self.loader = loader
        self.device = torch.device(device)
        self.segments = segments
        self._ahead: list[DeviceBatch] = []
        self._ahead_time = FeedTime()  # spent fetching the batches ahead
        self._state_taken: dict | None = None  # loader state before the batches ahead

    def __iter__(self) -> Iterator[DeviceBatch]:
        return self

    def __next__(self) -> DeviceBatch:
        if self._ahead:
            b = self._ahead.pop(0)
            if not self._ahead:
                self._state_taken = None
            return b
        return next(self.loader).to(self.device, self.segments)

    def take(self, n: int) -> tuple[list[DeviceBatch], FeedTime]:
        """The next `n` batches (prefetched ones first) and the time spent getting them
        (their prefetch included). Raises StopIteration if the loader ends before `n`."""
        spent, self._ahead_time = self._ahead_time, FeedTime()
        return self._timed(lambda: [next(self) for _ in range(n)], spent)

    def prefetch(self, n: int) -> None:
        """Fetches `n` batches now (call while the device is busy), keeping the loader
        state from before them for `state_dict()`."""
        if self._state_taken is None:
            self._state_taken = self.loader.state_dict()

        def fetch() -> list[DeviceBatch]:
            return [next(self.loader).to(self.device, self.segments) for _ in range(n)]

        batches, self._ahead_time = self._timed(fetch, self._ahead_time)
        self._ahead += batches

    def _timed(
        self, fetch: Callable[[], list[DeviceBatch]], spent: FeedTime
    ) -> tuple[list[DeviceBatch], FeedTime]:
        waited, t0 = self.loader.waited_s(), time.perf_counter()
        out = fetch()
        now = FeedTime(self.loader.waited_s() - waited, time.perf_counter() - t0)
        return out, spent + now

    def state_dict(self) -> dict:
        """The loader state after the batches handed out (not the ones fetched ahead)."""
        return (
            dict(self._state_taken) if self._state_taken is not None else self.loader.state_dict()
        )

    def load_state_dict(self, state: dict) -> None:
        self._ahead.clear()
        self._ahead_time, self._state_taken = FeedTime(), None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self._ahead.clear()
        self.loader.close()

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
