"""Checkpoints that survive a kill: written to a temporary file, fsynced, renamed into
place; the last K are kept; resume takes the newest one that loads (a truncated file is
skipped with a warning)."""

from __future__ import annotations

import os
import random
import re
import warnings
from pathlib import Path

import numpy as np
import torch

from pytrain.config import ConfigError

PATTERN = re.compile(r"^ckpt-(\d{8})\.pt$")


class CheckpointMismatch(ConfigError):
    """A checkpoint that loads but was saved by a run this one cannot continue."""


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
