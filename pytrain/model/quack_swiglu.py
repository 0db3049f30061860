"""The SwiGLU MLP with its activation inside its matmuls, for training: quack's gated GEMMs
(`quack.mlp.mlp_func`, CuTe DSL kernels of quack-kernels, which flash-attn-4 installs),
chosen with `--model.fused_swiglu quack`.

Why: even with pytrain.model.fused_swiglu, the SwiGLU between the up and down projections
is its own pass over (tokens x 2 hidden) in forward and again in backward: on the H100 at
Llama-3.2-1B's shape its kernels take 47 ms of a 924 ms step (BENCHMARKS.md, "Eleventh
session"). quack's up projection computes silu(gate) * up in its epilogue as it writes
both; its down projection's backward computes the activation's gradient in its epilogue
as it writes the gradient of the up projection's output. The weights are ours unchanged:
the up projection's [gate; up] rows are quack's "concat layout".

Hopper and Blackwell only (compute capability 9.x, 10.x), bf16/fp16, plain linear layers
(not torchao's float8 ones). The trainer calls `check` once before compiling, so a config
that asks for quack where it cannot run stops with one line; the forward asks only `used`,
which reads the config and the device type (no import, no device query inside a trace).
Evaluation, export and sampling keep the plain MLP: the same function of the weights."""

from __future__ import annotations

import torch

from pytrain.config import ConfigError
from pytrain.model.config import ModelConfig

__all__ = ["check", "mlp", "used", "why_not"]

_why: dict[int, str] = {}
"""Per CUDA device index: '' where quack's MLP can run, else why not. A plain dict, not
functools.cache, for the reason pytrain.model.fused_gelu gives."""


def why_not(device: torch.device) -> str:
    """'' where quack's gated-GEMM MLP runs on this device, else why not, in a few words."""
    if device.type != "cuda":
        return f"needs a CUDA GPU (here {device.type})"
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _why:
        major, minor = torch.cuda.get_device_capability(index)
        if major not in (9, 10):
            _why[index] = (
                f"needs a Hopper or Blackwell GPU (here compute capability {major}.{minor})"
            )
        else:
            try:
                import quack.mlp  # noqa: F401

                _why[index] = ""
            except Exception as e:  # ImportError, or the CuTe DSL's libraries failing to load
                first = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                _why[index] = f"quack-kernels does not import ({first}): `pip install flash-attn-4`"
    return _why[index]


def used(cfg: ModelConfig, device: torch.device) -> bool:
    """Whether training steps of this config on this device run their MLPs through `mlp`:
    model.fused_swiglu 'quack' on a SwiGLU model, on CUDA (where `check` has passed)."""
    return cfg.mlp == "swiglu" and cfg.fused_swiglu == "quack" and device.type == "cuda"


def check(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """ConfigError, one line, where the config asks for quack's MLP and it cannot run here."""
    if cfg.fused_swiglu != "quack":
        return
    if device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        why = f"needs bf16 or fp16 (here {str(dtype).removeprefix('torch.')})"
    else:
        why = why_not(device)
    if why:
        raise ConfigError(f"model.fused_swiglu=quack {why}; choose auto, on or off")


def mlp(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, dtype: torch.dtype):
    """down(silu(gate) * up) for the up weight [gate; up] (2 hidden x d_model) and the down
    weight (d_model x hidden), computed in dtype (the step's compute dtype: quack's ops are
    not autocast's, so the operands are cast here, differentiably)."""
    from quack.mlp import mlp_func

    x, w_up, w_down = x.to(dtype), w_up.to(dtype), w_down.to(dtype)
    return mlp_func(x, w_up, w_down, activation="swiglu", concat_layout=True)
