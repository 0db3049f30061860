"""Scaling of the GPT-2 124M preset over GPUs of one host: tokens/s on 1 GPU and on N GPUs
(torchrun, DDP, NCCL; with --fsdp also FSDP2), the scaling efficiency, the final loss (DDP and
FSDP2 start from the same weights and see the same data, so they should end close), and the
CPU time of the loader threads per GPU.

    python scripts/bench_scaling_gpu.py [--gpus 1,2] [--steps 200] [--batch 16] [--fsdp]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(n: int, data: Path, out: Path, steps: int, batch: int, fsdp: bool = False) -> dict:
    name = f"gpus{n}" + ("-fsdp2" if fsdp else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--master_port=29611", "-m", "pytrain.train",
           "--config", str(ROOT / "configs/gpt2-124m.toml"), "--data.path", str(data), "--out_dir", str(out), "--name", name,
           "--no-resume", "--max_steps", str(steps), "--optim.grad_accum", "1", "--data.batch_size", str(batch),
           "--eval_every", "0", "--ckpt_every", "0", "--log_every", "1", "--samples", "0", "--no-progress",
           "--model.attention", "causal", *(["--fsdp"] if fsdp else [])]  # fmt: skip
    r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
        return {
            "gpus": n,
            "wrapper": name,
            "error": (r.stderr.strip().splitlines() or ["?"])[-1][:200],
        }
    log = (out / name / "train.log").read_text()
    toks = [
        float(t.replace(",", ""))
        for s, t in re.findall(r"step (\d+) loss \S+ lr \S+ grad_norm \S+ tok/s ([\d,]+)", log)
        if int(s) > steps // 3
    ]
    cpu = re.search(
        r"loader threads CPU: ([\d.]+)s over ([\d.]+)s of training = ([\d.]+) cores", log
    )
    losses = re.findall(r"step \d+ loss (\S+)", log)
    return {
        "gpus": n,
        "wrapper": "FSDP2" if fsdp else ("DDP" if n > 1 else "single"),
        "final_loss": float(losses[-1]) if losses else None,
        "tokens_per_s": statistics.median(toks),
        "loader_cores_per_gpu": float(cpu.group(3)) if cpu else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", default="1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-scaling")
    p.add_argument(
        "--fsdp", action="store_true", help="also run every multi-GPU count with --fsdp (FSDP2)"
    )
    args = p.parse_args()
    import torch

    from pytrain import _loader

    data = args.work / "synthetic"
    if not (data / "manifest.json").exists():
        _loader.write_synthetic(str(data), 40_000, mu=6.5, sigma=1.0, vocab=50257, seed=0)
    runs = [(int(n), False) for n in args.gpus.split(",")]
    if args.fsdp:
        runs += [(n, True) for n, _ in runs if n > 1]
    results = [run(n, data, args.work / "runs", args.steps, args.batch, f) for n, f in runs]
    for r in results:
        print(r, flush=True)
    base = results[0].get("tokens_per_s")
    print(
        f"\nGPT-2 124M preset, batch {args.batch} x 1024 per GPU, bf16, compiled, DDP; torch {torch.__version__}, {torch.cuda.get_device_name()}"
    )
    print(
        "| GPUs | wrapper | tokens/s (all GPUs) | per GPU | scaling efficiency | final loss | loader CPU (cores per GPU, rank 0) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['gpus']} | {r['wrapper']} | failed: {r['error']} | | | | |")
            continue
        eff = r["tokens_per_s"] / (base * r["gpus"]) if base else float("nan")
        lc = f"{r['loader_cores_per_gpu']:.3f}" if r["loader_cores_per_gpu"] is not None else "-"
        print(
            f"| {r['gpus']} | {r['wrapper']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / r['gpus']:,.0f} | {eff:.1%} | {r['final_loss']} | {lc} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
