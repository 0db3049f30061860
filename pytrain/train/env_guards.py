"""Environment variables that must be set before torch is first imported.

On H100s with recent torch, Triton autotuning has failed with "CUDA error: invalid
argument" and CUDA graphs with activation checkpointing have crashed; the fix that
worked was to switch autotuning and CUDA graphs off through the environment before
`import torch`. `python -m pytrain.train` applies these (unless `--compile.safe_env=false`)
before it imports anything that imports torch. A variable the user already set wins."""

from __future__ import annotations

import os
import sys

SAFE_INDUCTOR_ENV = {
    "TORCHINDUCTOR_MAX_AUTOTUNE": "0",
    "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "0",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM": "0",
    "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "0",
    "TORCH_COMPILE_DISABLE_CUDAGRAPHS": "1",
}


class GuardTooLate(RuntimeError):
    """torch was imported before the guards could be applied."""


def apply_safe_env(cache_dir: str | None = None, cudagraphs: bool = False) -> dict[str, str]:
    """Sets the guards (keeping values the user set) and returns what is in force.
    `cudagraphs`: the configuration asks for CUDA graphs by name (compile mode
    'reduce-overhead'), so they are not switched off here; the compile policy still
    refuses them where they are known to fail, and a failure at run time falls back."""
    if "torch" in sys.modules:
        raise GuardTooLate(
            "torch is already imported; Inductor reads these variables at import time"
        )
    applied = {}
    for k, v in SAFE_INDUCTOR_ENV.items():
        if cudagraphs and k == "TORCH_COMPILE_DISABLE_CUDAGRAPHS":
            continue
        os.environ.setdefault(k, v)
        applied[k] = os.environ[k]
    if cache_dir:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)
        applied["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return applied
