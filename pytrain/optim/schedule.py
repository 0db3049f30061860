"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay, or
warm-up-stable-decay (constant, then a linear decay over the last optim.decay_frac of the
steps: a checkpoint of the constant phase can be trained on or decayed at any length)."""

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
    min_lr = o.lr * o.min_lr_ratio
    if o.schedule == "wsd":
        decay_start = max(o.warmup_steps, max_steps - round(o.decay_frac * max_steps))
        if step < decay_start:
            return o.lr
        frac = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
        return o.lr - (o.lr - min_lr) * frac
    frac = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    if o.schedule == "linear":
        return o.lr - (o.lr - min_lr) * frac
    return min_lr + 0.5 * (o.lr - min_lr) * (1 + math.cos(math.pi * frac))
