"""Replica groups on torchft against plain data parallelism, on the CPU: what torchft's
quorum and commit cost a step, and how long a killed group takes to train again.

    PYTHONPATH=$PWD python benchmarks/replica_groups.py [--groups 2] [--steps 300] [--work DIR]
    # one GPU, one group (no ft-kill row: there is no peer to heal from), a preset's model:
    PYTHONPATH=$PWD python benchmarks/replica_groups.py --groups 1 --kill-at 0 --steps 30 \
        --flags "--config configs/llama-350m.toml"

On the embedded default dataset (built once), a small GPT at one global batch, rows:
  plain    one torchrun job of GROUPS gloo ranks (DDP), no torchft
  ft       GROUPS replica groups of one rank each (a torchrun job each) and torchft's
           Lighthouse on localhost: a quorum, an all-reduce of the gradients through
           torchft and a commit vote every step
  ft-kill  the same, the last group's rank SIGKILLed at step --kill-at under
           torchrun --max-restarts 1: the seconds from the kill to its first committed
           step (its ledger), and the heal's own seconds (its "healed from a peer" line)
With --kills N, instead: GROUPS groups at --min-replicas and a Lighthouse whose heartbeat
timeout is 1 s train until a random group's rank has been SIGKILLed N times at random
points of a step (each kill once every group is back in the quorum; torchrun restarts the
rank, which heals from a peer). For each kill, the seconds from it to each survivor's next
committed step (its ledger) and whether the kill failed a survivor's step attempt (it came
in the all-reduce); at the end, the largest of them against the heartbeat timeout plus the
survivors' median step (the goal: every one within it; the exit status says so), and how
many committed steps kept work trained before the quorum that dropped the dead group (the
survivors' own shares, then the dead group's rows between them):

    PYTHONPATH=$PWD python benchmarks/replica_groups.py --groups 3 --kills 50

For plain and ft: the median step time after the first 20 steps (train.log's step_ms); for
ft, the medians of what torchft's part took a step (group 0's ledger), each also as a share
of ft's step: the quorum, the gradients' copy into the all-reduce's buffer (on a GPU by
CUDA events; the copy back out is as large again), the all-reduce between groups (what
plain does too, within its DDP; with one group, a sum over one) and the commit vote.
One core a rank is what the figures assume: on fewer, the ranks share them. --flags go to
every run last (a preset, a device): on a GPU host each rank has a GPU, and torchft's
all-reduce between groups is ProcessGroupBabyNCCL's."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
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
ENV = harness.child_env(OMP_NUM_THREADS="1", RUST_LOG="warn")


def train_flags(work: Path, name: str, steps: int, extra: list[str]) -> list[str]:
    from pytrain.data.corpus import build_default

    train, _ = build_default()
    # A small GPT unless the flags name a preset, which then runs as shipped (its model,
    # rows and accumulation): flags override a preset, so these would replace its shape.
    small = [] if "--config" in extra else [
        "--model.n_layer", "4", "--model.n_head", "4", "--model.d_model", "128",
        "--data.seq_len", "128", "--data.batch_size", "4", "--optim.grad_accum", "1"]  # fmt: skip
    return ["--data.path", str(train), "--out_dir", str(work), "--name", name, *small,
            "--max_steps", str(steps), "--eval_every", "0", "--ckpt_every", "0", "--samples", "0",
            "--log_every", "1", "--no-tensorboard", "--no-progress", "--no-compile.safe_env",
            *extra]  # fmt: skip


def torchrun(ranks: int, port: int, restarts: int = 0) -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
            f"--master_port={port}", f"--max-restarts={restarts}", "-m", "pytrain.train"]  # fmt: skip


HEARTBEAT_S = 1.0  # the Lighthouse's heartbeat timeout (and its join timeout)
TICK_S = 0.05  # how often the Lighthouse looks for a quorum it can form


def start_ft(args, name: str, steps: int, restarts, min_replicas: int = 1, extra=()):
    """A Lighthouse and GROUPS replica groups (group k's torchrun restarts its rank
    `restarts(k)` times): (the Lighthouse, the groups' torchrun agents, their output files)."""
    port, ms = args.port, str(int(HEARTBEAT_S * 1000))
    lighthouse = subprocess.Popen(
        [str(Path(PY).parent / "torchft_lighthouse"), "--min_replicas", str(min_replicas),
         "--bind", f"[::]:{port}", "--join_timeout_ms", ms, "--heartbeat_timeout_ms", ms,
         "--quorum_tick_ms", str(int(TICK_S * 1000))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
    )  # fmt: skip
    procs, logs = [], []
    for k in range(args.groups):
        cmd = [*torchrun(1, port + 1 + k, restarts=restarts(k)),
               *train_flags(args.work, name, steps, args.flags), "--ft.lighthouse",
               f"http://localhost:{port}", "--ft.group", str(k), "--ft.groups", str(args.groups),
               "--ft.min_replicas", str(min_replicas), *extra]  # fmt: skip
        logs.append(open(args.work / f"{name}-group{k}.out", "w"))  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=ENV))
    return lighthouse, procs, logs


def stop_ft(lighthouse, procs, logs) -> None:
    for p in procs:
        harness.kill_tree(p.pid)
    for log in logs:
        log.close()
    lighthouse.kill()


def ft_run(args, name: str, kill_at: int = 0) -> tuple[Path, dict]:
    """GROUPS replica groups and a Lighthouse; with `kill_at`, the last group's rank is
    killed there. Returns the run directory and, for a kill, the recovery's seconds."""
    last = args.groups - 1
    lighthouse, procs, logs = start_ft(
        args, name, args.steps, lambda k: int(bool(kill_at) and k == last)
    )
    run, found = args.work / name, {}
    try:
        if kill_at:
            found = kill_and_time(run / f"group{last}", procs[last], kill_at)
        for k, p in enumerate(procs):
            if p.wait() != 0:
                out = (args.work / f"{name}-group{k}.out").read_text()
                raise SystemExit(f"{name} group {k}: {harness.failure_line(out)}")
    finally:
        stop_ft(lighthouse, procs, logs)
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


def kills(args) -> int:
    """The --kills loop (see the module docstring): a line a kill, then the largest gap."""
    rng = random.Random(args.seed)
    name = "ft-kills"
    shutil.rmtree(args.work / name, ignore_errors=True)
    lighthouse, procs, logs = start_ft(
        args, name, 10**7, lambda k: args.kills, min_replicas=args.min_replicas,
        extra=("--ft.timeout_s", str(args.timeout_s)),
    )  # fmt: skip
    dirs = [args.work / name / f"group{k}" for k in range(args.groups)]
    limit = 3 * args.timeout_s + 60  # a wait that long is a hang: said, and the loop ends
    gaps: list[float] = []
    try:
        since = 0.0
        for i in range(args.kills):
            # Every group back: each committed after the last kill, in a quorum of all.
            until(lambda: all(committed(d, since, args.groups) for d in dirs), procs, limit,  # noqa: B023
                  "every group back in the quorum")  # fmt: skip
            time.sleep(rng.uniform(0.0, 0.5))  # a random point of a step
            k = rng.randrange(args.groups)
            victim = harness.children(procs[k].pid)[-1]
            since = time.time()
            os.kill(victim, signal.SIGKILL)
            back, quorum, failed = [], [], 0
            for j, d in enumerate(dirs):
                if j != k:
                    line = until(lambda: committed(d, since), procs, limit, f"group {j} to commit")  # noqa: B023
                    back.append(line["time"] - since)
                    quorum.append(line["quorum_ms"] / 1e3)
                    failed += any(not x["committed"] and x["time"] > since for x in ledger(d))
            gaps += back
            print(f"kill {i + 1}: group {k}; the others committed again after "
                  f"{', '.join(f'{g:.2f}' for g in back)} s, their quorums "
                  f"{', '.join(f'{q:.2f}' for q in quorum)} s of it; {failed} of them had "
                  "a step attempt fail", flush=True)  # fmt: skip
    finally:
        stop_ft(lighthouse, procs, logs)
    steps = [x["step_ms"] for d in dirs for x in harness.read_steps(d / "train.log")]
    step_s = statistics.median(steps) / 1e3
    bound = HEARTBEAT_S + step_s
    over = [g - bound for g in gaps if g > bound]
    # The step in flight when the kill came fails at its all-reduce (or, killed between two
    # steps, the next one trains ahead of its quorum while the Lighthouse waits out the dead
    # group's heartbeat); under the quorum without it the survivors keep what they trained
    # and train its rows between them: within the heartbeat timeout and a step (the goal,
    # the exit status).
    kept = sum("extra" in x for d in dirs for x in ledger(d) if x["committed"])
    print(f"{args.kills} kills: the survivors committed again after {statistics.median(gaps):.2f} s "
          f"(median), {max(gaps):.2f} s at most (ft.timeout_s {args.timeout_s:g} s). The heartbeat "
          f"timeout {HEARTBEAT_S:g} s + a step ({step_s * 1e3:.0f} ms, the median): {bound:.2f} s, "
          f"{len(over)} of {len(gaps)} over it" + (f" by {max(over):.2f} s at most" if over else "")
          + f"; {kept} committed steps kept work trained before the quorum that dropped a group")  # fmt: skip
    return int(bool(over))


def committed(group_dir: Path, after: float, groups: int = 0) -> dict | None:
    """The group's first committed ledger line after `after` (in a quorum of `groups`)."""
    lines = (x for x in ledger(group_dir) if x["committed"] and x["time"] > after)
    return next((x for x in lines if x["groups"] >= groups), None)


def until(what, procs, limit: float, doing: str):
    """Polls `what()` until it is true; SystemExit if a group ends or `limit` s pass."""
    t0 = time.monotonic()
    while not (got := what()):
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"a group ended while waiting for {doing}")
        if time.monotonic() - t0 > limit:
            raise SystemExit(f"waited {limit:g} s for {doing}: a hang")
        time.sleep(0.02)
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--port", type=int, default=29710)
    p.add_argument("--work", type=Path, default=Path("/tmp/pytrain-replica-groups"))
    p.add_argument("--flags", default="", help="trainer flags every run adds last")
    p.add_argument("--kills", type=int, default=0, help="the kill loop instead (see above)")
    p.add_argument("--min-replicas", type=int, default=2, help="the kill loop's")
    p.add_argument("--timeout-s", type=float, default=30.0, help="the kill loop's ft.timeout_s")
    p.add_argument("--seed", type=int, default=0, help="the kill loop's victims and times")
    args = p.parse_args()
    args.flags = shlex.split(args.flags)
    args.work.mkdir(parents=True, exist_ok=True)
    print(harness.machine_line())
    if args.kills:
        return kills(args)
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
    parts = {k: statistics.median(x[k] for x in lines)
             for k in ("quorum_ms", "copy_ms", "allreduce_ms", "vote_ms")}  # fmt: skip
    share = lambda ms: f"{ms:.2f} ({100 * ms / with_ft:.1f}%)"  # noqa: E731
    rows = [
        ["plain", f"{base:.1f}", "", "", "", "", ""],
        ["ft", f"{with_ft:.1f} ({with_ft - base:+.1f}, {100 * (with_ft / base - 1):+.1f}%)",
         *(share(ms) for ms in parts.values()), ""],
    ]  # fmt: skip
    if kill:
        rows.append(["ft-kill", "", "", "", "", "", f"{kill['recovery_s']:.1f} (heal "
                     f"{kill['heal_s']} s; rejoined at step {kill['rejoined_at']})"])  # fmt: skip
    headers = [f"{args.groups} groups", "step ms (median)", "quorum ms (of the step)",
               "copy into the all-reduce ms", "all-reduce ms", "vote ms", "kill -> committed, s"]  # fmt: skip
    print(harness.markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
