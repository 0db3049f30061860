"""Scaling of a preset, as shipped, over the GPUs of one host: tokens/s on 1 GPU and on N
(torchrun; the wrapper the trainer chooses, and with --fsdp also FSDP2 forced), the
per-GPU scaling efficiency, the final loss (every run starts from the same weights and
reads the same stream, so the losses should agree), peak memory, and the loader's CPU
time per GPU.

    python benchmarks/scaling_gpu.py [--gpus 1,2,4] [--steps 30] [--fsdp] [--two-agents]
    python benchmarks/scaling_gpu.py --preset configs/llama-1b.toml --vocab 128256 \\
        --set optim.tokens_per_step=131072
    python benchmarks/scaling_gpu.py --gpus 1,2,4 --fsdp --two-agents --dry-run  # commands only

By default the GPU counts are 1, 2, 4, ... up to the host's GPUs, so one command on a host
of 4 GPUs gives the table at 1, 2 and 4.

--two-agents: the largest count once more, as two torchrun agents of half its GPUs each
(`--nnodes 2`, c10d rendezvous on this host, CUDA_VISIBLE_DEVICES split between them),
started together: the trainer sees a job of two nodes. Under FSDP2 (the preset's own
choice, or --fsdp) that is HSDP, FSDP2 within each agent's GPUs and replicas across them
(fsdp_shard_size auto), the row "4 (HSDP 2x2)" beside the FSDP2 over 4. The agents share
one host, so NCCL still joins all their GPUs over NVLink: the row shows what HSDP's two
levels of collectives cost, not what a network between nodes would.

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
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import (  # noqa: E402
    failure_line,
    machine_line,
    markdown_table,
    median_steady,
    read_for,
    read_steps,
)
from pytrain.train.cli import read_peak_memory  # noqa: E402

Launch = tuple[list[str], dict[str, str]]
"""A process to start: its command and the environment variables it sets."""


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them: its entries where
    it is set, else nvidia-smi's indices; none where there is no nvidia-smi."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    r = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                       capture_output=True, text=True) if smi else None  # fmt: skip
    return r.stdout.split() if r and r.returncode == 0 else []


def free_port() -> int:
    """A port no one listens on now, for the agents' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launches(n: int, args, data: Path, fsdp: bool, profile: bool, agents: int = 1):
    """(the run's name, [Launch]): the processes that start one run of `n` GPUs together.
    One torchrun of `n` ranks (with --plain at n = 1, one Python), or `agents` torchrun
    agents of n / agents ranks each, meeting through c10d rendezvous on this host as the
    nodes of a job do, each on its own GPUs."""
    name = f"gpus{n}" + (f"-{agents}agents" if agents > 1 else "") + ("-fsdp2" if fsdp else "")
    out = args.work / "runs"
    sets = [f"--{s.replace('=', ' ', 1)}" for s in args.set]
    train = ["-m", "pytrain.train", "--config", str(args.preset), "--data.path", str(data),
             "--out_dir", str(out), "--name", name, "--no-resume", "--max_steps", str(args.steps),
             "--eval_every", "0", "--ckpt_every", "0", "--log_every", "1", "--samples", "0",
             "--no-progress", "--compile.cache_dir", str(args.work / "inductor-cache"),
             *(["--fsdp"] if fsdp else []),
             *(["--profile_steps", f"{args.steps - 5}:{args.steps - 2}"] if profile else []),
             *" ".join(sets).split()]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if agents == 1:
        one = [sys.executable] if n == 1 and args.plain else [*torchrun, "--standalone", f"--nproc_per_node={n}"]  # fmt: skip
        return name, [([*one, *train], {})]
    per, port = n // agents, free_port()
    agent = [*torchrun, "--nnodes", str(agents), "--nproc-per-node", str(per),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
             "--rdzv-id", f"{name}-{port}"]  # fmt: skip
    # Where no GPU is seen (a dry run elsewhere), the indices the host would have.
    gpus = visible_gpus() or [str(i) for i in range(n)]
    split = [",".join(gpus[i * per : (i + 1) * per]) for i in range(agents)]
    return name, [([*agent, *train], {"CUDA_VISIBLE_DEVICES": g}) for g in split]


def run_together(procs: list[Launch], stem: Path) -> tuple[int, str, str]:
    """Starts the processes together and waits for all: (the first failure's exit code, or
    0; their stdouts; their stderrs), written to files beside `stem` while they run (a pipe
    left unread would fill and stop them). Where one fails, the others are stopped: they
    would wait for their lost peers until a timeout."""
    files = [(stem.with_suffix(f".{i}.stdout"), stem.with_suffix(f".{i}.stderr"))
             for i in range(len(procs))]  # fmt: skip
    running = []
    for (cmd, env), (out, err) in zip(procs, files, strict=True):
        with out.open("w") as o, err.open("w") as e:
            running.append(subprocess.Popen(cmd, stdout=o, stderr=e, env={**os.environ, **env}))
    code = 0
    while None in (states := [p.poll() for p in running]):
        if not code and (code := next((c for c in states if c), 0)):
            for p, c in zip(running, states, strict=True):
                if c is None:
                    p.terminate()  # torchrun passes SIGTERM on to its ranks
        time.sleep(1)
    code = code or next((c for c in states if c), 0)
    outs = ["".join(f.read_text() for f in fs) for fs in zip(*files, strict=True)]
    for f in (f for pair in files for f in pair):
        f.unlink()
    return code, outs[0], outs[1]


def run(n: int, args, data: Path, fsdp: bool, profile: bool, agents: int = 1) -> dict:
    name, procs = launches(n, args, data, fsdp, profile, agents)
    out = args.work / "runs"
    shutil.rmtree(out / name, ignore_errors=True)
    t0 = time.perf_counter()
    code, stdout, stderr = run_together(procs, args.work / name)
    wall = time.perf_counter() - t0
    (args.work / f"{name}.out").write_text(stdout + stderr)
    plan = re.search(r"data parallel: (\w+)", stdout)
    label = {"replicated": "replicas"}.get(plan.group(1), plan.group(1)) if plan else "single"
    # A job of several agents says how its GPUs were grouped, e.g. "4 (HSDP 2x2)".
    kind = f"{label} " if plan else ""
    gpus = str(n) if agents == 1 else f"{n} ({kind}{agents}x{n // agents})"
    row = {"gpus": n, "agents": agents, "label": gpus, "wrapper": label, "fsdp": fsdp}
    if code != 0:
        print(stdout[-2000:], stderr[-4000:], file=sys.stderr)
        return {**row, "error": failure_line(stderr), "wall_s": wall}
    steps = read_steps(out / name / "train.log")
    # The profiled steps, and the one after them (its period includes the trace's writing).
    skip = set(range(args.steps - 4, args.steps + 1)) if profile else set()
    warm = max(3, args.steps // 3)
    measured = [x for x in steps if x["step"] not in skip]
    tokens_per_s = median_steady(measured, "tok/s", warm)
    peak = read_peak_memory(stdout)
    accum = re.search(r"gradient accumulation: (\d+) micro-batches", stdout)
    summary = out / name / "profile" / "summary.md"
    return {
        **row,
        "plan": plan and stdout[plan.start() :].splitlines()[0],
        "accum": int(accum.group(1)) if accum else None,
        "final_loss": f"{steps[-1]['loss']:.4f}" if steps else None,
        "tokens_per_s": float("nan") if tokens_per_s is None else tokens_per_s,
        "steps_measured": sum(x["step"] > warm for x in measured),
        "peak_gb": peak[0] if peak else None,
        "reserved_gib": peak[1] if peak else None,
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


def default_counts() -> str:
    """1, 2, 4, ... up to this host's GPUs (1 where none is seen)."""
    gpus, counts = len(visible_gpus()), [1]
    while counts[-1] * 2 <= gpus:
        counts.append(counts[-1] * 2)
    return ",".join(map(str, counts))


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", help="GPU counts, comma-separated (default: 1, 2, 4, ... up to this host's GPUs)")  # fmt: skip
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--preset", type=Path, default=ROOT / "configs/gpt2-124m.toml")
    p.add_argument("--vocab", type=int, default=50257, help="of the synthetic dataset")
    p.add_argument("--set", action="append", default=[], help="name=value over the preset")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-scaling")
    p.add_argument("--fsdp", action="store_true", help="also every N > 1 with --fsdp forced")
    p.add_argument(
        "--two-agents",
        action="store_true",
        help="also the largest count as two torchrun agents of half its GPUs each, as two "
        "nodes (with --fsdp forced where --fsdp is given): under FSDP2, HSDP",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--plain",
        action="store_true",
        help="the 1-GPU run without torchrun (no wrapper), as one GPU is trained",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = p.parse_args()
    try:
        counts = [int(n) for n in (args.gpus or default_counts()).split(",")]
    except ValueError:
        p.error(f"--gpus takes GPU counts, comma-separated, such as 1,2,4 (not {args.gpus!r})")
    if min(counts) < 1:
        p.error(f"--gpus {args.gpus}: every count is at least 1")
    biggest, seen = max(counts), len(visible_gpus())
    if seen and biggest > seen and not args.dry_run:
        p.error(f"--gpus {args.gpus}: this host shows {seen} GPU(s)")
    if args.two_agents and biggest % 2:
        shown = "" if args.gpus else f" (the default --gpus, up to this host's {seen} GPU(s))"
        p.error(f"--two-agents splits the largest GPU count in two: {biggest} is odd{shown}")
    # (GPUs, --fsdp forced, torchrun agents)
    plan = [(n, False, 1) for n in counts] + [(n, True, 1) for n in counts if args.fsdp and n > 1]
    plan += [(biggest, args.fsdp, 2)] if args.two_agents else []
    profiled = (biggest, False, 1) if args.profile else None
    data = args.work / f"synthetic-{args.vocab}"
    if args.dry_run:
        for n, fsdp, agents in plan:
            name, procs = launches(n, args, data, fsdp, (n, fsdp, agents) == profiled, agents)
            together = " (started together)" if len(procs) > 1 else ""
            print(f"# {name}{together}")
            for cmd, env in procs:
                print(shlex.join([*(f"{k}={v}" for k, v in env.items()), *cmd]))
        return 0
    print(machine_line(), flush=True)
    from pytrain import _loader

    if not (data / "manifest.json").exists():
        _loader.write_synthetic(str(data), 40_000, mu=6.5, sigma=1.0, vocab=args.vocab, seed=0)
    results = []
    for n, fsdp, agents in plan:
        results.append(run(n, args, data, fsdp, (n, fsdp, agents) == profiled, agents))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "profile"}), flush=True)
    per_token = loader_cpu_per_token(args, data, biggest)
    first = results[0]  # the baseline of the efficiencies: its tokens/s per GPU
    base = first["tokens_per_s"] / first["gpus"] if "tokens_per_s" in first else None
    print(
        f"\n{args.preset.name} as shipped{' with ' + ', '.join(args.set) if args.set else ''}; "
        f"median tok/s of steps {max(3, args.steps // 3) + 1}-{args.steps}"
    )
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["label"], r["wrapper"], "", f"failed: {r['error']}", "", "", "", "", "", ""])  # fmt: skip
            continue
        per_gpu = r["tokens_per_s"] / r["gpus"]
        eff = f"{per_gpu / base:.1%}" if base else "- (the first row failed)"
        rows.append([r["label"], r["wrapper"], r["accum"] or "-", f"{r['tokens_per_s']:,.0f}", f"{per_gpu:,.0f}",
                     eff, r["final_loss"], r["peak_gb"] or "-", r["reserved_gib"] or "-",
                     f"{per_token * per_gpu:.4f}"])  # fmt: skip
    headers = ["GPUs", "wrapper", "accumulation per rank", "tokens/s (all GPUs)", "per GPU",
               "scaling efficiency", "loss at the last step", "peak GB (rank 0)",
               "peak GiB reserved (rank 0)", "loader CPU per GPU (cores)"]  # fmt: skip
    print(markdown_table(headers, rows))
    print(
        f"\nloader alone, rank 0 of {biggest}: {per_token * 1e9:.1f} CPU ns per token "
        "(process CPU time)"
    )
    for r in results:
        agents = f", {r['agents']} agents of {r['gpus'] // r['agents']}" if r["agents"] > 1 else ""
        if r.get("plan"):
            print(f"{r['gpus']} GPUs{agents}{' --fsdp' if r['fsdp'] else ''}: {r['plan']}")
        if r.get("profile"):
            print(f"\nprofile, {r['gpus']} GPUs, {r['wrapper']}, rank 0:\n{r['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
