"""Checkpoints that survive a kill: written to a temporary file, fsynced, renamed into
place; the last K are kept; resume takes the newest one that loads (a truncated file is
skipped with a warning).

Saving does not stop training (`AsyncWriter`): the state is copied at the step boundary,
device tensors into pinned host buffers by copies queued on the current stream (so they
see exactly that step's values and the next step's kernels queue behind them), host
tensors by clone, and a background thread waits for the copies and writes the file.
One write is in flight at a time; the next save waits for it (its buffers are reused)."""

from __future__ import annotations

import copy
import os
import random
import re
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from pytrain.config import ConfigError, flag_value

PATTERN = re.compile(r"^ckpt-(\d{8})\.pt$")


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


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, step: int, state: dict, keep: int) -> Path:
    """Atomically writes `state` as ckpt-<step>.pt and prunes all but the newest `keep`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_path(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for stale in run_dir.glob(".ckpt-*.tmp-*"):  # writes a killed process left unfinished
        if not stale.name.endswith(f".tmp-{os.getpid()}"):
            stale.unlink(missing_ok=True)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints oldest first (temporary files of interrupted writes are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    return sorted((p for p in run_dir.iterdir() if PATTERN.match(p.name)), key=lambda p: p.name)


def load_latest(run_dir: Path) -> tuple[dict, Path] | None:
    """The newest checkpoint that loads, or None. Unreadable ones are skipped, loudly."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return torch.load(path, map_location="cpu", weights_only=False), path
        except Exception as e:  # a truncated zip raises RuntimeError, EOFError, ...
            warnings.warn(
                f"skipping unreadable checkpoint {path}: {type(e).__name__}: {e}", stacklevel=2
            )
    return None


class AsyncWriter:
    """Writes checkpoints on a background thread from a snapshot taken at submit time.

    `submit` returns once the snapshot's copies are queued (for device tensors) or done
    (host tensors); `wait` blocks until the write in flight is on disk and re-raises its
    error, if any. The thread is not a daemon: a process that ends normally finishes the
    write first; one that is killed leaves a temporary file that resume ignores."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pinned: dict[str, torch.Tensor] = {}  # host buffers by place in the state
        self._queued_copies = False  # device-to-host copies of the snapshot being taken
        self.last: tuple[Path, float] | None = None  # (path, seconds the write took)

    def submit(self, run_dir: Path, step: int, state: dict, keep: int) -> None:
        self.wait()  # one write at a time: the pinned buffers are about to be reused
        self._queued_copies = False
        snapshot = self._copy(state, "")
        event = None
        if self._queued_copies:
            event = torch.cuda.Event()
            event.record()
        self._thread = threading.Thread(
            target=self._write, args=(run_dir, step, snapshot, keep, event), name="ckpt-writer"
        )
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, run_dir: Path, step: int, snapshot: dict, keep: int, event) -> None:
        try:
            t0 = time.perf_counter()
            if event is not None:
                event.synchronize()  # the device-to-host copies have landed
            path = save(run_dir, step, snapshot, keep)
            self.last = (path, time.perf_counter() - t0)
        except BaseException as e:  # handed to the training thread at its next wait()
            self._error = e

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
