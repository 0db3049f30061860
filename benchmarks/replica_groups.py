"""Replica groups on torchft against plain data parallelism, on the CPU: what torchft's
quorum and commit cost a step, and how long a killed group takes to train again.

    PYTHONPATH=$PWD python benchmarks/replica_groups.py [--groups 2] [--steps 300] [--work DIR]
    # one GPU, one group (no ft-kill row: there is no peer to heal from), a preset's model:
    PYTHONPATH=$PWD python benchmarks/replica_groups.py --groups 1 --kill-at 0 --steps 100 \
        --flags "--config configs/gpt2-124m.toml --optim.grad_accum 1"

On the embedded default dataset (built once), a small GPT at one global batch, rows:
  plain    one torchrun job of GROUPS gloo ranks (DDP), no torchft
  ft       GROUPS replica groups of one rank each (a torchrun job each) and torchft's
           Lighthouse on localhost: a quorum, an all-reduce of the gradients through
           torchft and a commit vote every step
  ft-kill  the same, the last group's rank SIGKILLed at step --kill-at under
           torchrun --max-restarts 1: the seconds from the kill to its first committed
           step (its ledger), and the heal's own seconds (its "healed from a peer" line)
For plain and ft: the median step time after the first 20 steps (train.log's step_ms); for
ft, the medians of what torchft's part took a step (group 0's ledger): the quorum, and the
all-reduce of the gradients with the commit vote (the all-reduce is what plain does too).
One core a rank is what the figures assume: on fewer, the ranks share them. --flags go to
every run last (a preset, a device): on a GPU host each rank has a GPU, and torchft's
all-reduce between groups is ProcessGroupBabyNCCL's."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import harness  # noqa: E402

PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RUST_LOG": "warn"}


def train_flags(work: Path, name: str, steps: int, extra: list[str]) -> list[str]:
    from pytrain.data.corpus import build_default

    train, _ = build_default()
    return ["--data.path", str(train), "--out_dir", str(work), "--name", name,
            "--model.n_layer", "4", "--model.n_head", "4", "--model.d_model", "128",
            "--data.seq_len", "128", "--data.batch_size", "4", "--optim.grad_accum", "1",
            "--max_steps", str(steps), "--eval_every", "0", "--ckpt_every", "0", "--samples", "0",
            "--log_every", "1", "--no-tensorboard", "--no-progress", "--no-compile.safe_env",
            *extra]  # fmt: skip


def torchrun(ranks: int, port: int, restarts: int = 0) -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={port}", f"--max-restarts={restarts}", "-m", "pytrain.train"]  # fmt: skip


def ft_run(args, name: str, kill_at: int = 0) -> tuple[Path, dict]:
    """GROUPS replica groups and a Lighthouse; with `kill_at`, the last group's rank is
    killed there. Returns the run directory and, for a kill, the recovery's seconds."""
    port = args.port
    lighthouse = subprocess.Popen(
        [str(Path(PY).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind",
         f"[::]:{port}", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    last = args.groups - 1
    procs, logs = [], []
    for k in range(args.groups):
        cmd = [*torchrun(1, port + 1 + k, restarts=int(bool(kill_at) and k == last)),
               *train_flags(args.work, name, args.steps, args.flags), "--ft.lighthouse",
               f"http://localhost:{port}", "--ft.group", str(k), "--ft.groups", str(args.groups),
               "--ft.min_replicas", "1"]  # fmt: skip
        logs.append(open(args.work / f"{name}-group{k}.out", "w"))  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=ENV))
    run, found = args.work / name, {}
    try:
        if kill_at:
            found = kill_and_time(run / f"group{last}", procs[last], kill_at)
        for k, p in enumerate(procs):
            if p.wait() != 0:
                out = (args.work / f"{name}-group{k}.out").read_text()
                raise SystemExit(f"{name} group {k}: {harness.failure_line(out)}")
    finally:
        for p in procs:
            harness.kill_tree(p.pid)
        for log in logs:
            log.close()
        lighthouse.kill()
    if kill_at:
        out = (args.work / f"{name}-group{last}.out").read_text()
        healed = re.findall(r"healed from a peer at step \d+ in ([\d.]+)s", out)
        found["heal_s"] = float(healed[-1]) if healed else None
    return run, found


def ledger(group_dir: Path) -> list[dict]:
    path = group_dir / "ledger.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(x) for x in lines if x.endswith("}")]


def kill_and_time(group_dir: Path, agent: subprocess.Popen, at: int) -> dict:
    while not any(x["step"] >= at for x in ledger(group_dir)):
        if agent.poll() is not None:
            raise SystemExit(f"the group to kill ended before step {at}")
        time.sleep(0.05)
    victim = harness.children(agent.pid)[-1]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    while True:
        back = [x for x in ledger(group_dir) if x["committed"] and x["pid"] != victim]
        if back := [x for x in back if x["time"] > killed]:
            return {"recovery_s": back[0]["time"] - killed, "rejoined_at": back[0]["step"]}
        time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--port", type=int, default=29710)
    p.add_argument("--work", type=Path, default=Path("/tmp/pytrain-replica-groups"))
    p.add_argument("--flags", default="", help="trainer flags every run adds last")
    args = p.parse_args()
    args.flags = shlex.split(args.flags)
    args.work.mkdir(parents=True, exist_ok=True)
    print(harness.machine_line())
    plain = args.work / "plain"
    cmd = [
        *torchrun(args.groups, args.port + 50),
        *train_flags(args.work, "plain", args.steps, args.flags),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode != 0:
        raise SystemExit(f"plain: {harness.failure_line(r.stdout + r.stderr)}")
    ft, _ = ft_run(args, "ft")
    kill = ft_run(args, "ft-kill", kill_at=args.kill_at)[1] if args.kill_at else None
    base = harness.median_steady(harness.read_steps(plain / "train.log"), "step_ms", 20) or 0.0
    with_ft = (
        harness.median_steady(harness.read_steps(ft / "group0" / "train.log"), "step_ms", 20) or 0.0
    )
    lines = [x for x in ledger(ft / "group0") if x["step"] >= 20]
    quorum = statistics.median(x["quorum_ms"] for x in lines)
    sync = statistics.median(x["sync_ms"] for x in lines)
    rows = [
        ["plain", f"{base:.1f}", "", "", ""],
        ["ft", f"{with_ft:.1f} ({with_ft - base:+.1f})", f"{quorum:.2f}", f"{sync:.2f}", ""],
    ]
    if kill:
        rows.append(["ft-kill", "", "", "", f"{kill['recovery_s']:.1f} (heal {kill['heal_s']} s; "
                     f"rejoined at step {kill['rejoined_at']})"])  # fmt: skip
    headers = [f"{args.groups} groups", "step ms (median)", "quorum ms", "all-reduce + vote ms",
               "kill -> committed, s"]  # fmt: skip
    print(harness.markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
