"""Float8's loss against bf16's, decided by paired runs on one GPU. For each preset and seed,
two runs: the preset in bf16 throughout (its FP8 output layer off too) and the preset with
`--model.float8 tensorwise` (its output layer FP8, as shipped). Within a pair the seed is
the same, so are the initial weights (float8 converts the built model's linear layers after
they are initialised), the batches and their order (the loader's order is the seed's) and
the held-out batches; the difference within a pair is float8's cost, not a seed's noise.

The decision rule, fixed before the runs:
- A pair holds where float8's validation loss at the last step is within 1% of its bf16
  twin's: |float8 / bf16 - 1| <= 0.01.
- For a preset, float8's loss is "within 1%" where every seed's pair holds, two seeds at
  least; the preset may then ship float8 where it is faster. Where a pair does not hold,
  the table says where its losses part: the first evaluation from which the ratio stays
  beyond 1%.

The runs (`plan` prints their commands, each one GPU command of under 10 minutes): the
presets' own shapes, batch rows and learning rate, 65,536 tokens a step (the presets' 0.5M
with its 1,000 warm-up steps outlasts a command), a tenth of the steps to warm up, cosine
decay to the last step, an evaluation on 20 held-out batches every tenth of the steps.
llama-350m: 800 steps (52M tokens, about 4 min in bf16 on an H200); llama-1b: 300 steps (20M
tokens, about 4.5 min). By then the validation loss has left its first fast fall (from
ln(vocabulary) to within a few tenths of where it ends): the evaluations show it, and
`report` prints them. Text: Python sources (benchmarks/harness.py, every 20th file held
out), packed by pack-shards with --tokenizer (default: the embedded default's BPE).

    python benchmarks/float8_quality.py prepare --work W [--tokenizer T] [--mb 60]
    python benchmarks/float8_quality.py plan --work W            # the runs' commands
    python benchmarks/float8_quality.py run --work W --preset llama-1b --seed 1337 --side float8
    python benchmarks/float8_quality.py report --work W          # the table and the decision

`--float8-flags "--model.float8 off"` makes each pair two identical runs: where there is no
FP8 GPU it tries the script, and a pair of the same settings must end at ratio 1.0000 (the
pairing is exact; on a CPU with --deterministic, bit for bit)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (  # noqa: E402
    machine_line,
    markdown_table,
    pack_python_text,
    paired_runs_parser,
)

ROOT = Path(__file__).resolve().parent.parent
TOKENS_PER_STEP = 65536
PRESETS = {
    "llama-350m": {"config": "configs/llama-350m.toml", "steps": 800},
    "llama-1b": {"config": "configs/llama-1b.toml", "steps": 300},
    # For trying the script on a CPU (with --float8-flags): the embedded default's preset.
    "cpu-default": {"config": "configs/cpu-default.toml", "steps": 40, "tokens": 8192},
}
SEEDS = (1337, 2)
SIDES = ("bf16", "float8")
BF16 = ["--model.float8", "off", "--model.float8_head", "off"]
"""The bf16 side: bf16 throughout. The presets' output layer is FP8 where the GPU has FP8
matmuls (model.float8_head auto), which the float8 side keeps."""
TOLERANCE = 0.01


def command(
    work: Path, preset: str, seed: int, side: str, float8_flags: list[str], steps: int | None,
    both: list[str],
) -> list[str]:  # fmt: skip
    """The trainer's command for one run: `steps` (None: the preset's), `both`: flags both
    sides add last."""
    p = PRESETS[preset]
    steps = steps or p["steps"]
    flags = (BF16 if side == "bf16" else float8_flags) + both
    return [sys.executable, "-m", "pytrain.train", "--config", p["config"],
            "--data.path", str(work / "train"), "--data.val_path", str(work / "val"),
            "--seed", str(seed), "--max_steps", str(steps), "--optim.warmup_steps", str(steps // 10),
            "--optim.tokens_per_step", str(p.get("tokens", TOKENS_PER_STEP)), "--optim.grad_accum", "0",
            "--eval_every", str(max(1, steps // 10)), "--eval_batches", "20", "--log_every", "10",
            "--ckpt_every", "0", "--keep_ckpts", "1", "--samples", "0", "--no-progress",
            "--out_dir", str(work / "runs"), "--name", f"{preset}-{seed}-{side}", *flags]  # fmt: skip


def run(work: Path, preset: str, seed: int, side: str, *flags) -> dict:
    """One run from step 0; its evaluations and median tokens/s go to results/NAME.json, and
    its run directory (its checkpoint: 16 bytes a parameter) is removed."""
    from benchmarks.harness import median_steady, read_steps

    name = f"{preset}-{seed}-{side}"
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resume
    cmd = command(work, preset, seed, side, *flags)
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{name}: exit {out.returncode}: {out.stderr.strip()[-800:]}")
    log = (run_dir / "train.log").read_text()
    result = {
        "preset": preset, "seed": seed, "side": side, "command": shlex.join(cmd[1:]),
        "val": {int(s): float(v) for s, v in re.findall(r"\bstep (\d+) val_loss (\S+)", log)},
        "tok_s": median_steady(read_steps(run_dir / "train.log"), "tok/s", skip=3),
        "machine": machine_line(),
    }  # fmt: skip
    (work / "results").mkdir(exist_ok=True)
    (work / "results" / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def parting(bf16: dict[int, float], fp8: dict[int, float]) -> int | None:
    """The first evaluation step from which float8's loss stays beyond 1% of bf16's, or None
    where it ends within."""
    at = None
    for step in sorted(bf16.keys() & fp8.keys()):
        beyond = abs(fp8[step] / bf16[step] - 1) > TOLERANCE
        at = (at or step) if beyond else None
    return at


def decide(pairs: list[tuple[dict[int, float], dict[int, float]]]) -> str:
    """The rule of the module's docstring over one preset's pairs (bf16's and float8's
    validation losses by step, one pair a seed)."""
    if len(pairs) < 2:
        return f"undecided: {len(pairs)} seed(s) paired, the rule asks two at least"
    held = [abs(f[max(f)] / b[max(b)] - 1) <= TOLERANCE for b, f in pairs]
    return "within 1%: the claim stands" if all(held) else "NOT within 1%: the claim does not stand"


def report(work: Path) -> None:
    results = [json.loads(p.read_text()) for p in sorted((work / "results").glob("*.json"))]
    for r in results:  # JSON's keys are text
        r["val"] = {int(k): v for k, v in r["val"].items()}
    by = {(r["preset"], r["seed"], r["side"]): r for r in results}
    print(next((r["machine"] for r in results), machine_line()))
    for preset in PRESETS:
        rows, pairs = [], []
        for seed in sorted({s for p, s, _ in by if p == preset}):
            b, f = by.get((preset, seed, "bf16")), by.get((preset, seed, "float8"))
            if not (b and f) or max(b["val"]) != max(f["val"]):
                continue
            pairs.append((b["val"], f["val"]))
            last = max(b["val"])
            ratio = f["val"][last] / b["val"][last]
            part = parting(b["val"], f["val"])
            rows.append([seed, last, f"{b['val'][last]:.4f}", f"{f['val'][last]:.4f}", f"{ratio:.4f}",
                         "yes" if abs(ratio - 1) <= TOLERANCE else "NO", part or "-",
                         f"{b['tok_s']:,.0f}", f"{f['tok_s']:,.0f}"])  # fmt: skip
            curve = " ".join(f"{s}:{b['val'][s]:.3f}/{f['val'][s]:.3f}" for s in sorted(b["val"]))
            print(f"{preset} seed {seed}, validation loss bf16/float8 by step: {curve}")
        if rows:
            print(f"\n{preset}: `{by[(preset, rows[0][0], 'float8')]['command']}`\n")
            print(markdown_table(["seed", "step", "bf16 val", "float8 val", "ratio", "within 1%",
                                  "parts at", "bf16 tok/s", "float8 tok/s"], rows))  # fmt: skip
            print(f"\n{preset}: {decide(pairs)}\n")


def main() -> int:
    p = paired_runs_parser(__doc__, mb=60)
    p.add_argument("--preset", choices=list(PRESETS), default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--side", choices=SIDES, default=None)
    p.add_argument(
        "--float8-flags",
        default="--model.float8 tensorwise",
        help="the float8 side's flags (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=None, help="run: steps (default: the preset's)")
    p.add_argument("--flags", default="", help="run: flags both sides add last")  # fmt: skip
    args = p.parse_args()
    f8 = shlex.split(args.float8_flags)
    if args.what == "prepare":
        pack_python_text(args.work, args.tokenizer, args.mb)
    elif args.what == "plan":
        for preset in ("llama-350m", "llama-1b"):
            for seed in SEEDS:
                for side in SIDES:
                    print(f"python benchmarks/float8_quality.py run --work {args.work} "
                          f"--preset {preset} --seed {seed} --side {side}")  # fmt: skip
    elif args.what == "run":
        if None in (args.preset, args.seed, args.side):
            p.error("run needs --preset, --seed and --side")
        both = shlex.split(args.flags)
        print(run(args.work, args.preset, args.seed, args.side, f8, args.steps, both), flush=True)
    else:
        report(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
