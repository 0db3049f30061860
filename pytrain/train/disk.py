"""Disk space: what a checkpoint of this run needs, whether the run directory has it, and
a write that failed because the disk is full (told apart from other failures so the run
ends with one line that says how much is free and how much was needed)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

# No torch at import: pytrain.train.cli names DiskFull before the environment guards.

FULL = (errno.ENOSPC, errno.EDQUOT)
"""No space left on the device; disk quota exceeded (what a full disk looks like to a
process on a cluster's shared file system)."""


class DiskFull(Exception):
    """A write that failed for space; the partial file is already removed."""


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer of `path` (or of its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def full_disk_error(e: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError in `e`'s chain, if any. torch.save reports a failed write
    as a RuntimeError of its zip writer with the OSError as its context; Inductor wraps
    its own in BackendCompilerFailed; DCP's CheckpointException carries it per rank."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in FULL:
            return x
        # torch.distributed.checkpoint reports every rank's failure to every rank, as
        # (exception, traceback) pairs by rank.
        for failure in getattr(x, "failures", {}).values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and (found := full_disk_error(inner)):
                return found
        x = x.__cause__ or x.__context__
    return None


def state_bytes(obj) -> int:
    """Bytes of the tensors in a (nested) state: what its checkpoint file holds, within
    the small overhead of the zip and the pickled plain values."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def checkpoint_estimate(model, optimizer, fp32_weights: bool) -> int:
    """Bytes one checkpoint of this run will take, known before the first step: the
    weights (fp32 where master weights are saved) and the optimizer state, measured where
    it exists (a resumed run, or MasterAdamW, whose moments exist from the start in their
    dtype) and otherwise taken as Adam's two fp32 moments per parameter (the largest of
    the optimizers here: Muon keeps one on its matrices)."""
    params = sum(p.numel() for p in model.parameters())
    weights = params * 4 if fp32_weights else state_bytes(dict(model.state_dict()))
    held = state_bytes(optimizer.state_dict())  # torch's: its "state", empty before a step
    return weights + (held if held else 2 * 4 * params)


def fitting(free: int, existing: int, per_checkpoint: int) -> int:
    """How many checkpoints of `per_checkpoint` bytes a run directory can keep, given `free`
    bytes and the `existing` bytes of its own checkpoints (which the run will replace): the
    kept ones plus the one being written before the oldest is removed."""
    return max(0, (free + existing) // max(1, per_checkpoint) - 1)


def space_note(run_dir: Path, per_checkpoint: int, keep: int) -> str | None:
    """One line when the run directory cannot hold the checkpoints the run will keep
    (`keep` of them plus the one being written before the oldest is removed), counting
    the space the run's existing checkpoints already take, saying how many would fit;
    None when they fit."""
    existing = sum(
        f.stat().st_size
        for p in Path(run_dir).glob("ckpt-*")
        for f in (p.rglob("*") if p.is_dir() else [p])
        if f.is_file()
    )  # checkpoint files and sharded checkpoints' directories
    kept = keep if keep > 0 else 1
    need = per_checkpoint * (kept + 1) - existing
    free = free_bytes(run_dir)
    if need <= free:
        return None
    fit = fitting(free, existing, per_checkpoint)
    room = (
        f"{fit} fit beside the one being written: --keep_ckpts {fit}"
        if fit
        else "not one fits beside the one being written: free some or point --out_dir elsewhere"
    )
    return (
        f"warning: {run_dir} has {human(free)} free for checkpoints of about "
        f"{human(per_checkpoint)} each; this run keeps {kept} and writes one more before "
        f"removing the oldest (about {human(need - free)} more than is free), so a checkpoint "
        f"write will fail for space; {room}"
    )
