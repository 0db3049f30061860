"""GPU acceptance: the commands a user runs, run as a user runs them, on one GPU.

    PYTHONPATH=$PWD python scripts/gpu_acceptance.py [--work DIR] [--rows default,preset,...]

Rows (each a fresh run directory; the preset rows share one Inductor cache, as a user's
repeated runs of one preset would):
  default     `python -m pytrain.train` (the embedded default) from an empty cache, with
              its evaluation, samples and report
  preset      the GPT-2 124M preset on a packed dataset with a validation set: evaluation at
              least twice and a checkpoint, then a second invocation that resumes
  preset-ac   the same with --activation_checkpointing full
  preset-bucket  the same with --data.mode bucket
  preset-sigterm the preset stopped by SIGTERM mid-run (exit 143, a checkpoint at the stop
              step), then resumed by the same command; its note has both compile warm-ups
  torchrun    `torchrun --nproc_per_node=1` of the preset (DDP on one GPU), with resume
  fsdp-cpu-gpu  the embedded default under --fsdp on 2 CPU ranks (gloo) to a sharded
              checkpoint, resumed by `torchrun --nproc_per_node=1` on the GPU (resharded
              from 2 ranks to 1): the step count and the loss continue
  pack        `pack-shards` on real text (Python sources as JSONL) with a real tokenizer
              file, then training on it with evaluation
  llama-350m, llama-1b, llama-3b  the Llama presets, shortened: evaluation, a checkpoint,
              the resume, and the export, whose LlamaForCausalLM gives our logits, then
              3 steps of a new run `--init_from` the export (continued pretraining: its
              first loss is the trained model's); tokens/s and peak memory in the note
              (1B and 3B need an 80 GB GPU; 3B ~110 GB of disk)

Every row checks the exit codes, that validation losses were logged, that the second
invocation resumed and continued the step count, and that nothing went non-finite. The
preset rows change only the run length (--max_steps, --halt_after, --eval_every,
--ckpt_every) and --optim.grad_accum 2 (the preset's 16 would make a step 1 s). A
pass/fail table is printed last, and written to WORK/acceptance.md and .json."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pytrain.model.hf import LOGITS_TOLERANCE  # noqa: E402
from pytrain.train.cli import read_fallbacks, read_start_line  # noqa: E402
from pytrain.train.metrics import read_step_lines  # noqa: E402

PY = sys.executable
TRAIN = [PY, "-m", "pytrain.train", "--no-progress"]


@dataclass
class Row:
    name: str
    command: str
    ok: bool = False
    wall_s: float = 0.0
    steps: int = 0
    train_loss: float = math.nan
    val_loss: float = math.nan
    evals: int = 0
    resumed: str = "-"
    setup: str = "-"
    note: str = ""
    logs: list[str] = field(default_factory=list)


def run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str]:
    """Runs `cmd` with its output written to `log` as it comes (a row cut by a time limit
    leaves what it had done there); returns (exit code, output). One line per command on
    stdout, with its wall time, says how far a row got and where its time went."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                           env={**os.environ, **(env or {})})  # fmt: skip
    out = log.read_text().split("\n", 1)[1]
    wall = time.perf_counter() - t0
    with open(log, "a") as f:
        f.write(f"\n[exit {r.returncode} after {wall:.0f}s]\n")
    print(f"  {log.name}: exit {r.returncode} after {wall:.0f}s", flush=True)
    return r.returncode, out


def read_setup(out: str, row: Row) -> None:
    """What the trainer's start line says it chose: attention, the output layer's and the
    MLP's kernels, batch (rows x tokens x micro-batches), e.g. 'fa4, fp8 head, gelu fused,
    32x1024x2'."""
    if s := read_start_line(out):
        head = "fp8 head" if s["output_layer"] == "fp8" else ""
        row.setup = ", ".join(x for x in (s["attention"], head, s["mlp"], s["batch"]) if x)


def read_log(run_dir: Path, row: Row) -> None:
    """Steps, last train and validation loss, evaluations from runs/<name>/train.log."""
    text = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    # Lines are "<date> <time> step N loss X ..." and "<date> <time> step N val_loss X".
    steps = [int(s) for s in re.findall(r"\bstep (\d+) loss ", text)]
    losses = [float(x) for x in re.findall(r"\bstep \d+ loss (\S+)", text)]
    vals = [float(x) for x in re.findall(r"\bstep \d+ val_loss (\S+)", text)]
    row.steps = max(steps, default=0)
    row.train_loss = losses[-1] if losses else math.nan
    row.val_loss = vals[-1] if vals else math.nan
    row.evals = len(vals)
    if any(not math.isfinite(x) for x in losses + vals):
        row.note += "non-finite loss; "


def train_twice(row: Row, work: Path, args: list[str], first: int, total: int, launcher=None):
    """Two invocations of the same command: the first halts after `first` steps (a
    checkpoint), the second resumes and runs to `total`."""
    launcher = launcher or TRAIN
    cmd = [*launcher, *args, "--out_dir", str(work / "runs"), "--name", row.name,
           "--max_steps", str(total), "--halt_after", str(first)]  # fmt: skip
    row.command = " ".join(c if c != PY else "python" for c in cmd)
    # A fresh run directory: checkpoints of an earlier (perhaps interrupted) attempt would
    # be resumed by the first invocation.
    shutil.rmtree(work / "runs" / row.name, ignore_errors=True)
    t0 = time.perf_counter()
    rc1, out1 = run(cmd, work / f"{row.name}-1.log")
    rc2, out2 = run(cmd, work / f"{row.name}-2.log")
    row.wall_s = time.perf_counter() - t0
    read_log(work / "runs" / row.name, row)
    read_setup(out1, row)
    m = re.search(r"resumed from \S+ at step (\d+)", out2)
    row.resumed = f"at step {m.group(1)}" if m else "no"
    problems = []
    if rc1 or rc2:
        problems.append(f"exit codes {rc1}, {rc2}")
    if not m or int(m.group(1)) != first:
        problems.append(f"second run did not resume at step {first}")
    if row.steps != total:
        problems.append(f"last logged step {row.steps}, not {total}")
    if row.evals < 2:
        problems.append(f"{row.evals} evaluation(s)")
    for out in (out1, out2):
        if "Traceback" in out:
            problems.append("traceback in output")
        if "recompile(s) after warm-up" in out:
            problems.append("recompiles after warm-up")
        if "flex_attention called without torch.compile" in out:
            problems.append("uncompiled FlexAttention")
        problems += read_fallbacks(out)  # not run as configured: the row fails
    row.note += "; ".join(problems)
    row.ok = not problems and not row.note


def row_default(work: Path) -> Row:
    row = Row("default", "python -m pytrain.train")
    # A cache of its own, emptied: the other rows build the same dataset in theirs, and a
    # user's first run starts from none (run after them, this row once failed for that).
    cache = work / "cache-default"
    shutil.rmtree(cache, ignore_errors=True)
    env = {"PYTRAIN_CACHE": str(cache)}
    t0 = time.perf_counter()
    rc, out = run([*TRAIN, "--out_dir", str(work / "runs")], work / "default.log", env)
    row.wall_s = time.perf_counter() - t0
    read_log(work / "runs" / "default", row)
    read_setup(out, row)
    m = re.search(r"validation loss ([\d.]+) nats/token vs unigram baseline ([\d.]+)", out)
    problems = [f"exit code {rc}"] if rc else []
    if "building the embedded default dataset" not in out:
        problems.append("dataset not built from an empty cache")
    if not m or float(m.group(1)) >= float(m.group(2)):
        problems.append("validation loss not below the unigram baseline")
    if "--- sample 1 ---" not in out:
        problems.append("no samples")
    if "flex_attention called without torch.compile" in out or "Traceback" in out:
        problems.append("uncompiled FlexAttention or a traceback")
    problems += read_fallbacks(out)
    row.note = "; ".join(problems)
    row.ok = not problems and row.evals >= 2
    return row


def default_dataset(work: Path) -> tuple[Path, Path]:
    """The embedded default's train/val split (row `default` builds it)."""
    root = work / "cache" / "stdlib-bpe4096"
    if not (root / "val" / "manifest.json").exists():
        env = {"PYTRAIN_CACHE": str(work / "cache")}
        code = "from pytrain.data.corpus import build_default; build_default()"
        subprocess.run([PY, "-c", code], check=True, cwd=ROOT, env={**os.environ, **env})
    return root / "train", root / "val"


def preset_args(work: Path, *extra: str) -> list[str]:
    train, val = default_dataset(work)
    return ["--config", "configs/gpt2-124m.toml", "--data.path", str(train), "--data.val_path", str(val),
            "--optim.grad_accum", "2", "--compile.cache_dir", str(work / "inductor-cache"),
            "--samples", "1", *extra]  # fmt: skip


def row_preset(work: Path, name: str, *extra: str) -> Row:
    row = Row(name, "")
    args = preset_args(
        work, "--eval_every", "10", "--ckpt_every", "20", "--eval_batches", "4", *extra
    )
    train_twice(row, work, args, first=20, total=40)
    return row


def row_sigterm(work: Path) -> Row:
    """The preset stopped by SIGTERM (what Slurm and Kubernetes send) once it trains: exit
    143, a checkpoint at the stop step, one line saying so; the same command resumes there
    and finishes. Also the warm restart: the compile warm-up of both invocations (the
    second loads the first's cache artifacts)."""
    row = Row("preset-sigterm", "")
    args = preset_args(work, "--eval_every", "10", "--ckpt_every", "1000", "--eval_batches", "4")
    run_dir = work / "runs" / row.name
    cmd = [*TRAIN, *args, "--out_dir", str(work / "runs"), "--name", row.name, "--max_steps", "40"]
    row.command = " ".join(c if c != PY else "python" for c in cmd) + " (SIGTERM at step >= 12)"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    with open(work / f"{row.name}-1.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        while p.poll() is None:
            text = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
            if max((int(s) for s in re.findall(r"\bstep (\d+) loss ", text)), default=0) >= 12:
                p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
        rc1 = p.wait()
    out1 = (work / f"{row.name}-1.log").read_text()
    rc2, out2 = run(cmd, work / f"{row.name}-2.log")
    row.wall_s = time.perf_counter() - t0
    read_log(run_dir, row)
    read_setup(out1, row)
    stop = re.search(r"stopped at step (\d+) by SIGTERM; checkpoint (\S+);", out1)
    m = re.search(r"resumed from \S+ at step (\d+)", out2)
    row.resumed = f"at step {m.group(1)}" if m else "no"
    warm = [
        f"{x}s" for x in re.findall(r"compile warm-up: \d+ shape\(s\) in ([\d.]+)s", out1 + out2)
    ]
    row.note = f"stopped at step {stop.group(1) if stop else '?'}; warm-up {' then '.join(warm)}; "
    problems = [] if rc1 == 143 else [f"first exit {rc1}, not 143"]
    problems += [] if rc2 == 0 else [f"second exit {rc2}"]
    if not stop or not Path(stop.group(2)).is_file():
        problems.append("no stop line with its checkpoint")
    elif not m or m.group(1) != stop.group(1):
        problems.append("second run did not resume at the stop step")
    if row.steps != 40 or "Traceback" in out1 + out2:
        problems.append(f"last step {row.steps}, or a traceback")
    problems += read_fallbacks(out1) + read_fallbacks(out2)
    row.note += "; ".join(problems)
    row.ok = not problems
    return row


def row_torchrun(work: Path) -> Row:
    row = Row("torchrun", "")
    launcher = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                "-m", "pytrain.train", "--no-progress"]  # fmt: skip
    args = preset_args(work, "--eval_every", "10", "--ckpt_every", "20", "--eval_batches", "4")
    train_twice(row, work, args, first=20, total=40, launcher=launcher)
    return row


def row_fsdp_cpu_gpu(work: Path) -> Row:
    row = Row("fsdp-cpu-gpu", "")
    train, val = default_dataset(work)
    launcher = [PY, "-m", "torch.distributed.run", "--standalone"]
    args = ["-m", "pytrain.train", "--no-progress", "--fsdp", "--data.path", str(train),
            "--data.val_path", str(val), "--optim.master_weights", "off", "--samples", "0", "--log_every", "1",
            "--eval_every", "10", "--eval_batches", "4", "--ckpt_every", "20",
            "--out_dir", str(work / "runs"), "--name", row.name, "--max_steps", "40"]  # fmt: skip
    cpu = [*launcher, "--nproc_per_node=2", *args, "--device", "cpu", "--halt_after", "20"]
    gpu = [*launcher, "--nproc_per_node=1", *args]
    row.command = (
        " ".join(c if c != PY else "python" for c in cpu) + "; then on the GPU with 1 rank"
    )
    run_dir = work / "runs" / row.name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    rc1, out1 = run(cpu, work / f"{row.name}-1.log", {"OMP_NUM_THREADS": "4"})
    rc2, out2 = run(gpu, work / f"{row.name}-2.log")
    row.wall_s = time.perf_counter() - t0
    read_log(run_dir, row)
    read_setup(out2, row)
    m = re.search(r"resumed from \S+ at step (\d+)", out2)
    row.resumed = f"at step {m.group(1)}" if m else "no"
    text = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    losses = {int(s): float(x) for s, x in re.findall(r"\bstep (\d+) loss (\S+)", text)}
    problems = [f"exit codes {rc1}, {rc2}"] if rc1 or rc2 else []
    if not (run_dir / "ckpt-00000020" / ".metadata").is_file():
        problems.append("no sharded checkpoint at step 20")
    if "resuming a run saved on 2 rank(s) on 1" not in out2 or not m or m.group(1) != "20":
        problems.append("the GPU run did not resume the 2-rank checkpoint at step 20")
    if "Traceback" in out1 + out2:
        problems.append("traceback in output")
    if {1, 20, 21, 40} <= losses.keys():
        # The loss continues where the CPU left it (a model or optimizer state not loaded
        # would start again near the first step's loss).
        row.note = f"loss {losses[1]:.2f} at 1, {losses[20]:.2f} at 20 (CPU), {losses[21]:.2f} at 21 (GPU); "
        if abs(losses[21] - losses[20]) > 0.1 * losses[20] or losses[40] >= losses[20]:
            problems.append("the loss did not continue")
    else:
        problems.append(f"steps logged: {sorted(losses)[:3]}...{sorted(losses)[-3:]}")
    row.note = (row.note + "; ".join(problems)).rstrip("; ")
    row.ok = not problems
    return row


def row_pack(work: Path) -> Row:
    """Real text: the Python sources installed on this machine (site-packages), as JSONL
    (one file a document), packed with the embedded default's tokenizer.json (trained by
    `tokenizers`, a real Hugging Face file), then a run of the default model on it."""
    row = Row("pack", "")
    site = Path(sysconfig.get_paths()["purelib"])
    raw = work / "realtext"
    raw.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in site.rglob("*.py") if 0 < p.stat().st_size < 200_000)
    total = 0
    with open(raw / "train.jsonl", "w") as tr, open(raw / "val.jsonl", "w") as va:
        for i, p in enumerate(files):
            text = p.read_text(encoding="utf-8", errors="replace")
            (va if i % 50 == 0 else tr).write(json.dumps({"text": text, "path": str(p)}) + "\n")
            total += len(text)
            if total > 40_000_000:
                break
    tok = default_dataset(work)[0].parent / "tokenizer.json"
    t0 = time.perf_counter()
    packs = []
    for split in ("train", "val"):
        cmd = [PY, "-m", "pytrain.pack_shards", str(raw / f"{split}.jsonl"), "-o", str(work / "packed" / split),
               "--tokenizer", str(tok), "--overwrite", "--no-progress"]  # fmt: skip
        packs.append(run(cmd, work / f"pack-{split}.log"))
    row.note = "; ".join(f"pack exit {rc}" for rc, _ in packs if rc)
    args = ["--data.path", str(work / "packed" / "train"), "--data.val_path", str(work / "packed" / "val"),
            "--eval_every", "20", "--ckpt_every", "30", "--samples", "1"]  # fmt: skip
    train_twice(row, work, args, first=30, total=60)
    row.wall_s = time.perf_counter() - t0  # packing included
    m = re.search(r"packed ([\d,]+) documents .* ([\d,]+) tokens from ([\d.,]+) MB", packs[0][1])
    if m:
        row.command = f"pack-shards ({m.group(1)} docs, {m.group(3)} MB) + " + row.command
    return row


# Run by row llama-1b in a process of its own: our model from the run's checkpoint and
# transformers' from the export, both in fp32 on the CPU (no TF32 or kernel choices between
# them), on the same ids.
LOGITS_CHECK = """
import sys, torch, transformers
from pytrain.model.load import load
run, out = sys.argv[1], sys.argv[2]
ours = load(run).gpt.float().eval()
theirs = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
ids = torch.randint(0, ours.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    a, b = ours(ids).float(), theirs(ids).logits
print(f"class {type(theirs).__name__} max_abs_diff {(a - b).abs().max().item():.3g} "
      f"max_abs_logit {a.abs().max().item():.3g}")
"""


def row_llama(work: Path, preset: str) -> Row:
    """configs/<preset>.toml as shipped, shortened (the embedded default's data and
    tokenizer, so a vocabulary of 4096; 2 micro-batches a step): evaluation, a
    checkpoint, the resume, then `python -m pytrain.export` of the run, loaded by
    transformers as LlamaForCausalLM with logits equal to ours, and a new run from that
    export (`--init_from`, continued()). The note has the steady
    tokens/s and the peak GPU memory. Its checkpoints (with AdamW's state: ~16 GB at 1B,
    ~51 GB at 3B, and two exist while the last is written) are deleted at the end."""
    row = Row(preset, "")
    train, val = default_dataset(work)
    args = ["--config", f"configs/{preset}.toml", "--data.path", str(train), "--data.val_path", str(val),
            "--optim.grad_accum", "2", "--compile.cache_dir", str(work / "inductor-cache"),
            "--samples", "1", "--eval_every", "5", "--ckpt_every", "10", "--eval_batches", "4",
            "--keep_ckpts", "1", "--log_every", "1"]  # fmt: skip
    train_twice(row, work, args, first=10, total=20)
    run_dir, hf = work / "runs" / row.name, work / f"{preset}-hf"
    log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    speed = [x["tok/s"] for x in read_step_lines(log)][-5:]
    peak = re.findall(r"peak GPU memory ([\d.]+) GB", (work / f"{row.name}-2.log").read_text())
    shutil.rmtree(hf, ignore_errors=True)
    rc, _ = run([PY, "-m", "pytrain.export", str(run_dir), str(hf)], work / f"{preset}-export.log")
    rc2, out = run([PY, "-c", LOGITS_CHECK, str(run_dir), str(hf)], work / f"{preset}-logits.log")
    m = re.search(r"class (\w+) max_abs_diff (\S+) max_abs_logit (\S+)", out)
    problems = [row.note] if row.note else []
    if rc or rc2 or not m:
        problems.append(f"export exit {rc}, logits check exit {rc2}")
    elif m.group(1) != "LlamaForCausalLM" or float(m.group(2)) > LOGITS_TOLERANCE:
        problems.append(f"export: {m.group(1)}, logits differ by {m.group(2)}")
    problems += continued(work, preset, args, hf, row.train_loss)
    figures = (f"{sorted(speed)[len(speed) // 2]:,.0f} tok/s (median of the last {len(speed)} lines)"
               if speed else "no tok/s")  # fmt: skip
    figures += f", peak {peak[-1]} GB allocated" if peak else ""
    if problems:
        row.note = "; ".join(problems)
    else:
        row.note = (f"{figures}; export: LlamaForCausalLM, logits within {m.group(2)} "
                    f"(of up to {m.group(3)})")  # fmt: skip
    row.ok = row.ok and not problems
    for ckpt in run_dir.glob("ckpt-*"):
        shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(work / "runs" / f"{preset}-continued", ignore_errors=True)
    return row


def continued(work: Path, preset: str, args: list[str], hf: Path, trained_loss: float) -> list[str]:
    """Continued pretraining from the export (`--init_from`, the compiled GPU path): a new
    run of 3 steps whose first loss is the trained model's, well below a random
    initialisation's ln(vocabulary). Problems, as one-line strings."""
    name = f"{preset}-continued"
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    cmd = [*TRAIN, *args, "--init_from", str(hf), "--out_dir", str(work / "runs"), "--name", name,
           "--max_steps", "3", "--eval_every", "0", "--samples", "0", "--ckpt_every", "0"]  # fmt: skip
    rc, out = run(cmd, work / f"{name}.log")
    log = work / "runs" / name / "train.log"
    first = read_step_lines(log.read_text())[:1] if log.exists() else []
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"] if hf.exists() else 0
    if rc or "weights from" not in out or not first:
        return [f"--init_from the export: exit {rc}"]
    if not first[0]["loss"] < math.log(vocab) - 1.0:
        return [f"--init_from the export: first loss {first[0]['loss']:.3f} (trained "
                f"{trained_loss:.3f}, a random start ~{math.log(vocab):.2f})"]  # fmt: skip
    return []


ROWS = {
    "default": row_default,
    "preset": lambda w: row_preset(w, "preset"),
    "preset-ac": lambda w: row_preset(w, "preset-ac", "--activation_checkpointing", "full"),
    "preset-bucket": lambda w: row_preset(
        w,
        "preset-bucket",
        "--data.mode",
        "bucket",
        "--data.bucket_lengths",
        "256",
        "512",
        "1024",
        "--data.token_budget",
        "16384",
    ),  # fmt: skip
    "preset-sigterm": row_sigterm,
    "torchrun": row_torchrun,
    "fsdp-cpu-gpu": row_fsdp_cpu_gpu,
    "pack": row_pack,
    "llama-350m": lambda w: row_llama(w, "llama-350m"),
    "llama-1b": lambda w: row_llama(w, "llama-1b"),
    "llama-3b": lambda w: row_llama(w, "llama-3b"),
}


def table(rows: list[Row]) -> str:
    lines = [
        "| row | result | wall s | setup | steps | train loss | val loss | evals | resumed | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {'PASS' if r.ok else 'FAIL'} | {r.wall_s:.0f} | {r.setup} | {r.steps} | {r.train_loss:.4f} | "
            f"{r.val_loss:.4f} | {r.evals} | {r.resumed} | {r.note or '-'} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("runs/acceptance"),
        help="scratch directory (emptied runs)",
    )
    p.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}"
    )
    args = p.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.rows.split(","):
        t0 = time.perf_counter()
        try:
            row = ROWS[name](work)
        except Exception as e:  # a broken row is a failed row, the others still run
            row = Row(name, "", note=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - t0)
        rows.append(row)
        print(
            f"[{name}] {'PASS' if row.ok else 'FAIL'} in {row.wall_s:.0f}s {row.note}", flush=True
        )
        (work / "acceptance.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    import torch

    head = f"GPU acceptance, {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, torch {torch.__version__}"
    text = (
        head
        + "\n\n"
        + table(rows)
        + "\n\ncommands:\n"
        + "\n".join(f"- {r.name}: `{r.command}`" for r in rows)
    )
    (work / "acceptance.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
