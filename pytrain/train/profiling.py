"""A profiler window over training steps (`--profile_steps A:B`), and the per-step kernel
summary that benchmarks/profile_step.py prints for our trainer and for nanoGPT side by side.

Kernels are grouped by what they do (matmul, attention, Inductor's generated kernels, the
optimizer, copies) so two trainers can be compared even though their kernel names differ;
the device's busy time per step against the step's wall time shows how long it sat idle."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from pytrain.config import profile_window

# First match wins; names as CUDA, cuBLAS, cuDNN, FlashAttention and Triton report them.
CATEGORIES = (
    ("communication (NCCL)", r"nccl|allreduce|all_reduce|reducescatter|allgather"),
    (
        "attention backward",
        r"(flash|fmha|attention|attn|sdpa).*(bwd|backward|dq|dk|dv)|bwd.*(flash|fmha|attn)",
    ),
    ("attention forward", r"flash|fmha|attention|attn|sdpa"),
    # A mixture of experts' own: torch._grouped_mm's kernels, and the routing around them
    # (top-k, the stable sort by expert, the gathers and scatters that permute the tokens;
    # Inductor names its kernels after the ops they fuse). CUTLASS's grouped GEMMs, as
    # torch._grouped_mm runs them on Hopper, are named for their GroupProblemShape.
    ("grouped GEMM (experts)", r"grouped|group_gemm|groupproblem"),
    ("routing: top-k, sort, gathers, scatters", r"topk|sort|radix|gather|scatter|index_put"),
    ("matmul", r"gemm|nvjet|sm90_xmma|cutlass|cublas|wgmma|matmul|mm_"),
    ("optimizer", r"adam|foreach|multi_tensor|norm_kernel|fused_adam"),
    ("cross-entropy / softmax", r"log_softmax|nll_loss|cross_entropy|softmax|ce_grad"),
    # Inductor's kernels (triton_poi_/triton_red_/triton_per_...) before the copies: their
    # names list the fused ops, and nearly all of them hold a `_to_copy` (a dtype cast).
    ("Inductor's kernels (norms, RoPE, elementwise)", r"^triton_"),
    ("copies / memset", r"memcpy|memset|copy|fill|cat_"),
    # Triton kernels written by hand (pytrain.model.fused_swiglu, the gradient accumulation).
    ("hand-written Triton kernels", r"^_\w+_kernel$"),
)


def category(kernel: str) -> str:
    low = kernel.lower()
    for name, pattern in CATEGORIES:
        if re.search(pattern, low):
            return name
    return "other"


def device_summary(
    kernel_us: Iterable[tuple[str, float]], steps: int, step_ms: float, top: int = 40
) -> dict:
    """Device time a step by category (ms), the top kernels, and busy against the step's wall
    time `step_ms`, from (kernel name, microseconds) over `steps` steps: a live profiler's
    (kernel_summary) or a chrome trace's (benchmarks/chrome_trace.py)."""
    by_cat: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for name, us in kernel_us:
        kernels[name] = kernels.get(name, 0.0) + us
        cat = category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    busy = sum(by_cat.values()) / 1e3 / steps
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {
        "steps": steps,
        "step_ms": step_ms,
        "device_busy_ms": busy,
        "device_idle_ms": step_ms - busy,
        "categories_ms": {
            k: v / 1e3 / steps for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])
        },
        "top_kernels_ms": [(k[:120], v / 1e3 / steps) for k, v in ranked],
    }


def kernel_summary(prof: torch.profiler.profile, steps: int, wall_s: float) -> dict:
    """Device time per step by category (ms), the top kernels, and busy vs wall time."""
    kernel_us = (
        (evt.key, us)
        for evt in prof.key_averages()
        if (us := getattr(evt, "self_device_time_total", 0.0) or 0.0) > 0
        and _is_kernel(evt, evt.key)
    )
    return {
        "idle_gaps": idle_gaps(prof, steps),
        **device_summary(kernel_us, steps, wall_s * 1e3 / steps),
        "matmuls": matmuls_by_shape(prof, steps),
    }


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm")


def _matmul_flops(op: str, shapes: list) -> float:
    """2 M N K (times the batch for bmm) from the op's input shapes, 0 where they are not
    the usual ones (addmm's first input is the bias)."""
    try:
        a, b = shapes[1:3] if op == "aten::addmm" else shapes[:2]
        if op == "aten::bmm":
            return 2.0 * a[0] * a[1] * a[2] * b[2]
        return 2.0 * a[0] * a[1] * b[1]
    except (IndexError, TypeError, ValueError):
        return 0.0


def _pass(evt) -> str:
    """'backward' for an op that autograd's engine ran (an ancestor is its
    evaluate_function range, or a compiled graph's backward), else 'forward'. The engine's
    own thread would not tell on the CPU, where it runs backward on the caller's thread.
    Forwards recomputed by activation checkpointing run inside the backward, and count
    there."""
    parent = evt.cpu_parent
    while parent is not None:
        if (
            parent.name.startswith("autograd::engine::evaluate_function")
            or "Backward" in parent.name
        ):
            return "backward"
        parent = parent.cpu_parent
    return "forward"


def matmuls_by_shape(prof: torch.profiler.profile, steps: int, top: int = 16) -> list[dict]:
    """The matmul ops grouped by pass (forward or backward) and input shapes (the profiler
    records them): calls and device ms per step and the TFLOP/s each reaches, the slowest in
    total first, so a shape that runs far below the GPU's peak stands out, and the same
    shape's forward and backward can be told apart. The CPU's time where there is no device
    (tests)."""
    groups: dict[tuple, list] = {}
    for evt in prof.events():
        if evt.name not in MATMUL_OPS or _inside_matmul(evt):
            continue
        shapes = [list(x) for x in evt.input_shapes if x][:3]
        # The op's own matmul kernels, not the profiler's device_time_total: that one also
        # counts the kernels of every op nested in it, of any kind, and so a nested matmul
        # op, which this loop meets again, twice. With it the 1B step's rows summed to 814
        # ms per step against 686 ms of matmul kernels.
        kernels = [k for k in _kernels(evt) if category(k.name) == "matmul"]
        us = sum(k.duration for k in kernels) if kernels else evt.cpu_time_total
        acc = groups.setdefault((_pass(evt), evt.name, str(shapes)), [0, 0.0, 0.0, {}])
        acc[0] += 1
        acc[1] += us
        acc[2] += _matmul_flops(evt.name, evt.input_shapes)
        for k in kernels:
            acc[3][k.name] = acc[3].get(k.name, 0.0) + k.duration
    rows = [
        {
            "pass": phase,
            "op": op.removeprefix("aten::"),
            "shapes": shapes,
            "calls": n / steps,
            "ms": us / 1e3 / steps,
            "tflops": flops / (us * 1e-6) / 1e12 if us > 0 else 0.0,
            # The kernel that took most of the time: cuBLAS names its operands' layouts
            # (nvjet_..._NTN), which tells a forward from a backward of one shape apart.
            "kernel": max(kernels, key=kernels.__getitem__) if kernels else "-",
        }
        for (phase, op, shapes), (n, us, flops, kernels) in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def _inside_matmul(evt) -> bool:
    """Whether a matmul op encloses this one (an mm that dispatches to another mm): the
    outer one counts it."""
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name in MATMUL_OPS:
            return True
        parent = parent.cpu_parent
    return False


def _kernels(evt) -> list:
    """The device kernels an op launched, its children's included (aten::linear's mm)."""
    return [*evt.kernels, *(k for child in evt.cpu_children for k in _kernels(child))]


def _is_kernel(evt, name: str) -> bool:
    """Device work, not a range such as Optimizer.step#AdamW.step (which the profiler
    also reports on the device timeline). Such ranges have no spaces; kernel names with a
    '#' do (ATen's `reduce_kernel<...{lambda(float, float)#1}...>`)."""
    return (
        evt.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(evt, "is_user_annotation", False)
        and not ("#" in name and " " not in name)
    )


def _add(acc: dict, key, us: float) -> None:
    """Adds one gap of `us` microseconds to acc[key] = [total us, count]."""
    total = acc.setdefault(key, [0.0, 0])
    total[0] += us
    total[1] += 1


GAP_BUCKETS_US = (2.0, 5.0, 10.0, 20.0, 100.0, float("inf"))


def idle_gaps(prof: torch.profiler.profile, steps: int, min_us: float = 5.0) -> dict:
    """Where the device waits: gaps of at least `min_us` between one kernel's end and the
    next kernel's start, summed per (kernel before, kernel after) pair, ms per step; the
    largest first, and all gaps by size (bucket upper edge in us, ms per step, gaps per
    step). A gap after the last kernel of a step means the host queued the next
    one late; one inside a step, that the host waited on something there."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if _is_kernel(e, e.name)
    )
    pairs: dict[tuple[str, str], list[float]] = {}
    histogram: dict[float, list[float]] = {}
    end, before = None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            gap = start - end
            _add(histogram, next(e for e in GAP_BUCKETS_US if gap < e), gap)
            if gap >= min_us:
                _add(pairs, (before[:70], name[:70]), gap)
        if end is None or stop > end:
            end, before = stop, name
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][0])[:12]
    return {
        "pairs": [(a, b, us / 1e3 / steps, n) for (a, b), (us, n) in ranked],
        "histogram": [
            (edge, us / 1e3 / steps, n / steps) for edge, (us, n) in sorted(histogram.items())
        ],
    }


def format_summary(s: dict) -> str:
    gaps = s.get("idle_gaps", {})
    lines = [
        f"step {s['step_ms']:.2f} ms: device busy {s['device_busy_ms']:.2f} ms, idle {s['device_idle_ms']:.2f} ms",
        "| category | ms per step |",
        "|---|---|",
        *(f"| {k} | {v:.3f} |" for k, v in s["categories_ms"].items()),
        "",
        "| kernel | ms per step |",
        "|---|---|",
        *(f"| `{k}` | {v:.3f} |" for k, v in s["top_kernels_ms"]),
        "",
        "| pass | matmul | input shapes | calls per step | ms per step | TFLOP/s | kernel |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {m.get('pass', '-')} | {m['op']} | {m['shapes']} | {m['calls']:g} | {m['ms']:.3f} "
            f"| {m['tflops']:.3g} | `{m.get('kernel', '-')}` |"
            for m in s.get("matmuls", [])
        ),  # fmt: skip
        # The rows' sum can only fall short of the kernels' (the table keeps the top rows):
        # a sum above it would mean time counted twice. No kernels on the CPU: no line.
        *(
            [
                f"rows above: {sum(m['ms'] for m in s['matmuls']):.3f} ms per step of the "
                f"matmul kernels' {s['categories_ms']['matmul']:.3f}"
            ]
            if "matmul" in s["categories_ms"] and s.get("matmuls")
            else []
        ),
        "",
        "| idle gap after | before | ms per step | gaps |",
        "|---|---|---|---|",
        *(f"| `{a}` | `{b}` | {ms:.3f} | {n} |" for a, b, ms, n in gaps.get("pairs", [])),
        "",
        "| gaps shorter than (us) | ms per step | gaps per step |",
        "|---|---|---|",
        *(f"| {e:g} | {ms:.3f} | {n:.0f} |" for e, ms, n in gaps.get("histogram", [])),
    ]
    return "\n".join(lines)


class StepProfiler:
    """Starts torch.profiler at step A and stops after step B-1 ('A:B'), then writes
    trace.json and summary.{json,md} under `out`. Inactive for an empty spec."""

    def __init__(self, spec: str, out: Path, device: torch.device, memory: bool = False):
        self.start, self.stop = profile_window(spec) or (-1, -1)
        self.out, self.device, self.t0 = out, device, 0.0
        self.memory = memory and device.type == "cuda"
        """Also the CUDA caching allocator's history over the window (memory.pickle)."""
        self.prof: torch.profiler.profile | None = None
        self.summary: dict | None = None

    def before_step(self, step: int) -> None:
        if step != self.start:
            return
        import time

        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        # Shapes: the summary's matmul table groups the matmuls by them.
        prof = torch.profiler.profile(activities=acts, record_shapes=True)
        prof.__enter__()
        self.prof = prof
        self.t0 = time.perf_counter()

    def ends_at(self, step_done: int) -> bool:
        """Whether the window ends after `step_done` steps (after_step then writes)."""
        return self.prof is not None and step_done == self.stop

    def after_step(self, step_done: int) -> str | None:
        """`step_done`: the number of completed steps (the trainer's step counter). Returns
        a line naming the summary when the window ends here."""
        prof = self.prof
        if prof is None or step_done != self.stop:  # not ends_at: mypy narrows `prof` here
            return None
        import time

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.t0
        prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / "trace.json"))
        self.summary = kernel_summary(prof, self.stop - self.start, wall)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1))
        (self.out / "summary.md").write_text(format_summary(self.summary) + "\n")
        self.prof = None
        line = f"profile of steps {self.start}:{self.stop}: {self.out}/summary.md"
        if self.memory:
            import pickle

            from pytrain.train.memory_peak import (
                format_composition,
                peak_composition,
                reserved_by_stream,
            )

            # What _dump_snapshot writes, kept in hand for the peak's composition.
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(self.out / "memory.pickle", "wb") as f:
                pickle.dump(snapshot, f)
            device = self.device.index or 0
            peak = peak_composition(snapshot, device)
            streams = reserved_by_stream(snapshot, device)
            (self.out / "memory.md").write_text(format_composition(peak, streams) + "\n")
            line += (
                f", {self.out}/memory.pickle (pytorch.org/memory_viz), and what held the "
                f"peak's {peak['peak_bytes'] / 2**30:.1f} GiB: {self.out}/memory.md"
            )
        return line
