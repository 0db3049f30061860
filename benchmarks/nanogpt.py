"""Trainer throughput on one GPU: the GPT-2 124M preset (bf16, compiled) against
nanoGPT's bench.py at the same model size and batch, in one run.

    python benchmarks/nanogpt.py --nanogpt PATH_TO_NANOGPT [--steps 300] [--batch 12]

The first variant, `preset`, is the preset as shipped (configs/gpt2-124m.toml with no
flag that changes the step: its attention choice, 32 x 1,024 tokens x 16 micro-batches
per optimizer step, CUDA graphs, tuning): the first line printed is what a user gets.
`preset+FLAG` adds trainer flags to it. The other variants run one micro-batch of
`--batch` rows per step, as bench.py does.

Both see synthetic token ids (ours through the real loader from a synthetic dataset on
disk, nanoGPT's bench from torch.randint on the device). Tokens/s is batch x seq_len per
optimizer step, the median over the steps after warm-up. Prints a table last."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import (  # noqa: E402
    machine_line,
    markdown_table,
    median_steady,
    read_steps,
)
from pytrain.train.cli import read_fallbacks, read_peak_memory, read_start_line  # noqa: E402


def synthetic_dataset(path: Path, docs: int) -> Path:
    from pytrain import _loader

    if not (path / "manifest.json").exists():
        t0 = time.perf_counter()
        n = _loader.write_synthetic(str(path), docs, mu=6.5, sigma=1.0, vocab=50257, seed=0)
        print(f"synthetic dataset: {n:,} tokens in {time.perf_counter() - t0:.1f}s", flush=True)
    return path


def run_ours(
    data: Path,
    out: Path,
    steps: int,
    batch: int | None,
    attention: str | None,
    compile_mode: str | None,
    extra: list[str],
    tag: str = "",
    env: dict[str, str] | None = None,
) -> dict:
    """One run of the trainer; batch/attention/compile_mode None: the preset's own."""
    if attention is None:
        name = "ours-preset-as-shipped" + (f"-{tag}" if tag else "")
        step_flags = []
    else:
        name = f"ours-{attention}-{compile_mode}" + (f"-{tag}" if tag else "")
        step_flags = ["--optim.grad_accum", "1", "--data.batch_size", str(batch),
                      "--model.attention", attention, "--compile.mode", str(compile_mode)]  # fmt: skip
    cmd = [
        sys.executable, "-m", "pytrain.train", "--config", str(ROOT / "configs/gpt2-124m.toml"),
        "--data.path", str(data), "--out_dir", str(out), "--name", name, "--no-resume",
        "--max_steps", str(steps), "--eval_every", "0", "--ckpt_every", "0", "--log_every", "1",
        "--samples", "0", "--no-progress", *step_flags, *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-5000:], file=sys.stderr)
        return {
            "name": name,
            "error": r.stderr.strip().splitlines()[-1]
            if r.stderr.strip()
            else f"rc {r.returncode}",
        }
    # data_wait_ms: the loop blocked on the loader; feed_ms: all host time getting the
    # step's batches (overlapping the device's queued work). Medians over the same steady
    # steps (a single line is noisy).
    rows, skip = read_steps(out / name / "train.log"), min(50, steps // 3)
    if median_steady(rows, "tok/s", skip) is None:
        return {"name": name, "error": f"no step after step {skip} in train.log"}
    allocated, reserved = read_peak_memory(r.stdout) or (float("nan"), float("nan"))
    return {
        "name": name,
        "tokens_per_s": median_steady(rows, "tok/s", skip),
        "step_ms": median_steady(rows, "step_ms", skip),
        "data_wait_ms": median_steady(rows, "data_wait_ms", skip),
        "feed_ms": median_steady(rows, "feed_ms", skip),
        "mfu": median_steady(rows, "mfu", skip),
        "wall_s": wall,
        "compile_line": next(
            (line for line in r.stdout.splitlines() if line.startswith("compile:")), ""
        ),
        # What `auto` resolved to (fa4 where flash-attn-4 runs, else flex; the output
        # layer's and the MLP's kernels): the run's start line says.
        **(read_start_line(r.stdout) or {"attention": "?", "output_layer": "?", "mlp": "?"}),
        # A run that fell back (e.g. CUDA graphs refused) did not measure the configuration
        # it names: the table says so under it.
        "fallbacks": read_fallbacks(r.stdout),
        "peak_gpu_gb": allocated,
        "peak_reserved_gib": reserved,
    }


def run_nanogpt(peer: Path, batch: int, heads: int = 12) -> dict:
    """nanoGPT's bench.py as it is, or (heads != 12) a copy beside it whose GPTConfig has
    `heads` heads: same parameters and FLOPs, another head size (the copy is deleted)."""
    script, name = "bench.py", "nanoGPT bench.py"
    if heads != 12:
        src = (peer / "bench.py").read_text()
        patched = src.replace("n_head = 12,", f"n_head = {heads},")
        if patched == src:
            return {"name": f"nanoGPT bench.py, {heads} heads", "error": "n_head not found"}
        script, name = f"bench_{heads}heads.py", f"nanoGPT bench.py, {heads} heads"
        (peer / script).write_text(patched)
    cmd = [
        sys.executable,
        script,
        "--real_data=False",
        f"--batch_size={batch}",
        "--compile=True",
    ]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=peer)
    finally:
        if script != "bench.py":
            (peer / script).unlink()
    wall = time.perf_counter() - t0
    m = re.search(r"time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%", r.stdout)
    if r.returncode != 0 or not m:
        print(r.stdout[-3000:], r.stderr[-5000:], file=sys.stderr)
        return {"name": name, "error": "failed"}
    ms = float(m.group(1))
    return {
        "name": name,
        "tokens_per_s": batch * 1024 / (ms / 1e3),
        "step_ms": ms,
        "wall_s": wall,
        "nanogpt_mfu_a100_peak": float(m.group(2)) / 100,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nanogpt", type=Path, required=True, help="path to a checkout of karpathy/nanoGPT"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench")
    p.add_argument(
        "--preset-steps",
        type=int,
        default=40,
        help="optimizer steps of the preset variants (each the preset's 16 micro-batches)",
    )
    p.add_argument(
        "--variants",
        default="preset,causal:reduce-overhead",
        help="attention:compile_mode[:sdpa_backend[:cdt]], comma-separated, on top of the preset "
        "(configs/gpt2-124m.toml); cdt turns on Inductor's "
        "coordinate-descent tuning; '+FLAG' appends a trainer flag (e.g. +--activation_checkpointing=full), "
        "'+env:NAME=VALUE' sets an environment variable for that run (e.g. +env:TORCHINDUCTOR_ENABLE_PDL=1)",
    )
    p.add_argument(
        "--nanogpt-heads",
        default="12",
        help="comma-separated head counts for nanoGPT's bench (12 is its own config); the "
        "first is the baseline of the ratios",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    env = machine_line()
    print(env, flush=True)
    data = synthetic_dataset(args.work / "synthetic-50k", 40_000)
    # nanoGPT first: the baseline of every ratio, so a run cut short by a time limit still
    # has one; its rows are printed last.
    peers = [run_nanogpt(args.nanogpt, args.batch, int(h)) for h in args.nanogpt_heads.split(",")]
    for r in peers:
        print(json.dumps(r), flush=True)
    results = []
    for v in args.variants.split(","):
        spec, *flags = v.split("+")
        run_env = dict(f.removeprefix("env:").split("=", 1) for f in flags if f.startswith("env:"))
        flags = [f for f in flags if not f.startswith("env:")]
        if spec == "preset":
            tag = "-".join(f.lstrip("-").replace("=", "_") for f in (*flags, *run_env))
            results.append(
                run_ours(
                    data,
                    args.work / "runs",
                    args.preset_steps,
                    None,
                    None,
                    None,
                    flags,
                    tag,
                    run_env,
                )
            )
            print(json.dumps(results[-1]), flush=True)
            continue
        attention, mode, backend, tuning = (spec.split(":") + ["auto", ""])[:4]
        extra = ["--model.sdpa_backend", backend, *flags]
        if tuning == "cdt":  # Inductor's coordinate-descent tuning of its generated kernels
            extra.append("--compile.coordinate_descent")
        results.append(
            run_ours(
                data,
                args.work / "runs",
                args.steps,
                args.batch,
                attention,
                mode,
                extra,
                tag="-".join(
                    t for t in (backend, tuning, *flags, *run_env) if t not in ("", "auto")
                ),
                env=run_env,
            )  # fmt: skip
        )
        print(json.dumps(results[-1]), flush=True)
    results += peers
    base = peers[0].get("tokens_per_s")
    if args.json:
        args.json.write_text(json.dumps({"env": env, "results": results}, indent=1))
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["name"], "", "", "", f"failed: {r['error']}", "", "", "", "", ""])
            continue
        ratio = f"{r['tokens_per_s'] / base:.3f}x" if base else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        rows.append([f"{r['name']}{' (fell back)' if r.get('fallbacks') else ''}",
                     r.get("attention", "causal"), r.get("output_layer", "bf16"), r.get("mlp", "gelu"),
                     f"{r['tokens_per_s']:,.0f}", f"{r['step_ms']:.1f}",
                     f"{r.get('data_wait_ms', float('nan')):.2f}",
                     f"{r.get('feed_ms', float('nan')):.2f}", mfu, ratio])  # fmt: skip
    headers = ["run", "attention", "output layer", "mlp", "tokens/s", "step ms", "data wait ms",
               "host feed ms", "MFU (989 TF peak)", "vs nanoGPT"]  # fmt: skip
    print("\n" + markdown_table(headers, rows))
    for r in results:
        for line in r.get("fallbacks", []):
            print(f"note: {r['name']}: {line}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
