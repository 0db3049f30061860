"""Scaling of a preset, as shipped, over the GPUs of one host: tokens/s on 1 GPU and on N
(torchrun; the wrapper the trainer chooses, and with --fsdp also FSDP2 forced), the
per-GPU scaling efficiency, the final loss (every run starts from the same weights and
reads the same stream, so the losses should agree), peak memory, and the loader's CPU
time per GPU.

    python benchmarks/scaling_gpu.py [--gpus 1,2] [--steps 30] [--fsdp] [--profile]
    python benchmarks/scaling_gpu.py --preset configs/llama-1b.toml --vocab 128256 \\
        --set optim.tokens_per_step=131072

The preset's optimizer step is the same number of tokens at every world size (its
gradient accumulation per rank is derived from optim.tokens_per_step), so a run on N GPUs
does the same work per step as on one, N times faster if it scales. Synthetic token ids
(tokens/s do not depend on the text). Every run shares one Inductor cache.

Loader CPU per GPU: a sandbox may report no per-thread CPU time (gVisor), so the loader
is measured on its own here, from this process's CPU time: it reads the preset's batches
as rank 0 of N for a few seconds, and its CPU seconds per token times one GPU's tokens/s
is the share of a core it needs per GPU.

--profile: a profile of three steps on rank 0 of the largest run without --fsdp; its
summary (device time per kernel category, communication included; busy vs idle) is
printed and kept under the work directory."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table, median_steady, read_for, read_steps  # noqa: E402


def run(n: int, args, data: Path, fsdp: bool, profile: bool) -> dict:
    name = f"gpus{n}" + ("-fsdp2" if fsdp else "")
    out = args.work / "runs"
    shutil.rmtree(out / name, ignore_errors=True)
    sets = [f"--{s.replace('=', ' ', 1)}" for s in args.set]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
    ]
    if n == 1 and args.plain:
        launch = [sys.executable]
    cmd = [*launch, "-m", "pytrain.train", "--config", str(args.preset), "--data.path", str(data),
           "--out_dir", str(out), "--name", name, "--no-resume", "--max_steps", str(args.steps),
           "--eval_every", "0", "--ckpt_every", "0", "--log_every", "1", "--samples", "0",
           "--no-progress", "--compile.cache_dir", str(args.work / "inductor-cache"),
           *(["--fsdp"] if fsdp else []),
           *(["--profile_steps", f"{args.steps - 5}:{args.steps - 2}"] if profile else []),
           *" ".join(sets).split()]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (args.work / f"{name}.out").write_text(r.stdout + r.stderr)
    plan = re.search(r"data parallel: (\w+)", r.stdout)
    label = {"replicated": "replicas"}.get(plan.group(1), plan.group(1)) if plan else "single"
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
        tail = (r.stderr.strip().splitlines() or ["?"])[-1][:200]
        return {"gpus": n, "wrapper": label, "error": tail, "wall_s": wall}
    steps = read_steps(out / name / "train.log")
    # The profiled steps, and the one after them (its period includes the trace's writing).
    skip = set(range(args.steps - 4, args.steps + 1)) if profile else set()
    warm = max(3, args.steps // 3)
    measured = [x for x in steps if x["step"] not in skip]
    tokens_per_s = median_steady(measured, "tok/s", warm)
    peak = re.search(r"peak GPU memory ([\d.]+) GB", r.stdout)
    accum = re.search(r"gradient accumulation: (\d+) micro-batches", r.stdout)
    summary = out / name / "profile" / "summary.md"
    return {
        "gpus": n,
        "wrapper": label,
        "plan": plan and r.stdout[plan.start() :].splitlines()[0],
        "accum": int(accum.group(1)) if accum else None,
        "final_loss": f"{steps[-1]['loss']:.4f}" if steps else None,
        "tokens_per_s": float("nan") if tokens_per_s is None else tokens_per_s,
        "steps_measured": sum(x["step"] > warm for x in measured),
        "peak_gb": float(peak.group(1)) if peak else None,
        "wall_s": wall,
        "profile": summary.read_text() if summary.exists() else None,
    }


def loader_cpu_per_token(args, data: Path, world: int) -> float:
    """Process CPU seconds per token of the preset's loader, read as rank 0 of `world`."""
    from pytrain.config import parse_args
    from pytrain.data import TokenLoader

    cfg = parse_args(["--config", str(args.preset), "--data.path", str(data)])
    loader = TokenLoader(data, cfg.data, rank=0, world_size=world)
    tokens, _, cpu = read_for(loader, 5.0)
    loader.close()
    return cpu / tokens


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--preset", type=Path, default=ROOT / "configs/gpt2-124m.toml")
    p.add_argument("--vocab", type=int, default=50257, help="of the synthetic dataset")
    p.add_argument("--set", action="append", default=[], help="name=value over the preset")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-scaling")
    p.add_argument("--fsdp", action="store_true", help="also every N > 1 with --fsdp forced")
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--plain",
        action="store_true",
        help="the 1-GPU run without torchrun (no wrapper), as one GPU is trained",
    )
    args = p.parse_args()
    print(machine_line(), flush=True)
    from pytrain import _loader

    data = args.work / f"synthetic-{args.vocab}"
    if not (data / "manifest.json").exists():
        _loader.write_synthetic(str(data), 40_000, mu=6.5, sigma=1.0, vocab=args.vocab, seed=0)
    counts = [int(n) for n in args.gpus.split(",")]
    plan = [(n, False) for n in counts] + [(n, True) for n in counts if args.fsdp and n > 1]
    biggest = max(counts)
    results = []
    for n, fsdp in plan:
        results.append(run(n, args, data, fsdp, args.profile and n == biggest and not fsdp))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "profile"}), flush=True)
    per_token = loader_cpu_per_token(args, data, biggest)
    base = results[0].get("tokens_per_s")
    print(
        f"\n{args.preset.name} as shipped{' with ' + ', '.join(args.set) if args.set else ''}; "
        f"median tok/s of steps {max(3, args.steps // 3) + 1}-{args.steps}"
    )
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["gpus"], r["wrapper"], "", f"failed: {r['error']}", "", "", "", "", ""])
            continue
        per_gpu = r["tokens_per_s"] / r["gpus"]
        eff = per_gpu / base if base else float("nan")
        rows.append([r["gpus"], r["wrapper"], r["accum"], f"{r['tokens_per_s']:,.0f}", f"{per_gpu:,.0f}",
                     f"{eff:.1%}", r["final_loss"], r["peak_gb"] or "-", f"{per_token * per_gpu:.4f}"])  # fmt: skip
    headers = ["GPUs", "wrapper", "accumulation per rank", "tokens/s (all GPUs)", "per GPU",
               "scaling efficiency", "loss at the last step", "peak GB (rank 0)",
               "loader CPU per GPU (cores)"]  # fmt: skip
    print(markdown_table(headers, rows))
    print(
        f"\nloader alone, rank 0 of {biggest}: {per_token * 1e9:.1f} CPU ns per token "
        "(process CPU time)"
    )
    for r in results:
        if r.get("plan"):
            print(f"{r['gpus']} GPUs{' --fsdp' if r['wrapper'] == 'FSDP2' else ''}: {r['plan']}")
        if r.get("profile"):
            print(f"\nprofile, {r['gpus']} GPUs, {r['wrapper']}, rank 0:\n{r['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
