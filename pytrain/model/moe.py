"""The mixture-of-experts family: GPT's blocks with a router over SwiGLU experts in place
of the dense MLP (Qwen3-MoE, OLMoE, DeepSeek-V3's routing), the first `dense_layers`
blocks dense.

Routing is token choice and dropless: each token goes to its top_k experts, none is
dropped for capacity. The (token, slot) pairs are sorted by expert (a stable sort, so the
order is deterministic); each expert's count becomes the grouped GEMM's offsets on the
device, never a Python list, so a training step needs no host sync and can run under CUDA
graphs. The outputs are put back in token order by the inverse permutation and summed over
each token's slots with its top-k weights: gathers and sums, no atomic adds, so the result
does not depend on the order in which the device ran them.

The router's logits are fp32. Its scores (softmax or sigmoid) weight the experts' outputs;
with auxiliary-loss-free balancing (DeepSeek-V3) a per-expert bias is added to the scores
for choosing only, and moved after each optimizer step towards the mean load, on the loads
summed over the step's micro-batches and its ranks. The balancing losses (global,
sequence-level) and the router z-loss are options, returned beside the output."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from pytrain.model.config import ModelConfig
from pytrain.model.gpt import GPT, MLP, compute_dtype


def grouped_swiglu(x, up, down, offsets, mm=torch._grouped_mm) -> torch.Tensor:
    """The experts' SwiGLU over tokens sorted by expert: x (N, d) in the compute dtype,
    up (E, 2h, d), down (E, d, h), offsets (E,) int32, each the end of an expert's rows.
    Two grouped GEMMs (`mm`: torch._grouped_mm, or float8_grouped_mm), no host sync. The
    weights' transposes are column-major within each expert, as both kernels take them."""
    u = mm(x, up.transpose(-2, -1), offs=offsets)
    a, b = u.chunk(2, dim=-1)
    return mm(F.silu(a) * b, down.transpose(-2, -1), offs=offsets)


def aligned_groups(
    offs: torch.Tensor, rows: int, align: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of `rows` tokens sorted by expert goes when every expert's rows are padded
    to a multiple of `align` (FP8 grouped GEMMs need 16): (each token's row in the padded
    layout, the padded groups' end offsets, the padded layout's rows). The layout's size is
    the most padding can need, rows + experts x (align - 1), so that it is known without
    reading the counts on the host; rows past the last offset belong to no expert."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0).to(torch.int32)
    token = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, token, right=True)
    shift = (ends - padded) - (offs - counts)  # each expert's padded start less its start
    return token.long() + shift[expert].long(), ends, rows + offs.numel() * (align - 1)


def padded_grouped_mm(x, w_t, offs, mm, align: int = 16) -> torch.Tensor:
    """`mm` (a grouped GEMM that needs each expert's rows a multiple of `align`) over x's
    rows put in that layout (zeros between experts) and taken back out: gathers, no host
    sync, differentiable."""
    dest, ends, size = aligned_groups(offs, x.shape[0], align)
    padded = x.new_zeros(size, x.shape[1]).index_copy(0, dest, x)
    return mm(padded, w_t, ends).index_select(0, dest)


def float8_grouped_mm(x, w_t, offs) -> torch.Tensor:
    """torch._grouped_mm in FP8 (e4m3, a scale for each row of the tokens and each column of
    an expert's weight, rounded to powers of 2), forward and backward: torchao's MoE training
    path, over each expert's rows padded to the 16 its kernel needs (padded_grouped_mm:
    torchao's own padding, its default, asserts that it is not supported in 0.17 and 0.18).
    Output in x's dtype."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    def mm(a, b, ends):
        return _to_fp8_rowwise_then_scaled_grouped_mm(
            a, b, ends, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=False
        )

    return padded_grouped_mm(x, w_t, offs, mm)


def check_float8_experts(cfg: ModelConfig, device: torch.device) -> None:
    """ConfigError, one line, where model.moe_kernel float8 cannot run here."""
    from pytrain.config import ConfigError

    if cfg.moe_kernel != "float8":
        return
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            "model.moe_kernel=float8 needs an NVIDIA GPU with FP8 matmuls (Ada, Hopper or "
            f"later); this run is on {device}"
        )
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    except ImportError as e:
        raise ConfigError(
            f"model.moe_kernel=float8 needs torchao's MoE training path, which does not "
            f"import here ({e}): pip install 'pytrain[float8]'"
        ) from None
    if (
        "pad_token_groups_for_grouped_mm"
        not in inspect.signature(_to_fp8_rowwise_then_scaled_grouped_mm).parameters
    ):
        raise ConfigError(
            "model.moe_kernel=float8 needs torchao 0.17 or later (its FP8 grouped GEMM's "
            "pad_token_groups_for_grouped_mm): pip install -U 'pytrain[float8]'"
        )


def looped_swiglu(x, up, down, counts) -> torch.Tensor:
    """The same with one pair of matmuls an expert: the reference, and the path where
    grouped GEMMs do not run (the CPU). Reads the counts on the host."""
    out = []
    for e, rows in enumerate(x.split(counts.tolist())):
        a, b = (rows @ up[e].t()).chunk(2, dim=-1)
        out.append((F.silu(a) * b) @ down[e].t())
    return torch.cat(out)


class Experts(nn.Module):
    """E SwiGLU experts as two tensors, [E, 2h, d] (gate rows, then up rows, as nn.Linear
    stores them) and [E, d, h]: FSDP2 shards them like any weight, expert parallelism
    slices dim 0 (pytrain.train.expert_parallel: its all-to-alls wrap this module's forward
    as hooks, so that `x` and `counts` are then the tokens of this rank's experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, h = cfg.experts, cfg.d_model, cfg.expert_width
        self.up = nn.Parameter(torch.empty(e, 2 * h, d))
        self.down = nn.Parameter(torch.empty(e, d, h))
        self.kernel = cfg.moe_kernel

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(x)
        # Under expert parallelism the weights are DTensors of every expert: this rank
        # computes with its own slice of them.
        up, down = (w.to_local() if hasattr(w, "to_local") else w for w in (self.up, self.down))
        up, down, x = up.to(dtype), down.to(dtype), x.to(dtype)
        kernel = self.kernel
        if kernel == "auto" or (kernel == "float8" and not self.training):
            kernel = "grouped" if x.is_cuda else "loop"
        if kernel == "loop":
            return looped_swiglu(x, up, down, counts)
        offsets = counts.cumsum(0).to(torch.int32)
        mm = float8_grouped_mm if kernel == "float8" else torch._grouped_mm
        return grouped_swiglu(x, up, down, offsets, mm)


class _Dispatch(torch.autograd.Function):
    """Each token's copies in expert order: row i of the output is token order[i] // k.
    The backward takes each copy's gradient back by the inverse permutation and sums a
    token's k of them: a gather and a sum. Autograd's own backward of `x[index]` zeroes a
    buffer of N x k rows and adds into it (index_put with accumulate): on an H100 at the
    1.8B preset's shape, about a tenth of the step."""

    @staticmethod
    def forward(ctx, x, order, inverse, k: int):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse].view(-1, ctx.k, grad.shape[-1]).sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """x's rows in the order `index` (a permutation, `inverse` its inverse); the backward
    is the gather by `inverse`, not a zeroed buffer added into."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class MoE(nn.Module):
    """A block's mixture of experts: router, routed experts, optional shared experts.
    forward returns (output, auxiliary loss or None)."""

    returns_aux = True  # Block unpacks (output, aux)
    expert_bias: torch.Tensor
    micro_load: torch.Tensor
    step_load: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = None
        if cfg.shared_experts:
            self.shared = MLP(cfg, hidden=cfg.shared_experts * cfg.expert_width)
        e = cfg.experts
        # The balancing bias is state: it is saved and restored, so resume stays exact.
        self.register_buffer("expert_bias", torch.zeros(e))
        # Tokens routed to each expert: by the last forward (written, not added, so that a
        # forward recomputed by activation checkpointing counts once), and by the optimizer
        # step (after_update hands each step's to the logs).
        for name in ("micro_load", "step_load"):
            self.register_buffer(name, torch.zeros(e), persistent=False)

    def route(self, x: torch.Tensor):
        """(logits fp32 (N, E), scores (N, E), chosen experts (N, k), their weights (N, k))."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
        # The bias chooses, the scores weigh (DeepSeek-V3).
        ids = (scores + self.expert_bias).topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, ids)
        if cfg.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, ids, weights * cfg.route_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, d = x.shape
        k, E = self.cfg.top_k, self.cfg.experts
        flat = x.reshape(-1, d)
        logits, scores, ids, weights = self.route(flat)
        slots = ids.flatten()  # (N * k): token t's slots at t*k .. t*k+k-1
        counts = torch.zeros(E, device=x.device, dtype=torch.int64)
        counts.scatter_add_(0, slots, torch.ones_like(slots))
        with torch.no_grad():
            self.micro_load.copy_(counts)
        order = slots.argsort(stable=True)  # slots grouped by expert
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=x.device)
        # Each token once a slot, sorted by expert, and the experts' outputs back in slot
        # order: permutations, whose backwards are gathers by the inverse (_Dispatch).
        xc = flat.to(compute_dtype(flat))
        sorted_x = _Dispatch.apply(xc, order, inverse, k)
        ys = _Permute.apply(self.experts(sorted_x, counts), inverse, order).view(-1, k, d)
        out = (ys * weights.to(ys.dtype).unsqueeze(-1)).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        aux = self.aux_loss(logits, scores, counts, ids, B) if self.training else None
        return out.view(B, T, d).to(x.dtype), aux

    def aux_loss(self, logits, scores, counts, ids, rows: int) -> torch.Tensor | None:
        """The weighted sum of the balancing losses asked for, or None where none is. With
        aux_loss_scope 'model', a vector instead: that sum, then this layer's (tokens routed
        to each expert / tokens) and mean scores, which GPT.trunk sums over the layers and
        MoEGPT.aux_objective turns into one product."""
        cfg = self.cfg
        N, E, k = scores.shape[0], cfg.experts, cfg.top_k
        terms = []
        probs = scores / scores.sum(-1, keepdim=True)  # sigmoid scores normalised
        pooled = cfg.aux_loss and cfg.aux_loss_scope == "model"
        if cfg.aux_loss and not pooled:  # Switch: E * sum_i (tokens to i / N) * mean prob of i
            terms.append(cfg.aux_loss * E * (counts.float() / N * probs.mean(0)).sum())
        if cfg.seq_aux_loss:  # DeepSeek-V3: the same within each row, averaged over rows
            per_row = torch.zeros(rows, E, device=ids.device)
            chosen = ids.view(rows, -1)
            per_row.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float))
            f = per_row * E / (k * (N // rows))
            p = probs.view(rows, -1, E).mean(1)
            terms.append(cfg.seq_aux_loss * (f * p).sum(-1).mean())
        if cfg.z_loss:  # ST-MoE: keeps the logits small
            terms.append(cfg.z_loss * torch.logsumexp(logits, -1).square().mean())
        if not pooled:
            return sum(terms[1:], terms[0]) if terms else None
        rest = sum(terms, torch.zeros((), device=logits.device))
        return torch.cat([rest.view(1), counts.float() / N, probs.mean(0)])


class MoEGPT(GPT):
    """GPT whose blocks route over experts (from block `dense_layers` on)."""

    def make_mlp(self, cfg: ModelConfig, i: int) -> nn.Module:
        return MoE(cfg) if i >= cfg.dense_layers else MLP(cfg)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def init_extra(self) -> None:
        """The experts as GPT initialises its linear layers: normal 0.02, the down
        projections (residual) 0.02 / sqrt(2 * n_layer); the bias zero."""
        std_down = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for m in self.moe_layers():
            nn.init.normal_(m.experts.up, std=0.02)
            nn.init.normal_(m.experts.down, std=std_down)
            m.expert_bias.zero_()
            for buf in (m.micro_load, m.step_load):
                buf.zero_()

    def aux_objective(self, aux: torch.Tensor) -> torch.Tensor:
        """The blocks' summed auxiliary terms as one loss: with aux_loss_scope 'model',
        transformers' Qwen3-MoE and OLMoE balancing loss (load_balancing_loss_func): E x
        sum over experts of (tokens routed to it / tokens) x its mean score, both over the
        tokens of every MoE layer at once."""
        if aux.ndim == 0:
            return aux
        E, layers = self.cfg.experts, len(self.moe_layers())
        share, score = aux[1 : 1 + E] / layers, aux[1 + E :] / layers
        return aux[0] + self.cfg.aux_loss * E * (share * score).sum()

    def active_params(self) -> int:
        """The routed experts a token does not visit are not multiplied by."""
        cfg = self.cfg
        idle = (cfg.experts - cfg.top_k) * 3 * cfg.d_model * cfg.expert_width
        return self.num_params() - idle * len(self.moe_layers())

    @torch.no_grad()
    def after_micro_batch(self) -> None:
        layers = self.moe_layers()
        torch._foreach_add_([m.step_load for m in layers], [m.micro_load for m in layers])

    @torch.no_grad()
    def after_update(self, skipped: torch.Tensor) -> torch.Tensor | None:
        """Each layer's loads of the step, summed over the ranks (so that every rank moves
        its bias alike), move the balancing bias by balance_rate towards the mean load
        (not where the step was skipped); returned, (layers, experts) on the device, for
        the logs of this step (routing_stats)."""
        layers = self.moe_layers()
        if not layers:
            return None
        load = torch.stack([m.step_load for m in layers]).float()  # (layers, E)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load)
        rate = self.cfg.balance_rate
        if rate:
            keep = 1.0 - skipped.to(load.device, torch.float32)
            move = (load.mean(-1, keepdim=True) - load).sign() * (rate * keep)
            torch._foreach_add_([m.expert_bias for m in layers], list(move.unbind(0)))
        torch._foreach_zero_([m.step_load for m in layers])
        return load

    def step_sums(self) -> list[torch.Tensor]:
        """The step's loads: summed over replica groups with the gradients, so that every
        group moves its bias by every group's tokens (after_update then sums the ranks)."""
        return [m.step_load for m in self.moe_layers()]

    @torch.no_grad()
    def discard_step(self) -> None:
        torch._foreach_zero_(self.step_sums())

    def routing_stats(self, window: torch.Tensor) -> dict[str, float]:
        """Each MoE layer's expert load over the steps of `window` (the sum of their
        after_update loads: max over mean tokens an expert, experts that got none), and the
        worst of each over the layers; one transfer."""
        mean = window.mean(-1).clamp_min(1e-9)
        table = torch.stack([window.max(-1).values / mean, (window == 0).sum(-1).float()])
        ratio, unused = table.cpu().tolist()
        first = self.cfg.dense_layers
        out = {}
        for j, (r, u) in enumerate(zip(ratio, unused, strict=True)):
            out[f"moe/load_max_over_mean/{first + j}"] = r
            out[f"moe/unused_experts/{first + j}"] = u
        out["moe/load_max_over_mean"] = max(ratio)
        out["moe/unused_experts"] = max(unused)
        return out
