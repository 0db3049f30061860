"""The optimizer's side of a training step (see `OptimizerStep`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pytrain.model import float8
from pytrain.optim.adamw import clip_grads, fused_step, grad_norm
from pytrain.optim.master_adamw import MasterAdamW


class OptimizerStep:
    """The optimizer's side of a training step: clearing gradients, fp32 accumulation of
    master weights, clipping, the step guard's skip, and the update (fused with clipping
    folded in, through fp16's GradScaler, or plain)."""

    def __init__(
        self,
        optimizer,
        model: nn.Module,
        scaler,
        grad_clip: float,
        replicas: int = 0,
    ):
        self.optimizer = optimizer
        self.replicas = replicas
        """Ranks that all-reduce the masters' fp32 gradient sums each step (0: none; see
        pytrain.train.parallel, 'replicas')."""
        self.model = model
        self.scaler = scaler
        self.grad_clip = grad_clip
        self.master = isinstance(optimizer, MasterAdamW)
        # FSDP2 with float8 all-gathers: the weights' scales after each update.
        self.after_update = float8.scale_updater(model)
        # The model's own work around the step, where it has any (GPT's: a mixture of
        # experts adds up its load after each micro-batch, moves its balancing bias after
        # each update).
        self.model_after_micro_batch = getattr(model, "after_micro_batch", lambda: None)
        self.model_after_update = getattr(model, "after_update", lambda skipped: None)
        self.routing: torch.Tensor | None = None
        # Before each update (skipped or not): a checkpoint's copies still reading the
        # tensors it overwrites are waited for (ShardedWriter.before_update).
        self.before_update: Callable[[], None] | None = None

    @property
    def masters(self) -> MasterAdamW:
        """The optimizer, when it keeps fp32 master weights."""
        assert isinstance(self.optimizer, MasterAdamW)
        return self.optimizer

    @property
    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, on the paths only torch's AdamW takes (fused step, GradScaler)."""
        assert isinstance(self.optimizer, torch.optim.Optimizer)
        return self.optimizer

    def set_lr(self, lr: float) -> None:
        """The schedule's learning rate (optim.lr's); a group with its own peak rate
        (Muon's) holds its ratio to optim.lr as `lr_ratio`."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_ratio", 1.0)

    def zero_grads(self, keep: bool) -> None:
        """Clears the gradients before a step's backward passes. `keep` (CUDA graphs with
        gradient accumulation): they stay allocated and are zeroed instead of dropped, since
        a backward graph's output installed as `.grad` would be overwritten by the next
        micro-batch's replay (pytorch/pytorch#169545: an error, or in some versions
        silently wrong gradients); into an existing `.grad` the output is added at once."""
        if self.master or not keep:
            # MasterAdamW consumes each micro-batch's gradients as they come.
            self.optimizer.zero_grad(set_to_none=True)
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch._foreach_zero_([p.grad for p in params if p.grad is not None])

    def after_micro_batch(self, accumulating: bool) -> None:
        if self.master and (accumulating or self.replicas):
            self.masters.accumulate()  # into fp32, not into the bf16 .grad
        self.model_after_micro_batch()

    def step(self, guard, step: int, loss: torch.Tensor):
        """The gradient norm, the guard's decision (skip, running mean before), and the
        clipped update or its skip. With a fused AdamW (CUDA, no GradScaler; FSDP2's shards
        too) clipping happens inside the optimizer and nothing waits for the device."""
        max_norm = self.grad_clip
        if self.before_update is not None:
            self.before_update()
        if self.replicas:
            self.masters.all_reduce_grads(self.replicas)
        # FSDP2's shards take the fused path too: the kernel runs on each rank's shards, its
        # two scalars replicated (DTensor takes a 0-d tensor as one).
        fold = self.optimizer.defaults.get("fused") and not self.scaler
        if fold:
            norm = grad_norm(self.optimizer)
        else:
            if self.scaler:
                self.scaler.unscale_(self._torch_optimizer)
            norm = clip_grads(list(self.model.parameters()), max_norm)
        bad, ema_before = guard.check(step, loss, norm)
        if fold:
            fused_step(self.optimizer, bad, norm, max_norm)
            if self.after_update is not None:  # a skipped step leaves the scales as they were
                self.after_update()
        elif self.scaler:
            bad = self._scaler_step(bad, loss, norm)
        elif not bool(bad):
            self.optimizer.step()
            if self.after_update is not None:
                self.after_update()
        self.routing = self.model_after_update(torch.as_tensor(bad))  # the step's, for its log
        return norm, bad, ema_before

    def _scaler_step(self, bad, loss, norm) -> torch.Tensor:
        """fp16: the GradScaler skips steps with inf/NaN gradients itself (and lowers its
        scale), so an overflow is not a bad step; a bad loss or a spike still is."""
        finite_grads = math.isfinite(float(norm))
        if not bool(bad) or not finite_grads:
            self.scaler.step(self._torch_optimizer)
        self.scaler.update()
        if not finite_grads and math.isfinite(float(loss)):
            return torch.zeros_like(bad)
        return bad
