"""Where a training step's time goes on the GPU, ours next to nanoGPT's, in one run.

    python benchmarks/profile_step.py --nanogpt PATH [--batch 12] [--ours-flags "..."]
    python benchmarks/profile_step.py --nanogpt PATH --as-shipped   # the preset's own step
    python benchmarks/profile_step.py --as-shipped --config configs/moe-1.8b-a320m.toml

Ours: the GPT-2 124M preset through `python -m pytrain.train --profile_steps 40:50` (the
real trainer: loader, guard, logging). nanoGPT: its model.py and bench.py's loop (random
ids on the device, fused AdamW, bf16 autocast, torch.compile), profiled over the same number
of steps after the same warm-up. Prints per-step device time by kernel category, the
device's idle time (step wall time minus busy time), and each side's top kernels."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import machine_line, markdown_table  # noqa: E402
from benchmarks.nanogpt import synthetic_dataset  # noqa: E402
from pytrain.train.profiling import StepProfiler, format_summary  # noqa: E402


def profile_ours(data: Path, out: Path, batch: int | None, flags: list[str],
                 config: str = "configs/gpt2-124m.toml") -> dict:  # fmt: skip
    """batch None: the preset as shipped (its batch and 32 micro-batches per step), steps
    5-7 of 8; otherwise one micro-batch of `batch` rows a step as bench.py, steps 40-50."""
    name = "profile-ours"
    if batch is None:
        shape = ["--max_steps", "8", "--profile_steps", "5:7"]
    else:
        shape = ["--max_steps", "60", "--profile_steps", "40:50", "--optim.grad_accum", "1",
                 "--data.batch_size", str(batch)]  # fmt: skip
    cmd = [
        sys.executable, "-m", "pytrain.train", "--config", str(ROOT / config),
        "--data.path", str(data), "--out_dir", str(out), "--name", name, "--no-resume",
        *shape, "--eval_every", "0", "--ckpt_every", "0",
        "--log_every", "1", "--samples", "0", "--no-progress", *flags,
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"our trainer failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads((out / name / "profile" / "summary.json").read_text())


def profile_nanogpt(peer: Path, batch: int, out: Path) -> dict:
    import torch

    sys.path.insert(0, str(peer))
    from model import GPT, GPTConfig  # nanoGPT's model.py

    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    # bench.py's configuration.
    cfg = GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0, bias=False)
    model = GPT(cfg).cuda()
    opt = model.configure_optimizers(
        weight_decay=1e-2, learning_rate=1e-4, betas=(0.9, 0.95), device_type="cuda"
    )
    model = torch.compile(model)
    x = torch.randint(50304, (batch, 1024), device="cuda")
    y = torch.randint(50304, (batch, 1024), device="cuda")
    prof = StepProfiler("20:30", out / "nanogpt-profile", torch.device("cuda"))
    for step in range(30):
        prof.before_step(step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()  # bench.py reads the loss every step
        prof.after_step(step + 1)
    return prof.summary or json.loads((out / "nanogpt-profile" / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--nanogpt", type=Path, help="nanoGPT's checkout (not with --as-shipped or --no-nanogpt)"
    )
    p.add_argument(
        "--config",
        default="configs/gpt2-124m.toml",
        help="our preset (the GPT-2 124M one, which nanoGPT's step matches)",
    )
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--ours-flags", default="", help="extra trainer flags, one shell string")
    p.add_argument("--no-nanogpt", action="store_true", help="profile ours only")
    p.add_argument(
        "--as-shipped",
        action="store_true",
        help="profile the preset's own step (its batch, 32 micro-batches; figures per "
        "optimizer step), ours only",
    )
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench")
    args = p.parse_args()
    print(machine_line(), flush=True)
    data = synthetic_dataset(args.work / "synthetic-50k", 40_000)
    t0 = time.perf_counter()
    batch = None if args.as_shipped else args.batch
    ours = profile_ours(data, args.work / "runs", batch, shlex.split(args.ours_flags),
                        args.config)  # fmt: skip
    if args.no_nanogpt or args.as_shipped:
        print(f"## ours {args.config} {args.ours_flags}\n\n{format_summary(ours)}")
        return 0
    if args.nanogpt is None:
        p.error("--nanogpt PATH (or --no-nanogpt)")
    theirs = profile_nanogpt(args.nanogpt, args.batch, args.work)
    print(f"profiled in {time.perf_counter() - t0:.0f}s")
    for name, s in (("ours " + args.ours_flags, ours), ("nanoGPT", theirs)):
        print(f"\n## {name}\n\n{format_summary(s)}")
    cats = sorted(set(ours["categories_ms"]) | set(theirs["categories_ms"]))
    rows = [[label, f"{ours[key]:.2f}", f"{theirs[key]:.2f}"]
            for key, label in (("step_ms", "step (wall)"), ("device_busy_ms", "device busy"),
                               ("device_idle_ms", "device idle"))]  # fmt: skip
    for c in cats:
        a, b = ours["categories_ms"].get(c, 0.0), theirs["categories_ms"].get(c, 0.0)
        rows.append([c, f"{a:.2f}", f"{b:.2f}"])
    print("\n" + markdown_table(["ms per step", "ours", "nanoGPT"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
