"""A mixture of experts against a dense model with the same active parameters, at equal
tokens on real text, each with several seeds: the validation loss at the last step, and the
experts' load (the worst layer's max over mean tokens an expert, and the most experts any
layer left unused, in the logs' last window) under the balancing the MoE is run with.

    PYTHONPATH=$PWD python benchmarks/moe_quality.py [--steps 300] [--seeds 1337,2]

By default (any CPU): the embedded default's data (standard-library sources, BPE of 4,096)
and its preset (configs/cpu-default.toml: 4 layers, d_model 256, SwiGLU 704); the MoE
keeps its attention and replaces each MLP by 8 SwiGLU experts of 352, each token routed to
2 (the same 3 x 256 x 704 weights a token as the dense MLP's), balanced by DeepSeek-V3's
bias (the default). On one GPU, the presets (configs/moe-1.8b-a320m.toml's active
parameters match configs/llama-350m.toml's):

    PYTHONPATH=$PWD python benchmarks/moe_quality.py --steps 2000 --data DIR --val DIR \\
        --dense "--config configs/llama-350m.toml --optim.grad_accum 4" \\
        --moe "--config configs/moe-1.8b-a320m.toml --optim.grad_accum 4"

`--against softmax` compares router scores instead: --moe's flags with softmax scores
against the same with sigmoid (the default's balancing bias on both).

Both runs of a seed see the same batches in the same order (the loader's order depends on
the seed alone). A table is printed last."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import machine_line, markdown_table  # noqa: E402

CPU_DENSE = "--config configs/cpu-default.toml"
CPU_MOE = (f"{CPU_DENSE} --model.family moe --model.experts 8 --model.top_k 2 "
           "--model.expert_hidden 352")  # fmt: skip


def active_params(flags: list[str]) -> int:
    """The parameters a token's forward multiplies by (the family's count), on the meta
    device: the shape only."""
    import torch

    from pytrain.config import parse_args
    from pytrain.model import families

    cfg = parse_args(flags).model
    with torch.device("meta"):
        return families.of(cfg).model(cfg).active_params()


def run(
    name: str, flags: list[str], seed: int, steps: int, data: tuple[str, str], work: Path
) -> dict:
    """One training run to `steps` with an evaluation at its end: its last validation loss
    and the last logged expert load (None for a dense model)."""
    from pytrain.train.metrics import read_step_lines

    run_name = f"{name}-{seed}"
    cmd = [sys.executable, "-m", "pytrain.train", "--no-progress", *flags,
           "--data.path", data[0], "--data.val_path", data[1], "--max_steps", str(steps),
           "--eval_every", str(steps), "--log_every", "10", "--ckpt_every", "0",
           "--samples", "0", "--seed", str(seed), "--out_dir", str(work), "--name", run_name]  # fmt: skip
    shutil.rmtree(work / run_name, ignore_errors=True)  # a fresh run, not a resume
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{run_name}: exit {out.returncode}: {out.stderr.strip()[-500:]}")
    log = (work / run_name / "train.log").read_text()
    vals = [float(v) for v in re.findall(r"\bstep \d+ val_loss (\S+)", log)]
    last = read_step_lines(log)[-1]
    load = (
        (last["expert_load_max_over_mean"], int(last["unused_experts"]))
        if "unused_experts" in last
        else None
    )
    return {"val": vals[-1], "load": load, "tok_s": last["tok/s"]}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="1337,2")
    p.add_argument("--dense", default=CPU_DENSE, help="the dense run's flags")
    p.add_argument("--moe", default=CPU_MOE, help="the mixture of experts' flags")
    p.add_argument(
        "--against",
        default="dense",
        choices=("dense", "softmax"),
        help="what the mixture is compared with: the dense model (--dense), or the "
        "same mixture with softmax router scores (the sigmoid decision: --moe's "
        "flags with --model.router_score softmax against sigmoid)",
    )
    p.add_argument("--data", default="", help="training dataset (default: the embedded default's)")
    p.add_argument("--val", default="", help="validation dataset")
    p.add_argument("--work", type=Path, default=Path("runs/moe-quality"))
    args = p.parse_args()
    if args.data:
        data = (args.data, args.val)
    else:
        from pytrain.data.corpus import build_default

        data = tuple(str(d) for d in build_default())
    seeds = [int(s) for s in args.seeds.split(",")]
    print(machine_line(), flush=True)
    results: dict[str, list[dict]] = {}
    pair = (("dense", args.dense), ("moe", args.moe))
    if args.against == "softmax":
        pair = (("softmax", f"{args.moe} --model.router_score softmax"),
                ("sigmoid", f"{args.moe} --model.router_score sigmoid"))  # fmt: skip
    for name, spec in pair:
        flags = shlex.split(spec)
        results[name] = []
        for seed in seeds:
            r = run(name, flags, seed, args.steps, data, args.work)
            print(f"{name} seed {seed}: {r}", flush=True)
            results[name].append(r)
        results[name + " active"] = [{"n": active_params(flags)}]
    rows = []
    for name, spec in pair:
        rs = results[name]
        load = [r["load"] for r in rs if r["load"] is not None]
        rows.append([
            f"`{spec}`", f"{results[name + ' active'][0]['n'] / 1e6:.2f}M",
            " / ".join(f"{r['val']:.4f}" for r in rs), f"{statistics.mean(r['val'] for r in rs):.4f}",
            " / ".join(f"{m:.2f}" for m, _ in load) or "-",
            " / ".join(str(u) for _, u in load) or "-",
            f"{statistics.mean(r['tok_s'] for r in rs):,.0f}",
        ])  # fmt: skip
    print(f"\n{args.steps} steps, seeds {args.seeds}\n")
    print(markdown_table(
        ["run", "active params", "val loss by seed", "mean", "expert load max/mean", "unused experts", "tok/s"],
        rows,
    ))  # fmt: skip
    base, moe = (statistics.mean(r["val"] for r in results[n]) for n, _ in pair)
    spread = [r["val"] for r in results[pair[0][0]]]
    print(
        f"\n{pair[1][0]} - {pair[0][0]}: {moe - base:+.4f} nats ({(moe - base) / base:+.2%}); "
        f"{pair[0][0]}'s own spread across seeds {(max(spread) - min(spread)) / base:.2%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
