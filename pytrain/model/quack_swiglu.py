"""The SwiGLU MLP with its activation inside its matmuls, for training: quack's gated GEMMs
(`quack.mlp.mlp_func`, CuTe DSL kernels of quack-kernels, which flash-attn-4 installs),
taken by `--model.fused_swiglu auto` where it runs, or asked for with 'quack'.

Why: even with pytrain.model.fused_swiglu, the SwiGLU between the up and down projections
is its own pass over (tokens x 2 hidden) in forward and again in backward: on the H100 at
Llama-3.2-1B's shape its kernels take 47 ms of a 924 ms step (measured with the profiler).
quack's up projection computes silu(gate) * up in its epilogue as it writes
both; its down projection's backward computes the activation's gradient in its epilogue
as it writes the gradient of the up projection's output. The weights are ours unchanged:
the up projection's [gate; up] rows are quack's "concat layout".

On the H100 at that shape, 8 rows of 2048 a micro-batch: 73,984 tokens/s (61.5% MFU) and
42.6 GiB at peak, against 71,174 (59.2%) and 46.2 GiB with the Triton op (one run each).
Alone, one layer's MLP is no faster than cuBLAS + the Triton op (7.99 against 7.91 ms):
the step gains from what it no longer keeps and moves between the kernels.

Hopper and Blackwell only (compute capability 9.x, 10.x), bf16/fp16, plain linear layers
(not torchao's float8 ones). The trainer calls `check` once before compiling, so a config
that asks for quack where it cannot run stops with one line, and 'auto' learns whether it
runs; inside the trace, `used` reads only what `check` learned.
Evaluation, export and sampling keep the plain MLP: the same function of the weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from pytrain.config import ConfigError
from pytrain.model.config import ModelConfig

__all__ = ["auto_note", "check", "dsl_outside_site_packages", "mlp", "used", "why_not"]

HALF = (torch.bfloat16, torch.float16)
ALIGN = 8
"""quack's GEMMs need rows of 16 bytes (quack's own MLP module falls back to torch where a
width is not a multiple of 8); the hidden width is a multiple of 64 already."""

_why: dict[int, str] = {}
"""Per CUDA device index: '' where quack's MLP can run, else why not. A plain dict, not
functools.cache, for the reason pytrain.model.fused_gelu gives."""


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def why_not(device: torch.device) -> str:
    """'' where quack's gated-GEMM MLP runs on this device, else why not, in a few words."""
    if device.type != "cuda":
        return f"needs a CUDA GPU (here {device.type})"
    if (index := _index(device)) not in _why:
        major, minor = torch.cuda.get_device_capability(index)
        if major not in (9, 10):
            _why[index] = (
                f"needs a Hopper or Blackwell GPU (here compute capability {major}.{minor})"
            )
        else:
            try:
                import quack.mlp  # noqa: F401

                _why[index] = dsl_outside_site_packages()
            except Exception as e:  # ImportError, or the CuTe DSL's libraries failing to load
                first = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                _why[index] = f"quack-kernels does not import ({first}): `pip install flash-attn-4`"
    return _why[index]


def auto_note(cfg: ModelConfig, device: torch.device) -> str:
    """Why 'auto' leaves quack's MLP out although quack-kernels imports: its CuTe DSL lies
    outside site-packages (dsl_outside_site_packages); '' otherwise. The trainer says it at
    the start: other reasons are the GPU's or the config's, and a missing quack is FA4's
    install hint's to tell."""
    if cfg.mlp != "swiglu" or cfg.fused_swiglu != "auto" or device.type != "cuda":
        return ""
    why = why_not(device)
    return why if why == dsl_outside_site_packages() else ""


def dsl_outside_site_packages() -> str:
    """'' where the CuTe DSL (package `cutlass`, of nvidia-cutlass-dsl) lies under a
    site-packages (or dist-packages) directory, as pip installs it into an environment;
    else why quack's MLP cannot run. quack fingerprints its epilogues' code to cache their
    kernels and keys functions under such a directory by name alone; elsewhere (`pip
    install --target DIR` put on PYTHONPATH) it walks into the DSL's own globals and stops
    the first step on one it cannot key ("TypeError: epilogue fn depends on <ContextVar
    name='_LOC_TRANSFORMS'...>", quack-kernels 0.6.5 with nvidia-cutlass-dsl 4.8)."""
    spec = importlib.util.find_spec("cutlass")
    if spec is None or spec.origin is None:
        return ""  # not installed: quack's own import says so
    where = Path(spec.origin).parent
    if {"site-packages", "dist-packages"} & set(where.parts):
        return ""
    return (
        f"needs the CuTe DSL installed under a site-packages directory (here {where}): "
        "install flash-attn-4 into a virtual environment, or --target a directory named "
        "site-packages"
    )


def _why_not_here(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> str:
    """'' where quack's MLP runs for this config, device and compute dtype, else why not:
    what both 'quack' (an error) and 'auto' (the Triton op instead) go by."""
    if device.type == "cuda" and dtype not in HALF:
        return f"needs bf16 or fp16 (here {str(dtype).removeprefix('torch.')})"
    if cfg.d_model % ALIGN:
        return f"needs model.d_model a multiple of {ALIGN} (here {cfg.d_model})"
    if cfg.float8 != "off":  # quack's GEMMs would bypass torchao's float8 linear layers
        return f"needs model.float8=off (here {cfg.float8})"
    return why_not(device)


def used(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether training steps of this config, on this device and in this compute dtype, run
    their MLPs through `mlp`: model.fused_swiglu 'quack' on CUDA (where `check` has passed),
    or 'auto' where quack runs (float8 off, bf16/fp16, d_model a multiple of 8, Hopper or
    Blackwell with quack-kernels).
    Inside a trace it reads only what `check` learned before compiling."""
    if cfg.mlp != "swiglu" or device.type != "cuda" or cfg.fused_swiglu not in ("quack", "auto"):
        return False
    if cfg.fused_swiglu == "quack":
        return True
    if torch.compiler.is_compiling() and _index(device) not in _why:
        return False  # not checked before the trace: the Triton op, as without quack
    return not _why_not_here(cfg, device, dtype)


def check(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """ConfigError, one line, where the config asks for quack's MLP and it cannot run here;
    else whether training steps use it (the trainer asks once, before compiling)."""
    if cfg.fused_swiglu == "quack" and (why := _why_not_here(cfg, device, dtype)):
        raise ConfigError(f"model.fused_swiglu=quack {why}; choose auto, on or off")
    return used(cfg, device, dtype)


def mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, dtype: torch.dtype):
    """down(silu(gate) * up) for the up weight [gate; up] (2 hidden x d_model) and the down
    weight (d_model x hidden), computed in dtype (the step's compute dtype: quack's ops are
    not autocast's, so the operands are cast here, differentiably)."""
    from quack.mlp import mlp_func

    x, w_up, w_down = x.to(dtype), w_up.to(dtype), w_down.to(dtype)
    return mlp_func(x, w_up, w_down, activation="swiglu", concat_layout=True)
