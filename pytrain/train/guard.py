"""The step guard and what a step returns: a step is checked on the device (no host
sync), and its values are read one step later (`PendingStep` -> `StepResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class TrainingStopped(RuntimeError):
    """Training cannot go on (for example, too many bad steps in a row)."""


@dataclass
class StepGuard:
    """Skips steps with a non-finite loss or gradient, or a loss far above its running
    mean; stops after too many in a row. The decision is made on the device (`check`, no
    host sync: the fused optimizer skips the update itself); the counts, the message and
    the stop follow when the host reads the step's values (`record`). Its state is saved
    in checkpoints."""

    spike_factor: float
    max_bad: int
    warmup: int
    ema: float | None = None
    """Running mean of applied steps' losses (as of the last checkpoint or load)."""
    bad_in_row: int = 0
    skipped: int = 0
    _ema_t: torch.Tensor | None = None  # the running mean on the device; NaN: none yet

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor):
        """(skip, running mean before this step): 0-d tensors on the loss's device."""
        if self._ema_t is None or self._ema_t.device != loss.device:
            start = math.nan if self.ema is None else self.ema
            self._ema_t = torch.tensor(start, dtype=torch.float32, device=loss.device)
        ema = self._ema_t
        loss = loss.float()
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        if self.spike_factor > 0 and step >= self.warmup:
            bad = bad | (loss > self.spike_factor * ema)  # False while ema is NaN
        updated = torch.where(torch.isnan(ema), loss, 0.95 * ema + 0.05 * loss)
        self._ema_t = torch.where(bad, ema, updated)
        return bad, ema

    def record(self, bad: bool, loss: float, grad_norm: float, ema_before: float) -> str | None:
        """Host bookkeeping of one checked step, in step order: None if it was applied,
        else the reason it was skipped. Raises TrainingStopped after max_bad in a row."""
        if not bad:
            self.bad_in_row = 0
            return None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason = f"non-finite loss {loss} or grad norm {grad_norm}"
        else:
            reason = f"loss spike {loss:.3f} > {self.spike_factor} x running mean {ema_before:.3f}"
        self.bad_in_row += 1
        self.skipped += 1
        if self.bad_in_row >= self.max_bad:
            raise TrainingStopped(
                f"{self.bad_in_row} bad steps in a row (last: {reason}); stopping. Lower the learning rate, "
                "check the data, or resume from an earlier checkpoint."
            )
        return reason

    def state_dict(self) -> dict:
        if self._ema_t is not None:
            ema = float(self._ema_t)
            self.ema = None if math.isnan(ema) else ema
        return {"ema": self.ema, "bad_in_row": self.bad_in_row, "skipped": self.skipped}

    def load_state_dict(self, s: dict) -> None:
        self.ema, self.bad_in_row, self.skipped = s["ema"], s["bad_in_row"], s["skipped"]
        self._ema_t = None


@dataclass
class StepResult:
    loss: float
    """Mean loss per loss token over the whole step (all micro-batches, all ranks)."""
    grad_norm: float
    loss_tokens: int
    tokens: int
    skipped: str | None = None
    fallbacks: list[str] = field(default_factory=list)
    routing: torch.Tensor | None = None
    """The model's values of this step for the logs (GPT.after_update), on the device."""


@dataclass
class PendingStep:
    """A step whose kernels may still be running. Its values stay on the device until
    `Trainer.settle` reads them, one step later, when the device has long finished them:
    the host never waits for the device in the middle of a step."""

    values: torch.Tensor
    """loss, grad norm, skip flag and the running mean before the step (host memory,
    pinned on CUDA, filled by a copy queued at the end of the step)."""
    ready: torch.cuda.Event | None
    """Recorded after that copy: waiting on it waits for this step only, not for the
    steps queued after it (a read of a device tensor would wait for all of them)."""
    loss_tokens: int
    tokens: int
    fallbacks: list[str]
    stop: bool = False
    """Some rank was asked to stop (a signal) before this step: every rank stops after it."""
    routing: torch.Tensor | None = None
    """GPT.after_update's values of this step (a mixture of experts' loads), on the device:
    read at log steps only, so logged with the step they belong to."""
