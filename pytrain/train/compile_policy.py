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
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pytrain.config import COMPILE_LEVELS, inductor_options
from pytrain.train import compile_cache, disk

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
    fsdp2: bool = False,
) -> CompileDecision:
    """Chooses the compile level; `requested` is the user's mode ('auto' lets us choose)."""
    if enabled is False or requested == "eager":
        return CompileDecision("eager", "compile disabled by configuration")
    if enabled is None and device.type != "cuda":
        return CompileDecision("eager", "CPU: compile is off unless --compile is given")
    if not hasattr(torch, "compile"):
        return CompileDecision("eager", f"torch {torch.__version__} has no torch.compile")
    mode = "default" if requested == "auto" else requested
    if mode not in COMPILE_LEVELS:
        raise ValueError(
            f"compile mode {requested!r} is not one of auto, {', '.join(COMPILE_LEVELS)}"
        )
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
        if fsdp2:
            # FSDP2 all-gathers and frees each block's parameters around its graphs; with
            # CUDA graphs the GPT-2 preset on 2 H100s ran at 0.18x its replicated tokens/s
            # (BENCHMARKS.md). Without them, Llama-1B on FSDP2 scaled 92% from 1 to 2 GPUs.
            return CompileDecision(
                "default",
                "FSDP2 under CUDA graphs measured 0.18x of replicas' speed; using default",
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
    'triton.enable_pdl'; parsed by pytrain.config.inductor_options). Returns what was done,
    one 'name=value' per option; an option this torch version does not have is skipped and
    reported as such (a preset stays usable on an older torch)."""
    import torch._inductor.config as inductor_config

    applied = []
    for name, value in inductor_options(spec):
        *path, leaf = name.split(".")
        owner: object = inductor_config
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, leaf):
            applied.append(f"{name} (not an option of torch {torch.__version__}; skipped)")
            continue
        setattr(owner, leaf, value)
        applied.append(f"{name}={value!r}")
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


def failure_line(e: BaseException) -> str:
    """A compile failure in a few words for its fallback line; a full disk (Inductor's
    cache, Triton's kernels) is said first and loudly: it is the cause, not the model, and
    freeing space restores the compiled speed."""
    first = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if (full := disk.full_disk_error(e)) is None:
        return first
    where = full.filename or os.environ.get("TORCHINDUCTOR_CACHE_DIR", "the compile cache")
    return f"DISK FULL writing {where}, {disk.human(disk.free_bytes(Path(where)))} free; {first}"


class CompiledModel:
    """Everything about how the loss module runs compiled: the training and evaluation
    modules, the level in force and why, the fallbacks taken, the graphs the warm-up
    made, Inductor's cache artifacts, and the failure injection tests use. The trainer
    calls `forward`, `fall_back` and `evaluate`; it never looks at a compile level."""

    def __init__(self, module, eval_module, decision: CompileDecision, guard: bool, say):
        self.module, self.eval_module = module, eval_module
        self.mode, self.reason = decision.mode, decision.reason
        self.eval_mode = self.mode
        self.guard = guard
        self.say = say
        self.fallbacks: list[str] = []
        self.expected_graphs = -1  # graphs compiled by the warm-up
        self.inject_failure: tuple[int, str] | None = None
        """(step, mode): raise a compile-like failure there (tests, scripts/compile_matrix.py)."""
        self.train_fn = self.eval_fn = module

    @property
    def eager(self) -> bool:
        return self.mode == "eager"

    def state_dict(self) -> dict:
        return {"compile_mode": self.mode, "fallbacks": list(self.fallbacks)}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run keeps the fallbacks and never retries a level that failed. A lower
        level the previous run chose (eager on a CPU, --no-compile) is no failure: the
        resumed run's own choice (e.g. --compile) stands."""
        self.fallbacks = list(state["fallbacks"])
        lower = COMPILE_LEVELS.index(state["compile_mode"]) > COMPILE_LEVELS.index(self.mode)
        if lower and self.fallbacks:
            self.mode = state["compile_mode"]
            self.reason = (
                "a previous run fell back to it after a failure (see fallbacks in the log)"
            )

    def start(self, coordinate_descent: bool, inductor: str, graphs: int) -> None:
        """Sets Inductor's options and compiles both modules (after a resume has restored
        the level). `graphs`: how many graphs (shapes x train/eval) must share one cache."""
        if not self.eager:
            if coordinate_descent:
                import torch._inductor.config as inductor_config

                inductor_config.coordinate_descent_tuning = True
                self.reason += "; coordinate-descent tuning on"
            if inductor:
                self.reason += f"; Inductor options {', '.join(set_inductor_options(inductor))}"
            compile_cache.enable_warm_caches()
            ensure_graph_room(graphs)
        self.train_fn = compile_model(self.module, self.mode)
        # Evaluation runs compiled too (uncompiled FlexAttention materialises the scores),
        # without CUDA graphs (a few batches now and then).
        self.eval_mode = "default" if self.mode == "reduce-overhead" else self.mode
        self.eval_fn = compile_model(self.eval_module, self.eval_mode)
        self.say(f"compile: {self.mode} ({self.reason})")

    def forward(self, step: int, *args):
        if self.inject_failure == (step, self.mode):
            raise InjectedCompileFailure(f"injected failure at step {step} ({self.mode})")
        return self.train_fn(*args)

    def _recoverable(self, e: BaseException, mode: str) -> bool:
        return self.guard and is_compile_failure(e) and mode != "eager"

    def fall_back(self, e: BaseException, step: int) -> str:
        """After `e` failed a training step: re-raises it unless a lower level avoids it;
        else drops one level, recompiles and returns the note that says so."""
        if not self._recoverable(e, self.mode):
            raise e
        old, self.mode = self.mode, next_level(self.mode)
        note = f"step {step}: {old} failed ({failure_line(e)}); falling back to {self.mode}"
        self.say(f"compile fallback: {note}")
        self.fallbacks.append(note)
        self.train_fn = compile_model(self.module, self.mode)
        return note

    def evaluate(self, *args):
        """The evaluation module's output; a compile failure drops evaluation one level."""
        while True:
            try:
                return self.eval_fn(*args)
            except Exception as e:
                if not self._recoverable(e, self.eval_mode):
                    raise
                old, self.eval_mode = self.eval_mode, next_level(self.eval_mode)
                self.say(
                    f"compile fallback (evaluation): {old} failed ({failure_line(e)}); using {self.eval_mode}"
                )
                self.eval_fn = compile_model(self.eval_module, self.eval_mode)

    def warm_up(self, cache_path, compile_all, is_main: bool) -> str:
        """Runs `compile_all()` (every shape, before the timed loop) with Inductor's cache
        artifacts loaded from and saved to `cache_path`; records the graphs it made."""
        cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        free = disk.free_bytes(Path(cache_dir)) if is_main and cache_dir else None
        if free is not None and free < 2e9:
            # A cache that cannot be written costs a fallback to eager speed, said loudly
            # then; said here first, while there is time to free space.
            self.say(f"warning: the compile cache {cache_dir} has {disk.human(free)} free; "
                     "compiling may fail for space")  # fmt: skip
        t0 = time.perf_counter()
        loaded = compile_cache.load_artifacts(cache_path)
        t_load = time.perf_counter() - t0
        compile_all()
        self.expected_graphs = compiled_graphs()
        if is_main and not loaded:
            compile_cache.save_artifacts(cache_path)
        return f" (cache artifacts loaded in {t_load:.1f}s)" if loaded else ""

    def summary(self, check_recompiles: bool) -> tuple[int, str | None]:
        """(graphs compiled in this process, a warning if training recompiled after the
        warm-up)."""
        graphs = 0 if self.eager else compiled_graphs()
        if check_recompiles and 0 <= self.expected_graphs < graphs:
            return graphs, (
                f"warning: {graphs - self.expected_graphs} recompile(s) after warm-up ({graphs} graphs, warm-up made "
                f"{self.expected_graphs}); shapes or guards changed during training (see TORCH_LOGS=recompiles)"
            )
        return graphs, None
