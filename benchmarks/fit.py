"""What it takes to fit a preset on one GPU: activation checkpointing policies side by side,
each run under the same cap on GPU memory, in one command.

    PYTHONPATH=$PWD python benchmarks/fit.py [--preset configs/llama-3b.toml] [--gpu-gb 80] \
        [--policies full,every-2,every-4,off] [--steps 12] [--accum 2] [--vocab 128256]

Each policy trains the preset as shipped (its batch, precision, attention and optimizer)
with `--activation_checkpointing POLICY` on synthetic ids at `--vocab` (Llama 3's by
default: the tied embedding's gradient and AdamW state grow with it) through the real
loader, for `--steps` optimizer steps of `--accum` micro-batches, in a fresh run directory.
With `--gpu-gb` below the GPU's memory, the process may use only that much
(`torch.cuda.set_per_process_memory_fraction`), so an H200 answers for an 80 GB H100: a
policy that needs more ends in CUDA's out-of-memory error and is reported as not fitting.

A run is killed once its last step is logged: the trainer would otherwise write its final
checkpoint (~51 GB at 3B with AdamW's state), which says nothing about fitting. Tokens/s
and MFU are the trainer's own (train.log), the median of the steps after the first third;
peak memory is `max_memory_reserved` as train.log's lines give it (`reserved_gib`)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    failure_line,
    machine_line,
    markdown_table,
    median_steady,
    read_steps,
)

# The trainer in this process after capping its share of the GPU's memory. The cap needs
# torch, and torch must come after the trainer's Inductor guards (they are read at import):
# so the guards are applied here first, by the trainer CLI's own function, and it is told so.
CAPPED = """
import runpy, sys
from pytrain.config import parse_args
from pytrain.train.cli import apply_env_guards
gb, argv = float(sys.argv[1]), sys.argv[2:]
apply_env_guards(parse_args(argv))
import torch
total = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
if gb and gb * 2**30 < total:
    torch.cuda.set_per_process_memory_fraction(gb * 2**30 / total)
sys.argv = ["pytrain.train", *argv, "--no-compile.safe_env"]
runpy.run_module("pytrain.train", run_name="__main__")
"""


def run_policy(args, data: Path, policy: str) -> dict:
    name = f"fit-{policy}"
    run_dir = args.work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-c", CAPPED, str(args.gpu_gb), "--no-progress", "--config", str(args.preset),
           "--data.path", str(data), "--optim.grad_accum", str(args.accum),
           "--activation_checkpointing", policy, "--max_steps", str(args.steps + 1),
           "--eval_every", "0", "--samples", "0", "--log_every", "1", "--ckpt_every", "0",
           "--out_dir", str(args.work / "runs"), "--name", name, *shlex.split(args.flags)]  # fmt: skip
    log_path = args.work / f"{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        train_log = run_dir / "train.log"
        timed_out = False
        while proc.poll() is None:
            time.sleep(2)
            finished = any(x["step"] == args.steps for x in read_steps(train_log))
            timed_out = not finished and time.perf_counter() - t0 > args.timeout
            if finished or timed_out:
                proc.send_signal(signal.SIGKILL)  # before the final checkpoint (see above)
                proc.wait()
                break
    wall = time.perf_counter() - t0
    steps = read_steps(train_log)
    output = log_path.read_text()
    shutil.rmtree(run_dir, ignore_errors=True)
    if len(steps) < args.steps:
        if "out of memory" in output.lower():
            why = "out of memory"
        elif timed_out:
            why = f"no step {args.steps} in {args.timeout:g} s"
        else:
            why = failure_line(output)
        return {"fits": False, "why": why, "wall_s": wall}
    peak = [x["reserved_gib"] for x in steps if "reserved_gib" in x]
    return {
        "fits": True,
        "tokens_per_s": median_steady(steps, "tok/s", args.steps // 3),
        "mfu": median_steady(steps, "mfu", args.steps // 3),
        "peak_gib": max(peak) if peak else None,
        "wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", type=Path, default=ROOT / "configs" / "llama-3b.toml")
    p.add_argument("--gpu-gb", type=float, default=80.0,
                   help="GPU memory the runs may use, GiB (0: all of it)")  # fmt: skip
    p.add_argument("--policies", default="full,every-2,every-4,off")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a policy's run may take")
    p.add_argument("--flags", default="", help="more trainer flags for every run, one shell string")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-fit")
    args = p.parse_args()
    print(machine_line(), flush=True)
    from pytrain import _loader

    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / f"syn{args.vocab}"
    if not (data / "manifest.json").exists():
        _loader.write_synthetic(str(data), 20000, mu=7.0, sigma=1.0, vocab=args.vocab, seed=0)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(args, data, policy)
        print(f"{policy}: {results[policy]}", flush=True)
    print(f"\n{args.preset.name} on one GPU, capped at {args.gpu_gb:g} GiB, vocabulary "
          f"{args.vocab}, {args.accum} micro-batches a step, {time.strftime('%Y-%m-%d')}\n")  # fmt: skip
    rows = []
    for policy, r in results.items():
        if r["fits"]:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] else "-"
            rows.append([policy, "yes", f"{r['tokens_per_s']:,.0f}", mfu, peak])
        else:
            rows.append([policy, f"no: {r['why']}", "-", "-", "-"])
    headers = ["activation checkpointing", "fits", "tok/s", "MFU", "peak GiB reserved"]
    print(markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
