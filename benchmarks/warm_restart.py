"""Warm restarts of the GPT-2 124M preset: how long the compile warm-up takes when a run
starts again (a requeued or resumed job), and what those seconds are.

    PYTHONPATH=$PWD python benchmarks/warm_restart.py [--work DIR]

Four starts of the preset as shipped (a validation set, so the evaluation graph too), each
short (--max_steps, no samples), sharing one Inductor cache directory as a user's repeated
runs of one preset do:
  cold      an empty Inductor cache and a new run directory
  restart   the same command again: resumes, loads the run's compile-artifacts.bin
  new-run   another run directory (no artifacts of its own), the Inductor cache warm
  restart2  the restart once more (the spread of one configuration)
  restart3  and once more
With --torchrun, each start runs under torchrun (one rank: DDP, whose graph Dynamo splits
at the gradient buckets).
For each: the warm-up seconds the trainer reports, the process's wall time, and from
train.log Dynamo's and Inductor's seconds by phase and the cache hit/miss counters
(all tables are written to WORK/<row>-phases.txt), among them the seconds spent in
coordinate-descent tuning, and how many kernels' tuned configs Inductor has cached. A table
is printed last."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table  # noqa: E402

PY = sys.executable


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", type=Path, default=Path("runs/warm-restart"))
    p.add_argument(
        "--steps", type=int, default=3, help="steps per start (each start adds this many)"
    )
    p.add_argument("--plan", default="cold:a:1,restart:a:2,new-run:b:1,restart2:a:3,restart3:a:4",
                   help="starts as ROW:RUN_NAME:LEG[:KEY=VALUE...] (LEG x --steps is its max_steps; "
                   "KEY=VALUE sets that start's environment, e.g. TORCHINDUCTOR_COMPILE_THREADS=1)")  # fmt: skip
    p.add_argument("--torchrun", action="store_true",
                   help="each start under `torchrun --standalone --nproc_per_node 1` (DDP, its graph split by bucket)")  # fmt: skip
    args = p.parse_args()
    print(machine_line(), flush=True)
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "PYTRAIN_CACHE": str(work / "data")}
    code = "from pytrain.data.corpus import build_default; build_default()"
    subprocess.run([PY, "-c", code], check=True, cwd=ROOT, env=env)
    data = work / "data" / "stdlib-bpe4096"
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    base = [*(launcher if args.torchrun else [PY]), "-m", "pytrain.train", "--no-progress", "--config", "configs/gpt2-124m.toml",
            "--data.path", str(data / "train"), "--data.val_path", str(data / "val"),
            "--compile.cache_dir", str(work / "inductor-cache"), "--out_dir", str(work / "runs"),
            "--samples", "0", "--eval_every", "0", "--eval_batches", "2", "--optim.grad_accum", "2"]  # fmt: skip
    rows = []
    seen: dict[Path, str] = {}  # each cached tuned config, as the previous start left it
    for start in args.plan.split(","):
        row, name, leg, *extra = start.split(":")  # extra: KEY=VALUE for this start's env
        cmd = [*base, "--name", name, "--max_steps", str(args.steps * int(leg))]
        t0 = time.perf_counter()
        run_env = {**env, **dict(x.split("=", 1) for x in extra)}
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=run_env)
        wall = time.perf_counter() - t0
        out = r.stdout + r.stderr
        (work / f"{row}.log").write_text(f"$ {' '.join(cmd)}\n{out}\n[exit {r.returncode}]\n")
        m = re.search(r"compile warm-up: \d+ shape\(s\) in ([\d.]+)s(.*)", out)
        log = (work / "runs" / name / "train.log").read_text()
        phases = log.split("compile seconds by phase:")[-1].split("\n20")[0]
        (work / f"{row}-phases.txt").write_text(phases)
        dynamo = re.search(r"_compile\.compile_inner\D+([\d.]+)", phases)
        caches = re.search(r"cache counters: (.*)", phases)
        row += "".join(f" ({x})" for x in extra)
        tuning = re.search(r"coordinate_descent_tuning\D+([\d.]+)", phases)
        # Kernels whose coordinate-descent result Inductor has cached (.best_config files).
        best = list((work / "inductor-cache").rglob("*.best_config"))
        coordesc = sum('"found_by_coordesc": true' in b.read_text() for b in best)
        (work / f"{row}-best-configs.txt").write_text(changed_configs(best, seen))
        rows.append(
            (row, r.returncode, m.group(1) if m else "?", (m.group(2).strip() if m else "") or "-",
             dynamo.group(1) if dynamo else "?", tuning.group(1) if tuning else "0",
             f"{coordesc}/{len(best)}", f"{wall:.0f}", caches.group(1) if caches else "?")
        )  # fmt: skip
        print(f"[{row}] exit {r.returncode}, warm-up {rows[-1][2]}s, wall {wall:.0f}s", flush=True)
    print(f"\nwarm restarts of the GPT-2 preset, {time.strftime('%Y-%m-%d')}\n")
    headers = ["start", "exit", "warm-up s", "artifacts", "Dynamo compile_inner s",
               "coordinate descent s", "coordesc/best configs cached", "process wall s",
               "cache counters"]  # fmt: skip
    print(markdown_table(headers, rows))
    return 0 if all(r[1] == 0 for r in rows) else 1


def changed_configs(best: list[Path], seen: dict[Path, str]) -> str:
    """The tuned configs this start wrote or rewrote (which kernels tuned again), each with
    its kernel's name and its content before and after; updates `seen`."""
    lines = []
    for b in sorted(best):
        now = b.read_text()
        if seen.get(b) != now:
            # The kernel's source sits in the same directory (with others of its hash prefix).
            names = sorted(
                {
                    n
                    for k in b.parent.glob("*.py")
                    for n in re.findall(r"def (triton_\w+)", k.read_text())
                }
            )
            lines.append(f"{b.parent.name}/{b.name} (kernels there: {', '.join(names) or '?'})\n"
                         f"  before: {seen.get(b, '(none)')}\n  after:  {now}")  # fmt: skip
            seen[b] = now
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
