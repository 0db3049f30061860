"""Llama-3.2-1B's shape on one GPU, Llama-3.1-8B's on the GPUs of one host, or 8 layers of
Qwen3-30B-A3B (a mixture of experts) on one GPU, side by side with torchtitan, in one command.

    PYTHONPATH=$PWD python benchmarks/titan.py --titan-site DIR [--tokenizer tokenizer.json] \
        [--text corpus.jsonl] [--seq 2048,4096] [--steps 40]
    PYTHONPATH=$PWD python benchmarks/titan.py --titan-site DIR --shape 8b --gpus 4 \
        --seq 8192 --rows 1 --accum 2 --steps 10 [--ours-ac every-2,selective] \
        [--ours-variant 'bf16 moments=--optim.state_dtype bf16'] [--quality --seeds 1337,2]
    PYTHONPATH=$PWD python benchmarks/titan.py --titan-site DIR --shape qwen3-moe-8l --seq 4096 --rows 2 --steps 30

expert parallelism over several GPUs, when such a host is available:

    PYTHONPATH=$PWD python benchmarks/titan.py --titan-site DIR --shape qwen3-moe-8l --gpus 4 \
        --seq 4096 --rows 2 --steps 30 --runs 'ours bf16' --ours-flags '--model.ep 4'

(ours only, the experts split over the 4 GPUs; the trainer's expert-parallel flag, written
here `--model.ep 4`, perhaps to be named `--ep 4`, is not there yet.)

--dry-run prints each run's command (torchtitan's with the variables this script sets) and
runs nothing.

DIR holds torchtitan and its dependencies as pinned in benchmarks/titan.requirements.txt
(`pip install --no-deps --target DIR` of those wheels; the GPU hosts have no network).

torchtitan runs through its own trainer (`torchtitan.train` under torchrun) from its PyPI
wheel 0.2.2 (installed into DIR with its dependencies: the newest, 0.3.0, needs a newer torch
than 2.11), reading text through its own loader (`c4_test`, a local JSON corpus written here).
Its llama3 has no 1B flavor: this script registers one with Llama-3.2-1B's shape (dim 2048, 16
layers, 32 heads, 8 KV heads, SwiGLU 8192 = ffn_dim_multiplier 1.5 at multiple_of 1024, RoPE
theta 500000, scaling factor 32) before calling torchtitan's `main`; 0.2.2 cannot tie the
embeddings, so its model has 262M parameters more than ours (configs/llama-1b.toml ties them,
as Llama-3.2-1B does). --shape 8b takes its own 8B flavor (Llama-3.1-8B's shape, as
configs/llama-8b.toml), both sides under torchrun over --gpus GPUs with FSDP2, torchtitan
with its 8B recipe's selective activation checkpointing (per op) and ours with the preset's
(--ours-ac runs ours with each of several; --ours-variant NAME=FLAGS with named flags, a
row each); its float8 runs as its recipes set them, the
weights all-gathered in float8 with precomputed scales. Ours trains on synthetic ids at the
same vocabulary (128256) through the real loader: tokens/s do not depend on the text.

Runs, all at the same sequence length and tokens per optimizer step (`--rows` x
`--accum` micro-batches on each GPU), compiled, activation checkpointing off at 1B: ours in bf16 (`--model.float8_head
off`), as shipped (the FP8 output layer), and with `--model.float8 tensorwise` (torchao);
torchtitan (on one GPU its data-parallel degree resolves to 1: no FSDP, bf16 under
torch.autocast; FSDP2 over several) in bf16 and with its float8 converter (tensorwise)
twice: on every linear layer, the output one included (its default), and with the output
layer left in bf16 (`filter_fqns output`, as its llama3 recipes set it); asked for by name,
ours in float8 with the output layer in bf16 too, and each side's float8 with a scale a
row (OURS_RUNS, TITAN_RUNS). Compared: bf16 with bf16, float8 with float8, and each side's fastest
run with the other's. MFU with one formula for both: 6N + 12 L H d T per token
(N: the blocks and the output layer, the embedding lookup costing nothing; attention
included), against 989 TFLOP/s (H100 dense bf16). Tokens/s per GPU (torchtitan logs its
"tps" per GPU, ours its whole job's, divided here). Peak memory: rank 0's
torch.cuda.max_memory_reserved for both (torchtitan logs it as "memory"), torchtitan with
the CUDA allocator's expandable segments, as its launcher sets them (TITAN_ALLOC). Medians
over the steps after the first third. A table is printed last.

--shape qwen3-moe-8l: Qwen3-30B-A3B's layers, 8 of them (dim 2048, 32 heads of 128 over 4
KV heads, QK-norm, 128 experts of SwiGLU 768, top 8 by softmax with the 8 weights normalised,
RoPE theta 1e6, vocabulary 151936, embeddings untied: 5.61B parameters on both sides, 0.77B
active), sequences of 4096, 2 rows a step in one micro-batch (--rows and --accum default so
at this shape), compiled, activation checkpointing off on both sides (ours'
`--activation_checkpointing off`: the preset's is selective; `--ours-ac selective` runs it).
torchtitan's qwen3 (torchtitan/models/qwen3/__init__.py: the dict `qwen3_args` of
Qwen3ModelArgs flavors, "30B-A3B" with moe_enabled, moe_inter_dim 768 and MoEArgs(128
experts, no shared one, top_k 8, softmax, route_norm)) has no 8-layer flavor: "30B-A3B-8L",
"30B-A3B" with n_layers 8, is put in that dict before its `main`, as the 1B flavor in
llama3's. Its experts run through torch._grouped_mm (MoEArgs.use_grouped_mm, true by
default: no flag selects it); --compile.enable compiles each MoE block's attention, norms
and router, and the experts' grouped GEMMs, not the tokens' dispatch; its attention is SDPA.
On one GPU it trains fp32 weights under autocast with fp32 AdamW moments; ours has the
preset's bf16 moments. Its load balancing as its qwen3 has it: MoEArgs' load_balance_coeff
1e-3 gives each MoE layer an expert bias for choosing experts (auxiliary-loss-free), but
0.2.2's qwen3 builds plain optimizers (`build_optimizers`, not llama4's and deepseek_v3's
`build_optimizers_with_moe_load_balancing`): the bias stays 0, with no auxiliary loss, plain
top-8 routing. Ours balances as the preset does (a global balancing loss of weight 0.001,
Qwen3's, and no bias: --model.aux_loss, --model.balance_rate). "torchtitan fp8 experts":
its float8 converter for MoE (`quantize.grouped_mm.float8`, fqns "experts": torchao's
dynamic rowwise float8 grouped GEMMs, every other layer in bf16); 0.2.2 imports torchao's
MoETrainingConfig, which torchao 0.17 renamed Float8TrainingOpConfig (the same recipe): the
worker gives it the old name where missing. "ours fp8 experts" is the same recipe through
the same torchao function (--model.moe_kernel float8), asked for by name. Ours trains on synthetic ids at 151936. MFU over the
active parameters (flops_per_token): 6 N_active + 12 L H d T, N_active a token's attention
(q, k, v, o, norms), router (dim x experts), top_k experts (3 x dim x expert_hidden each),
final norm and output layer (dim x vocab): 6.21 GFLOP a token at 4096, what torchtitan's
own count and ours' trainer give too.

With --quality, every run trains on real text instead (the Python sources, every 20th
document held out; ours packed by pack-shards with the same tokenizer, so at that
tokenizer's vocabulary) with a warm-up of a tenth of --steps (--warmup N sets it), and both
sides report their validation loss at the last step on the held-out text (beside it, each
run's training loss against its reference's over each quarter of the steps): a float8 run
counts only within 1% of its own side's bf16 run, e.g. `--quality --steps 300`; with
--ours-variant, each variant's bf16 run is held against the first's (e.g. bf16 moments
against fp32 moments).
At 8B and 100 steps, runs of the same settings differ by more than 1% (BENCHMARKS.md,
"Float8's loss"): --seeds 1337,2 makes every run once per seed and the table shows each
side's mean and its seeds' spread, a gap that half the spread could carry across 1% being
"undecided".

With --memory-peaks, both sides also record the CUDA allocator's history on rank 0 (ours
over steps 3-4, `--profile_steps 3:5 --profile_memory`; torchtitan from its start, its
memory snapshot at the last step) and a table of what held each run's peak follows the
results (pytrain/train/memory_peak.py reads both). The recording costs host time: tokens/s
of such a command are not the results'.

With --kernel-profile, both sides profile their last steps with torch.profiler (ours
`--profile_steps`, its summary.json; torchtitan `--profiling.enable_profiling`, its chrome
trace of rank 0, read by benchmarks/chrome_trace.py) and a table of each run's device time
a step by kernel category (pytrain/train/profiling.py's categories: grouped GEMMs, routing,
attention, matmuls, ...) follows the results. Tokens/s then count the profiling too.

    python benchmarks/titan.py --titan-site DIR --shape qwen3-moe-8l --seq 4096 --rows 2 \
        --steps 12 --runs "ours bf16,torchtitan bf16" --ours-ac selective,off --kernel-profile"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.chrome_trace import side_by_side, trace_summary  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    failure_line,
    kill_tree,
    machine_line,
    markdown_table,
    median_steady,
    read_steps,
)

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16
OURS_RUNS = {"bf16": ["--model.float8_head", "off"], "preset": [],
             "fp8": ["--model.float8", "tensorwise"],
             "fp8 output-bf16": ["--model.float8", "tensorwise", "--model.float8_head", "off"],
             "fp8 rowwise": ["--model.float8", "rowwise"],
             "fp8 experts": ["--model.moe_kernel", "float8", "--model.float8_head", "off"]}  # fmt: skip
"""Ours' runs: the preset's flags each adds. "fp8 output-bf16" leaves the whole output layer
in bf16, as torchtitan's recipes do; "rowwise" is torchao's recipe of a scale a row (finer
than a tensor's, slower, and without the float8 all-gathers); "fp8 experts" (an MoE shape's)
the experts' grouped GEMMs in FP8 with rowwise scales through torchao's MoE path, every
other layer in bf16, as torchtitan's "fp8 experts"."""
TITAN_RUNS: dict[str, tuple[str, list[str]] | None] = {
    "bf16": None,
    "fp8": ("tensorwise", []),
    "fp8 output-bf16": ("tensorwise", ["output"]),
    "fp8 rowwise output-bf16": ("rowwise", ["output"]),
    "fp8 experts": ("grouped_mm", ["experts"]),
}
"""torchtitan's runs: None for bf16, else its float8 converter's (recipe, `filter_fqns`):
every linear layer (its default), and without the output layer, as its own llama3 recipes
set `filter_fqns`; or ("grouped_mm", the MoE modules whose grouped GEMMs go float8: its
`quantize.grouped_mm.float8.fqns`), an MoE shape's only."""
ALL_RUNS = (*(f"ours {n}" for n in OURS_RUNS), *(f"torchtitan {n}" for n in TITAN_RUNS))
RUNS = ("ours bf16", "ours preset", "ours fp8",
        "torchtitan bf16", "torchtitan fp8", "torchtitan fp8 output-bf16")  # fmt: skip
MOE_RUNS = ("ours bf16", "torchtitan bf16", "torchtitan fp8 experts")
"""The runs without --runs (MOE_RUNS at an MoE shape); the others are asked for by name."""
VAL_BATCHES = 20  # --quality: validation batches of --rows rows, the same for both
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
TITAN_ALLOC = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
"""The CUDA allocator's setting torchtitan's launcher (run_train.sh) gives its trainer: part
of its recipe, so its runs here have it too. Ours run with what the trainer sets. Set either
variable in the shell and both sides run with it instead."""
SHAPES = {
    "1b": {"title": "Llama-3.2-1B", "n_layer": 16, "d_model": 2048, "n_head": 32, "n_kv_head": 8,
           "mlp_hidden": 8192, "vocab": 128256, "preset": "configs/llama-1b.toml", "titan_flavor": "1B",
           "titan_recipe": ["--activation_checkpoint.mode", "none"]},
    "8b": {"title": "Llama-3.1-8B", "n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_head": 8,
           "mlp_hidden": 14336, "vocab": 128256, "preset": "configs/llama-8b.toml", "titan_flavor": "8B",
           "titan_recipe": ["--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "op",
                            "--optimizer.lr", "3e-4"]},
    "qwen3-moe-8l": {"title": "Qwen3-30B-A3B (8 layers)", "n_layer": 8, "d_model": 2048,
                     "n_head": 32, "n_kv_head": 4, "head_dim": 128, "qk_norm": True, "experts": 128,
                     "top_k": 8, "expert_hidden": 768, "vocab": 151936,
                     "preset": "configs/qwen3-moe-30b-a3b.toml",
                     "ours_flags": ["--model.n_layer", "8", "--activation_checkpointing", "off"],
                     "titan_model": "qwen3", "titan_flavor": "30B-A3B-8L",
                     "titan_recipe": ["--activation_checkpoint.mode", "none"],
                     "defaults": {"rows": 2, "accum": 1, "runs": ",".join(MOE_RUNS)}},
}  # fmt: skip
"""Each shape's model and torchtitan's flags from its recipe: at 8B its llama3_8b.toml's
per-op selective checkpointing and learning rate (3e-4, as configs/llama-8b.toml; its
trainer's default is 8e-4), which --quality's loss depends on; 0.2.2 has no 1B recipe and
no MoE one. Optional keys: head_dim (else d_model / n_head), qk_norm, experts, top_k and
expert_hidden (an MoE shape: every block's MLP routed), ours_flags (added to the preset's),
titan_model (else llama3), defaults (of --rows, --accum, --runs: DEFAULTS' otherwise)."""
DEFAULTS = {"rows": 8, "accum": 4, "runs": ",".join(RUNS)}
TITAN_MOE_BASE = "30B-A3B"
"""The torchtitan qwen3 flavor whose 8 layers are "30B-A3B-8L"."""


def titan_worker(argv: list[str]) -> None:
    """Inside torchrun: registers the flavors torchtitan lacks (llama3's 1B, qwen3's 8-layer
    30B-A3B), then torchtitan's own entry point."""
    # torchtitan 0.2.2 reads its arguments through a default argument, `sys.argv[1:]` as it
    # was when its config module was imported: set before any torchtitan import.
    sys.argv = [sys.argv[0], *argv]
    from torchtitan.train import Trainer, main

    if argv[argv.index("--model.name") + 1] == "qwen3":
        register_qwen3_flavor()
    else:
        register_llama3_flavor()
    if "quantize.grouped_mm.float8" in argv:
        alias_torchao_moe_config()
    main(Trainer)


def register_llama3_flavor() -> None:
    """Llama-3.2-1B's shape as torchtitan's llama3 flavor "1B"."""
    from torchtitan.models import llama3
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    llama3.llama3_args["1B"] = TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        multiple_of=1024, rope_theta=500000, rope_scaling_args=RoPEScalingArgs(scaling_factor=32.0),
    )  # fmt: skip


def register_qwen3_flavor() -> None:
    """torchtitan's qwen3 "30B-A3B" (Qwen3ModelArgs with its MoEArgs) at 8 layers, as the
    flavor "30B-A3B-8L" (SHAPES' qwen3-moe-8l): the same dict its TrainSpec reads flavors from."""
    import dataclasses

    from torchtitan.models import qwen3

    base = qwen3.qwen3_args[TITAN_MOE_BASE]
    qwen3.qwen3_args[SHAPES["qwen3-moe-8l"]["titan_flavor"]] = dataclasses.replace(
        base,
        n_layers=SHAPES["qwen3-moe-8l"]["n_layer"],
        moe_args=dataclasses.replace(base.moe_args),
    )


def alias_torchao_moe_config() -> None:
    """torchtitan 0.2.2's float8 MoE converter imports torchao's
    `prototype.moe_training.conversion_utils.MoETrainingConfig` (torchao 0.16 and before);
    torchao 0.17 renamed it `config.Float8TrainingOpConfig` (dynamic rowwise float8 grouped
    GEMMs, the same recipe, registered with `quantize_` the same way): the old name for it."""
    try:
        from torchao.prototype.moe_training import conversion_utils
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    except ImportError:  # torchao 0.16 or older, or none: torchtitan says what it lacks
        return
    if not hasattr(conversion_utils, "MoETrainingConfig"):
        conversion_utils.MoETrainingConfig = Float8TrainingOpConfig


def head_dim(shape: dict) -> int:
    return shape.get("head_dim", shape["d_model"] // shape["n_head"])


def active_params(shape: dict) -> int:
    """The parameters a token's matmuls pass through: each block's attention (q, k, v, o, its
    two norms, QK-norm's), its MLP (dense: SwiGLU; MoE: the router, dim x experts, and top_k
    experts of 3 x dim x expert_hidden), the final norm and the output layer; the embedding
    lookup costs nothing."""
    d, hd = shape["d_model"], head_dim(shape)
    q, kv = shape["n_head"] * hd, shape["n_kv_head"] * hd
    attention = d * (q + 2 * kv) + q * d + 2 * d + (2 * hd if shape.get("qk_norm") else 0)
    if "experts" in shape:
        mlp = d * shape["experts"] + shape["top_k"] * 3 * d * shape["expert_hidden"]
    else:
        mlp = 3 * d * shape["mlp_hidden"]
    return shape["n_layer"] * (attention + mlp) + d + shape["vocab"] * d


def flops_per_token(shape: dict, seq: int) -> float:
    """One formula for both sides, dense or MoE: 6 N_active + 12 L H d T (active_params; the
    PaLM appendix B formula that ours' MFU uses too)."""
    attention = 12 * shape["n_layer"] * shape["n_head"] * head_dim(shape) * seq
    return 6 * active_params(shape) + attention


def torchrun(gpus: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus)]  # fmt: skip


def titan_float8_flags(float8: tuple[str, list[str]] | None, gpus: int) -> list[str]:
    """torchtitan's flags for a float8 run (TITAN_RUNS' (recipe, layers left in bf16)):
    0.2.2 registers the converter under this name; tensorwise is its default recipe, which
    it refuses to have named beside the float8 all-gathers, and its recipes over several
    GPUs all-gather the weights in float8 (tensorwise only). ("grouped_mm", fqns): its MoE
    converter on those modules' grouped GEMMs (rowwise scales; nothing else in float8)."""
    if float8 is None:
        return []
    recipe, keep_bf16 = float8
    if recipe == "grouped_mm":
        return ["--model.converters", "quantize.grouped_mm.float8",
                "--quantize.grouped_mm.float8.fqns", ",".join(keep_bf16)]  # fmt: skip
    flags = ["--model.converters", "quantize.linear.float8"]
    if gpus == 1 or recipe != "tensorwise":
        flags += ["--quantize.linear.float8.recipe_name", recipe]
    if keep_bf16:
        flags += ["--quantize.linear.float8.filter_fqns", ",".join(keep_bf16)]
    if gpus > 1 and recipe == "tensorwise":
        flags += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                  "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]  # fmt: skip
    return flags


TITAN_STEP = re.compile(
    r"(?<!validate )step:\s*(\d+)\s+loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps: ([\d,]+)"
)


def titan_step_lines(log: str) -> list[dict[str, float]]:
    """torchtitan's training step lines (its metrics logger, colours removed): step, loss,
    tok/s a GPU and peak memory reserved; its validation lines are not step lines."""
    return [{"step": int(s), "loss": float(loss), "tok/s": float(t.replace(",", "")),
             "memory_gib": float(m)} for s, loss, m, t in TITAN_STEP.findall(log)]  # fmt: skip


def run_titan(
    work: Path, site: Path, shape: dict, gpus: int, seq: int, rows: int, accum: int, steps: int,
    label: str, float8: tuple[str, list[str]] | None, val: Path | None = None,
    memory: bool = False, seed: int | None = None, warmup: int | None = None,
    profile: bool = False,
) -> dict:  # fmt: skip
    """torchtitan's trainer (titan_command's arguments; `label` names its log)."""
    cmd = titan_command(
        work, shape, gpus, seq, rows, accum, steps, float8, val, memory, seed, warmup, profile
    )
    env = {**os.environ, **titan_env(site)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    snap = titan_snapshot(work / "titan-out", steps)
    memory_md = peak_table(snap) if memory and snap.exists() else None
    trace = titan_trace(work / "titan-out") if profile else None
    kernels = trace_summary(trace) if trace is not None else None
    shutil.rmtree(work / "titan-out", ignore_errors=True)
    log = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    (work / f"titan-{seq}-{label.replace(' ', '-')}.log").write_text(log)
    logged = titan_step_lines(log)
    if r.returncode or not logged:
        return {"error": failure_line(log)}
    vals = re.findall(r"validate step:\s*\d+\s+loss:\s*([\d.]+)", log)
    return {"tokens_per_s": median_steady(logged, "tok/s", steps // 3),
            "peak_gib": max(x["memory_gib"] for x in logged), "wall_s": round(wall),
            "train_loss": quarter_means([x["loss"] for x in logged]),
            **({"val_loss": float(vals[-1])} if vals else {}),
            **({"memory": memory_md} if memory_md else {}),
            **({"kernels": kernels} if kernels else {})}  # fmt: skip


def titan_command(
    work: Path, shape: dict, gpus: int, seq: int, rows: int, accum: int, steps: int,
    float8: tuple[str, list[str]] | None, val: Path | None = None, memory: bool = False,
    seed: int | None = None, warmup: int | None = None, profile: bool = False,
) -> list[str]:  # fmt: skip
    """torchtitan's command line: its trainer under torchrun through this script's worker
    (titan_worker); `float8`: None for bf16, else TITAN_RUNS' (recipe, layers);
    `seed`: its --debug.seed (None: its default); `warmup`: with `val` (--quality), the
    warm-up's steps (None: a tenth of `steps`); `profile`: --kernel-profile's flags."""
    corpus, tok = work / "titan-corpus", work / "titan-tokenizer"  # written by main()
    cmd = [*torchrun(gpus), str(Path(__file__).resolve()), "--titan-run",
           "--model.name", shape.get("titan_model", "llama3"), "--model.flavor", shape["titan_flavor"],
           "--model.hf_assets_path", str(tok),
           "--training.dataset", "c4_test", "--training.dataset_path", str(corpus),
           "--training.local_batch_size", str(rows),
           "--training.global_batch_size", str(rows * accum * gpus),
           "--training.seq_len", str(seq), "--training.steps", str(steps), "--metrics.log_freq", "1",
           "--compile.enable", *shape["titan_recipe"], "--job.dump_folder", str(work / "titan-out")]  # fmt: skip
    cmd += titan_float8_flags(float8, gpus)
    if seed is not None:
        cmd += ["--debug.seed", str(seed)]
    if val is not None:  # --quality: its validation at the last step, a short warm-up
        cmd += ["--validation.enable", "--validation.dataset", "c4_test",
                "--validation.dataset_path", str(val), "--validation.freq", str(steps),
                "--validation.steps", str(VAL_BATCHES), "--validation.local_batch_size", str(rows),
                "--validation.seq_len", str(seq), "--lr_scheduler.warmup_steps",
                str(steps // 10 if warmup is None else warmup)]  # fmt: skip
    if memory:
        cmd += titan_memory_flags(steps)
    if profile:
        cmd += titan_profile_flags(steps)
    return cmd


def titan_env(site: Path) -> dict[str, str]:
    """What torchtitan's runs have beyond this shell's environment: DIR and this repository
    first on the path, and its launcher's allocator setting unless the shell names one for
    both sides."""
    env = {"PYTHONPATH": f"{site}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    if not any(k in os.environ for k in ALLOC_VARS):
        env.update(TITAN_ALLOC)
    return env


MEMORY_WINDOW = "3:5"  # --memory-peaks: ours records steps 3 and 4
PROFILED = 2  # --kernel-profile: each side's last steps profiled, after one of warm-up


def titan_profile_flags(steps: int) -> list[str]:
    """torchtitan's torch.profiler over its last PROFILED steps (--kernel-profile): one
    cycle of `steps` steps, its trace written at the last (titan_trace)."""
    return ["--profiling.enable_profiling", "--profiling.save_traces_folder", "profile_traces",
            "--profiling.profile_freq", str(steps), "--profiling.profiler_warmup", "1",
            "--profiling.profiler_active", str(PROFILED)]  # fmt: skip


def titan_trace(dump_folder: Path) -> Path | None:
    """Rank 0's chrome trace, where torchtitan 0.2.2 writes it (iteration_N/rank0_trace.json)."""
    found = sorted((dump_folder / "profile_traces").glob("iteration_*/rank0_trace.json"))
    return found[-1] if found else None


def ours_profile_window(steps: int) -> str:
    """--profile_steps for ours' last PROFILED steps before its last (--kernel-profile)."""
    return f"{steps - PROFILED}:{steps}"


def titan_memory_flags(steps: int) -> list[str]:
    """torchtitan's memory snapshot (--memory-peaks): recorded from its start, dumped at
    every multiple of profile_freq: here the last step."""
    return ["--profiling.enable_memory_snapshot", "--profiling.profile_freq", str(steps)]


def titan_snapshot(dump_folder: Path, steps: int) -> Path:
    """Where torchtitan 0.2.2 writes rank 0's snapshot at step `steps`."""
    return dump_folder / "memory_snapshot" / f"iteration_{steps}" / "rank0_memory_snapshot.pickle"


def peak_table(snapshot_path: Path) -> str:
    """What held the peak in a pickled allocator snapshot of rank 0 (its GPU 0), and what
    was reserved by stream."""
    import pickle

    from pytrain.train.memory_peak import format_composition, peak_composition, reserved_by_stream

    with open(snapshot_path, "rb") as f:
        snapshot = pickle.load(f)
    return format_composition(peak_composition(snapshot, 0), reserved_by_stream(snapshot, 0))


def run_ours(
    work: Path, shape: dict, gpus: int, seq: int, rows: int, accum: int, steps: int, label: str,
    extra: list[str], text: tuple[Path, Path] | None = None, memory: bool = False,
    warmup: int | None = None, profile: bool = False,
) -> dict:  # fmt: skip
    """Ours' trainer (ours_command's arguments), on synthetic ids at the shape's vocabulary
    written here where missing."""
    from pytrain import _loader
    from pytrain.train.cli import read_fallbacks, read_start_line

    data = synthetic_ids(work, shape)
    if text is None and not (data / "manifest.json").exists():
        _loader.write_synthetic(str(data), 20000, mu=7.0, sigma=1.0, vocab=shape["vocab"], seed=0)
    name = f"ours-{seq}-{label}"
    # A fresh run directory: an old one would be resumed (and its ~16 GB checkpoint kept).
    shutil.rmtree(work / "runs" / name, ignore_errors=True)
    cmd = ours_command(
        work, shape, gpus, seq, rows, accum, steps, label, extra, text, memory, warmup, profile
    )
    log = work / "runs" / name / "train.log"
    t0 = time.perf_counter()
    code, out = run_until_step(cmd, log, steps, evaluated=text is not None)
    wall = time.perf_counter() - t0
    for ckpt in (work / "runs" / name).glob("ckpt-*"):  # ~16 GB each: the next run needs the disk
        shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
    (work / f"{name}.log").write_text(out)
    logged = read_steps(log)
    if code or len(logged) < steps:
        return {"error": failure_line(out)}
    vals = re.findall(r"step \d+ val_loss ([\d.]+)", log.read_text())
    md = work / "runs" / name / "profile" / "memory.md"
    kernels = work / "runs" / name / "profile" / "summary.json"
    # What `auto` resolved to (a missing FA4 library turns attention into flex, silently
    # slower), and any compile fallback: the table shows both beside the figures.
    start = read_start_line(out) or {}
    setup = ", ".join(start[k] for k in ("attention", "output_layer", "mlp") if k in start)
    return {"tokens_per_s": median_steady(logged, "tok/s", steps // 3) / gpus,
            "peak_gib": max(x.get("reserved_gib", float("nan")) for x in logged),
            # torchtitan logs no allocated peak: in the result line only, not the table
            "allocated_gib": max(x.get("allocated_gib", float("nan")) for x in logged),
            "setup": "; ".join([setup or "?", *read_fallbacks(out)]), "wall_s": round(wall),
            "train_loss": quarter_means([x["loss"] for x in logged if "loss" in x]),
            **({"val_loss": float(vals[-1])} if vals else {}),
            **({"memory": md.read_text()} if memory and md.exists() else {}),
            **({"kernels": json.loads(kernels.read_text())}
               if profile and kernels.exists() else {})}  # fmt: skip


def ours_command(
    work: Path, shape: dict, gpus: int, seq: int, rows: int, accum: int, steps: int, label: str,
    extra: list[str], text: tuple[Path, Path] | None = None, memory: bool = False,
    warmup: int | None = None, profile: bool = False,
) -> list[str]:  # fmt: skip
    """Ours' command line: the preset with the shape's flags and then `extra`, on synthetic
    ids (synthetic_ids); with `text` (--quality), on that packed train and validation text,
    evaluated at the last step, with a short warm-up (`warmup` steps; None: a tenth of
    `steps`)."""
    data = synthetic_ids(work, shape)
    if text is not None:
        data = text[0]
        extra = [*extra, "--data.val_path", str(text[1]), "--eval_every", str(steps),
                 "--eval_batches", str(VAL_BATCHES), "--optim.warmup_steps",
                 str(steps // 10 if warmup is None else warmup)]  # fmt: skip
    if memory:
        extra = [*extra, "--profile_steps", MEMORY_WINDOW, "--profile_memory"]
    if profile:
        extra = [*extra, "--profile_steps", ours_profile_window(steps)]
    launch = [*torchrun(gpus), "-m"] if gpus > 1 else [sys.executable, "-m"]
    return [*launch, "pytrain.train", "--no-progress", "--config", shape["preset"],
            *shape.get("ours_flags", []),
            "--data.path", str(data), "--data.seq_len", str(seq), "--data.batch_size", str(rows),
            "--optim.grad_accum", str(accum),
            "--max_steps", str(steps), "--eval_every", "0", "--samples", "0", "--log_every", "1",
            "--ckpt_every", "0", "--out_dir", str(work / "runs"), "--name", f"ours-{seq}-{label}",
            *extra]  # fmt: skip


def synthetic_ids(work: Path, shape: dict) -> Path:
    """Ours' synthetic dataset at the shape's vocabulary (ours takes the dataset's)."""
    return work / f"syn{shape['vocab']}"


def quarter_means(losses: list[float]) -> list[float]:
    """The mean training loss over each quarter of a run's steps, in order (fewer than 4
    steps: none): beside the validation loss at the last step, --quality shows whether two
    runs' gap closes or widens."""
    n = len(losses) // 4
    return [round(sum(losses[i * n : (i + 1) * n]) / n, 4) for i in range(4)] if n else []


def loss_trend(reference: dict, run: dict) -> str:
    """The run's training loss against the reference's, quarter by quarter of the steps
    (quarter_means): e.g. "1.031, 1.024, 1.019, 1.018", a gap that closes; "-" where either
    has none."""
    ref, got = reference.get("train_loss", []), run.get("train_loss", [])
    if len(ref) != 4 or len(got) != 4:
        return "-"
    return ", ".join(f"{y / x:.3f}" for x, y in zip(ref, got, strict=True))


def seed_tag(seed: int | None, seeds: list[int | None]) -> str:
    """What a run's row name gains for its seed: nothing where --seeds names one or none."""
    return f" seed {seed}" if len(seeds) > 1 else ""


def verdict(ratio: float, spread: float) -> str:
    """Whether a run's mean validation loss is within 1% of its reference's: "yes" where the
    ratio stays within 1% even moved by half the seeds' spread (the larger side's, max - min
    over the mean), "NO" where it stays outside, else "undecided". One seed: spread 0."""
    gap = abs(ratio - 1)
    if gap + spread / 2 <= 0.01:
        return "yes"
    return "NO" if gap - spread / 2 > 0.01 else "undecided"


def quality_rows(
    results: dict[str, dict], pairs: list[tuple[str, str]], seeds: list[int | None]
) -> list[list[str]]:
    """One sequence length's --quality rows: each (reference, run) pair's validation loss
    at the last step (the mean over the seeds that ran, and the seeds' spread where several
    did), their ratio, the verdict, and the training loss by quarter (loss_trend) of the
    means. Pairs where either side has no validation loss at any seed are left out."""

    def over_seeds(label: str) -> tuple[list[float], dict]:
        ran = [results.get(label + seed_tag(s, seeds), {}) for s in seeds]
        vals = [x["val_loss"] for x in ran if "val_loss" in x]
        quarters = [x["train_loss"] for x in ran if len(x.get("train_loss", [])) == 4]
        return vals, {"train_loss": [fmean(q) for q in zip(*quarters, strict=True)]}

    def shown(vals: list[float]) -> str:
        apart = f" ({spread(vals):.1%} apart)" if len(vals) > 1 else ""
        return f"{fmean(vals):.4f}{apart}"

    def spread(vals: list[float]) -> float:
        return (max(vals) - min(vals)) / fmean(vals)

    rows = []
    for ref, run in pairs:
        (a, a_quarters), (b, b_quarters) = over_seeds(ref), over_seeds(run)
        if not a or not b:
            continue
        q = fmean(b) / fmean(a)
        rows.append([ref, shown(a), run, shown(b), f"{q:.4f}",
                     verdict(q, max(spread(a), spread(b))), loss_trend(a_quarters, b_quarters)])  # fmt: skip
    return rows


def run_line(seq: int, label: str, result: dict) -> str:
    """A run's line as it ends: its result, all but the table of its memory peak (printed at
    the end); with --dry-run, its command."""
    if "command" in result:
        return f"[{seq}] {label}:\n    {result['command']}"
    return f"[{seq}] {label}: { {k: v for k, v in result.items() if k != 'memory'} }"


def dry_ours(*args, **kwargs) -> dict:
    """--dry-run's run_ours: the command it would run."""
    return {"command": shlex.join(ours_command(*args, **kwargs))}


def dry_titan(work: Path, site: Path, shape: dict, gpus: int, seq: int, rows: int, accum: int,
              steps: int, label: str, *args, **kwargs) -> dict:  # fmt: skip
    """--dry-run's run_titan: the command it would run, after the variables it sets."""
    cmd = titan_command(work, shape, gpus, seq, rows, accum, steps, *args, **kwargs)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in titan_env(site).items())
    return {"command": f"{env} {shlex.join(cmd)}"}


def shape_defaults(args: argparse.Namespace, shape: dict) -> None:
    """--rows, --accum and --runs where the command names none: the shape's, else DEFAULTS'."""
    for key, value in {**DEFAULTS, **shape.get("defaults", {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def experts_only(titan_runs: list[str]) -> list[str]:
    """torchtitan's runs among `titan_runs` that convert experts (an MoE shape's only)."""
    return [n for n in titan_runs if (TITAN_RUNS[n] or ("",))[0] == "grouped_mm"]


def prepare_text(args: argparse.Namespace) -> tuple[Path | None, tuple[Path, Path] | None]:
    """torchtitan's tokenizer and text in --work; with --quality, the held-out split and ours'
    packed text (split_and_pack), else (None, None)."""
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    (work / "titan-tokenizer").mkdir(exist_ok=True)
    tokenizer = args.tokenizer or default_tokenizer()
    (work / "titan-tokenizer" / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (work / "titan-corpus").mkdir(exist_ok=True)
    corpus = work / "titan-corpus" / "train.json"
    if args.text:
        corpus.write_bytes(args.text.read_bytes())
    else:
        write_text_jsonl(corpus)
    if not args.quality:
        return None, None
    return split_and_pack(work, corpus, work / "titan-tokenizer" / "tokenizer.json")


def run_until_step(cmd: list[str], log: Path, steps: int, evaluated: bool) -> tuple[int, str]:
    """Runs the trainer and ends it (SIGKILL to it and its workers) once its train.log has
    the last step, and with `evaluated` (--quality) also that step's validation loss: the
    final checkpoint that follows (64 GB at 8B) is not measured here. Returns (exit code, 0
    where it was ended so; its output)."""
    last_val = re.compile(rf"step {steps} val_loss ")
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        while p.poll() is None:
            done = any(x["step"] >= steps for x in read_steps(log))
            if done and evaluated:
                done = bool(last_val.search(log.read_text()))
            if done:
                kill_tree(p.pid)
                p.wait()
                p.returncode = 0
                break
            time.sleep(2)
        out.seek(0)
        return p.returncode, out.read()


def default_tokenizer() -> Path:
    from pytrain.data.corpus import build_default

    return build_default()[0].parent / "tokenizer.json"


def write_text_jsonl(path: Path, mb: int = 30) -> None:
    """Python sources of this machine (benchmarks/harness.py), about `mb` MB, as torchtitan's
    JSONL text (~10M tokens: more than a run of --steps reads; its loader loops)."""
    import json

    from benchmarks.harness import python_sources

    with open(path, "w") as f:
        for _, text in python_sources(mb << 20):
            f.write(json.dumps({"text": text}) + "\n")


def split_and_pack(work: Path, corpus: Path, tokenizer: Path) -> tuple[Path, tuple[Path, Path]]:
    """--quality: every 20th document of `corpus` held out. torchtitan reads the JSONL
    (its train file rewritten without them, a validation directory of its own); ours
    reads both packed by pack-shards with the same tokenizer."""
    lines = corpus.read_text().splitlines()
    val_dir = work / "titan-val"
    val_dir.mkdir(exist_ok=True)
    (val_dir / "heldout.json").write_text(
        "".join(x + "\n" for i, x in enumerate(lines) if i % 20 == 0)
    )
    corpus.write_text("".join(x + "\n" for i, x in enumerate(lines) if i % 20))
    packed = work / "ours-text"
    packed.mkdir(exist_ok=True)
    for split, src in (("train", corpus), ("val", val_dir / "heldout.json")):
        jsonl = packed / f"{split}.jsonl"  # pack-shards knows JSON lines by this suffix
        shutil.copyfile(src, jsonl)
        cmd = [sys.executable, "-m", "pytrain.pack_shards", str(jsonl), "-o", str(packed / split),
               "--tokenizer", str(tokenizer), "--overwrite", "--no-progress"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT)
    return val_dir, (packed / "train", packed / "val")


def ours_variants(ac: str, named: list[str]) -> list[tuple[str | None, list[str]]]:
    """(row name, trainer flags) of each way ours runs: the activation checkpointing
    policies of --ours-ac, then each --ours-variant NAME=FLAGS; the preset as it is (no
    name) where neither is given."""
    out: list[tuple[str | None, list[str]]] = [
        (a.strip(), ["--activation_checkpointing", a.strip()]) for a in ac.split(",") if a.strip()
    ]
    for spec in named:
        name, eq, flags = spec.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"--ours-variant {spec!r}: expected NAME=FLAGS")
        out.append((name.strip(), shlex.split(flags)))
    return out or [(None, [])]


def comma_list(spec: str) -> list[str]:
    """A comma-separated option's words in the order given, each once."""
    return list(dict.fromkeys(w.strip() for w in spec.split(",") if w.strip()))


def parse_seeds(spec: str) -> list[int | None]:
    """--seeds: the seeds in the order given, each once; [None] (each side's own) where none;
    ValueError naming what is not a whole number."""
    words = comma_list(spec)
    if bad := [w for w in words if not w.isdigit()]:
        raise ValueError(f"--seeds: {', '.join(map(repr, bad))} not a whole number")
    return [int(w) for w in words] or [None]


def chosen_runs(spec: str) -> tuple[list[str], list[str]]:
    """--runs: the names of ours' runs (OURS_RUNS) and torchtitan's (TITAN_RUNS) in the order
    given, each once (ours run first); ValueError naming any that neither side has."""
    wanted = comma_list(spec)
    if unknown := [w for w in wanted if w not in ALL_RUNS]:
        raise ValueError(f"--runs: no run named {', '.join(map(repr, unknown))}; the runs: "
                         f"{', '.join(ALL_RUNS)}")  # fmt: skip
    return ([w.removeprefix("ours ") for w in wanted if w.startswith("ours ")],
            [w.removeprefix("torchtitan ") for w in wanted if w.startswith("torchtitan ")])  # fmt: skip


def quality_pairs(ours: list[tuple[str, str | None]], titan: list[str]) -> list[tuple[str, str]]:
    """(reference, run) pairs of the --quality table, by row name: each side's other runs
    (float8, the preset's FP8 output layer) against its bf16 run of the same variant, and
    each other variant's bf16 run against the first variant's (e.g. bf16 moments against
    fp32 moments). `ours`: (run, variant or None) as they ran; `titan`: its runs."""

    def label(name: str, variant: str | None) -> str:
        return f"ours {name}" + (f" ({variant})" if variant else "")

    first = ours[0][1] if ours else None
    pairs = [(label("bf16", v), label(n, v)) for n, v in ours if n != "bf16"]
    pairs += [(label("bf16", first), label(n, v)) for n, v in ours if n == "bf16" and v != first]
    return pairs + [("torchtitan bf16", f"torchtitan {n}") for n in titan if n != "bf16"]


def comparisons(results: dict) -> list[list[str]]:
    """One sequence length's pairs: ours in bf16 (its fastest run named "ours bf16...")
    against torchtitan's bf16, ours in float8 against torchtitan's float8, and each side's
    fastest run against the other's: [comparison, ours, torchtitan, speed ratio, peak
    memory reserved of ours less torchtitan's], "-" where a side is missing or failed."""
    ok = {k: v for k, v in results.items() if "error" not in v}

    def best(side: str) -> str | None:
        names = [k for k in ok if k.startswith(side)]
        return max(names, key=lambda k: ok[k]["tokens_per_s"]) if names else None

    rows = []
    for label, a, b in (("bf16 vs bf16", best("ours bf16"), best("torchtitan bf16")),
                        ("fp8 vs fp8", best("ours fp8"), best("torchtitan fp8")),
                        ("best vs best", best("ours"), best("torchtitan"))):  # fmt: skip
        if a is None or b is None:
            rows.append([label, a or "-", b or "-", "-", "-"])
            continue
        ratio = ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"]
        memory = ok[a]["peak_gib"] - ok[b]["peak_gib"]
        rows.append([label, a, b, f"{ratio:.2f}x", f"{memory:+.1f}"])
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--titan-run":
        titan_worker(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--titan-site", type=Path, required=True, help="torchtitan 0.2.2 and its dependencies"
    )
    p.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="1b",
        help="Llama-3.2-1B's, Llama-3.1-8B's or 8 layers of Qwen3-30B-A3B's shape (default 1b)",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs of this host, both sides (default 1)")
    p.add_argument("--seq", default="2048")
    p.add_argument("--rows", type=int, default=None,
                   help="rows per micro-batch (default 8, 2 at qwen3-moe-8l; 4 fit at 4096 at 1b)")  # fmt: skip
    p.add_argument("--accum", type=int, default=None,
                   help="micro-batches per optimizer step (default 4, 1 at qwen3-moe-8l)")  # fmt: skip
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--runs", default=None,
                   help=f"which runs, comma-separated (default: {', '.join(RUNS)}; at qwen3-moe-8l "
                   f"{', '.join(MOE_RUNS)}; also "
                   f"{', '.join(r for r in ALL_RUNS if r not in RUNS + MOE_RUNS)})")  # fmt: skip
    p.add_argument("--dry-run", action="store_true",
                   help="print each run's command, run nothing")  # fmt: skip
    p.add_argument("--ours-ac", default="",
                   help="activation checkpointing policies to run each of ours with, comma-"
                   "separated (e.g. every-2,selective): one row each, named so; default: the "
                   "preset's")  # fmt: skip
    p.add_argument("--ours-flags", default="",
                   help="trainer flags added to every run of ours, one shell string "
                   "(e.g. \"--model.fused_swiglu on\")")  # fmt: skip
    p.add_argument("--ours-variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="run each of ours once more with these trainer flags, its row named "
                   "NAME (repeatable; an empty FLAGS is the preset's own setting), e.g. "
                   "--ours-variant 'fp32 moments=' --ours-variant 'bf16 moments=--optim."
                   "state_dtype bf16'")  # fmt: skip
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-titan")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a tokenizer.json for torchtitan's text loader (default: the embedded default's BPE)")  # fmt: skip
    p.add_argument("--text", type=Path, default=None,
                   help="a JSONL file of {'text': ...} for torchtitan (default: this machine's Python sources)")  # fmt: skip
    p.add_argument("--quality", action="store_true",
                   help="every run on the text (ours: packed with the tokenizer), every 20th "
                   "document held out, the validation loss at the last step (--steps); each side's "
                   "float8 run against its bf16 run (goal: within 1%%)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=None,
                   help="--quality: both sides' warm-up, in steps (default: a tenth of --steps)")  # fmt: skip
    p.add_argument("--seeds", default="",
                   help="each run once per seed, comma-separated (ours --seed, torchtitan "
                   "--debug.seed), e.g. 1337,2: --quality then shows each pair's mean validation "
                   "loss and the seeds' spread, and calls a gap undecided where the spread could "
                   "move it across 1%%; default: each side's own seed")  # fmt: skip
    p.add_argument("--memory-peaks", action="store_true",
                   help="both sides record the allocator's history; what held each run's peak "
                   "follows the results (tokens/s then count the recording)")  # fmt: skip
    p.add_argument("--kernel-profile", action="store_true",
                   help="both sides profile their last steps; each run's device time a step "
                   "by kernel category follows the results (tokens/s then count the profiling)")  # fmt: skip
    args = p.parse_args()
    if args.kernel_profile and args.memory_peaks:
        p.error("--kernel-profile and --memory-peaks each profile a window: one at a time")
    if args.kernel_profile and args.steps < PROFILED + 2:
        p.error(
            f"--kernel-profile profiles the last {PROFILED} steps after warm-up: --steps at least {PROFILED + 2}"
        )
    if args.memory_peaks and args.steps < int(MEMORY_WINDOW.split(":")[1]):
        p.error(f"--memory-peaks records ours over steps {MEMORY_WINDOW}: --steps at least 5")
    if args.dry_run and args.quality:
        p.error(
            "--dry-run shows the commands of runs without --quality (its text is prepared first)"
        )
    shape = SHAPES[args.shape]
    shape_defaults(args, shape)
    try:
        variants = ours_variants(args.ours_ac, args.ours_variant)
        ours_runs, titan_runs = chosen_runs(args.runs)
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        p.error(str(e))
    if "experts" not in shape and (moe := experts_only(titan_runs)):
        p.error(f"--runs: {', '.join(f'torchtitan {n}' for n in moe)} needs an MoE --shape")
    work = args.work
    run_ours_, run_titan_ = (dry_ours, dry_titan) if args.dry_run else (run_ours, run_titan)
    if not args.dry_run:
        print(machine_line(), flush=True)
    titan_val, ours_text = (None, None) if args.dry_run else prepare_text(args)
    # Each side's runs once per sequence length; the comparisons pair them afterwards.
    results: dict[int, dict[str, dict]] = {}
    for seq, seed in itertools.product((int(s) for s in args.seq.split(",")), seeds):
        r = results.setdefault(seq, {})
        tag = seed_tag(seed, seeds)  # a seed's runs all before the next seed's
        seed_flags = [] if seed is None else ["--seed", str(seed)]
        for name, (variant, flags) in itertools.product(ours_runs, variants):
            label = f"ours {name}" + (f" ({variant})" if variant else "") + tag
            r[label] = run_ours_(
                work, shape, args.gpus, seq, args.rows, args.accum, args.steps,
                re.sub(r"[^A-Za-z0-9.]+", "-", label.removeprefix("ours ")).strip("-"),
                [*OURS_RUNS[name], *flags, *shlex.split(args.ours_flags), *seed_flags],
                ours_text, args.memory_peaks, args.warmup, profile=args.kernel_profile,
            )  # fmt: skip
            print(run_line(seq, label, r[label]), flush=True)
        for name in titan_runs:
            label = f"torchtitan {name}{tag}"
            r[label] = run_titan_(
                work, args.titan_site, shape, args.gpus, seq, args.rows, args.accum, args.steps,
                name + tag, TITAN_RUNS[name], titan_val, args.memory_peaks, seed, args.warmup,
                profile=args.kernel_profile,
            )  # fmt: skip
            print(run_line(seq, label, r[label]), flush=True)
    if args.dry_run:
        return 0
    where = "one GPU" if args.gpus == 1 else f"{args.gpus} GPUs, FSDP2"
    print(f"\n{shape['title']} shape on {where}, {args.rows} rows x {args.accum} "
          "micro-batches a step on each GPU; tok/s per GPU\n")  # fmt: skip
    if args.ours_flags:
        print(f"(every run of ours with {args.ours_flags})\n")
    if args.quality:
        print(f"(--quality: ours ran at its text's vocabulary, not {shape['vocab']}: its tokens/s and\n"
              "MFU below are not comparable with torchtitan's; use a run without --quality)\n")  # fmt: skip
    rows = []
    for seq, r in results.items():
        f = flops_per_token(shape, seq) / 1e12 / PEAK_TFLOPS
        for name, x in r.items():
            if "error" in x:
                rows.append([seq, name, f"failed: {x['error']}", "-", "-", "-"])
            else:
                rows.append([seq, name, f"{x['tokens_per_s']:,.0f}", f"{x['tokens_per_s'] * f:.1%}",
                             f"{x['peak_gib']:.1f}", x.get("setup", "-")])  # fmt: skip
    print(
        markdown_table(
            [
                "seq",
                "run",
                "tok/s",
                "MFU (active)" if "experts" in shape else "MFU",
                "peak GiB",
                "ours: attention, output layer, MLP",
            ],
            rows,
        )
    )
    if args.quality:
        print(f"\nvalidation loss at step {args.steps} ({VAL_BATCHES} batches of held-out text)\n")
        ours_ran = list(itertools.product(ours_runs, [v for v, _ in variants]))
        pairs = quality_pairs(ours_ran, titan_runs)
        if len(seeds) > 1:
            print(f"(the mean over seeds {', '.join(map(str, seeds))}; within 1%: 'yes' or 'NO' "
                  "where half the seeds' spread cannot move the ratio across 1%)\n")  # fmt: skip
        rows = [[seq, *row] for seq, r in results.items() for row in quality_rows(r, pairs, seeds)]
        headers = ["seq", "reference", "its val loss", "run", "its val loss", "run / reference",
                   "within 1%", "train loss by quarter of the steps, run / reference"]  # fmt: skip
        print(markdown_table(headers, rows))
    rows = [[seq, *row] for seq, r in results.items() for row in comparisons(r)]
    print("\n" + markdown_table(["seq", "comparison", "ours", "torchtitan", "ratio",
                                  "peak GiB, ours - torchtitan"], rows))  # fmt: skip
    for seq, r in results.items():
        profiled = {name: x["kernels"] for name, x in r.items() if "kernels" in x}
        if args.kernel_profile:
            print(f"\nDevice time a step by kernel category at {seq} (rank 0; the last "
                  f"{PROFILED} steps; runs without a profile: {sorted(set(r) - set(profiled))})\n")  # fmt: skip
            if profiled:
                print(markdown_table(*side_by_side(profiled)))
        for name, x in r.items():
            if args.memory_peaks:
                print(f"\nWhat held the peak, {name} at {seq} (rank 0):\n")
                print(x.get("memory", "no allocator history came back"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
