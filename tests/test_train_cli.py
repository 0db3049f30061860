"""`python -m pytrain.train` end to end: the embedded default (on a small slice of the
standard library), TensorBoard events, checkpoints, and a resume that continues."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script, losses_by_step

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_embedded_default_trains_logs_checkpoints_and_resumes(tmp_path):
    env = {
        **os.environ,
        "PYTRAIN_CACHE": str(tmp_path / "cache"),
        "PYTRAIN_DEFAULT_MAX_BYTES": "1500000",
    }
    base = [sys.executable, "-m", "pytrain.train", "--out_dir", str(tmp_path / "runs"), "--no-progress",
            "--model.n_layer", "2", "--model.d_model", "128", "--model.vocab_size", "1024",
            "--data.seq_len", "128", "--data.batch_size", "8", "--eval_every", "30", "--eval_batches", "3",
            "--log_every", "5", "--ckpt_every", "30", "--optim.lr", "3e-3", "--optim.warmup_steps", "5", "--samples", "1", "--sample_tokens", "10"]  # fmt: skip
    r = subprocess.run(
        [*base, "--max_steps", "60"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout
    assert "building the embedded default dataset" in out
    assert "compile: eager (CPU" in out
    m = re.search(r"validation loss ([\d.]+) nats/token vs unigram baseline ([\d.]+)", out)
    assert m, out
    assert float(m.group(1)) < float(m.group(2))
    assert "--- sample 1 ---" in out and "tensorboard --logdir" in out
    # scripts/gpu_acceptance.py reads what the run chose from the start line.
    acceptance = load_script("scripts/gpu_acceptance.py", "acceptance")
    row = acceptance.Row("default", "")
    acceptance.read_setup(out, row)
    assert row.setup == "sdpa_mask, swiglu, 8x128x1", row.setup
    assert "| output layer fp32 |" in out  # the CPU's precision (it said bf16)
    run = tmp_path / "runs" / "default"
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in run.glob("ckpt-*.pt")) == ["ckpt-00000030.pt", "ckpt-00000060.pt"]
    losses = list(losses_by_step((run / "train.log").read_text()).values())
    assert losses[-1] < losses[0] - 1.0

    r = subprocess.run(
        [*base, "--max_steps", "70"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 60" in r.stdout
    assert "building the embedded default dataset" not in r.stdout  # cached
    assert "done: 70 steps" in r.stdout


@pytest.mark.slow  # a process each, importing torch
@pytest.mark.parametrize(
    "args, named",
    [
        (["--data.path", "{tmp}/missing"], "--data.path {tmp}/missing: no such directory"),
        (["--data.path", "{tmp}"], "--data.path {tmp}: not a dataset made by pack-shards"),
        (["--data.path", "{train}", "--data.val_path", "{tmp}/nope"], "--data.val_path {tmp}/nope"),
        (["--config", "{tmp}/none.toml"], "--config {tmp}/none.toml: no such file"),
        (["--config", "{tmp}/bad.toml"], "unknown setting 'model.n_layers'"),
        (["--optim.lrr", "1"], "unrecognized arguments: --optim.lrr"),
        (["--compile=maybe"], "'maybe' is not a boolean"),
        (["--model.mlp", "relu"], "model.mlp is 'relu'; expected one of swiglu, gelu"),
        (["--model.float8_head", "yes"], "model.float8_head is 'yes'; expected one of auto"),
        (
            ["--model.fused_gelu", "on"],
            "model.fused_gelu=on needs model.mlp=gelu and model.float8=off",
        ),
        # Without a dataset: checked before the embedded default would be built (the test
        # asserts nothing was built: it ran after that build, minutes into a first run).
        (["--model.fused_swiglu", "quack", "--device", "cpu"], "fused_swiglu=quack needs a CUDA"),
        (["--model.attention", "fa4", "--device", "cpu"], "attention 'fa4' needs a Hopper"),
        (
            ["--model.family", "moe", "--model.moe_kernel", "float8", "--device", "cpu"],
            "model.moe_kernel=float8 needs an NVIDIA GPU with FP8 matmuls",
        ),
        (["--model.n_head", "5"], "model.d_model 256 is not a multiple of model.n_head 5"),
        (["--precision", "fp8"], "precision is 'fp8'; expected one of auto, bf16, fp16, fp32"),
        (["--compile.mode", "fast"], "compile.mode is 'fast'; expected one of auto, reduce-over"),
        (["--data.mode", "stream"], "data.mode is 'stream'; expected one of pack, bucket"),
        # Each of these once ran (a typo of a schedule trained with cosine) or ended in a
        # traceback from deep in the set-up.
        (["--optim.schedule", "cosin"], "optim.schedule is 'cosin'; expected one of cosine"),
        (["--optim.master_weights", "yes"], "optim.master_weights is 'yes'; expected one of"),
        (["--data.strategy", "bestfit"], "data.strategy is 'bestfit'; expected one of best_fit"),
        (["--device", "gpu"], "device is 'gpu'; expected auto, cpu, cuda, cuda:N or mps"),
        (["--activation_checkpointing", "every-x"], "activation_checkpointing is 'every-x'"),
        (["--profile_steps", "3"], "profile_steps '3' is not 'A:B'"),
        (["--profile_steps", "3:1"], "profile_steps '3:1': need 0 <= A < B"),
        (["--profile_memory"], "--profile_memory records the steps of --profile_steps A:B"),
        (["--compile.inductor", "bogus"], "compile.inductor: 'bogus' is not name=value"),
        (["--data.seq_len", "0"], "data.seq_len is 0; expected a number >= 1"),
        (["--optim.lr", "-1"], "optim.lr is -1.0; expected a learning rate above 0"),
        (["--model.d_model", "100", "--model.n_head", "4"], "= 25, an odd head size: RoPE"),
        (["--data.stages", "1:a=0.5"], "--data.stages sets a mixture's weights from a step on"),
    ],
)
def test_user_errors_are_one_line_naming_the_path_or_key(tmp_path, small_corpus, args, named):
    """A wrong path or key: exit code 2 and one line that names it, no traceback."""
    (tmp_path / "bad.toml").write_text("[model]\nn_layers = 3\n")
    subst = {"tmp": str(tmp_path), "train": str(small_corpus[0])}
    args = [a.format(**subst) for a in args]
    r = subprocess.run(
        [sys.executable, "-m", "pytrain.train", "--out_dir", str(tmp_path / "runs"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTRAIN_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "cache").exists()  # no embedded default built before the line
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and named.format(**subst) in lines[0], r.stderr


def test_a_configuration_error_ends_without_loading_torch(tmp_path):
    """A mistyped setting's line and exit come at once: the configuration is checked before
    torch loads (two CPU-seconds), and the process ends without loading it afterwards."""
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pytrain.train", "--out_dir", str(tmp_path),
         "--model.mlp", "relu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "model.mlp is 'relu'" in r.stderr, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "pytrain.config" in imported, r.stderr[-2000:]  # what -X importtime lists
    assert "torch" not in imported and "pytrain.train.distributed" not in imported


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_a_mistyped_model_path_ends_eval_sample_and_export_without_loading_torch(tmp_path, command):
    """The path is checked before torch loads: its line and exit 2 at once, not after the
    seconds torch takes."""
    missing = tmp_path / "runs" / "nope"
    out = [str(tmp_path / "hf")] if command == "export" else []
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", f"pytrain.{command}",
                        str(missing), *out], capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert lines == [f"pytrain.{command}: error: {missing}: no such file or directory"], lines
    imported = {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")}  # fmt: skip
    assert "pytrain.config" in imported and "torch" not in imported
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_a_validation_set_or_source_of_another_tokenizer_is_refused(tmp_path, small_corpus):
    """Ids of another tokenizer mean other tokens: a validation set packed with one gave a
    loss with no meaning, silently; a mixture's source ended in the loader's ValueError."""
    from conftest import learnable_docs, write_synthetic

    other = write_synthetic(tmp_path / "other", learnable_docs(50, vocab=300), vocab=300)
    train = small_corpus[0]
    base = [sys.executable, "-m", "pytrain.train", "--out_dir", str(tmp_path / "runs"),
            "--max_steps", "1", "--no-progress"]  # fmt: skip
    for args, flags in (
        (["--data.path", str(train), "--data.val_path", str(other)],
         ("--data.val_path", "--data.path")),
        (["--data.mix", f"a={train}:0.5", f"b={other}:0.5"], ("--data.mix b", "--data.mix a")),
    ):  # fmt: skip
        r = subprocess.run([*base, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert r.stderr.strip().splitlines()[-1] == (
            f"pytrain.train: error: {flags[0]} {other} was packed with another tokenizer than "
            f"{flags[1]} {train} (synthetic: vocabulary 300, settings hash 000000000000; "
            "against synthetic: vocabulary 256, settings hash 000000000000): its ids would "
            "mean other tokens; pack it with the same tokenizer.json"
        )
    # The same tokenizer with 4-byte tokens: the loader's refusal, in one line.
    wide = write_synthetic(tmp_path / "wide", learnable_docs(50), dtype="uint32", vocab=256)
    r = subprocess.run([*base, "--data.mix", f"a={train}:0.5", f"b={wide}:0.5"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"pytrain.train: error: --data.mix: {wide} stores 4-byte tokens, {train} 2-byte ones: "
        "a mixture needs one token width (repack with the same --dtype)"
    )


@pytest.mark.slow
def test_a_mixture_from_the_command_line_trains_without_the_embedded_default(
    tmp_path, small_corpus
):
    """README's mixture command: --data.mix without --data.path (the preset has none) used
    to be given the embedded default as well, and refused as 'not both'."""
    train, val = small_corpus
    r = subprocess.run(
        [sys.executable, "-m", "pytrain.train", "--out_dir", str(tmp_path / "runs"),
         "--name", "mix", "--data.mix", f"a={train}:0.7", f"b={val}:0.3",
         "--data.stages", "1:a=0.5,b=0.5", "--data.val_mix", f"a={val}",
         "--model.n_layer", "1", "--model.d_model", "32", "--model.n_head", "2",
         "--data.seq_len", "32", "--data.batch_size", "2", "--data.frames_per_block", "1",
         "--max_steps", "2", "--eval_every", "2", "--eval_batches", "1", "--samples", "0",
         "--no-progress", "--no-tensorboard"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTRAIN_CACHE": str(tmp_path / "cache")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "embedded default" not in r.stdout and "done: 2 steps" in r.stdout
    assert not (tmp_path / "cache").exists()


def test_the_end_lines_peak_memory_reads_back_as_the_report_writes_it():
    """The scripts read the end line's peak memory (pytrain.train.cli.read_peak_memory)
    from what final_report writes: the same words, allocated GB and reserved GiB."""
    import inspect

    from pytrain.train import report
    from pytrain.train.cli import read_peak_memory

    written = inspect.getsource(report.final_report)
    assert 'f"; peak GPU memory {' in written and ' GB "' in written and 'GiB reserved)"' in written
    line = "done: 40 steps, 2,621,440 tokens in 30s; peak GPU memory 8.0 GB (9.31 GiB reserved)"
    assert read_peak_memory(line) == (8.0, 9.31)
    assert read_peak_memory("done: 40 steps, 2,621,440 tokens in 30s; compile fallbacks 0") is None
