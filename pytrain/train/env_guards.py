"""Environment variables that must be set before torch is first imported.

On H100s with recent torch, Triton autotuning has failed with "CUDA error: invalid
argument" and CUDA graphs with activation checkpointing have crashed; the fix that
worked was to switch autotuning and CUDA graphs off through the environment before
`import torch`. `python -m pytrain.train` applies these (unless `--compile.safe_env=false`)
before it imports anything that imports torch. A variable the user already set wins.

The Inductor cache it names by default lives in the run directory; `run_inductor_cache`
decides whether that one may be used (see there)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pytrain.train import signing

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


ALLOCATOR_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""The CUDA caching allocator's settings: the current name and the older one torch still
reads."""
EXPANDABLE = "expandable_segments:True"


def apply_allocator_env(cudagraphs: bool = False) -> str:
    """Lets the CUDA allocator grow its segments in place (expandable segments, as
    torchtitan's launcher sets them) unless the user configured the allocator, and returns
    the setting in force (the user's where given; '' for torch's default). Without them,
    memory freed between blocks of different sizes stays reserved in segments that fit
    neither: the 8B preset on four GPUs reserved 67.2 GiB without them, 62.4 with, at the
    same speed. Not where the run asks for CUDA graphs (`cudagraphs`: compile mode
    reduce-overhead): their memory pools and expandable segments have failed together in
    torch (pytorch/pytorch#140419), and the models small enough for CUDA graphs gain
    little. torch reads the variable when CUDA is first used, so this goes before that."""
    for k in ALLOCATOR_VARS:
        if k in os.environ:
            return os.environ[k]
    if cudagraphs:
        return ""
    os.environ[ALLOCATOR_VARS[0]] = EXPANDABLE
    return EXPANDABLE


def expandable_in_force() -> bool:
    """Whether the allocator settings in this process's environment grow segments in place."""
    conf = ",".join(os.environ.get(k, "") for k in ALLOCATOR_VARS).replace(" ", "")
    return "expandable_segments:true" in conf.lower()


INDUCTOR_CACHE = "inductor-cache"
"""The run's Inductor cache, a directory of the run directory (warm restarts of the run)."""


def run_inductor_cache(run_dir: Path) -> tuple[str | None, str | None]:
    """(the run's Inductor cache directory or None, a line saying why not).

    Inductor loads its cache entries itself: pickles (compiled graphs, AOTAutograd's
    results) and Python modules of kernels, which it imports. Nothing of ours stands between
    an entry and its loading, so entries cannot be checked one by one; the directory is.
    The trainer signs the directory when it makes it (signing.stamp_dir: its path and inode
    under this user's key), and points Inductor at a directory it signed, or at one it makes
    now (none there yet, or an empty one). A run directory copied from someone else (or a
    cache put there by another hand) has no signature of this user's: Inductor then uses
    its own default cache outside the run directory (None here) and the line says so; the
    run compiles afresh. Under torchrun every rank decides alike: a fresh directory is
    signed with the same stamp by whichever rank comes first."""
    d = Path(run_dir) / INDUCTOR_CACHE
    try:
        if any(not signing.is_stamp(p.name) for p in _entries(d)):
            signing.check_dir(d, INDUCTOR_CACHE)
        else:  # nothing in it that could be loaded: ours from now on
            d.mkdir(parents=True, exist_ok=True)
            signing.stamp_dir(d, INDUCTOR_CACHE)
        return str(d), None
    except signing.NotTrusted as e:
        return None, (
            f"Inductor cache {d} not used: {e}, and its entries could run code this user did "
            "not write; Inductor uses its default cache (remove the directory for the run to "
            "keep a cache of its own again)"
        )
    except (signing.NoKey, OSError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else e
        return None, f"Inductor cache {d} not used: {why}; Inductor uses its default cache"


def _entries(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except FileNotFoundError:
        return []
