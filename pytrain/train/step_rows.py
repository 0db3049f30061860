"""The rows a rank of a replica group trains in one step (pytrain.train.replica_groups).

Every rank of every group reads the same global order, at world size 1: a step's global
batch is its rows [start, start + rows). The step's quorum (the groups torchft found alive)
cuts them: group g of the quorum's G takes the contiguous rows `share(rows, G, g)`, and the
group's ranks cut that share again the same way. A step that commits moves the order on by
`rows`, whatever G was; one that does not gives its rows back (`rewind`), and the next
attempt cuts the same rows by its own quorum. Since every rank read all of the step's rows,
each knows the step's loss tokens (the loss's denominator) without asking the others.

An attempt that failed because groups died keeps its work where the next quorum is the same
groups less the dead (`Kept`): each survivor keeps the gradients of its share under the old
quorum, and the dead groups' shares, taken together in row order, are cut again over the
new quorum as a step is. The survivors then train about a step over the quorum's size each,
not a whole step again (a group dead of three: half a step, not one and a half), and every
row of the step is still trained once."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pytrain.data.batch import DeviceBatch, FeedTime, HostBatch, loss_mask
from pytrain.data.loader import TokenLoader


def share(rows: int, parts: int, index: int) -> tuple[int, int]:
    """[first, end) of part `index` when `rows` rows are cut into `parts` contiguous parts
    whose sizes differ by one at most."""
    return rows * index // parts, rows * (index + 1) // parts


@dataclass(frozen=True)
class Kept:
    """What an attempt that did not commit leaves to the next one, under a quorum of the same
    groups less some that died: this group's `place` in the old quorum of `groups`, and the
    old places of the groups the new quorum lacks (`lost`)."""

    place: int
    groups: int
    lost: tuple[int, ...]


def lost_rows(rows: int, kept: Kept) -> torch.Tensor:
    """The step's rows (indices within it, in order) that the lost groups had: what the
    survivors of `kept`'s quorum train again between them."""
    return torch.cat([torch.arange(*share(rows, kept.groups, p)) for p in sorted(kept.lost)])


def runs(index: torch.Tensor) -> list[list[int]]:
    """Sorted row indices as [first, last] runs of consecutive rows (the ledger's form)."""
    out: list[list[int]] = []
    for i in index.tolist():
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def _host_batch(tokens: torch.Tensor, doc_ids: torch.Tensor, epoch: int) -> HostBatch:
    """Rows cut from loader batches, as a batch of no loader slot (its counts recomputed)."""
    doc_tokens = int((doc_ids >= 0).sum())
    loss_tokens = int(loss_mask(doc_ids).sum())
    return HostBatch(
        tokens, doc_ids, epoch, doc_tokens, tokens.numel() - doc_tokens, doc_tokens - loss_tokens
    )


class StepRows:
    """DeviceFeed's part for a replica group: `take` asks for the step's quorum (through
    `quorum`, which may heal this group from a peer first), reads the step's rows and returns
    this rank's micro-batches of at most `batch_size` rows; `rewind` gives them back and
    `commit` keeps them. Its state is the loader's at the start of the open step."""

    def __init__(
        self, loader: TokenLoader, device: torch.device, segments: bool, rows: int, rank: int,
        ranks: int,
    ):  # fmt: skip
        self.loader, self.device, self.segments = loader, device, segments
        self.rows = rows
        """The global batch: rows a step trains over every group of its quorum."""
        self.rank, self.ranks = rank, ranks  # within the group
        self.quorum: Callable[[], tuple[int, int, Kept | None]] = lambda: (0, 1, None)
        """(this group's place in the step's quorum, the quorum's groups, what this group
        keeps of the step's failed attempt or None)."""
        self.ahead: Callable[[], tuple[int, int] | None] = lambda: None
        """Where the step is cut while its quorum forms: (place, groups) of the last
        committed step's quorum, the quorum asked for on another thread; or None, to wait
        for the quorum first."""
        self.loss_tokens = 0
        """Loss tokens of the step's rows, over every group."""
        self.group_rows = (0, 0)
        """[first, end) of this group's rows within the step (under a Kept quorum: those of
        the attempt it keeps)."""
        self.extra_rows: torch.Tensor | None = None
        """Under a Kept quorum, the indices within the step of the lost groups' rows that this
        group trains in this attempt; else None."""
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's tokens, doc ids
        self._epochs: list[int] = []  # the epoch of each loader batch of the step
        self._start: dict | None = None  # loader state before the open step's rows

    def take(self, n: int = 0) -> tuple[list[DeviceBatch], FeedTime]:
        """This rank's micro-batches of the next step (`n`, DeviceFeed's count, is decided
        here by the quorum) and the host's time spent on them: its part of the group's share,
        or under a Kept quorum its part of the group's piece of the lost groups' rows. Where
        `ahead` gives a cut, the step is cut so while the quorum forms (the trainer asked
        for it), and `cut` cuts it again once the quorum says otherwise."""
        ahead = self.ahead()
        group, groups, kept = (*ahead, None) if ahead is not None else self.quorum()
        waited, t0 = self.loader.waited_s(), time.perf_counter()
        self._start = self.loader.state_dict()
        tokens, doc_ids, self._epochs = self._read()
        self._rows = tokens, doc_ids
        self.loss_tokens = int(loss_mask(doc_ids).sum())
        batches = self.cut(group, groups, kept)
        spent = FeedTime(self.loader.waited_s() - waited, time.perf_counter() - t0)
        return batches, spent

    def cut(self, group: int, groups: int, kept: Kept | None) -> list[DeviceBatch]:
        """The open step's micro-batches of this rank as place `group` of a quorum of
        `groups` cuts them (under `kept`: of the lost groups' rows only)."""
        assert self._rows is not None
        tokens, doc_ids = self._rows
        if kept is None:
            first, end = self.group_rows = share(self.rows, groups, group)
            self.extra_rows = None
            index = torch.arange(first, end)
        else:
            self.group_rows = share(self.rows, kept.groups, kept.place)
            lost = lost_rows(self.rows, kept)
            index = self.extra_rows = lost[slice(*share(len(lost), groups, group))]
        mine = index[slice(*share(len(index), self.ranks, self.rank))]
        size = self.loader.config.batch_size
        batches = []
        for part in mine.split(size):
            if not len(part):
                continue
            first, last = int(part[0]), int(part[-1])
            # Consecutive rows (a share always; the lost rows mostly) as a view, not a copy.
            rows = slice(first, last + 1) if last - first + 1 == len(part) else part
            batch = _host_batch(tokens[rows], doc_ids[rows], self._epochs[first // size])
            batches.append(batch.to(self.device, self.segments))
        return batches

    def _read(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The step's rows from the loader (copied: the slots go back at once), and the epoch
        of each loader batch."""
        parts = []
        for _ in range(self.rows // self.loader.config.batch_size):
            hb = next(self.loader)
            parts.append((hb.tokens.clone(), hb.doc_ids.clone(), hb.epoch))
            hb.release()
        tokens, doc_ids, epochs = zip(*parts, strict=True)
        return torch.cat(tokens), torch.cat(doc_ids), list(epochs)

    def group_crc(self, extra: bool = False) -> int:
        """CRC-32 of the tokens of this group's rows of the open step, in order (the ledger's
        fingerprint of what the group trained); `extra`: of its extra_rows."""
        assert self._rows is not None
        if extra:
            assert self.extra_rows is not None
            return zlib.crc32(self._rows[0][self.extra_rows].contiguous().numpy().tobytes())
        first, end = self.group_rows
        return zlib.crc32(self._rows[0][first:end].contiguous().numpy().tobytes())

    def commit(self) -> None:
        self._start = self._rows = None

    def rewind(self) -> None:
        """The open step did not commit: its rows go back, to be cut by the next quorum."""
        assert self._start is not None
        start, self._rows = self._start, None
        self.load_state_dict(start)

    def prefetch(self, n: int) -> None:
        """Nothing ahead: the next step's share waits for its quorum."""

    def state_dict(self) -> dict:
        """The loader state at the start of the open step (after the last committed one)."""
        return dict(self._start) if self._start is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._start = None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()
