"""One place that decides how the model is compiled, says why, and falls back at run
time when compilation or a compiled step fails.

Levels, from most to least ambitious: reduce-overhead (CUDA graphs),
max-autotune-no-cudagraphs, default, eager; a failure in either of the first two falls back
to default, one in default to eager. Known-bad combinations are avoided
up front: CUDA graphs with activation checkpointing (pointer / overwritten-output
errors), CUDA graphs when batch shapes vary (bucket mode: a graph per shape), and
compilation on the CPU by default (slow to compile, little gain for small models)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

LEVELS = ["reduce-overhead", "max-autotune-no-cudagraphs", "default", "eager"]

# Messages of failures that a lower compile level avoids.
COMPILE_FAILURE_MARKERS = (
    "CUDAGraphs",
    "cudagraph",
    "static input data pointer",
    "overwritten by a subsequent run",
    "triton",
    "Triton",
    "inductor",
    "Inductor",
    "dynamo",
    "Dynamo",
    "recompile",
    "autotun",
    "CUDA error: invalid argument",
    "InjectedCompileFailure",
)


class InjectedCompileFailure(RuntimeError):
    """Raised by tests (and the compile matrix script) to exercise the fallback path."""


@dataclass
class CompileDecision:
    mode: str
    reason: str

    def line(self) -> str:
        return f"compile: {self.mode} ({self.reason})"


def decide(
    requested: str,
    enabled: bool | None,
    device: torch.device,
    activation_checkpointing: bool,
    variable_shapes: bool,
    distributed: bool,
    guard: bool = True,
) -> CompileDecision:
    """Chooses the compile level; `requested` is the user's mode ('auto' lets us choose)."""
    if enabled is False or requested == "eager":
        return CompileDecision("eager", "compile disabled by configuration")
    if enabled is None and device.type != "cuda":
        return CompileDecision("eager", "CPU: compile is off unless --compile is given")
    if not hasattr(torch, "compile"):
        return CompileDecision("eager", f"torch {torch.__version__} has no torch.compile")
    mode = "default" if requested == "auto" else requested
    if mode not in LEVELS:
        raise ValueError(f"compile mode {requested!r} is not one of auto, {', '.join(LEVELS)}")
    if not guard:
        return CompileDecision(mode, "guard off: no up-front avoidance, no run-time fallback")
    if mode == "reduce-overhead":
        if os.environ.get("TORCH_COMPILE_DISABLE_CUDAGRAPHS") == "1":
            return CompileDecision(
                "default",
                "CUDA graphs are off (TORCH_COMPILE_DISABLE_CUDAGRAPHS=1 in the environment)",
            )
        if activation_checkpointing:
            return CompileDecision(
                "default",
                "CUDA graphs with activation checkpointing are known to fail; using default",
            )
        if variable_shapes:
            return CompileDecision(
                "default", "bucket mode varies shapes; CUDA graphs would record one graph per shape"
            )
        if device.type != "cuda":
            return CompileDecision("default", "CUDA graphs need a CUDA device")
    why = (
        "requested"
        if requested != "auto"
        else "CUDA default: Inductor without CUDA graphs or autotuning"
    )
    if distributed and mode == "default":
        why += "; DDP graph breaks at bucket boundaries are expected"
    return CompileDecision(mode, why)


def next_level(mode: str) -> str:
    """The level a failure falls back to. CUDA graphs and autotuning both drop straight to
    the default mode, then to eager: falling from CUDA graphs into GEMM autotuning would
    trade one known H100 failure for another (and autotuning the 124M preset ran past 7
    minutes there)."""
    return {"reduce-overhead": "default", "max-autotune-no-cudagraphs": "default"}.get(
        mode, "eager"
    )


def is_compile_failure(e: BaseException) -> bool:
    """True for errors that a lower compile level can avoid (never for e.g. OOM or NaN)."""
    if isinstance(e, InjectedCompileFailure):
        return True
    mod = type(e).__module__ or ""
    if mod.startswith(("torch._dynamo", "torch._inductor", "triton")):
        return True
    text = f"{type(e).__name__}: {e}"
    return any(m in text for m in COMPILE_FAILURE_MARKERS)


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process (recompiles included)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # private API; absent in some versions
        return -1


def set_inductor_options(spec: str) -> list[str]:
    """Sets Inductor config values from 'name=value,...' (values are Python literals, names
    are attributes of torch._inductor.config, dotted for its sub-configs such as
    'triton.enable_pdl'). Returns what was done, one 'name=value' per option; an option
    this torch version does not have is skipped and reported as such (a preset stays
    usable on an older torch). Raises ValueError for an item that is not name=value or
    a value that is not a literal."""
    import ast

    import torch._inductor.config as inductor_config

    applied = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"compile.inductor: {item!r} is not name=value")
        *path, leaf = name.strip().split(".")
        owner: object = inductor_config
        for part in path:
            owner = getattr(owner, part, None)
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError) as e:
            raise ValueError(
                f"compile.inductor: value of {name!r} is not a literal: {raw!r}"
            ) from e
        if owner is None or not hasattr(owner, leaf):
            applied.append(f"{name.strip()} (not an option of torch {torch.__version__}; skipped)")
            continue
        setattr(owner, leaf, value)
        applied.append(f"{name.strip()}={value!r}")
    return applied


def ensure_graph_room(graphs: int) -> None:
    """Lets Dynamo keep `graphs` compiled variants of one function (plus two to spare)
    before it gives up and runs it uncompiled: training and evaluation graphs of every
    bucket shape share the loss module's cache, whose default limit is 8."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(dynamo_config, name, graphs + 2) < graphs + 2:
            setattr(dynamo_config, name, graphs + 2)


def compile_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "eager":
        return model
    return torch.compile(model, mode=mode, dynamic=False)  # type: ignore[return-value]


def save_cache_artifacts(path) -> bool:
    """Saves Inductor's compiled artifacts (torch >= 2.7) so a restart skips most of the
    compile time; False where unsupported."""
    try:
        got = torch.compiler.save_cache_artifacts()
    except (AttributeError, RuntimeError):
        return False
    if not got:
        return False
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(got[0])
    return True


def load_cache_artifacts(path) -> bool:
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        return False
    try:
        return torch.compiler.load_cache_artifacts(p.read_bytes()) is not None
    except Exception:  # a stale or foreign cache only costs a normal compile
        return False
