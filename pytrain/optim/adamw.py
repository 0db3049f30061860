"""AdamW with weight-decay groups, the learning-rate schedule, and one optimizer step
with gradient clipping.

On CUDA the AdamW is fused, and the step needs neither a host sync nor a separate pass
over the gradients: the clipping factor goes to the fused kernel as its `grad_scale`
(each gradient is divided by it as it is read) and the skip decision of the step guard
as its `found_inf` (weights, moments and step counts are left alone where it is 1).
FSDP2's shards take that path too (each rank's kernel updates its shards). Elsewhere (CPU,
fp16 with a GradScaler) clipping is the usual `clip_grad_norm_` pass."""

from __future__ import annotations

import torch
from torch import nn

from pytrain.config import OptimConfig
from pytrain.optim.compact_adamw import CompactAdamW
from pytrain.optim.master_adamw import STATE_DTYPES, MasterAdamW


def use_master_weights(
    choice: str, device: torch.device, dtype: torch.dtype | None, sharded: bool
) -> bool:
    """Whether the model's parameters are bf16 with fp32 masters in the optimizer
    (pytrain.optim.master_adamw): asked for, or 'auto' on CUDA, with bf16 autocast, unless
    FSDP2 shards the model (it has its own mixed precision). Several ranks then all-reduce
    the optimizer's fp32 gradient sums (pytrain.train.parallel, 'replicas')."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"optim.master_weights is {choice!r}; expected auto, on or off")
    possible = dtype == torch.bfloat16 and not sharded
    if choice == "on" and not possible:
        raise ValueError(
            "optim.master_weights=on needs precision bf16 and no FSDP2 "
            "(set it to auto or off for fp16, fp32 or FSDP2)"
        )
    return choice == "on" or (choice == "auto" and possible and device.type == "cuda")


def make_optimizer(
    model: nn.Module, o: OptimConfig, device: torch.device, master: bool = False
) -> torch.optim.Optimizer | MasterAdamW:
    """AdamW; weight decay on matrices only (not norms); fused on CUDA. With `master`,
    the parameters become bf16 and the optimizer a MasterAdamW holding their fp32 copies;
    without, moments smaller than fp32 (optim.state_dtype) make it a CompactAdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    betas = (o.beta1, o.beta2)
    state = STATE_DTYPES[o.state_dtype]
    if master:
        return MasterAdamW(groups, lr=o.lr, betas=betas, dtype=torch.bfloat16, state_dtype=state)
    if state != torch.float32:  # fp32 parameters (FSDP2's shards), smaller moments
        return CompactAdamW(groups, lr=o.lr, betas=betas, state_dtype=state)
    return torch.optim.AdamW(groups, lr=o.lr, betas=betas, fused=device.type == "cuda")


def grad_norm(optimizer: torch.optim.Optimizer | MasterAdamW) -> torch.Tensor:
    """The total L2 norm of the gradients `optimizer` will step with (a 0-d tensor, no
    host sync): its parameters' `.grad` (all ranks' shards under FSDP2), or MasterAdamW's
    own (fp32 sums under accumulation)."""
    if isinstance(optimizer, MasterAdamW):
        return optimizer.grad_norm()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return total_norm([p.grad for p in params if p.grad is not None])


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of `grads`, a plain 0-d tensor (no host sync). FSDP2's gradients are
    shards (DTensors): their norm is one too, a partial sum on each rank until it is made
    whole. DTensor ops do not mix meshes, and under expert parallelism the experts' live on
    a mesh of their own: each mesh's gradients make a norm of their own first."""
    norms = []
    for part in _by_mesh(grads) or [[]]:
        norm = nn.utils.get_total_norm(part)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_grads(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ of `params` (max_norm 0: no clipping) through total_norm, so that
    DTensors of several meshes take it; returns the norm before clipping."""
    norm = total_norm([p.grad for p in params if p.grad is not None])
    if max_norm:  # (a parameter's gradient is on its mesh; one without is left alone)
        for part in _by_mesh(params):
            nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return norm


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped by their DTensor mesh (plain tensors: one group), in order."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault(getattr(t, "device_mesh", None), []).append(t)
    return list(groups.values())


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
