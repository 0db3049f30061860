"""Time to quality on one GPU: nanoGPT's train.py against ours (AdamW, Muon) on the same
token ids, the same model size and tokens per optimizer step, the same wall-clock budget,
evaluated by one procedure on the same held-out tokens.

    python benchmarks/time_to_quality.py prepare --work W --tokenizer gpt2.json
    python benchmarks/time_to_quality.py run {nanogpt,adamw,muon,adamw-unfused,adamw-plain} --work W [--nanogpt PEER]
    python benchmarks/time_to_quality.py eval {nanogpt,adamw,muon,adamw-unfused,adamw-plain} --work W [--nanogpt PEER]
    python benchmarks/time_to_quality.py report --results DIR --png curves.png

prepare: the Python sources installed on this machine (benchmarks/harness.py; every 50th file
held out) become two pack-shards datasets with one GPT-2 BPE, and nanoGPT's train.bin /
val.bin are written from the same documents' token ids (each ending in <|endoftext|>).

run: each trainer starts as a fresh process and is killed when the budget (wall clock from
its launch: imports, compile and everything) is over. All runs: 524,288 tokens per step
(nanoGPT 16 x 1,024 x 32 micro-batches, ours the preset's own, 32 x 1,024 x 16), peak lr
6e-4 (AdamW) with 30 warm-up steps and cosine decay to 10%
at step 300. Snapshots of the weights every 20 steps, with the wall time they were taken
at: nanoGPT's own checkpoint save writes the model only (no 1.5 GB optimizer file in its
loop); ours write their usual checkpoints (in the background). Ours run the GPT-2 preset
(configs/gpt2-124m.toml) without Inductor's coordinate-descent tuning (two more minutes of
compile, for long runs).

eval: every snapshot of a run, on the same 256 windows of 1,024 held-out tokens spread over
val.bin, mean cross-entropy of all next-token predictions; nanoGPT's model with its causal
attention, ours with the document masking it trained with (documents split at
<|endoftext|>). One JSON per run.

report: the table (loss at the end; time to reach nanoGPT's final loss) and one PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table, python_sources  # noqa: E402

STEPS, WARMUP, EVERY = 300, 30, 20
BATCH, SEQ, ACCUM = 16, 1024, 32
LR, MIN_LR = 6e-4, 6e-5
WINDOWS = 256
NAMES = {
    "nanogpt": "nanoGPT train.py (AdamW)",
    "adamw": "ours, AdamW",
    "muon": "ours, Muon",
    # The preset with its GELU unfused (--model.fused_gelu off): whether the cuBLASLt
    # epilogues change the loss reached in the same time (BENCHMARKS.md, "Time to quality").
    "adamw-unfused": "ours, AdamW, GELU unfused",
    # Neither the FP8 output layer nor the fused GELU: plain bf16 matmuls, the reference
    # against which the preset's two shortcuts must not cost loss at equal steps.
    "adamw-plain": "ours, AdamW, bf16 output layer, GELU unfused",
}


def prepare(work: Path, tokenizer: Path, max_mb: int) -> None:
    from pytrain.data.documents import read_all_documents

    if (work / "val.bin").exists():
        print("prepared already:", work)
        return
    work.mkdir(parents=True, exist_ok=True)
    files = {"train": open(work / "train.jsonl", "w"), "val": open(work / "val.jsonl", "w")}
    n = 0
    for n, (_, text) in enumerate(python_sources(max_mb << 20)):
        files["val" if n % 50 == 49 else "train"].write(json.dumps({"text": text}) + "\n")
    for f in files.values():
        f.close()
    print(f"{n + 1} source files", flush=True)
    if n + 1 < 50:
        for split in files:  # only what this call wrote: nothing usable
            (work / f"{split}.jsonl").unlink()
        sys.exit(f"prepare: {n + 1} source files in {max_mb} MB, fewer than the 50 that hold "
                 "one out for validation; raise --mb")  # fmt: skip
    for split in ("train", "val"):
        subprocess.run(
            [sys.executable, "-m", "pytrain.pack_shards", str(work / f"{split}.jsonl"),
             "--tokenizer", str(tokenizer), "-o", str(work / split), "--no-progress"],
            check=True,
        )  # fmt: skip
        docs = read_all_documents(work / split)
        ids = np.concatenate(docs)
        assert ids.max() < 65536
        ids.astype(np.uint16).tofile(work / f"{split}.bin")
        print(f"{split}: {len(docs):,} documents, {len(ids):,} tokens", flush=True)


def run(which: str, work: Path, peer: Path, budget: float, extra: list[str]) -> None:
    out = (work / which).resolve()  # absolute: nanoGPT runs in its own directory
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.time()
    if which == "nanogpt":
        data = peer / "data" / "ttq"
        data.mkdir(parents=True, exist_ok=True)
        for split in ("train", "val"):
            link = data / f"{split}.bin"
            link.unlink(missing_ok=True)
            link.symlink_to((work / f"{split}.bin").resolve())
        cmd = [
            sys.executable, "-c", NANOGPT_WRAPPER, str(t0), str(out / "snapshots"),
            "--dataset=ttq", f"--batch_size={BATCH}", f"--block_size={SEQ}",
            f"--gradient_accumulation_steps={ACCUM}", f"--max_iters={STEPS}",
            f"--lr_decay_iters={STEPS}", f"--warmup_iters={WARMUP}", f"--learning_rate={LR}",
            f"--min_lr={MIN_LR}", f"--eval_interval={EVERY}", "--eval_iters=10",
            "--log_interval=10", f"--out_dir={out}", "--compile=True", "--always_save_checkpoint=True",
        ]  # fmt: skip
        cwd = peer
    else:
        cmd = [
            sys.executable, "-m", "pytrain.train", "--config", str(ROOT / "configs/gpt2-124m.toml"),
            "--data.path", str(work / "train"), "--data.val_path", str(work / "val"),
            "--out_dir", str(out.parent), "--name", which, "--no-resume", "--max_steps", str(STEPS),
            "--optim.warmup_steps", str(WARMUP), "--optim.lr", str(LR), "--optim.min_lr_ratio", "0.1",
            "--eval_every", "0", "--ckpt_every", str(EVERY), "--keep_ckpts", "1000", "--samples", "0",
            "--no-progress", "--no-compile.coordinate_descent", "--log_every", "10",
        ]  # fmt: skip
        if which == "muon":
            # Keller Jordan's GPT-2 speedrun settings for Muon (record 3): Muon at 0.02 for
            # the blocks, AdamW at 0.0036 for the (tied) embedding.
            cmd += ["--optim.name", "muon", "--optim.muon_lr", "0.02", "--optim.lr", "0.0036"]
        if which in ("adamw-unfused", "adamw-plain"):
            cmd += ["--model.fused_gelu", "off"]
        if which == "adamw-plain":
            cmd += ["--model.float8_head", "off"]
        cwd = ROOT
    cmd += extra
    log = open(out / "stdout.log", "w")
    p = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        p.wait(timeout=budget - (time.time() - t0))
        ended = f"finished (rc {p.returncode})"
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        ended = "killed at the budget"
    (out / "run.json").write_text(
        json.dumps(
            {
                "which": which,
                "t0": t0,
                "budget_s": budget,
                "ended": ended,
                "wall_s": time.time() - t0,
                "cmd": cmd,
                "machine": machine_line(),
            },
            indent=1,
        )  # fmt: skip
    )
    print(f"{which}: {ended} after {time.time() - t0:.0f}s", flush=True)


# nanoGPT's train.py as it is, with torch.save replaced by a snapshot of the weights and the
# wall time since launch (argv: t0, snapshot dir, then train.py's own flags).
NANOGPT_WRAPPER = """
import os, runpy, sys, time, torch
t0, snaps = float(sys.argv[1]), sys.argv[2]
del sys.argv[1:3]
os.makedirs(snaps, exist_ok=True)
real_save = torch.save
def snapshot(ckpt, path, *a, **k):
    wall = time.time() - t0
    real_save({"model": ckpt["model"], "model_args": ckpt["model_args"], "step": ckpt["iter_num"],
               "wall_s": wall}, os.path.join(snaps, f"snap-{ckpt['iter_num']:05d}.pt"))
torch.save = snapshot
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def snapshots(which: str, work: Path) -> list[tuple[int, float | None, Path]]:
    """(step, wall seconds since launch, file) of a run's snapshots; nanoGPT's carry their
    wall time inside (None here)."""
    out = work / which
    t0 = json.loads((out / "run.json").read_text())["t0"]
    if which == "nanogpt":
        return [
            (int(f.stem.split("-")[1]), None, f)
            for f in sorted((out / "snapshots").glob("snap-*.pt"))
        ]
    log = (out / "train.log").read_text()
    found: list[tuple[int, float | None, Path]] = []
    for stamp, path in re.findall(r"^(\S+ \S+) checkpoint (\S+)", log, re.M):
        wall = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp() - t0
        step = int(re.search(r"ckpt-(\d+)\.pt", path).group(1))
        found.append((step, wall, Path(path)))
    return found


def windows(work: Path, device) -> tuple:
    import torch

    val = np.fromfile(work / "val.bin", dtype=np.uint16).astype(np.int64)
    starts = np.linspace(0, len(val) - SEQ - 1, WINDOWS).astype(np.int64)
    x = torch.from_numpy(np.stack([val[s : s + SEQ + 1] for s in starts])).to(device)
    return x[:, :-1], x[:, 1:]


def doc_ids_and_positions(inputs, eos: int):
    """Documents of each window split after <|endoftext|> (the token ends its document),
    and their positions as the trainer derives them from document ids."""
    import torch

    from pytrain.data.batch import position_ids

    ends = (inputs == eos).int()
    doc = (torch.cumsum(ends, dim=1) - ends).int()  # the eos belongs to the document it ends
    return doc, position_ids(doc)


def evaluate(which: str, work: Path, peer: Path) -> None:
    import torch
    import torch.nn.functional as F

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs, targets = windows(work, device)
    results = []
    for step, wall, path in snapshots(which, work):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if which == "nanogpt":
            sys.path.insert(0, str(peer))
            from model import GPT as NanoGPT  # noqa: E402
            from model import GPTConfig

            model = NanoGPT(GPTConfig(**state["model_args"]))
            sd = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()}
            model.load_state_dict(sd)
            wall = state["wall_s"]

            def logits_of(x, model=model):
                x = x.contiguous()
                return model(x, x)[0]  # with targets: logits at every position
        else:
            from pytrain.model.load import load

            loaded = load(path, device)
            model, eos = loaded.gpt, loaded.eos_id

            def logits_of(x, model=model, eos=eos):
                doc, pos = doc_ids_and_positions(x, eos)
                return model(x, pos, model.make_mask(doc, "sdpa_mask"))

        model.to(device).eval()
        total = 0.0
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            for i in range(0, WINDOWS, 16):
                logits = logits_of(inputs[i : i + 16])[..., :50257].float()
                total += F.cross_entropy(
                    logits.flatten(0, 1), targets[i : i + 16].flatten(), reduction="sum"
                ).item()
        loss = total / targets.numel()
        results.append({"step": step, "wall_s": wall, "val_loss": loss})
        print(f"{which} step {step} at {wall:.0f}s: {loss:.4f}", flush=True)
        del model, state
        torch.cuda.empty_cache()
    run_info = json.loads((work / which / "run.json").read_text())
    out = {"which": which, "name": NAMES[which],
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "run": run_info, "points": results}  # fmt: skip
    (work / f"ttq-{which}.json").write_text(json.dumps(out, indent=1))


def equal_steps(runs: dict, every: int = 100) -> str:
    """The preset as shipped (adamw) against its variants without the FP8 output layer or
    the fused GELU (adamw-plain, adamw-unfused) at the same steps: their validation losses
    and the ratio shipped / variant (the shortcuts must not cost loss). Every
    `every` steps both have and the last one; empty where adamw or no variant ran."""
    shipped = {p["step"]: p["val_loss"] for p in runs.get("adamw", {}).get("points", [])}
    variants = [w for w in ("adamw-plain", "adamw-unfused") if w in runs]
    other = {w: {p["step"]: p["val_loss"] for p in runs[w]["points"]} for w in variants}
    common = sorted(set(shipped).intersection(*other.values())) if variants else []
    if not common:
        return ""
    headers = ["step", runs["adamw"]["name"]]
    for w in variants:
        headers += [runs[w]["name"], "shipped / it"]
    rows = []
    for step in [s for s in common if s % every == 0 or s == common[-1]]:
        cells = [step, f"{shipped[step]:.4f}"]
        for w in variants:
            cells += [f"{other[w][step]:.4f}", f"{shipped[step] / other[w][step]:.4f}"]
        rows.append(cells)
    names = ", ".join(runs[w]["name"] for w in variants)
    return f"\nat equal steps: the preset as shipped against {names}\n" + markdown_table(
        headers, rows
    )


def crossing(points: list[dict], target: float) -> float | None:
    """Wall time at which the loss first reaches `target` (linear between snapshots)."""
    prev = None
    for p in points:
        if p["val_loss"] <= target:
            if prev is None:
                return p["wall_s"]
            a, b = prev, p
            f = (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            return a["wall_s"] + f * (b["wall_s"] - a["wall_s"])
        prev = p
    return None


def report(results: Path, png: Path | None) -> None:
    runs = {}
    for which in NAMES:
        f = results / f"ttq-{which}.json"
        if f.exists():
            runs[which] = json.loads(f.read_text())
    base = runs.get("nanogpt")
    target = base["points"][-1]["val_loss"] if base else math.nan
    t_base = crossing(base["points"], target) if base else None
    for machine in dict.fromkeys(
        r["run"].get("machine", "machine: not recorded") for r in runs.values()
    ):
        print(machine)  # where the runs were measured (run.json), not where this report is made
    print(f"target: nanoGPT's final validation loss {target:.4f} (reached at {t_base or 0:.0f}s)")
    rows = []
    for r in runs.values():
        pts = r["points"]
        t = crossing(pts, target)
        ratio = f"{t / t_base:.2f}x" if t and t_base else "-"
        when = f"{t:.0f} s" if t else "not reached"
        rows.append(
            [r["name"], len(pts), pts[-1]["step"], f"{pts[-1]['val_loss']:.4f}", when, ratio]
        )
    headers = ["run", "snapshots", "last step", "final val loss", "time to nanoGPT's final loss",
               "vs nanoGPT"]  # fmt: skip
    print(markdown_table(headers, rows))
    if table := equal_steps(runs):
        print(table)
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in runs.values():
            pts = r["points"]
            ax.plot(
                [p["wall_s"] for p in pts],
                [p["val_loss"] for p in pts],
                marker="o",
                ms=3,
                label=r["name"],
            )
        if base:
            ax.axhline(target, color="gray", lw=0.8, ls="--", label="nanoGPT's final loss")
        ax.set_xlabel("wall time since launch (s), compile included")
        ax.set_ylabel("validation loss (same 262k held-out tokens)")
        dev = next(iter(runs.values()))["device"] if runs else ""
        ax.set_title(f"GPT-2 124M class, 0.5M tokens/step, {dev}")
        ax.set_ylim(top=min(7.5, ax.get_ylim()[1]))
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        print("plot:", png)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--work", type=Path, required=True)
    a.add_argument("--tokenizer", type=Path, required=True)
    a.add_argument("--mb", type=int, default=400)
    for name in ("run", "eval"):
        a = sub.add_parser(name)
        a.add_argument("which", choices=list(NAMES))
        a.add_argument("--work", type=Path, required=True)
        a.add_argument("--nanogpt", type=Path, default=ROOT / "peers" / "nanoGPT")
        a.add_argument("--budget", type=float, default=480.0)
    a = sub.add_parser("report")
    a.add_argument("--results", type=Path, required=True)
    a.add_argument("--png", type=Path, default=None)
    args, extra = p.parse_known_args()  # run: further flags go to the trainer (smoke tests)
    if extra and args.cmd != "run":
        p.error(f"unknown arguments {extra}")
    if args.cmd != "report":  # the report names the machine its runs were measured on
        print(machine_line(), flush=True)
    if args.cmd == "prepare":
        prepare(args.work, args.tokenizer, args.mb)
    elif args.cmd == "run":
        run(args.which, args.work, args.nanogpt.resolve(), args.budget, extra)
    elif args.cmd == "eval":
        evaluate(args.which, args.work, args.nanogpt.resolve())
    else:
        report(args.results, args.png)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
