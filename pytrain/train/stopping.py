"""Stopping a run on a signal without losing work.

SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and torchrun send before they kill a
job) and SIGUSR1 (Slurm's early warning, `sbatch --signal=USR1@90`) ask the loop to stop:
it finishes the step it is in, writes a checkpoint of that step, says so in one line and
exits with 128 + the signal's number (130, 143, 138; non-zero, so a scheduler requeues
the job). A second SIGINT ends the process at once (the last checkpoint on disk stays).

Under torchrun a signal may reach one rank only, or the ranks at different moments; the
ranks agree through the sum they already take at the start of every step (the loss-token
count, `Trainer.train_step`), to which each adds 1 if it has been asked to stop: no extra
collective, and every rank stops after the same step."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def exit_code(name: str) -> int:
    """The process's exit code after stopping on signal `name` (shell convention)."""
    return 128 + int(signal.Signals[name])


class StoppedInSetUp(Exception):
    """A stop asked for before the first step (the run has nothing to save)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"stopped by {name} during set-up, before the first step: nothing "
                         "to save; run the same command to continue")  # fmt: skip
        self.signal = name


class NothingToDo(Exception):
    """A run whose steps are all done already (a replica group started after its job
    ended, or as it ended): its message, where it has one (the main rank's), is the one
    line said; the process ends with 0, having committed no step (and written nothing,
    where found before the group was built)."""


class StopSignals:
    """Records the first of HANDLED while installed; the loop reads `requested`."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.looping = False
        """Whether the loop runs (a signal then finishes its step), else set-up does."""
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def vote(self) -> tuple[int, int]:
        """This rank's part of the step's sum: (asked to stop, the signal's number)."""
        return (1, int(signal.Signals[self.received])) if self.received else (0, 0)

    def agreed(self, askers: float, signals: float) -> bool:
        """Whether any rank was asked to stop, from the summed votes; a rank that got no
        signal itself takes the one the others got (their mean, where they agree)."""
        if askers <= 0:
            return False
        if self.received is None:
            mean = round(signals / askers)
            self.received = signal.Signals(mean).name if mean in HANDLED else "SIGTERM"
        return True

    def check_set_up(self, sums: Callable[[list], list[float]], looping: bool = False) -> None:
        """Raises StoppedInSetUp on every rank if any rank was asked to stop; `looping`: the
        loop starts next (a signal from now on finishes the step it comes in). `sums`: the
        sums over ranks of a list of numbers, a collective (every rank calls this at the
        same points of set-up)."""
        self.looping = looping  # before the check: a signal after it is the loop's
        if self.agreed(*sums(list(self.vote()))):
            assert self.received is not None
            raise StoppedInSetUp(self.received)

    def install(self) -> None:
        # Python runs signal handlers on the main thread only, and only it may set them.
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return  # installed already (by the CLI, at its start)
        for s in HANDLED:
            self._previous[s] = signal.signal(s, self._on_signal)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            if not self.looping:  # said once set-up ends, by StoppedInSetUp's line
                return
            # os.write, not print: the main thread may be inside a print of its own.
            os.write(2, (
                f"{name} received: finishing this step and writing a checkpoint "
                "(a second SIGINT stops at once)\n").encode())  # fmt: skip
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
