"""Compile matrix on a GPU: {eager, default, reduce-overhead, max-autotune-no-cudagraphs}
x {no activation checkpointing, full, every-2} x {pack, bucket}, each a short training run
of a 4-block GPT through `python -m pytrain.train`.

For every cell the guarded run (the trainer's policy and run-time fallback) must complete.
Where the guard changed the plan up front, the same cell also runs with the guard off
(`--no-compile.guard`) to show what happens natively. An injected-failure variant checks the
run-time fallback. Runs go `--parallel` at a time on the one GPU (tokens/s are then measured
under contention; compare them within this table only).

    python scripts/compile_matrix.py [--modes default,reduce-overhead] [--steps 200] [--parallel 4]
Prints a markdown table last (and writes it to --out).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ["eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs"]
CKPT = ["off", "full", "every-2"]
DATA = ["pack", "bucket"]


def run_cell(
    data_path: Path, out: Path, mode: str, ckpt: str, data: str, steps: int, variant: str
) -> dict:
    name = f"{mode}-{ckpt}-{data}-{variant}"
    cmd = [sys.executable, "-m", "pytrain.train", "--data.path", str(data_path), "--out_dir", str(out), "--name", name,
           "--no-resume", "--max_steps", str(steps), "--eval_every", "0", "--ckpt_every", "0", "--log_every", "1",
           "--samples", "0", "--no-progress", "--model.n_layer", "4", "--model.n_head", "8", "--model.d_model", "512",
           "--model.vocab_size", "50304", "--model.attention", "causal", "--data.seq_len", "1024", "--data.batch_size", "8",
           "--data.mode", data, "--data.bucket_lengths", "256", "512", "1024", "--data.token_budget", "8192",
           "--activation_checkpointing", ckpt, "--compile.mode", mode, "--compile"]  # fmt: skip
    if variant == "native":
        # Natively means without our environment guards too (they disable CUDA graphs).
        cmd += ["--no-compile.guard", "--no-compile.safe_env"]
    if variant == "injected":
        cmd += ["--compile.inject_failure_at", "10"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log_path = out / name / "train.log"
    log = log_path.read_text() if log_path.exists() else ""
    toks = [
        float(t.replace(",", ""))
        for s, t in re.findall(r"step (\d+) loss \S+ lr \S+ grad_norm \S+ tok/s ([\d,]+)", log)
        if int(s) > steps // 2
    ]
    first = re.search(r"step 1 loss \S+ lr \S+ grad_norm \S+ tok/s \S+ step_ms ([\d.]+)", log)
    graphs = re.search(
        r"compiled graphs: (-?\d+); compile mode at the end: (\S+); fallbacks: (\d+)", log
    )
    decision = next((line for line in r.stdout.splitlines() if line.startswith("compile:")), "")
    err = ""
    if r.returncode != 0:
        lines = [
            line for line in r.stderr.strip().splitlines() if "Error" in line or "error" in line
        ]
        err = (
            lines[-1]
            if lines
            else r.stderr.strip().splitlines()[-1]
            if r.stderr.strip()
            else f"rc {r.returncode}"
        )[:160]
    return {
        "cell": (mode, ckpt, data), "variant": variant, "ok": r.returncode == 0, "error": err, "decision": decision,
        "tokens_per_s": statistics.median(toks) if toks else None,
        "first_step_s": float(first.group(1)) / 1e3 if first else None, "wall_s": wall,
        "graphs": int(graphs.group(1)) if graphs else None, "final_mode": graphs.group(2) if graphs else None,
        "fallbacks": int(graphs.group(3)) if graphs else None,
    }  # fmt: skip


def guard_changed(mode: str, ckpt: str, data: str) -> bool:
    return mode == "reduce-overhead" and (ckpt != "off" or data == "bucket")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-compile-matrix"
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--only-native", action="store_true", help="run just the native (guard off) variants"
    )
    args = p.parse_args()
    import torch

    from pytrain import _loader

    data_path = args.work / "synthetic"
    if not (data_path / "manifest.json").exists():
        _loader.write_synthetic(str(data_path), 20_000, mu=6.0, sigma=1.0, vocab=50257, seed=0)
    jobs = []
    for mode, ckpt, data in itertools.product(args.modes.split(","), CKPT, DATA):
        if args.only_native:
            if mode == "reduce-overhead":
                jobs.append((mode, ckpt, data, "native"))
            continue
        jobs.append((mode, ckpt, data, "guarded"))
        if guard_changed(mode, ckpt, data):
            jobs.append((mode, ckpt, data, "native"))
        if mode != "eager" and ckpt == "off" and data == "pack":
            jobs.append((mode, ckpt, data, "injected"))
    results = []
    with cf.ThreadPoolExecutor(args.parallel) as pool:
        futs = [
            pool.submit(run_cell, data_path, args.work / "runs", *j[:3], args.steps, j[3])
            for j in jobs
        ]
        for f in cf.as_completed(futs):
            results.append(f.result())
            r = results[-1]
            print(f"{r['cell']} {r['variant']}: ok={r['ok']} {r['error']}", flush=True)
    native = {r["cell"]: r for r in results if r["variant"] == "native"}
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}; {args.steps} steps per run, {args.parallel} runs at a time on one GPU", "",
             "| mode | act. ckpt | data | guarded run | natively (guard off) | what the guard did | tokens/s | first step s | graphs |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    order = {m: i for i, m in enumerate(MODES)}
    for r in sorted(
        (r for r in results if r["variant"] != "native"),
        key=lambda r: (
            order[r["cell"][0]],
            CKPT.index(r["cell"][1]),
            DATA.index(r["cell"][2]),
            r["variant"],
        ),
    ):
        mode, ckpt, data = r["cell"]
        n = native.get(r["cell"])
        nat = "-" if n is None else ("passed" if n["ok"] else f"FAILED: {n['error']}")
        did = r["decision"].removeprefix("compile: ")
        if r["fallbacks"]:
            did += f"; fell back {r['fallbacks']}x to {r['final_mode']}"
        label = f"{mode}{' (injected failure)' if r['variant'] == 'injected' else ''}"
        res = "completed" if r["ok"] else f"FAILED: {r['error']}"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        fs = f"{r['first_step_s']:.1f}" if r["first_step_s"] else "-"
        lines.append(
            f"| {label} | {ckpt} | {data} | {res} | {nat} | {did} | {tps} | {fs} | {r['graphs']} |"
        )
    if native:
        lines += [
            "",
            "Native runs (guard and environment guards off):",
            "",
            "| mode | act. ckpt | data | result | tokens/s |",
            "|---|---|---|---|---|",
        ]
        for cell, n in sorted(native.items()):
            tps = f"{n['tokens_per_s']:,.0f}" if n["tokens_per_s"] else "-"
            lines.append(
                f"| {cell[0]} | {cell[1]} | {cell[2]} | {'passed' if n['ok'] else 'FAILED: ' + n['error']} | {tps} |"
            )
    table = "\n".join(lines)
    if args.out:
        args.out.write_text(table + "\n")
    print("\n" + table)
    return 0 if all(r["ok"] for r in results if r["variant"] != "native") else 1


if __name__ == "__main__":
    sys.exit(main())
