"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import math

from pytrain.config import OptimConfig


def lr_at(step: int, o: OptimConfig, max_steps: int) -> float:
    """Learning rate of `step`: linear warm-up, then constant, linear or cosine decay to
    lr x min_lr_ratio at `max_steps`."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    frac = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    min_lr = o.lr * o.min_lr_ratio
    if o.schedule == "linear":
        return o.lr - (o.lr - min_lr) * frac
    return min_lr + 0.5 * (o.lr - min_lr) * (1 + math.cos(math.pi * frac))
