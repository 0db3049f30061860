"""AdamW with weight-decay groups, the learning-rate schedule, and one optimizer step
with gradient clipping.

On CUDA the AdamW is fused, and the step needs neither a host sync nor a separate pass
over the gradients: the clipping factor goes to the fused kernel as its `grad_scale`
(each gradient is divided by it as it is read) and the skip decision of the step guard
as its `found_inf` (weights, moments and step counts are left alone where it is 1).
Elsewhere (CPU, FSDP2 shards, fp16 with a GradScaler) clipping is the usual
`clip_grad_norm_` pass."""

from __future__ import annotations

import math

import torch
from torch import nn

from pytrain.config import OptimConfig
from pytrain.master_adamw import MasterAdamW


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


def use_master_weights(
    choice: str, device: torch.device, dtype: torch.dtype | None, one_process: bool
) -> bool:
    """Whether the model's parameters are bf16 with fp32 masters in the optimizer
    (pytrain.master_adamw): asked for, or 'auto' on CUDA, with bf16 autocast, in one
    process (DDP would reduce only the last micro-batch's bf16 gradients; FSDP2 has its
    own mixed precision)."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"optim.master_weights is {choice!r}; expected auto, on or off")
    possible = dtype == torch.bfloat16 and one_process
    if choice == "on" and not possible:
        raise ValueError(
            "optim.master_weights=on needs precision bf16 and a single process "
            "(set it to auto or off for fp16, fp32, DDP or FSDP2)"
        )
    return choice == "on" or (choice == "auto" and possible and device.type == "cuda")


def make_optimizer(
    model: nn.Module, o: OptimConfig, device: torch.device, master: bool = False
) -> torch.optim.Optimizer | MasterAdamW:
    """AdamW; weight decay on matrices only (not norms); fused on CUDA. With `master`,
    the parameters become bf16 and the optimizer a MasterAdamW holding their fp32 copies."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (o.beta1, o.beta2)
    if master:
        return MasterAdamW(groups, lr=o.lr, betas=betas, dtype=torch.bfloat16)
    return torch.optim.AdamW(groups, lr=o.lr, betas=betas, fused=device.type == "cuda")


def grad_norm(optimizer: torch.optim.Optimizer | MasterAdamW) -> torch.Tensor:
    """The total L2 norm of the gradients `optimizer` will step with (a 0-d tensor, no
    host sync): its parameters' `.grad`, or MasterAdamW's own (fp32 sums under
    accumulation)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.grad_norm()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradients are divided by so that their norm is at most max_norm: the
    inverse of clip_grad_norm_'s factor max_norm / (norm + 1e-6), never below 1."""
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


def fused_step(
    optimizer: torch.optim.Optimizer | MasterAdamW,
    skip: torch.Tensor,
    norm: torch.Tensor,
    max_norm: float,
) -> None:
    """One step of a fused AdamW with clipping folded in and the skip decided on the
    device (`skip`: 0-d bool). Same update as clip_grad_norm_ then step()."""
    if not optimizer.defaults.get("fused"):
        raise ValueError("fused_step needs an optimizer built with fused=True")
    # The fused kernel reads these two attributes (torch.optim's AMP hooks).
    optimizer.grad_scale = clip_scale(norm, max_norm) if max_norm > 0 else None  # type: ignore[union-attr]
    optimizer.found_inf = skip.float()  # type: ignore[union-attr]
    optimizer.step()


class OptimizerStep:
    """The optimizer's side of a training step: clearing gradients, fp32 accumulation of
    master weights, clipping, the step guard's skip, and the update (fused with clipping
    folded in, through fp16's GradScaler, or plain)."""

    def __init__(self, optimizer, model: nn.Module, scaler, sharded: bool, grad_clip: float):
        self.optimizer = optimizer
        self.model = model
        self.scaler = scaler
        self.sharded = sharded
        self.grad_clip = grad_clip
        self.master = isinstance(optimizer, MasterAdamW)

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
        for g in self.optimizer.param_groups:
            g["lr"] = lr

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
        if self.master and accumulating:
            self.masters.accumulate()  # into fp32, not into the bf16 .grad

    def step(self, guard, step: int, loss: torch.Tensor):
        """The gradient norm, the guard's decision (skip, running mean before), and the
        clipped update or its skip. With a fused AdamW (CUDA, unsharded, no GradScaler)
        clipping happens inside the optimizer and nothing waits for the device."""
        max_norm = self.grad_clip
        fold = self.optimizer.defaults.get("fused") and not (self.sharded or self.scaler)
        if fold:
            norm = grad_norm(self.optimizer)
        else:
            if self.scaler:
                self.scaler.unscale_(self._torch_optimizer)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm or float("inf"))
            if hasattr(norm, "full_tensor"):  # FSDP2: a replicated DTensor
                norm = norm.full_tensor()
        bad, ema_before = guard.check(step, loss, norm)
        if fold:
            fused_step(self.optimizer, bad, norm, max_norm)
        elif self.scaler:
            bad = self._scaler_step(bad, loss, norm)
        elif not bool(bad):
            self.optimizer.step()
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
