"""The GELU MLP with its activation inside its matmuls, for training: cuBLASLt's GELU_AUX and
DGELU epilogues, called through NVIDIA's nvmath-python (the optional `cublaslt` extra).

Why: unfused, the MLP's up projection writes h (tokens x 4 d_model), a GELU kernel reads
it and writes g = gelu(h); in backward the down projection's input gradient dg is written,
then read with h to write dh. Those passes over (tokens x 4 d_model) tensors are pure
memory traffic. GELU_AUX writes g and h from the matmul itself; DGELU multiplies by
gelu'(h) as the matmul writes dh, so dg never exists. On the H100, for one layer and
32,768 tokens of the GPT-2 124M preset: 0.286 vs 0.369 ms forward, 0.299 vs 0.438 ms
backward (matmul + compiled GELU); BENCHMARKS.md has the whole step.

cuBLASLt's GELU is the tanh form (GPT-2's own); torch's default GELU, which the unfused path
keeps (evaluation, export, CPUs), is the erf form. The two differ by less than 5e-4
anywhere, and by less than half a bf16 rounding step of the output for h > -2: the weights
compute the same function within bf16 rounding (tests/test_gpu.py compares the losses and
gradients, BENCHMARKS.md the validation loss on real text).

Both matmuls return column-major (tokens x hidden) tensors, the layout cuBLASLt writes; the
matmuls that read them take either layout. Elsewhere than CUDA with nvmath-python, the
same ops run in torch (the reference the GPU test compares against, and what the CPU
tests run)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pytrain.model.config import ModelConfig

__all__ = ["available", "mlp", "used", "why_not"]


_imports: list[bool] = []
"""Whether nvmath-python imports, once known. A plain list, not functools.cache: the model's
forward asks (through `used`) inside the compiled trace, where Dynamo warns, with a stack,
on every call of an lru_cache-wrapped function; a global it reads is only a guard."""


def _nvmath() -> bool:
    if not _imports:
        try:
            from nvmath.linalg.advanced import Matmul  # noqa: F401

            _imports.append(True)
        except Exception:  # ImportError, or the CUDA libraries failing to load
            _imports.append(False)
    return _imports[0]


_checked: dict[int, str] = {}
"""Per CUDA device index: '' where a tiny GELU_AUX matmul ran through nvmath-python, else
what went wrong (e.g. a cuBLAS of another CUDA major version than nvmath's bindings load)."""


def _check(device: torch.device) -> str:
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _checked:
        if torch.compiler.is_compiling():
            return ""  # the trainer checks before compiling; a trace cannot run a matmul
        try:
            a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            _run("GELU_AUX", a, a.t())
            _checked[index] = ""
        except Exception as e:  # the library failing to load or to plan: run unfused
            _checked[index] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return _checked[index]


def available(device: torch.device) -> bool:
    """True on CUDA devices where nvmath-python imports and runs a GELU_AUX matmul."""
    return device.type == "cuda" and _nvmath() and not _check(device)


def _asked(cfg: ModelConfig) -> bool:
    """GELU MLPs whose linear layers are plain (not torchao's FP8 ones), fused_gelu not off."""
    return cfg.mlp == "gelu" and cfg.float8 == "off" and cfg.fused_gelu != "off"


def used(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether training steps of a model with this config, on this device and in this
    compute dtype, run its MLPs through `mlp` here: where it applies (_asked) and
    model.fused_gelu is 'on', or 'auto' with nvmath-python on a GPU and bf16/fp16 (in fp32,
    torch's TF32 matmuls are faster)."""
    if not _asked(cfg):
        return False
    return cfg.fused_gelu == "on" or (available(device) and dtype != torch.float32)


def why_not(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> str:
    """Why `auto` leaves this model's GELU unfused on a GPU where it would otherwise fuse
    (nvmath-python missing or failing); '' where it fuses or was not asked to."""
    if not _asked(cfg) or cfg.fused_gelu != "auto" or device.type != "cuda":
        return ""
    if dtype == torch.float32:  # not a reason to install anything
        return ""
    if not _nvmath():
        return "nvmath-python is not installed: `pip install '.[cublaslt]'`"
    if why := _check(device):
        return f"cuBLASLt through nvmath-python failed here ({why})"
    return ""


# One planned cuBLASLt matmul per (epilogue, operand shapes, strides, dtype, device): plans
# are made once (the heuristic's algorithm), then each call only swaps the operand
# pointers. The plans hold no device memory between calls: not the operands
# (release_operands) and not the workspace (release_workspace: it comes from torch's caching
# allocator per call, like any intermediate). A workspace kept across calls would be a
# tensor of a CUDA graph's private pool that the graph does not own: CUDA graphs refuse
# that ("tensor(s) in the cudagraph pool not tracked as outputs"), and after the fallback
# the plan would write into memory the pool had handed on.
_plans: dict[tuple, Any] = {}  # nvmath Matmul objects (an optional import)


def _run(epilog: str, a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor | None = None):
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    stream = torch.cuda.current_stream(a.device)
    key = (epilog, a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device)
    inputs = None if aux is None else {"gelu_aux": aux}
    mm = _plans.get(key)
    if mm is None:
        mm = Matmul(a, b, stream=stream)
        mm.plan(epilog=getattr(MatmulEpilog, epilog), epilog_inputs=inputs, stream=stream)
        _plans[key] = mm
    else:
        mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs, stream=stream)
    out = mm.execute(release_workspace=True, stream=stream)
    mm.release_operands()
    return out


def _colmajor(t: torch.Tensor) -> torch.Tensor:
    """A column-major copy of the 2-D `t`: the layout the cuBLASLt ops return."""
    return t.t().contiguous().t()


@torch.library.custom_op("pytrain::gelu_up", mutates_args=())
def _gelu_up(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gelu(h), h) for h = x @ weight.T: x (N, C), weight (H, C), both (N, H), column-major."""
    if available(x.device):
        g, aux = _run("GELU_AUX", x, weight.t())
        return g, aux["gelu_aux"]
    h = x @ weight.t()
    return _colmajor(F.gelu(h, approximate="tanh")), _colmajor(h)


@_gelu_up.register_fake
def _(x, weight):
    n, hidden = x.shape[0], weight.shape[0]
    return (x.new_empty_strided((n, hidden), (1, n)), x.new_empty_strided((n, hidden), (1, n)))


@torch.library.custom_op("pytrain::dgelu_down", mutates_args=())
def _dgelu_down(grad: torch.Tensor, weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """(grad @ weight) * gelu'(h): grad (N, C), weight (C, H), h from gelu_up; (N, H),
    column-major."""
    if available(grad.device):
        return _run("DGELU", grad, weight, aux=h)
    dg = grad @ weight
    return _colmajor(torch.ops.aten.gelu_backward(dg, h, approximate="tanh"))


@_dgelu_down.register_fake
def _(grad, weight, h):
    n = grad.shape[0]
    return grad.new_empty_strided((n, weight.shape[1]), (1, n))


class _GeluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_up, w_down):
        g, h = _gelu_up(x, w_up)
        ctx.save_for_backward(x, w_up, w_down, g, h)
        return g @ w_down.t()

    @staticmethod
    def backward(ctx, dy):
        x, w_up, w_down, g, h = ctx.saved_tensors
        dy = dy.to(x.dtype).contiguous()
        dh = _dgelu_down(dy, w_down, h)
        return dh @ w_up, dh.t() @ x, dy.t() @ g


def mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, dtype: torch.dtype):
    """down(gelu_tanh(up(x))) without biases, in `dtype` (the compute dtype): x (..., C),
    w_up (H, C), w_down (C, H) in any dtype; the weights' gradients come back in theirs."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(dtype).contiguous()
    y = _GeluMLP.apply(x2, w_up.to(dtype), w_down.to(dtype))
    return y.view(*shape[:-1], y.shape[-1])
