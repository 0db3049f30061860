"""AdamW over fp32 master weights for a model whose parameters are bf16.

With fp32 parameters under bf16 autocast, every forward casts each weight to bf16, every
backward casts each weight gradient back to fp32, and the fused AdamW then reads fp32
gradients (and, when it clips, writes them back). Here the model's parameters are bf16,
so autocast has nothing to cast and autograd makes bf16 gradients, and the fp32 copies
live in this optimizer (flat buffers, with the two moments). One kernel per step reads
each bf16 gradient once, clips it (divides by `grad_scale`), updates the fp32 master and
moments, and writes the bf16 parameter the next forward reads. At GPT-2 124M that takes
about 2 GB of traffic out of every step (docs/TRAINER.md, "Master weights").

The update is torch's AdamW (decoupled weight decay, bias-corrected moments) with the
same attributes the fused torch AdamW reads: `grad_scale` (the gradients are divided by
it) and `found_inf` (where it is 1 the step leaves weights, moments and the step count
alone). The step count lives on the device, so a skip decided on the device costs no host
sync.

Gradient accumulation: a bf16 `.grad` summed over micro-batches would lose precision, so
with more than one micro-batch `accumulate()` adds each micro-batch's gradients into an
fp32 buffer and drops them (`.grad` is None between micro-batches), and the step reads
that buffer. Several ranks all-reduce that buffer once per step (`all_reduce_grads`) and
use no DDP wrapper, which would all-reduce the bf16 `.grad` of the last micro-batch only;
FSDP2 has its own mixed precision.

The kernels are Triton on CUDA (one launch for all parameters: a table maps each block
of the launch to its tensor, and the gradients are found through a table of their
addresses); elsewhere the same math runs in torch, and tests compare the two (through
Triton's interpreter on CPU) and both against torch.optim.AdamW."""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch path
    triton = None

BLOCK = 1024
"""Elements of one tensor per program of the kernels (blocks never straddle tensors)."""


if triton is not None:

    @triton.jit
    def _grad_block(
        t, idx, at, keep, grad_addr_ptr, flat_grad_ptr, GRAD_DTYPE: tl.constexpr, FLAT: tl.constexpr
    ):
        """This block's gradient in fp32: from the flat fp32 buffer, or from the tensor
        whose address is entry t of the address table."""
        if FLAT:
            g = tl.load(flat_grad_ptr + at, mask=keep, other=0.0)
        else:
            src = tl.load(grad_addr_ptr + t).to(tl.pointer_type(GRAD_DTYPE))
            g = tl.load(src + idx, mask=keep, other=0.0).to(tl.float32)
        return g

    @triton.jit
    def _adamw_kernel(
        blk_tensor_ptr, blk_start_ptr, numel_ptr, offset_ptr, decay_ptr, grad_addr_ptr,
        master_ptr, exp_avg_ptr, exp_avg_sq_ptr, param_ptr, flat_grad_ptr,
        step_ptr, scale_ptr, skip_ptr,
        lr, beta1, beta2, log2_beta1, log2_beta2, eps,
        GRAD_DTYPE: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.load(blk_tensor_ptr + tl.program_id(0))
        idx = tl.load(blk_start_ptr + tl.program_id(0)).to(tl.int64) + tl.arange(0, BLOCK)
        # A skipped step (skip != 0) touches nothing: no element is in range.
        keep = idx < tl.where(tl.load(skip_ptr) == 0, tl.load(numel_ptr + t), 0)
        at = tl.load(offset_ptr + t) + idx
        g = _grad_block(t, idx, at, keep, grad_addr_ptr, flat_grad_ptr, GRAD_DTYPE, FLAT)
        g = g / tl.load(scale_ptr)
        p = tl.load(master_ptr + at, mask=keep)
        # The moments in fp32 here whatever they are stored in (optim.state_dtype).
        m = tl.load(exp_avg_ptr + at, mask=keep).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + at, mask=keep).to(tl.float32)
        step = tl.load(step_ptr)
        bias1 = 1.0 - tl.exp2(step * log2_beta1)
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        p = p * (1.0 - lr * tl.load(decay_ptr + t))
        m = m + (1.0 - beta1) * (g - m)
        v = v * beta2 + (1.0 - beta2) * g * g
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(master_ptr + at, p, mask=keep)
        tl.store(exp_avg_ptr + at, m.to(exp_avg_ptr.dtype.element_ty), mask=keep)
        tl.store(exp_avg_sq_ptr + at, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=keep)
        # Rounded to nearest even on the GPU, as torch rounds (Triton's interpreter
        # truncates instead; its test allows that).
        tl.store(param_ptr + at, p.to(param_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def _accumulate_kernel(
        blk_tensor_ptr, blk_start_ptr, numel_ptr, offset_ptr, grad_addr_ptr, flat_grad_ptr,
        GRAD_DTYPE: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.load(blk_tensor_ptr + tl.program_id(0))
        idx = tl.load(blk_start_ptr + tl.program_id(0)).to(tl.int64) + tl.arange(0, BLOCK)
        keep = idx < tl.load(numel_ptr + t)
        at = tl.load(offset_ptr + t) + idx
        g = _grad_block(t, idx, at, keep, grad_addr_ptr, flat_grad_ptr, GRAD_DTYPE, False)
        if not FIRST:
            g += tl.load(flat_grad_ptr + at, mask=keep)
        tl.store(flat_grad_ptr + at, g, mask=keep)


_TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""optim.state_dtype: the dtype the two moments are stored in."""


class MasterAdamW:
    """AdamW with fp32 master weights for parameters held in a lower precision.

    Building it moves every parameter into one flat buffer of `dtype` (the parameters
    become views of it; their values are rounded from the fp32 masters). The interface
    the trainer uses is torch.optim's: `param_groups` (one shared `lr`), `step()`,
    `zero_grad()`, `state_dict()` / `load_state_dict()`, `defaults["fused"]` (clipping
    and skipping are folded into the step, see pytrain.optim.adamw.fused_step)."""

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        dtype: torch.dtype = torch.bfloat16,
        use_triton: bool | None = None,
        state_dtype: torch.dtype = torch.float32,
    ):
        self.param_groups = [dict(g, lr=lr) for g in groups]
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.defaults = {"lr": lr, "betas": betas, "eps": eps, "fused": True}
        self.betas, self.eps = betas, eps
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        device = self.params[0].device
        self.use_triton = (
            (triton is not None and device.type == "cuda") if use_triton is None else use_triton
        )
        numels = [p.numel() for p in self.params]
        offsets = [0, *itertools.accumulate(numels)][:-1]
        total = sum(numels)
        self.master = torch.empty(total, dtype=torch.float32, device=device)
        self.flat_param = torch.empty(total, dtype=dtype, device=device)
        for p, o, n in zip(self.params, offsets, numels, strict=True):
            self.master[o : o + n].copy_(p.detach().flatten())
            self.flat_param[o : o + n].copy_(p.detach().flatten())
            p.data = self.flat_param[o : o + n].view_as(p)
        # The two moments: fp32, or bf16 (optim.state_dtype; DeepSeek-V3 trains so) to save
        # 4 bytes a parameter. Either way the update computes in fp32 and rounds once.
        self.exp_avg = torch.zeros_like(self.master, dtype=state_dtype)
        self.exp_avg_sq = torch.zeros_like(self.master, dtype=state_dtype)
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)
        # Stand-ins for grad_scale and found_inf when they are not given (no clip, no skip).
        self._one, self._zero = torch.ones((), device=device), torch.zeros((), device=device)
        self.flat_grad: torch.Tensor | None = None  # fp32 sums of micro-batch gradients
        self._views = [(o, n) for o, n in zip(offsets, numels, strict=True)]
        self._numels = numels
        decay = [float(g["weight_decay"]) for g in self.param_groups for _ in g["params"]]
        self._tables = _block_tables(numels, offsets, decay, device)
        self._addr: tuple[tuple[int, ...], torch.Tensor] | None = None
        self._decay_elems: torch.Tensor | None = None  # the torch path's, made when first needed

    # ---- torch.optim-like surface ---------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.flat_grad = None

    def state_dict(self) -> dict:
        """Moments and step count; the fp32 masters are the model's weights in a checkpoint
        (`master_state`), so they are not stored twice."""
        return {
            "step": float(self.step_t),
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "numels": self._numels,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("numels") != self._numels:
            raise ValueError(
                "optimizer state does not match the model: it was saved for parameters of "
                f"sizes {state.get('numels')}, this model has {self._numels}"
            )
        self.step_t.fill_(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        for g, saved in zip(self.param_groups, state["param_groups"], strict=True):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def per_param(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """`flat` (the masters, or the fp32 gradient sums `flat_grad`) as a view per
        parameter, by the parameter's id."""
        return {
            id(p): flat[o : o + n].view_as(p)
            for p, (o, n) in zip(self.params, self._views, strict=True)
        }

    def master_state(self, model: nn.Module) -> dict:
        """The model's state dict with each parameter's fp32 master in its place."""
        masters = self.per_param(self.master)
        named = dict(model.named_parameters(remove_duplicate=False))
        return {
            k: masters[id(named[k])] if k in named else v for k, v in model.state_dict().items()
        }

    def load_masters(self, model: nn.Module, state: dict) -> None:
        """Sets masters (and the parameters, rounded) from a state dict of fp32 weights."""
        named = dict(model.named_parameters(remove_duplicate=False))
        index = {id(p): i for i, p in enumerate(self.params)}
        for k, v in state.items():
            if k in named:
                o, n = self._views[index[id(named[k])]]
                self.master[o : o + n].copy_(v.flatten())
        self.flat_param.copy_(self.master)

    # ---- gradients ------------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        grads = [p.grad for p in self.params]
        if any(g is None for g in grads):
            missing = sum(g is None for g in grads)
            raise RuntimeError(f"MasterAdamW: {missing} parameter(s) have no gradient")
        return grads

    def _grads_flat(self) -> torch.Tensor:
        """The torch path's view of this micro-batch's gradients: one fp32 vector."""
        return torch.cat([g.detach().float().flatten() for g in self._grads()])

    def accumulate(self) -> None:
        """Adds the parameters' gradients (one micro-batch's) into the fp32 buffer and
        drops them, so the next micro-batch's backward starts from none."""
        first = self.flat_grad is None
        if self.flat_grad is None:
            self.flat_grad = torch.empty_like(self.master)
        if self.use_triton:
            self._launch_accumulate(self._grads(), first)
        else:
            flat = self._grads_flat()
            self.flat_grad.copy_(flat) if first else self.flat_grad.add_(flat)
        for p in self.params:
            p.grad = None

    def all_reduce_grads(self, world_size: int) -> None:
        """Averages the accumulated fp32 gradients over the ranks of the default process
        group (data parallelism without a wrapper; pytrain.train.parallel): one all-reduce of
        the whole buffer, after the step's last micro-batch."""
        if self.flat_grad is None:
            raise RuntimeError("MasterAdamW: all_reduce_grads before any accumulate()")
        torch.distributed.all_reduce(self.flat_grad)
        self.flat_grad.div_(world_size)

    def grad_norm(self) -> torch.Tensor:
        """The total L2 norm of the gradients (fp32, 0-d, on the device, no host sync)."""
        if self.flat_grad is not None:
            return torch.linalg.vector_norm(self.flat_grad)
        norms = torch._foreach_norm(self._grads(), 2.0, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms))

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> None:
        lrs = {g["lr"] for g in self.param_groups}
        if len(lrs) != 1:
            raise ValueError(f"MasterAdamW needs one learning rate for all groups, got {lrs}")
        lr = lrs.pop()
        scale = self._one if self.grad_scale is None else self.grad_scale.float()
        skip = self._zero if self.found_inf is None else self.found_inf.float()
        self.step_t.add_(1.0 - skip)
        if self.use_triton:
            self._launch_step(lr, scale, skip)
        else:
            self._step_torch(lr, scale, skip)
        self.flat_grad = None

    def _step_torch(self, lr: float, scale: torch.Tensor, skip: torch.Tensor) -> None:
        beta1, beta2 = self.betas
        g = (self.flat_grad if self.flat_grad is not None else self._grads_flat()) / scale
        bias1 = 1.0 - beta1**self.step_t
        bias2_sqrt = (1.0 - beta2**self.step_t).sqrt()
        if self._decay_elems is None:
            sizes = torch.tensor(self._numels, device=self.master.device)
            self._decay_elems = self._tables["decay"].repeat_interleave(sizes)
        p = self.master * (1.0 - lr * self._decay_elems)
        m0, v0 = self.exp_avg.float(), self.exp_avg_sq.float()
        m = m0 + (1.0 - beta1) * (g - m0)
        v = v0 * beta2 + (1.0 - beta2) * g * g
        p = p - (lr / bias1) * m / (v.sqrt() / bias2_sqrt + self.eps)
        keep = skip == 0
        for buf, new in ((self.master, p), (self.exp_avg, m), (self.exp_avg_sq, v)):
            buf.copy_(torch.where(keep, new, buf))
        self.flat_param.copy_(self.master)

    def _grad_addresses(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradients' addresses on the device; rebuilt only when they move (under CUDA
        graphs they come from the graph's memory pool and stay put)."""
        for g in grads:
            if not g.is_contiguous() or g.dtype != self.flat_param.dtype:
                raise RuntimeError(
                    f"MasterAdamW: gradient of shape {tuple(g.shape)} is {g.dtype}, "
                    f"contiguous={g.is_contiguous()}; expected contiguous {self.flat_param.dtype}"
                )
        key = tuple(g.data_ptr() for g in grads)
        if self._addr is None or self._addr[0] != key:
            table = torch.tensor(key, dtype=torch.int64)
            if self.master.is_cuda:  # pinned: the copy does not wait for the device
                table = table.pin_memory()
            self._addr = (key, table.to(self.master.device, non_blocking=True))
        return self._addr[1]

    def _launch_step(self, lr: float, scale: torch.Tensor, skip: torch.Tensor) -> None:
        t = self._tables
        flat = self.flat_grad is not None
        addr = t["numel"] if flat else self._grad_addresses(self._grads())  # unread if flat
        beta1, beta2 = self.betas
        _adamw_kernel[(t["n_blocks"],)](
            t["blk_tensor"], t["blk_start"], t["numel"], t["offset"], t["decay"], addr,
            self.master, self.exp_avg, self.exp_avg_sq, self.flat_param,
            self.flat_grad if flat else self.master,  # unread unless flat
            self.step_t, scale, skip,
            lr, beta1, beta2, math.log2(beta1), math.log2(beta2), self.eps,
            GRAD_DTYPE=getattr(tl, _TL_DTYPES[self.flat_param.dtype]), FLAT=flat, BLOCK=BLOCK,
        )  # fmt: skip

    def _launch_accumulate(self, grads: list[torch.Tensor], first: bool) -> None:
        t = self._tables
        _accumulate_kernel[(t["n_blocks"],)](
            t["blk_tensor"], t["blk_start"], t["numel"], t["offset"],
            self._grad_addresses(grads), self.flat_grad,
            GRAD_DTYPE=getattr(tl, _TL_DTYPES[self.flat_param.dtype]), FIRST=first, BLOCK=BLOCK,
        )  # fmt: skip


def _block_tables(
    numels: list[int], offsets: list[int], decay: list[float], device: torch.device
) -> dict:
    """Per block of the kernels: its tensor and its first element; per tensor: size, flat
    offset and weight decay."""
    blk_tensor, blk_start = [], []
    for i, n in enumerate(numels):
        starts = range(0, n, BLOCK)
        blk_tensor += [i] * len(starts)
        blk_start += list(starts)
    return {
        "n_blocks": len(blk_tensor),
        "blk_tensor": torch.tensor(blk_tensor, dtype=torch.int32, device=device),
        "blk_start": torch.tensor(blk_start, dtype=torch.int32, device=device),
        "numel": torch.tensor(numels, dtype=torch.int64, device=device),
        "offset": torch.tensor(offsets, dtype=torch.int64, device=device),
        "decay": torch.tensor(decay, dtype=torch.float32, device=device),
    }
