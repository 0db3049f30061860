"""Muon for the blocks' weight matrices, AdamW for everything else, as one optimizer.

Muon (Keller Jordan, 2024) replaces each 2-D weight's update by the orthogonalised
momentum (a few Newton-Schulz iterations in bf16; in fp32 on a CPU), so every direction of the matrix moves
at the same rate. It is meant for hidden matrices: the embedding, the output layer, norms
and biases keep AdamW (its authors' advice, and what modded-nanogpt does).

`torch.optim.Muon` is used on a GPU where the installed torch has it (2.9 and later);
otherwise `CompactMuon` below does the same update with the same constants, so a run gives
the same numbers on either (tests/test_muon.py compares them). On a CPU, CompactMuon runs
the iteration in fp32, which every CPU multiplies natively.

Learning rates: the Muon group runs at `optim.muon_lr` (scaled per matrix by
sqrt(max(1, rows/cols)), the original rule), the AdamW groups at `optim.lr`; the schedule
(warm-up, decay) multiplies both: each group holds its `lr_ratio` to `optim.lr`.

Limits, refused up front: FSDP2 (Muon needs each matrix whole, FSDP2 shards them), fp16
(the GradScaler unscales one torch optimizer), bf16 master weights (pytrain.optim.master_adamw
is an AdamW; with Muon the parameters stay fp32 under autocast)."""

from __future__ import annotations

import math

import torch
from torch import nn

from pytrain.config import ConfigError, OptimConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients of Keller Jordan's Muon (and torch's)."""
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(
    g: torch.Tensor, steps: int = NS_STEPS, eps: float = EPS, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """An approximately orthogonal matrix with g's singular vectors (singular values pushed
    into roughly [0.7, 1.2]): the quintic iteration, in `dtype` (torch.optim.Muon's bf16),
    on the wide orientation so the Gram matrix is the smaller one. Same operations as
    torch.optim.Muon."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype=dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


class CompactMuon(torch.optim.Optimizer):
    """Muon where torch has none, or on a CPU: momentum (lerp form), Nesterov, Newton-Schulz
    in `ns_dtype`, decoupled weight decay, lr scaled by sqrt(max(1, rows/cols)); the update
    of torch.optim.Muon (in bf16), whose group settings it keeps too, so that either loads
    the other's state."""

    def __init__(
        self, params, lr: float, weight_decay: float, momentum: float = 0.95,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):  # fmt: skip
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": True,
                    "ns_coefficients": NS_COEFFICIENTS, "eps": EPS, "ns_steps": NS_STEPS,
                    "adjust_lr_fn": None}  # fmt: skip
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon takes 2-D parameters, not one of shape {tuple(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                update = newton_schulz(update, dtype=self.ns_dtype)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))
        return None


def muon_class() -> type[CompactMuon]:
    """torch.optim.Muon where this torch has it, else CompactMuon (same constructor
    arguments for what is used here)."""
    return getattr(torch.optim, "Muon", CompactMuon)


def split_parameters(
    model: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's with weight decay, AdamW's without): the 2-D weights inside the
    transformer blocks go to Muon; the embedding and the output layer (tied or not) to
    AdamW with decay; norms and biases to AdamW without. Each parameter once."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # a tied weight comes once, under its first name
        if not p.requires_grad:
            continue
        if p.dim() == 2 and name.startswith("blocks."):
            muon.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return muon, decay, no_decay


class MuonAdamW:
    """Muon and AdamW stepped together, with the optimizer interface the trainer uses
    (param_groups, step, zero_grad, state_dict, load_state_dict)."""

    def __init__(self, model: nn.Module, o: OptimConfig, device: torch.device):
        muon_params, decay, no_decay = split_parameters(model)
        if not muon_params:
            raise ConfigError("optim.name=muon: the model has no 2-D weights in blocks.* for Muon")
        groups = [{"params": muon_params, "lr_ratio": o.muon_lr / o.lr}]
        kw: dict = {
            "lr": o.muon_lr,
            "weight_decay": o.muon_weight_decay,
            "momentum": o.muon_momentum,
        }
        if device.type == "cpu":
            # Newton-Schulz in fp32: a CPU without bf16 matrix units (AVX512-BF16, AMX)
            # emulates bf16 matmuls, and Muon's step took 7.2x AdamW's there, 1.1x in fp32;
            # with them, fp32 costs what bf16 does (BENCHMARKS.md, "Muon on a CPU").
            self.muon: torch.optim.Optimizer = CompactMuon(groups, ns_dtype=torch.float32, **kw)
        else:
            self.muon = muon_class()(groups, **kw)
        self.adamw = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o.weight_decay, "lr_ratio": 1.0},
                {"params": no_decay, "weight_decay": 0.0, "lr_ratio": 1.0},
            ],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            fused=device.type == "cuda",
        )
        # Not a fused optimizer as a whole: the trainer clips with clip_grad_norm_ and
        # decides a skip on the host before calling step().
        self.defaults: dict = {}

    @property
    def param_groups(self) -> list[dict]:
        # Read each time: load_state_dict replaces the optimizers' group dicts.
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
