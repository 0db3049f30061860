"""Checkpoints that survive a kill: written to a temporary file, fsynced, renamed into
place; the last K are kept; resume takes the newest one that loads (a truncated file is
skipped with a warning).

Saving does not stop training (`AsyncWriter`): the state is copied at the step boundary,
device tensors into pinned host buffers by copies queued on the current stream (so they
see exactly that step's values and the next step's kernels queue behind them), host
tensors by clone, and a background thread waits for the copies and writes the file.
One write is in flight at a time; the next save waits for it (its buffers are reused).

Loading never runs code (`read`): torch's weights-only unpickler, which rebuilds tensors
and plain values (dicts, lists, numbers, strings) and refuses every other global, so a
checkpoint someone else made cannot call `open` or `os.system` on the way in."""

from __future__ import annotations

import copy
import os
import pickle
import random
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from pytrain.config import ConfigError, flag_value
from pytrain.data.shards import fsync_dir
from pytrain.train import disk

SHARDED_STATE = "state.pt"
"""The file of a sharded checkpoint's directory that holds all but its tensors."""

PATTERN = re.compile(r"^ckpt-(\d{8})(\.pt)?$")
"""A checkpoint file (ckpt-<step>.pt), or a sharded checkpoint's directory (ckpt-<step>/,
pytrain.train.sharded_checkpoint)."""


class CheckpointMismatch(ConfigError):
    """A checkpoint that loads but was saved by a run this one cannot continue."""


def refuse_changed(path: Path, section: str, saved: dict, now: dict, why: str) -> None:
    """Raises CheckpointMismatch naming each setting of `section` that differs between a
    checkpoint (`saved`) and this run (`now`), and the flags that resume it."""
    differ = [k for k in now if saved.get(k) != now[k]]
    if not differ:
        return
    said = ", ".join(
        f"{section}.{k} {flag_value(saved.get(k))} (now {flag_value(now[k])})" for k in differ
    )
    flags = " ".join(f"--{section}.{k} {flag_value(saved.get(k))}" for k in differ)
    raise CheckpointMismatch(
        f"{path} was saved with {said}: {why}; resume it with {flags}, or train a new "
        "run under another --name"
    )


def ckpt_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}.pt"


class UnsafeCheckpoint(ConfigError):
    """A file that would run code (or rebuild objects of other types) when unpickled."""


# What checkpoints of earlier versions need beyond tensors and plain values: their numpy
# RNG state was a pickled ndarray (uint32 key). Rebuilding an array runs no user code.
# Current checkpoints store that key as a tensor and need none of these.
_NUMPY_CORE = getattr(np, "_core", None) or np.core
LEGACY_GLOBALS = [
    _NUMPY_CORE.multiarray._reconstruct,
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


def read(path: Path) -> dict:
    """A checkpoint's contents (see `read_file`); for a sharded checkpoint's directory, its
    state.pt, with `sharded` set to the directory (its tensors are loaded by
    pytrain.train.sharded_checkpoint into the model and optimizer that will hold them)."""
    path = Path(path)
    if path.is_dir():
        state = read_file(path / SHARDED_STATE)
        state["sharded"] = path
        return state
    return read_file(path)


def read_file(path: Path) -> dict:
    """A checkpoint's contents, loaded with `weights_only=True` (tensors and plain values;
    the numpy globals of LEGACY_GLOBALS for files of earlier versions). A file that needs
    any other global is refused with one line naming the file and those globals; a
    damaged file raises what torch raises."""
    try:
        with torch.serialization.safe_globals(LEGACY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # not a zip at all: not a file torch.save wrote
            raise UnsafeCheckpoint(
                f"{path}: refused to load: not a file torch.save wrote, as a pytrain "
                "checkpoint is (nothing in it was run)"
            ) from None
        allowed = {f"{g.__module__}.{g.__qualname__}" for g in LEGACY_GLOBALS}
        named = [g for g in unsafe if g not in allowed]
        what = ", ".join(named) if named else str(e).splitlines()[0][:200]
        raise UnsafeCheckpoint(
            f"{path}: refused to load: it holds {what}, which unpickling would call; a "
            "pytrain checkpoint holds tensors and plain values only (nothing was run)"
        ) from None


def rng_state() -> dict:
    # numpy's state as a dict with its key as a tensor: loadable without numpy globals.
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = dict(np_state["state"], key=torch.from_numpy(
        np_state["state"]["key"].astype(np.int64)))  # fmt: skip
    state = {
        "python": random.getstate(),
        "numpy": np_state,
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    if isinstance(np_state, dict):  # a tensor key (older checkpoints: numpy's tuple)
        key = np_state["state"]["key"]
        key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
        np_state = dict(np_state, state=dict(np_state["state"], key=key.astype(np.uint32)))
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _open_for_write(path: Path):
    """The file a checkpoint is written to (the tests' fault injection replaces it)."""
    return open(path, "wb")


def save(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Atomically writes `state` as ckpt-<step>.pt and prunes all but the newest `keep`.
    A write that fails removes its partial file (the previous checkpoints are untouched);
    one that failed for space raises disk.DiskFull saying how much was free and needed."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_path(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with _open_for_write(tmp) as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if disk.full_disk_error(e) is None:
            raise
        raise not_written(final, f"about {disk.human(disk.state_bytes(state))} needed") from None
    os.replace(tmp, final)
    for stale in run_dir.glob(".ckpt-*.tmp-*"):  # writes a killed process left unfinished
        if not stale.name.endswith(f".tmp-{os.getpid()}"):
            stale.unlink(missing_ok=True)
    fsync_dir(run_dir)
    prune(run_dir, keep)
    return final


def not_written(final: Path, detail: str) -> disk.DiskFull:
    """The one-line error of checkpoint `final` (a file or a sharded directory) that could
    not be written for space: the free space, `detail`, the checkpoint still intact."""
    run_dir = final.parent
    previous = [p for p in list_checkpoints(run_dir) if p != final]
    kept = (
        f"the previous checkpoint {previous[-1].name} is intact"
        if previous
        else "no earlier checkpoint"
    )
    return disk.DiskFull(
        f"checkpoint {final} not written: no space left in {run_dir} "
        f"({disk.human(disk.free_bytes(run_dir))} free, {detail}); {kept}; free some space "
        "(or lower --keep_ckpts) and run the same command to resume"
    )


def prune(run_dir: Path, keep: int) -> None:
    """Removes all but the newest `keep` checkpoints, files and sharded directories."""
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints oldest first (temporary files of interrupted writes are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))  # type: ignore[union-attr]


def load_latest(run_dir: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that loads, or None. Unreadable ones are skipped, loudly."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return read(path), path
        except UnsafeCheckpoint:
            raise  # never skipped to an older one: someone put this file here
        except Exception as e:  # a truncated zip raises RuntimeError, EOFError, ...
            warnings.warn(
                f"skipping unreadable checkpoint {path}: {type(e).__name__}: {e}", stacklevel=2
            )
    return None


class BackgroundWrite:
    """One checkpoint write at a time on a thread of its own; `wait` blocks until the write
    in flight is done and re-raises its error, if any, in the training thread. The thread
    is not a daemon: a process that ends normally finishes the write first; one that is
    killed leaves a temporary that resume ignores."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: tuple[Path, float] | None = None  # (path, seconds the write took)

    def start(self, target, name: str) -> None:
        """Runs `target` on a thread of its own; its error is raised by the next `wait`."""

        def run() -> None:
            try:
                target()
            except BaseException as e:  # handed to the training thread at its next wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=name)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class AsyncWriter(BackgroundWrite):
    """Writes checkpoints on a background thread from a snapshot taken at submit time.

    `submit` returns once the snapshot's copies are queued (for device tensors) or done
    (host tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self._pinned: dict[str, torch.Tensor] = {}  # host buffers by place in the state
        self._queued_copies = False  # device-to-host copies of the snapshot being taken

    def submit(self, run_dir: Path, step: int, state: dict, keep: int) -> None:
        self.wait()  # one write at a time: the pinned buffers are about to be reused
        self._queued_copies = False
        snapshot = self._copy(state, "")
        event = None
        if self._queued_copies:
            event = torch.cuda.Event()
            event.record()
        self.start(lambda: self._write(run_dir, step, snapshot, keep, event), "ckpt-writer")

    def _write(self, run_dir: Path, step: int, snapshot: dict, keep: int, event) -> None:
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()  # the device-to-host copies have landed
        path = save(run_dir, step, snapshot, keep)
        self.last = (path, time.perf_counter() - t0)

    def _copy(self, obj, where: str):
        if isinstance(obj, torch.Tensor):
            if not obj.is_cuda:
                return obj.detach().clone()
            buf = self._pinned.get(where)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
                self._pinned[where] = buf
            buf.copy_(obj.detach(), non_blocking=True)
            self._queued_copies = True
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{where}/{k}") for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{where}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)
