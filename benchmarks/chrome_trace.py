"""A torch.profiler chrome trace (what torchtitan's `--profiling.enable_profiling` writes for
each rank) summed as pytrain.train.profiling.kernel_summary sums a live profiler: device time
a step by kernel category (the same categories), the top kernels, and the step's wall time
against the device's busy time. For benchmarks/titan.py --kernel-profile, which puts
torchtitan's step beside ours."""

from __future__ import annotations

import json
from pathlib import Path

from pytrain.train.profiling import device_summary

# Device work in a chrome trace: kernels, and the copies and fills the device runs.
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_summary(path: Path, top: int = 20) -> dict:
    """{"steps", "step_ms", "device_busy_ms", "device_idle_ms", "categories_ms",
    "top_kernels_ms"} over the trace's profiled steps (its `ProfilerStep#N` ranges, whose
    wall time is the step's), the device's time divided by their number."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError(f"{path}: no ProfilerStep# range: not a profiled step's trace")
    step_ms = sum(float(e["dur"]) for e in steps) / 1e3 / len(steps)
    kernel_us = (
        (str(e["name"]), float(e.get("dur", 0.0))) for e in spans if e.get("cat") in DEVICE_CATS
    )
    return device_summary(kernel_us, len(steps), step_ms, top)


def side_by_side(summaries: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of ms a step by category, one column a run: the step's wall time,
    the device's busy and idle time, then each category, the largest first."""
    names = list(summaries)
    cats: dict[str, float] = {}
    for s in summaries.values():
        for k, v in s["categories_ms"].items():
            cats[k] = max(cats.get(k, 0.0), v)
    rows = [
        [label, *(f"{summaries[n][key]:.1f}" for n in names)]
        for key, label in (("step_ms", "step (wall)"), ("device_busy_ms", "device busy"),
                           ("device_idle_ms", "device idle"))
    ]  # fmt: skip
    for c in sorted(cats, key=lambda c: -cats[c]):
        rows.append([c, *(f"{summaries[n]['categories_ms'].get(c, 0.0):.1f}" for n in names)])
    return ["ms a step", *names], rows
