"""SwiGLU's activation as two ops whose backward writes the up projection's gradient in
one pass, for training (`--model.fused_swiglu`).

Why: the MLP's up projection writes u = [a | b] (tokens x 2 hidden) and the activation is
h = silu(a) * b. Compiled as plain torch, the backward's gradient of u is a `cat` of da and
db, which Inductor writes as one pointwise kernel in which every output element loads its
own inputs: the first half loads a, b and g, the second a and g. It also recomputes h there
for the down projection's weight gradient. On an H200 at Llama-3.2-1B's shape that kernel
moves about 2.15 GB per layer and micro-batch and takes 0.65 ms, 41.7 ms of a 940 ms step
(measured on the GPU). Here one program reads a, b and g once for a block of a
row and writes both halves of du: 1.34 GB. h comes out of an op too, so the partitioner
keeps it for the down projection instead of recomputing it. That costs memory: one
(tokens x hidden) tensor per layer, about 4.3 GB at 1B with 8 rows of 2048.

The kernels are Triton on CUDA; elsewhere the same math runs in torch (`_swiglu_torch`
and `_swiglu_backward_torch`, the references the Triton kernels are tested against under
Triton's interpreter). Both are torch custom ops with an autograd formula, so
torch.compile treats each as one opaque call, and the up and down projections stay
ordinary linear layers (torchao's float8 ones too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pytrain.model.config import ModelConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch path
    triton = None

__all__ = ["swiglu", "used"]

BLOCK = 1024  # elements of a row's half per program: 4 warps, 8 per thread


if triton is not None:

    @triton.jit
    def _swiglu_kernel(u_ptr, h_ptr, H, BLOCK: tl.constexpr):
        """h[r, j] = silu(u[r, j]) * u[r, H + j] for one block of row r, in fp32."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        a = tl.load(u_ptr + row * 2 * H + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(u_ptr + row * 2 * H + H + cols, mask=mask, other=0.0).to(tl.float32)
        h = a * tl.sigmoid(a) * b
        tl.store(h_ptr + row * H + cols, h.to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(u_ptr, g_ptr, du_ptr, H, BLOCK: tl.constexpr):
        """du[r, j] = g * b * s * (1 + a * (1 - s)) and du[r, H + j] = g * a * s for
        s = sigmoid(a), from one read of a = u[r, j], b = u[r, H + j] and g = g[r, j]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        a = tl.load(u_ptr + row * 2 * H + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(u_ptr + row * 2 * H + H + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        da = g * b * s * (1.0 + a * (1.0 - s))
        db = g * a * s
        out = du_ptr + row * 2 * H
        tl.store(out + cols, da.to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(out + H + cols, db.to(du_ptr.dtype.element_ty), mask=mask)


def _rows(u: torch.Tensor) -> tuple[torch.Tensor, int]:
    """u as a contiguous (rows, 2 H) matrix, and H."""
    return u.contiguous().view(-1, u.shape[-1]), u.shape[-1] // 2


def _use_triton(u: torch.Tensor) -> bool:
    return triton is not None and u.device.type == "cuda"


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or fp64 where it is fp64 already (the kernels compute in fp32)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _swiglu_torch(u: torch.Tensor) -> torch.Tensor:
    a, b = _wide(u).chunk(2, dim=-1)
    return (F.silu(a) * b).to(u.dtype)


def _swiglu_backward_torch(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    a, b = _wide(u).chunk(2, dim=-1)
    gf, s = _wide(g), torch.sigmoid(a)
    return torch.cat((gf * b * s * (1 + a * (1 - s)), gf * a * s), dim=-1).to(u.dtype)


def _swiglu_triton(u: torch.Tensor) -> torch.Tensor:
    m, hidden = _rows(u)
    h = m.new_empty((m.shape[0], hidden))
    _swiglu_kernel[(m.shape[0], triton.cdiv(hidden, BLOCK))](m, h, hidden, BLOCK=BLOCK)
    return h.view(*u.shape[:-1], hidden)


def _swiglu_backward_triton(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    m, hidden = _rows(u)
    gm = g.contiguous().view(-1, hidden)
    du = m.new_empty(m.shape)
    grid = (m.shape[0], triton.cdiv(hidden, BLOCK))
    _swiglu_backward_kernel[grid](m, gm, du, hidden, BLOCK=BLOCK)
    return du.view(u.shape)


@torch.library.custom_op("pytrain::swiglu", mutates_args=())
def _swiglu(u: torch.Tensor) -> torch.Tensor:
    """silu(u[..., :H]) * u[..., H:], in u's dtype (computed in fp32)."""
    return _swiglu_triton(u) if _use_triton(u) else _swiglu_torch(u)


@_swiglu.register_fake
def _(u):
    return u.new_empty((*u.shape[:-1], u.shape[-1] // 2))


@torch.library.custom_op("pytrain::swiglu_backward", mutates_args=())
def _swiglu_backward(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient of u, [da | db], for the gradient g of the activation's output."""
    if _use_triton(u):
        return _swiglu_backward_triton(u, g)
    return _swiglu_backward_torch(u, g)


@_swiglu_backward.register_fake
def _(u, g):
    return u.new_empty(u.shape)  # contiguous, as both paths return it


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (u,) = ctx.saved_tensors
    return torch.ops.pytrain.swiglu_backward(u, grad)


torch.library.register_autograd("pytrain::swiglu", _backward, setup_context=_setup_context)


def swiglu(u: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of the up projection's output u = [gate | up] (..., 2 H):
    silu(gate) * up (..., H), differentiable, its backward one kernel on CUDA."""
    if u.shape[-1] % 2:
        raise ValueError(
            f"SwiGLU input's last dimension {u.shape[-1]} is odd (expected [gate | up])"
        )
    return torch.ops.pytrain.swiglu(u)


def used(cfg: ModelConfig, device: torch.device) -> bool:
    """Whether training steps of a SwiGLU model with this config, on this device, run the
    activation through `swiglu`: model.fused_swiglu 'on', or 'auto' on CUDA with Triton
    (where pytrain.model.quack_swiglu takes the whole MLP, 'quack' or 'auto' on a GPU where
    quack runs, the model's MLP never reaches this op)."""
    if cfg.mlp != "swiglu" or cfg.fused_swiglu not in ("auto", "on"):
        return False
    return cfg.fused_swiglu == "on" or (triton is not None and device.type == "cuda")
