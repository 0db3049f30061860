"""One run per run directory: an exclusive OS file lock (flock) on `run.lock` in it, held
by the run's main process for its whole life. The kernel drops the lock when that process
ends however it ends (a kill -9 included), so no stale lock is ever left to remove by
hand. A second run on the same directory (a requeued job while the first still runs, a
second terminal) exits with one line naming the directory and the process holding it.

Under torchrun rank 0 holds the lock for the job; the other ranks learn from one sum
whether it got it, so all of them exit when it did not. The lock works on local disks
and on shared file systems that implement flock across hosts (NFSv4, Lustre, GPFS)."""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from pytrain.config import ConfigError


class RunDirInUse(ConfigError):
    """Another process holds the run directory's lock."""


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "run.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock or raises RunDirInUse naming its holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if not isinstance(e, BlockingIOError):  # ENOLCK: a file system without locks
                os.close(fd)
                print(f"warning: cannot lock {self.path} ({e.strerror}): nothing stops a "
                      "second run from writing this run directory", file=sys.stderr)  # fmt: skip
                return
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirInUse(
                f"run directory {self.path.parent} is in use by {holder}; wait for that run "
                "to end or stop it, or train under another --name"
            ) from None
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} (since {since})\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drops the lock (the file stays: removing it would race a run taking it)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def take(run_dir: Path, dist, device) -> RunLock:
    """The run directory's lock, taken by rank 0 for the whole job; every rank raises
    RunDirInUse when rank 0 could not take it."""
    from pytrain.train import distributed

    lock = RunLock(run_dir)
    error: RunDirInUse | None = None
    if dist.is_main:
        try:
            lock.acquire()
        except RunDirInUse as e:
            error = e
    if distributed.all_sum(1 if error else 0, dist, device) > 0:
        raise error or RunDirInUse(
            f"run directory {run_dir} is in use by another run (rank 0 names it)"
        )
    return lock
