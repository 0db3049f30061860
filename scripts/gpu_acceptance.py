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
              a new run `--init_from` the export (continued pretraining: its first loss
              is the trained model's; ended once that is logged); tokens/s and peak memory in the note
              (1B and 3B need an 80 GB GPU; 3B ~110 GB of disk)
  moe         configs/moe-1.8b-a320m.toml the same way, as shipped: its export (sigmoid
              scores, the balancing bias) is a Glm4MoeForCausalLM with our logits

Rows run only where --rows names them (the default rows run on one 80 GB GPU); where the
host lacks what a row needs, it fails at once, saying so:
  olmoe       configs/olmoe-1b-7b.toml the same way, its export an OlmoeForCausalLM with
              our logits; needs a GPU of 120 GiB or more (a 141 GB H200) and ~150 GB of
              disk (a checkpoint is 55 GB, two exist while the second is written, and the
              fp32 export is 28 GB)
  llama-8b    configs/llama-8b.toml under `torchrun --standalone --nproc_per_node 4`
              (FSDP2), shortened: synthetic ids at Llama 3's vocabulary, 4 micro-batches a
              rank, evaluation, a checkpoint (~64 GB), the resume, the export and its
              logits, then the first step of a new 4-rank run `--init_from` the export; tokens/s
              and peak memory in the note; ~160 GB of disk at its peak
  two-agent   HSDP as two nodes run it: two torchrun agents of 2 GPUs each (c10d
              rendezvous on this host) train configs/llama-1b.toml shortened (its own
              attention, FA4, deterministic under --deterministic); then the same job with
              one rank killed by SIGKILL after a checkpoint: both agents restart it
              (--max-restarts 1) and the losses after its resume are the uninterrupted
              job's bit for bit

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
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import children, failure_line, kill_tree  # noqa: E402
from pytrain.model.hf import LOGITS_TOLERANCE  # noqa: E402
from pytrain.train.cli import read_fallbacks, read_peak_memory, read_start_line  # noqa: E402
from pytrain.train.metrics import read_step_lines  # noqa: E402

PY = sys.executable
TRAIN = [PY, "-m", "pytrain.train", "--no-progress"]
TORCHRUN = [PY, "-m", "torch.distributed.run"]
MULTI_GPU = ("llama-8b", "two-agent", "olmoe")
"""The rows that need more than one 80 GB GPU: not in --rows' default."""
OLMOE_GIB = 120
"""GPU memory the olmoe row needs (its plan, configs/olmoe-1b-7b.toml: 77 GiB of training
state, activations and the allocator's slack)."""
VOCAB = 128256
"""Llama 3's vocabulary: the multi-GPU rows' synthetic ids, as the Llama presets train."""


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


def run(cmd: list[str], log: Path, env: dict | None = None, done=None) -> tuple[int, str]:
    """Runs `cmd` with its output written to `log` as it comes (a row cut by a time limit
    leaves what it had done there); returns (exit code, output). One line per command on
    stdout, with its wall time, says how far a row got and where its time went. `done`: a
    check made every half second; once it holds, what the row needed of the command has
    happened, and the command and every process under it are killed and waited for (exit
    code 0 returned), e.g. a run whose first steps are all a row reads, so its end's
    checkpoint is not waited for, nor its GPUs still held when the next command starts."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                             env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
        stopped = False
        while p.poll() is None:
            if done is not None and done():
                # torchrun's agent and its ranks, each in a process group of its own
                kill_tree(p.pid)
                p.wait()
                stopped = True
            time.sleep(0.5)
    rc = 0 if stopped else p.returncode
    out = log.read_text().split("\n", 1)[1]
    wall = time.perf_counter() - t0
    with open(log, "a") as f:
        f.write(f"\n[exit {rc} after {wall:.0f}s{', stopped once done' if stopped else ''}]\n")
    print(f"  {log.name}: exit {rc} after {wall:.0f}s{' (stopped once done)' if stopped else ''}",
          flush=True)  # fmt: skip
    return rc, out


def read_setup(out: str, row: Row) -> None:
    """What the trainer's start line says it chose: attention, the output layer's and the
    MLP's kernels, batch (rows x tokens x micro-batches), e.g. 'fa4, fp8 head, gelu fused,
    32x1024x2'."""
    if s := read_start_line(out):
        head = "fp8 head" if s["output_layer"] == "fp8" else ""
        row.setup = ", ".join(x for x in (s["attention"], head, s["mlp"], s["batch"]) if x)


def train_log(run_dir: Path) -> str:
    """runs/<name>/train.log's text ('' before the run writes it)."""
    return (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""


def step_losses(run_dir: Path) -> dict[int, float]:
    """Each logged step's exact loss (`loss_exact`); a step logged again after a resume
    keeps its last line."""
    return {int(x["step"]): x["loss"] for x in read_step_lines(train_log(run_dir))}


def logged_step(run_dir: Path) -> int:
    """The last step train.log has a line of (0 before the first)."""
    return max(step_losses(run_dir), default=0)


def trainer_argv(work: Path, name: str, args: list[str], total: int, first: int = 0) -> list[str]:
    """The trainer's flags for run `name` under WORK/runs: `args`, then its length (--max_steps
    `total`, and --halt_after `first` where given)."""
    halt = ["--halt_after", str(first)] if first else []
    return [*args, "--out_dir", str(work / "runs"), "--name", name,
            "--max_steps", str(total), *halt]  # fmt: skip


def standalone(ranks: int) -> list[str]:
    """`torchrun --standalone` of the trainer with `ranks` processes on this host."""
    return [*TORCHRUN, "--standalone", f"--nproc_per_node={ranks}", "-m", "pytrain.train",
            "--no-progress"]  # fmt: skip


def shown(cmd: list[str]) -> str:
    """A command as a user types it (`python`, not this interpreter's path)."""
    return " ".join(c if c != PY else "python" for c in cmd)


def read_log(run_dir: Path, row: Row) -> None:
    """Steps, last train and validation loss, evaluations from runs/<name>/train.log."""
    text = train_log(run_dir)
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
    cmd = [*(launcher or TRAIN), *trainer_argv(work, row.name, args, total, first)]
    row.command = shown(cmd)
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
            problems.append(f"traceback in output ({failure_line(out)})")
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
    cmd = [*TRAIN, *trainer_argv(work, row.name, args, 40)]
    row.command = shown(cmd) + " (SIGTERM at step >= 12)"
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    with open(work / f"{row.name}-1.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        while p.poll() is None:
            if logged_step(run_dir) >= 12:
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
    args = preset_args(work, "--eval_every", "10", "--ckpt_every", "20", "--eval_batches", "4")
    train_twice(row, work, args, first=20, total=40, launcher=standalone(1))
    return row


def row_fsdp_cpu_gpu(work: Path) -> Row:
    row = Row("fsdp-cpu-gpu", "")
    train, val = default_dataset(work)
    args = ["--fsdp", "--data.path", str(train), "--data.val_path", str(val),
            "--optim.master_weights", "off", "--samples", "0", "--log_every", "1",
            "--eval_every", "10", "--eval_batches", "4", "--ckpt_every", "20"]  # fmt: skip
    cpu = [*standalone(2), *trainer_argv(work, row.name, [*args, "--device", "cpu"], 40, 20)]
    gpu = [*standalone(1), *trainer_argv(work, row.name, args, 40)]
    row.command = shown(cpu) + "; then on the GPU with 1 rank"
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
    losses = step_losses(run_dir)
    problems = [f"exit codes {rc1}, {rc2}"] if rc1 or rc2 else []
    if not (run_dir / "ckpt-00000020" / ".metadata").is_file():
        problems.append("no sharded checkpoint at step 20")
    if "resuming a run saved on 2 rank(s) on 1" not in out2 or not m or m.group(1) != "20":
        problems.append("the GPU run did not resume the 2-rank checkpoint at step 20")
    if "Traceback" in out1 + out2:
        problems.append(f"traceback in output ({failure_line(out1 + out2)})")
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


# Run by the Llama rows in a process of its own: our model from the run's checkpoint and
# transformers' from the export, both in fp32 on the CPU (no TF32 or kernel choices between
# them: what LOGITS_TOLERANCE is measured in), on the same ids.
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


def row_llama(work: Path, preset: str, name: str = "", extra: tuple[str, ...] = (),
              hf_class: str = "LlamaForCausalLM") -> Row:  # fmt: skip
    """configs/<preset>.toml as shipped (with `extra` flags), shortened (the embedded
    default's data and tokenizer, so a vocabulary of 4096; 2 micro-batches a step):
    evaluation, a checkpoint, the resume, then `python -m pytrain.export` of the run,
    loaded by transformers as `hf_class` with logits equal to ours, and a new run from that
    export (`--init_from`, continued()). The note has the steady
    tokens/s and the peak GPU memory. Its checkpoints (with AdamW's state: ~16 GB at 1B,
    ~51 GB at 3B, and two exist while the last is written) are deleted at the end."""
    row = Row(name or preset, "")
    train, val = default_dataset(work)
    args = ["--config", f"configs/{preset}.toml", "--data.path", str(train), "--data.val_path", str(val),
            "--optim.grad_accum", "2", "--compile.cache_dir", str(work / "inductor-cache"),
            "--samples", "1", "--eval_every", "5", "--ckpt_every", "10", "--eval_batches", "4",
            "--keep_ckpts", "1", "--log_every", "1", *extra]  # fmt: skip
    train_twice(row, work, args, first=10, total=20)
    hf = work / f"{row.name}-hf"
    problems, exported = export_matches(work, row, hf, hf_class)
    problems += continued(work, row.name, args, hf, row.train_loss)
    conclude(row, problems, f"{figures(work, row)}; {exported}")
    drop_checkpoints(work / "runs" / row.name)
    shutil.rmtree(hf, ignore_errors=True)
    shutil.rmtree(work / "runs" / f"{row.name}-continued", ignore_errors=True)
    return row


def export_matches(
    work: Path, row: Row, hf: Path, hf_class: str = "LlamaForCausalLM"
) -> tuple[list[str], str]:
    """`python -m pytrain.export` of the row's run into `hf`, loaded by transformers as
    `hf_class` with our logits within LOGITS_TOLERANCE (LOGITS_CHECK): (problems, what was
    found)."""
    run_dir = work / "runs" / row.name
    shutil.rmtree(hf, ignore_errors=True)
    rc, _ = run(
        [PY, "-m", "pytrain.export", str(run_dir), str(hf)], work / f"{row.name}-export.log"
    )
    rc2, out = run([PY, "-c", LOGITS_CHECK, str(run_dir), str(hf)], work / f"{row.name}-logits.log")
    m = re.search(r"class (\w+) max_abs_diff (\S+) max_abs_logit (\S+)", out)
    if rc or rc2 or not m:
        return [f"export exit {rc}, logits check exit {rc2}"], ""
    if m.group(1) != hf_class or float(m.group(2)) > LOGITS_TOLERANCE:
        return [f"export: {m.group(1)}, logits differ by {m.group(2)}"], ""
    return [], f"export: {hf_class}, logits within {m.group(2)} (of up to {m.group(3)})"


def figures(work: Path, row: Row) -> str:
    """The speed and memory of a train_twice row: the median tokens/s of the last 5 step
    lines, the peak GPU memory allocated (the second invocation's end line) and reserved
    (the step lines' `reserved_gib`: what must fit)."""
    lines = read_step_lines(train_log(work / "runs" / row.name))
    speed = sorted(x["tok/s"] for x in lines[-5:])
    peak = read_peak_memory((work / f"{row.name}-2.log").read_text())
    reserved = max((x.get("reserved_gib", 0.0) for x in lines), default=0.0)
    text = (f"{speed[len(speed) // 2]:,.0f} tok/s (median of the last {len(speed)} lines)"
            if speed else "no tok/s")  # fmt: skip
    text += f", peak {peak[0]} GB allocated" if peak else ""
    return text + (f", {reserved:.1f} GiB reserved" if reserved else "")


def conclude(row: Row, problems: list[str], found: str) -> None:
    """The row's note: its problems (train_twice's first), or what it found where none."""
    problems = [row.note, *problems] if row.note else problems
    row.note = "; ".join(problems) if problems else found
    row.ok = row.ok and not problems


def drop_checkpoints(run_dir: Path) -> None:
    """Frees a run's disk, keeping its logs."""
    for ckpt in run_dir.glob("ckpt-*"):
        shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()


def gpus_missing(row: Row, need: int) -> bool:
    """Fails `row` in one line where this host has fewer than `need` GPUs."""
    import torch

    have = torch.cuda.device_count()
    if have < need:
        row.note = f"not run: needs {need} GPUs, this host has {have}"
    return have < need


def row_olmoe(work: Path) -> Row:
    """configs/olmoe-1b-7b.toml as row_llama runs a preset, on a GPU of OLMOE_GIB or more."""
    import torch

    have = torch.cuda.get_device_properties(0).total_memory / 2**30
    if have < OLMOE_GIB:
        return Row(
            "olmoe", "", note=f"not run: needs a GPU of {OLMOE_GIB} GiB, this one has {have:.0f}"
        )
    return row_llama(work, "olmoe-1b-7b", "olmoe", hf_class="OlmoeForCausalLM")


def synthetic_dataset(work: Path) -> tuple[Path, Path]:
    """Synthetic ids at Llama 3's vocabulary (log-normal lengths of ~1,800 tokens): a
    training set of 20,000 documents (~36M tokens) and a validation set of another seed."""
    from pytrain import _loader

    root = work / f"synthetic-{VOCAB}"
    for split, docs, seed in (("train", 20000, 0), ("val", 2000, 1)):
        if not (root / split / "manifest.json").exists():
            shutil.rmtree(root / split, ignore_errors=True)  # an interrupted write
            _loader.write_synthetic(
                str(root / split), docs, mu=7.0, sigma=1.0, vocab=VOCAB, seed=seed
            )
    return root / "train", root / "val"


def llama_8b_args(train: Path, val: Path, cache: Path) -> list[str]:
    """configs/llama-8b.toml as shipped but for the data and the step: 131072 tokens, 4
    micro-batches a rank on 4 GPUs (its 1M tokens would make a step ~36 s). An evaluation
    ends each invocation (steps 4 and 6) and a checkpoint too; one is kept."""
    return ["--config", "configs/llama-8b.toml", "--data.path", str(train), "--data.val_path", str(val),
            "--optim.tokens_per_step", "131072", "--compile.cache_dir", str(cache), "--samples", "0",
            "--log_every", "1", "--eval_every", "6", "--eval_batches", "2", "--ckpt_every", "6",
            "--keep_ckpts", "1"]  # fmt: skip


def row_llama_8b(work: Path) -> Row:
    """configs/llama-8b.toml on 4 GPUs (FSDP2): 4 steps, then the resume to 6, the export,
    and the first step of a new run from it (`--init_from`, continued). A checkpoint holds fp32 weights and both AdamW moments (bf16), ~64 GB, and two exist
    while the second is written: the checkpoints and the export are deleted at the end,
    also where the row fails, so that the disk is free for what follows."""
    row = Row("llama-8b", "")
    if gpus_missing(row, 4):
        return row
    train, val = synthetic_dataset(work)
    hf = work / "llama-8b-hf"
    try:
        args = llama_8b_args(train, val, work / "inductor-cache")
        train_twice(row, work, args, first=4, total=6, launcher=standalone(4))
        problems, exported = export_matches(work, row, hf)
        if not problems:  # a new run of 4 ranks from the export: its weights, sharded
            drop_checkpoints(work / "runs" / row.name)  # the disk: the new run saves 64 GB too
            problems = continued(work, "llama-8b", args, hf, row.train_loss, standalone(4))
        conclude(row, problems, f"{figures(work, row)}; {exported}")
    finally:
        drop_checkpoints(work / "runs" / row.name)
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(work / "runs" / "llama-8b-continued", ignore_errors=True)
    return row


AGENT_STEPS, AGENT_CKPT = 8, 3
"""The two-agent row's length and checkpoint interval: the kill comes once step
AGENT_CKPT + 1 is logged, after the (synchronous) checkpoint of step AGENT_CKPT."""
AGENT_LIMIT_S = 1800
"""The most one two-agent job may take (a cold compile, 8 steps and three 15 GB checkpoints
take a few minutes): a hung job is stopped and the row fails."""


def two_agent_args(train: Path, cache: Path) -> list[str]:
    """configs/llama-1b.toml under FSDP2 (fsdp_shard_size auto: a node's, here an agent's, 2
    ranks; the 2 agents replicas), shortened; checkpoints written in the loop, and
    deterministic kernels so that the resumed job can equal the uninterrupted one (FA4's
    backward, what attention auto takes on Hopper, then sums its gradients in a fixed
    order: pytrain.model.flash4)."""
    return ["--config", "configs/llama-1b.toml", "--fsdp", "--data.path", str(train),
            "--compile.cache_dir", str(cache), "--samples", "0", "--log_every", "1",
            "--eval_every", "0", "--ckpt_every", str(AGENT_CKPT), "--keep_ckpts", "1",
            "--no-ckpt_async", "--deterministic"]  # fmt: skip


def agents_cmd(work: Path, name: str, args: list[str], port: int | str) -> list[str]:
    """One agent's command of a job of two (torchrun --nnodes 2, c10d rendezvous at
    localhost:`port`, --max-restarts 1), as each node of two would run it."""
    return [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"{name}-{port}", "--max-restarts", "1",
            "-m", "pytrain.train", "--no-progress", *trainer_argv(work, name, args, AGENT_STEPS)]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_agents(
    work: Path, name: str, args: list[str], kill_after: int = 0
) -> tuple[list[int], list[str]]:
    """A job of two agents on GPUs 0,1 and 2,3, to its end; with `kill_after`, a rank of the
    second agent killed by SIGKILL once step `kill_after` is logged. Each agent's exit code
    and output (WORK/<name>-agent<i>.log)."""
    run_dir, logs = work / "runs" / name, [work / f"{name}-agent{i}.log" for i in (0, 1)]
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = agents_cmd(work, name, args, free_port())
    # LOGLEVEL INFO: each agent says when it restarts its ranks ("will restart worker group").
    procs = []
    for log, gpus in zip(logs, ("0,1", "2,3"), strict=True):
        with open(log, "w") as f:
            f.write(f"$ CUDA_VISIBLE_DEVICES={gpus} {shown(cmd)}\n")
            f.flush()
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus, "LOGLEVEL": "INFO"}
            procs.append(
                subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
            )
    t0 = time.perf_counter()
    while kill_after and time.perf_counter() - t0 < AGENT_LIMIT_S:
        if any(p.poll() is not None for p in procs):
            break  # ended before the step: the row fails on what it says
        if logged_step(run_dir) >= kill_after:
            for rank in children(procs[1].pid)[-1:]:  # the agent's ranks
                os.kill(rank, signal.SIGKILL)
            break
        time.sleep(0.5)
    rcs = [ended(p, AGENT_LIMIT_S - (time.perf_counter() - t0)) for p in procs]
    for rc, log in zip(rcs, logs, strict=True):
        print(f"  {log.name}: exit {rc} after {time.perf_counter() - t0:.0f}s", flush=True)
    return rcs, [log.read_text() for log in logs]


def ended(agent: subprocess.Popen, within: float) -> int:
    """The agent's exit code; one still running after `within` s is stopped (SIGTERM: it
    stops its ranks, with SIGKILL after 30 s), and killed after 90 s more."""
    try:
        return agent.wait(timeout=max(1.0, within))
    except subprocess.TimeoutExpired:
        agent.terminate()
    try:
        return agent.wait(timeout=90)
    except subprocess.TimeoutExpired:
        agent.kill()
        return agent.wait()


def row_two_agent(work: Path) -> Row:
    """HSDP over two agents of 2 GPUs, as two nodes would run it: an uninterrupted job, then
    the same with a rank killed after a checkpoint. Both agents must restart their ranks,
    the job resume from that checkpoint and its losses after it equal the uninterrupted
    job's bit for bit (`loss_exact`), as tests/test_hsdp.py checks on the CPU."""
    row = Row("two-agent", "")
    if gpus_missing(row, 4):
        return row
    args = two_agent_args(synthetic_dataset(work)[0], work / "inductor-cache")
    row.command = (f"CUDA_VISIBLE_DEVICES=0,1 and 2,3: {shown(agents_cmd(work, row.name, args, 'PORT'))}; "
                   f"again, a rank killed by SIGKILL at step {AGENT_CKPT + 1}")  # fmt: skip
    t0 = time.perf_counter()
    whole = two_agents(work, f"{row.name}-whole", args)
    killed = two_agents(work, row.name, args, kill_after=AGENT_CKPT + 1)
    row.wall_s = time.perf_counter() - t0
    run_dir = work / "runs" / row.name
    read_log(run_dir, row)
    read_setup("".join(whole[1]), row)
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", "".join(killed[1]))]
    row.resumed = ", ".join(f"at step {s}" for s in resumed) or "no"
    problems = ([row.note] if row.note else []) + restart_problems(whole, killed)
    if len(resumed) != 1 or resumed[0] < AGENT_CKPT:
        problems.append(f"resumed {row.resumed}, not once from a checkpoint")
    else:
        want = step_losses(work / "runs" / f"{row.name}-whole")
        steps = range(resumed[0] + 1, AGENT_STEPS + 1)
        problems += first_difference(step_losses(run_dir), want, steps)
    row.note = "; ".join(problems) or (
        f"both agents restarted; steps {resumed[0] + 1}-{AGENT_STEPS} bit for bit"
    )
    row.ok = not problems
    for name in (row.name, f"{row.name}-whole"):
        drop_checkpoints(work / "runs" / name)
    return row


def restart_problems(
    whole: tuple[list[int], list[str]], killed: tuple[list[int], list[str]]
) -> list[str]:
    """What the two jobs' agents (exit codes, outputs) say against HSDP over 2 x 2 ranks, an
    uninterrupted first job, and a second whose killed rank restarted both agents."""
    problems = []
    if any(whole[0] + killed[0]):
        problems.append(f"exit codes {whole[0]} uninterrupted, {killed[0]} killed")
    if "HSDP, FSDP2 within each group of 2 ranks" not in "".join(whole[1]):
        problems.append("not HSDP of 2 groups of 2 ranks")
    if "will restart worker group" in "".join(whole[1]):
        problems.append("the uninterrupted job restarted")
    if not re.search(r"exitcode\s*: -9", "".join(killed[1])):
        problems.append("no rank ended by SIGKILL")
    restarts = [out.count("will restart worker group") for out in killed[1]]
    if min(restarts) < 1:
        problems.append(f"restarts by agent: {restarts}, not both")
    return problems


def first_difference(got: dict[int, float], want: dict[int, float], steps: range) -> list[str]:
    """The first of `steps` whose loss is not the same float in both, as a problem."""
    for step in steps:
        if step not in got or step not in want:
            return [f"step {step} not logged by both jobs"]
        if got[step] != want[step]:
            rel = abs(got[step] - want[step]) / abs(want[step])
            return [f"step {step}: loss {got[step]!r}, uninterrupted {want[step]!r} ({rel:.1e})"]
    return []


def continued(work: Path, preset: str, args: list[str], hf: Path, trained_loss: float,
              launcher=None) -> list[str]:  # fmt: skip
    """Continued pretraining from the export (`--init_from`, the compiled GPU path): a new
    run (ended once its first step is logged) whose first loss is the trained model's: nearer it than a random
    initialisation's ln(vocabulary) (a short run, as the 8B's, is not far below that).
    Problems, as one-line strings."""
    name = f"{preset}-continued"
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    cmd = [*(launcher or TRAIN), *args, "--init_from", str(hf), "--out_dir", str(work / "runs"),
           "--name", name, "--max_steps", "3", "--eval_every", "0", "--samples", "0",
           "--ckpt_every", "0"]  # fmt: skip
    # Its first loss is all that is read: the run is ended once step 1 is logged (its end's
    # checkpoint, 64 GB at 8B, is not waited for).
    rc, out = run(cmd, work / f"{name}.log", done=lambda: logged_step(work / "runs" / name) >= 1)
    log = work / "runs" / name / "train.log"
    first = read_step_lines(log.read_text())[:1] if log.exists() else []
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"] if hf.exists() else 0
    if rc or "weights from" not in out or not first:
        return [f"--init_from the export: exit {rc}"]
    if not first[0]["loss"] < (trained_loss + math.log(vocab)) / 2:
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
    "moe": lambda w: row_llama(w, "moe-1.8b-a320m", "moe", hf_class="Glm4MoeForCausalLM"),
    "olmoe": row_olmoe,
    "llama-8b": row_llama_8b,
    "two-agent": row_two_agent,
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
        "--rows",
        default=",".join(r for r in ROWS if r not in MULTI_GPU),
        help=f"comma-separated subset of {', '.join(ROWS)} (default: all but "
        f"{', '.join(MULTI_GPU)}, which need more than one 80 GB GPU)",
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
