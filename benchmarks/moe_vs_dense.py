"""A mixture of experts against a dense model of the same active parameters, at equal tokens
on real text, on one GPU at a scale where it counts: each of two seeds a pair of runs (the
seed fixes both arms' batches, their order and the held-out batches), each run one GPU
command, or several where `--time-limit-s` stops it (a checkpoint at the stop; the same
command resumes it, exactly).

The rule, fixed before the runs:
- The MoE wins a seed where its validation loss at the last step is below dense's.
- The MoE learns better than dense where it wins every seed, two at least, and its mean
  is below dense's by more than dense's own spread across seeds (max - min).

The shapes, from OLMoE's and the Switch Transformer's ablations (fine-grained experts, a
few routed a token, the same compute a token as the dense model they replace):
- dense: 12 layers, d_model 576, 9 heads of 64, SwiGLU 1536, the embedded default's BPE of
  4,096 (tied): 50M parameters.
- moe: the same attention; each MLP 32 SwiGLU experts of 384, each token routed to 4 (the
  same 3 x 576 x 1536 weights a token as dense's MLP), the project's default routing and
  balancing, the 4 weights (normalised to sum to 1) times 4 (`--model.route_scale 4`): 50M
  active, 273M in all. The dense MLP sums its 4 slices of 384; weights summing to 1 would
  average 4 experts, a quarter of that output at the start. On a CPU at this granularity
  (BENCHMARKS.md, "Mixture of experts: quality") the scale of 4 lowered the validation loss
  by 1.2% and 2.2% on two seeds.
Both: configs/llama-350m.toml's optimizer (AdamW, lr 6e-4, weight decay 0.1), bf16,
compiled, 64 rows of 1,024 tokens a step, 4,600 steps (301M tokens), a tenth of them to
warm up, cosine decay to the last step, an evaluation on 20 held-out batches every tenth
(the curves `report --plot` draws). Text: Python sources (benchmarks/harness.py), every
20th file held out, packed with the embedded default's tokenizer; `report` says how many
passes over the training text the steps make.

    python benchmarks/moe_vs_dense.py prepare --work W [--mb 400]
    python benchmarks/moe_vs_dense.py plan --work W             # the runs' commands
    python benchmarks/moe_vs_dense.py run --work W --arm moe --seed 1337 [--time-limit-s 540]
    python benchmarks/moe_vs_dense.py report --work W [--plot curves.png]

A finished run's evaluations, tokens/s and expert load go to W/results/ARM-SEED.json and
its run directory is removed; `report` reads W/results alone (results from several
machines may be copied there). `run --steps N --flags "..."` shortens or
changes a run (both arms the same way), e.g. to try the script on a CPU."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    machine_line,
    markdown_table,
    median_steady,
    pack_python_text,
    paired_runs_parser,
    read_steps,
)

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("dense", "moe")
SEEDS = (1337, 2)
STEPS = 4600
DENSE = ["--config", "configs/llama-350m.toml", "--model.n_layer", "12", "--model.d_model", "576",
         "--model.n_head", "9", "--model.n_kv_head", "9", "--data.seq_len", "1024",
         "--data.batch_size", "64", "--optim.tokens_per_step", "65536", "--optim.grad_accum", "0"]  # fmt: skip
MOE = ["--model.family", "moe", "--model.experts", "32", "--model.top_k", "4",
       "--model.expert_hidden", "384", "--model.route_scale", "4"]  # fmt: skip
STOPPED = 3  # run's exit code where the time limit stopped the run (the same command resumes)


def command(work: Path, arm: str, seed: int, steps: int, extra: list[str]) -> list[str]:
    """The trainer's command for one run (its identity: a resume must be of the same)."""
    return [sys.executable, "-m", "pytrain.train", *DENSE, *(MOE if arm == "moe" else []),
            "--data.path", str(work / "train"), "--data.val_path", str(work / "val"),
            "--seed", str(seed), "--max_steps", str(steps), "--optim.warmup_steps", str(steps // 10),
            "--eval_every", str(max(1, steps // 10)), "--eval_batches", "20", "--log_every", "10",
            "--ckpt_every", "0", "--keep_ckpts", "1", "--samples", "0", "--no-progress",
            "--out_dir", str(work / "runs"), "--name", f"{arm}-{seed}", *extra]  # fmt: skip


def run(work: Path, arm: str, seed: int, steps: int, extra: list[str], limit_s: float) -> int:
    """One run, resumed where a run of the same command stopped at a time limit."""
    name = f"{arm}-{seed}"
    run_dir, cmd = work / "runs" / name, command(work, arm, seed, steps, extra)
    said = run_dir / "command.json"
    if run_dir.exists() and (not said.exists() or json.loads(said.read_text()) != cmd[1:]):
        shutil.rmtree(run_dir)  # another command's run: not this one's to resume
    run_dir.mkdir(parents=True, exist_ok=True)
    said.write_text(json.dumps(cmd[1:]))
    limit = ["--time_limit_s", str(limit_s)] if limit_s else []
    out = subprocess.run(cmd + limit, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{name}: exit {out.returncode}: {out.stderr.strip()[-800:]}")
    log = (run_dir / "train.log").read_text()
    val = {int(s): float(v) for s, v in re.findall(r"\bstep (\d+) val_loss (\S+)", log)}
    rows = read_steps(run_dir / "train.log")
    if steps not in val:
        print(f"{name}: stopped at step {rows[-1]['step']:.0f} of {steps} by --time-limit-s {limit_s:g}; "
              "run the same command to continue", flush=True)  # fmt: skip
        return STOPPED
    last = rows[-1]
    result = {
        "arm": arm, "seed": seed, "command": shlex.join(cmd[1:]), "val": val,
        "tokens": steps * tokens_per_step(cmd),
        "tok_s": median_steady(rows, "tok/s", skip=3),
        "load": [last["expert_load_max_over_mean"], int(last["unused_experts"])]
        if "unused_experts" in last else None,
        "machine": machine_line(),
    }  # fmt: skip
    (work / "results").mkdir(exist_ok=True)
    (work / "results" / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "command"}), flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: 16 bytes a parameter
    return 0


def tokens_per_step(cmd: list[str]) -> int:
    """The command's --optim.tokens_per_step (its last: the flags added last win)."""
    at = len(cmd) - 1 - cmd[::-1].index("--optim.tokens_per_step")
    return int(cmd[at + 1])


def decide(pairs: list[tuple[float, float]]) -> str:
    """The rule of the module's docstring over (dense's, the MoE's) last validation loss,
    one pair a seed."""
    if len(pairs) < 2:
        return f"undecided: {len(pairs)} seed(s) paired, the rule asks two at least"
    dense = [d for d, _ in pairs]
    gain = statistics.mean(dense) - statistics.mean(m for _, m in pairs)
    spread = max(dense) - min(dense)
    wins = sum(m < d for d, m in pairs)
    if wins == len(pairs) and gain > spread:
        return (f"the MoE learns better: lower on {wins} of {len(pairs)} seeds, by "
                f"{gain:.4f} on average against dense's spread of {spread:.4f}")  # fmt: skip
    return (f"NOT shown: the MoE lower on {wins} of {len(pairs)} seeds, by {gain:+.4f} on "
            f"average against dense's spread of {spread:.4f}")  # fmt: skip


def passes(work: Path, tokens: int | None) -> str:
    """How many passes over the training text `tokens` make, where W/train is here."""
    manifest = work / "train" / "manifest.json"
    if not tokens or not manifest.exists():
        return ""
    have = sum(s["tokens"] for s in json.loads(manifest.read_text())["shards"])
    return f"; {tokens / 1e6:.0f}M tokens, {tokens / have:.1f} passes over the training text"


def report(work: Path, plot: Path | None) -> None:
    results = [json.loads(p.read_text()) for p in sorted((work / "results").glob("*.json"))]
    for r in results:
        r["val"] = {int(k): v for k, v in r["val"].items()}  # JSON's keys are text
    by = {(r["arm"], r["seed"]): r for r in results}
    print(next((r["machine"] for r in results), machine_line()))
    rows, pairs = [], []
    for seed in sorted({s for _, s in by}):
        d, m = by.get(("dense", seed)), by.get(("moe", seed))
        if not (d and m) or max(d["val"]) != max(m["val"]):
            continue
        last = max(d["val"])
        pairs.append((d["val"][last], m["val"][last]))
        rows.append([seed, last, f"{d['val'][last]:.4f}", f"{m['val'][last]:.4f}",
                     f"{m['val'][last] - d['val'][last]:+.4f}", f"{d['tok_s']:,.0f}",
                     f"{m['tok_s']:,.0f}", "{:.2f} / {}".format(*m["load"]) if m["load"] else "-"])  # fmt: skip
        for arm, r in (("dense", d), ("moe", m)):
            curve = " ".join(f"{s}:{v:.4f}" for s, v in sorted(r["val"].items()))
            print(f"{arm} seed {seed}, validation loss by step: {curve}")
    if not rows:
        print("no seed has both arms' results yet")
        return
    first = by[("moe", rows[0][0])]
    print(f"\nmoe: `{first['command']}`{passes(work, first.get('tokens'))}\n")
    print(markdown_table(["seed", "step", "dense val", "moe val", "moe - dense", "dense tok/s",
                          "moe tok/s", "moe load max/mean / unused"], rows))  # fmt: skip
    print(f"\n{decide(pairs)}")
    if plot:
        from benchmarks.harness import line_chart, save_chart

        fig, ax = line_chart()
        for (arm, seed), r in sorted(by.items()):
            steps = sorted(r["val"])
            ax.plot(steps, [r["val"][s] for s in steps], "-" if arm == "moe" else "--",
                    marker="o", markersize=3, label=f"{arm}, seed {seed}")  # fmt: skip
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.legend()
        save_chart(fig, ax, "MoE against dense at equal active parameters", plot)


def main() -> int:
    p = paired_runs_parser(__doc__, mb=400)
    p.add_argument("--arm", choices=ARMS, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--flags", default="", help="run: flags both arms add last")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="run: stop (with a checkpoint) after this long; the same command resumes")  # fmt: skip
    p.add_argument("--plot", type=Path, default=None, help="report: the curves as a PNG")
    args = p.parse_args()
    if args.what == "prepare":
        pack_python_text(args.work, args.tokenizer, args.mb)
    elif args.what == "plan":
        for seed in SEEDS:
            for arm in ARMS:
                print(f"python benchmarks/moe_vs_dense.py run --work {args.work} --arm {arm} "
                      f"--seed {seed} --time-limit-s 540")  # fmt: skip
    elif args.what == "run":
        if None in (args.arm, args.seed):
            p.error("run needs --arm and --seed")
        extra = shlex.split(args.flags)
        return run(args.work, args.arm, args.seed, args.steps, extra, args.time_limit_s)
    else:
        report(args.work, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
