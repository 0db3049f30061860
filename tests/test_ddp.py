"""Two processes on CPU (gloo) through torchrun, under DDP and under FSDP2 (fully_shard):
ranks get disjoint data, and the reduced gradients equal single-process gradients on the
union of their batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PORTS, losses_by_step
from test_trainer import small_cfg

from pytrain.data import DeviceBatch, TokenLoader, token_ids
from pytrain.train.trainer import Trainer


def cfg_args(small_corpus, tmp_path):
    train, val = small_corpus
    return [
        "--data.path", str(train), "--data.val_path", str(val), "--out_dir", str(tmp_path / "runs"),
        "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64",
        "--data.seq_len", "64", "--data.batch_size", "4", "--data.frames_per_block", "1",
        "--optim.grad_accum", "2", "--no-tensorboard", "--no-progress", "--no-compile.safe_env",
    ]  # fmt: skip


def run_worker(small_corpus, tmp_path, *flags: str) -> None:
    """tests/ddp_worker.py on 2 gloo ranks under torchrun, the small model's settings and
    `flags`; each rank writes its results under tmp_path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={next(PORTS)}",
           str(Path(__file__).parent / "ddp_worker.py"), str(tmp_path), *cfg_args(small_corpus, tmp_path), *flags]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "wrapper", ["ddp", "fsdp2", "fsdp2-selective", "fsdp2-untied", "fsdp2-held", "replicas"]
)
def test_two_process_gloo_matches_single_process(small_corpus, tmp_path, wrapper):
    # bf16 replicas: each rank's bf16 gradients summed in fp32, the sums all-reduced once.
    bf16 = ["--precision", "bf16", "--optim.master_weights", "on"]
    # fsdp2-selective: every block recomputed in the backward inside FSDP2's hooks (the
    # checkpoint sits in Block.forward), its gradients those of one process without it.
    selective = ["--fsdp", "--activation_checkpointing", "selective"]
    # fsdp2-untied: the embedding apart from the output layer, a unit of FSDP2's own.
    untied = ["--model.tie_embeddings", "false"]
    # fsdp2-held: the gathered weights kept through the step (fsdp_hold_weights).
    held = ["--fsdp", "--fsdp_hold_weights", "true"]
    flags = {"ddp": [], "fsdp2": ["--fsdp"], "fsdp2-selective": selective,
             "fsdp2-untied": ["--fsdp", *untied], "fsdp2-held": held, "replicas": bf16}[wrapper]  # fmt: skip
    run_worker(small_corpus, tmp_path, *flags)
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    # Disjoint: the two ranks read different frames, so their batches differ.
    for a in ranks[0]["batches"]:
        for b in ranks[1]["batches"]:
            assert not torch.equal(a["input_ids"], b["input_ids"])
    assert ranks[0]["loader_state"] == ranks[1]["loader_state"]  # one state for every rank
    assert ranks[0]["plan"] == wrapper.split("-")[0]
    assert ranks[0]["embed_unit"] == (wrapper == "fsdp2-untied")
    if wrapper in ("fsdp2", "fsdp2-held", "fsdp2-untied"):
        # 3 units (2 blocks, the root): the blocks gathered for each forward and backward
        # and the root for each forward, 5 a micro-batch, 2 micro-batches; or, held, once
        # each in the step. Untied, the embedding is a fourth, gathered for its forward
        # only (its backward reads the token ids alone): 6 a micro-batch. Either way the
        # step ends with the weights sharded.
        assert (
            ranks[0]["all_gathers"] == {"fsdp2": 10, "fsdp2-held": 3, "fsdp2-untied": 12}[wrapper]
        )
        assert ranks[0]["resharded"]
    # All-reduced gradients are the same on both ranks ...
    assert ranks[0]["grads"].keys() == ranks[1]["grads"].keys()
    for name, g0 in ranks[0]["grads"].items():
        torch.testing.assert_close(g0, ranks[1]["grads"][name])
    # ... and equal to one process over the union of both ranks' micro-batches.
    extra = ["--model.n_layer", "2", *(bf16 if wrapper == "replicas" else []),
             *(untied if wrapper == "fsdp2-untied" else [])]  # fmt: skip
    single = Trainer(small_cfg(small_corpus, tmp_path / "single", *extra))
    union = [
        DeviceBatch(**b, epoch=0, doc_tokens=0, pad_tokens=0) for rk in ranks for b in rk["batches"]
    ]
    single.optimizer.zero_grad()
    single._forward_backward(union, ranks[0]["denom"])
    if wrapper == "replicas":  # the 4 micro-batches' sums in fp32, in the optimizer
        want = single.optimizer.per_param(single.optimizer.flat_grad)
    else:
        want = {id(p): p.grad for p in single.gpt.parameters()}
    for name, p in single.gpt.named_parameters():
        got, ref = ranks[0]["grads"][name], want[id(p)]
        if wrapper == "replicas":  # bf16 gradients: equal up to bf16's rounding (the ranks'
            # matmuls sum in another order); a wrong average, or a micro-batch left out, is
            # off by half the norm or more.
            assert float((got - ref).norm() / ref.norm()) < 1e-2, name
        else:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)
    single.close()
    if wrapper == "ddp":
        # close() destroyed the process group and joined its threads (not left running
        # into interpreter exit, where a rank once died of SIGABRT after its work was done).
        # FSDP2's sharded parameters keep their mesh, and so the group, until exit.
        for i in (0, 1):
            threads = (tmp_path / f"threads-rank{i}.txt").read_text().split()
            assert not [n for n in threads if "gloo" in n], (i, threads)


@pytest.mark.slow
def test_fsdp2_reduces_gradients_in_bf16_where_asked(small_corpus, tmp_path):
    # One bf16 micro-batch a rank under FSDP2: each rank's gradients are bf16 (its weights
    # gathered in bf16). Summed over the ranks in fp32, FSDP2's default, few of the sums are
    # bf16 values; reduced in bf16 (fsdp_reduce_dtype) every one is, up to the sum's order.
    run_worker(small_corpus, tmp_path, "--optim.grad_accum", "1", "--fsdp", "--precision", "bf16",
               "--fsdp_reduce_dtype", "bf16")  # fmt: skip
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert "gradients reduced in bf16 (fsdp_reduce_dtype)" in rank0["plan_line"]
    for name, g in rank0["grads"].items():
        assert g.dtype == torch.float32, name  # the shards accumulate in fp32
        assert torch.equal(g, g.bfloat16().float()), name
        assert g.abs().sum() > 0, name


def assert_same_weights(run: Path, reference: Path, step: int) -> None:
    """The newest checkpoints of two run directories are of `step` and hold the same model
    weights, bit for bit (a sharded checkpoint read whole)."""
    from pytrain.model.load import load

    got, want = load(run), load(reference)
    assert got.step == want.step == step, (got.step, want.step, step)
    a, b = got.gpt.state_dict(), want.gpt.state_dict()
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def torchrun_train(small_corpus, tmp_path, name: str, port: int, *flags: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "-m", "pytrain.train", *cfg_args(small_corpus, tmp_path), "--name", name, "--fsdp",
           "--max_steps", "6", "--ckpt_every", "1", "--log_every", "1", "--eval_every", "0",
           "--samples", "0", "--optim.warmup_steps", "2", *flags]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return (tmp_path / "runs" / name / "train.log").read_text()


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_exactly_with_bf16_moments(small_corpus, tmp_path):
    # A resumed 2-rank FSDP2 run continues with the losses of an uninterrupted one, bit for
    # bit, and ends with the same weights, with bf16 moments (CompactAdamW), whose checkpoint
    # holds them in bf16. (With fp32 moments, the default, the same holds of FSDP2 over two
    # agents killed and restarted: tests/test_acceptance_rows.py's two-agent row on CPU ranks.)
    flags = ("--optim.state_dtype", "bf16")
    whole = losses_by_step(torchrun_train(small_corpus, tmp_path, "whole", next(PORTS), *flags))
    torchrun_train(small_corpus, tmp_path, "cut", next(PORTS), "--halt_after", "3", *flags)
    ckpts = sorted((tmp_path / "runs" / "cut").glob("ckpt-*"))
    assert ckpts, "the halted run wrote no checkpoint"
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(ckpts[-1])).read_metadata().state_dict_metadata
    dtypes = {m.properties.dtype for k, m in saved.items() if k.endswith("exp_avg_sq")}
    assert dtypes == {torch.bfloat16}
    resumed = losses_by_step(torchrun_train(small_corpus, tmp_path, "cut", next(PORTS), *flags))
    assert len(whole) == 6 and set(resumed) >= {4, 5, 6}
    for step in (4, 5, 6):
        assert resumed[step] == whole[step], (step, resumed[step], whole[step])
    assert_same_weights(tmp_path / "runs" / "cut", tmp_path / "runs" / "whole", 6)


def _torchrun(n: int, port: int, script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
           f"--master_port={port}", str(Path(__file__).parent / script), *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.slow
def test_fsdp2_shards_step_fused_with_clipping_and_skips_as_the_plain_step(tmp_path):
    """FSDP2 with torch's fused AdamW (as on CUDA): the clip factor and the guard's skip go
    to the kernel as 0-d tensors beside the sharded DTensors. The weights after a clipped
    step, a skipped one (NaN loss) and two more equal the plain path's (clip_grad_norm_,
    step) within rounding, and the skip left the step counts alone."""
    _torchrun(2, next(PORTS), "fused_fsdp_worker.py", str(tmp_path / "out.pt"))
    got = torch.load(tmp_path / "out.pt")
    fused, plain = got["fused"], got["plain"]
    assert fused["skips"] == plain["skips"] == [False, True, False, False]
    assert fused["norms"] == pytest.approx(plain["norms"], rel=1e-5)
    assert max(fused["norms"]) > 0.05  # the clip (at 0.05) did cut steps
    assert fused["state_steps"] == plain["state_steps"] == [3.0] * 4
    for a, b in zip(fused["weights"], plain["weights"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "after,mix,wrapper",
    [
        (1, False, "ddp"),
        (3, True, "ddp"),  # 3 ranks from 2, on a mixture (a plain dataset: 1 from 2 above)
        (1, False, "replicas"),
    ],
)
def test_training_resumes_on_another_number_of_processes(
    small_corpus, tmp_path, after, mix, wrapper
):
    """2 processes train 3 steps and stop (checkpoint), then `after` processes resume to
    step 5: together they trained on exactly the first global batches of the stream, each
    once (no batch lost, none repeated), also for a mixture, and for bf16 replicas with fp32
    masters. (FSDP2's sharded checkpoint resharded, 4 ranks onto 2, and the same rows:
    tests/test_resharded_resume.py.)"""
    if 0 < torch.cuda.device_count() < after:
        pytest.skip(
            f"{after} ranks on this host's {torch.cuda.device_count()} GPU(s): one GPU a rank"
        )
    flags = {
        "ddp": [],
        "replicas": ["--precision", "bf16", "--optim.master_weights", "on"],
    }
    train, val = small_corpus
    data = ["--data.mix", f"a={train}:0.7", f"b={val}:0.3"] if mix else ["--data.path", str(train)]
    args = [
        *data, "--out_dir", str(tmp_path / "runs"), "--name", "el", "--max_steps", "5",
        "--model.n_layer", "1", "--model.n_head", "2", "--model.d_model", "32",
        "--data.seq_len", "64", "--data.batch_size", "2", "--data.frames_per_block", "1",
        "--optim.grad_accum", "2", "--eval_every", "0", "--ckpt_every", "0", "--samples", "0",
        "--no-tensorboard", "--no-progress", "--no-compile.safe_env", *flags[wrapper],
    ]  # fmt: skip
    _torchrun(
        2,
        next(PORTS),
        "elastic_worker.py",
        str(tmp_path),
        "first",
        *args,
        "--halt_after",
        "3",
    )
    log = _torchrun(
        after,
        next(PORTS),
        "elastic_worker.py",
        str(tmp_path),
        "second",
        *args,
    )
    assert f"resuming a run saved on 2 rank(s) on {after}" in log
    got = []
    for tag, world in (("first", 2), ("second", after)):
        for r in range(world):
            saved = torch.load(tmp_path / f"{tag}-rank{r}.pt", weights_only=False)
            assert saved["step"] == (3 if tag == "first" else 5)
            got += [tuple(row.tolist()) for rows in saved["rows"] for row in rows]
    # The same stream read by one process: 2 ranks x 2 micro-batches x 3 steps, then
    # `after` ranks x 2 x 2.
    n = 2 * 2 * 3 + after * 2 * 2
    cfg = small_cfg(small_corpus, tmp_path / "ref", *data, "--data.seq_len", "64",
                    "--data.batch_size", "2", "--data.frames_per_block", "1")  # fmt: skip
    weights = {"a": 0.7, "b": 0.3} if mix else None
    source = {"a": train, "b": val} if mix else train
    want = []
    with TokenLoader(source, cfg.data, weights=weights) as ref:
        for _, b in zip(range(n), ref, strict=False):
            want += [tuple(row.tolist()) for row in token_ids(b.tokens)]
            b.release()
    assert sorted(got) == sorted(want)


@pytest.mark.slow
def test_muon_under_ddp_keeps_ranks_equal_and_resumes_on_one_process(small_corpus, tmp_path):
    """Muon (Newton-Schulz on each rank) over DDP's all-reduced gradients: both ranks hold
    the same weights after 3 steps; a 1-process run continues the checkpoint."""
    train, _ = small_corpus
    args = [
        "--data.path", str(train), "--out_dir", str(tmp_path / "runs"), "--name", "mu",
        "--max_steps", "4", "--model.n_layer", "1", "--model.n_head", "2", "--model.d_model", "32",
        "--data.seq_len", "64", "--data.batch_size", "2", "--data.frames_per_block", "1",
        "--optim.grad_accum", "2", "--optim.name", "muon", "--eval_every", "0", "--ckpt_every", "0",
        "--samples", "0", "--no-tensorboard", "--no-progress", "--no-compile.safe_env",
    ]  # fmt: skip
    _torchrun(
        2, next(PORTS), "elastic_worker.py", str(tmp_path), "first", *args, "--halt_after", "3"
    )
    a, b = (torch.load(tmp_path / f"first-rank{r}.pt", weights_only=False) for r in (0, 1))
    assert a["step"] == b["step"] == 3
    for name, p in a["params"].items():
        torch.testing.assert_close(p, b["params"][name], rtol=0, atol=0)
    log = _torchrun(1, next(PORTS), "elastic_worker.py", str(tmp_path), "second", *args)
    assert "resuming a run saved on 2 rank(s) on 1" in log
    c = torch.load(tmp_path / "second-rank0.pt", weights_only=False)
    assert c["step"] == 4
    assert any(not torch.equal(p, c["params"][n]) for n, p in a["params"].items())


@pytest.mark.slow
def test_an_fsdp2_checkpoint_exports_to_transformers(small_corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    from pytrain.export import export
    from pytrain.model.hf import LOGITS_TOLERANCE
    from pytrain.model.load import load

    args = [*cfg_args(small_corpus, tmp_path), "--fsdp", "--name", "fsdp", "--max_steps", "2",
            "--eval_every", "0", "--ckpt_every", "0", "--samples", "0"]  # fmt: skip
    _torchrun(2, next(PORTS), "elastic_worker.py", str(tmp_path), "fsdp", *args)
    out = export(tmp_path / "runs" / "fsdp", tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ours = load(tmp_path / "runs" / "fsdp").gpt
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert (model(ids).logits - ours(ids)).abs().max().item() < LOGITS_TOLERANCE
