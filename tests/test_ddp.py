"""Two-process DDP on CPU (gloo) through torchrun: ranks get disjoint data, and the
all-reduced gradients equal single-process gradients on the union of their batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import small_cfg

from pytrain.data import DeviceBatch
from pytrain.trainer import Trainer


def cfg_args(small_corpus, tmp_path):
    train, val = small_corpus
    return [
        "--data.path", str(train), "--data.val_path", str(val), "--out_dir", str(tmp_path / "runs"),
        "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64",
        "--data.seq_len", "64", "--data.batch_size", "4", "--data.frames_per_block", "1",
        "--optim.grad_accum", "2", "--no-tensorboard", "--no-progress", "--no-compile.safe_env",
    ]  # fmt: skip


@pytest.mark.slow
def test_two_process_gloo_ddp_matches_single_process(small_corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
           str(Path(__file__).parent / "ddp_worker.py"), str(tmp_path), *cfg_args(small_corpus, tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    # Disjoint: the two ranks read different frames, so their batches differ.
    for a in ranks[0]["batches"]:
        for b in ranks[1]["batches"]:
            assert not torch.equal(a["input_ids"], b["input_ids"])
    assert ranks[0]["loader_state"]["world_size"] == 2
    # All-reduced gradients are the same on both ranks ...
    for g0, g1 in zip(ranks[0]["grads"], ranks[1]["grads"], strict=True):
        torch.testing.assert_close(g0, g1)
    # ... and equal to one process over the union of both ranks' micro-batches.
    single = Trainer(small_cfg(small_corpus, tmp_path / "single", "--model.n_layer", "2"))
    union = [
        DeviceBatch(**b, epoch=0, doc_tokens=0, pad_tokens=0) for rk in ranks for b in rk["batches"]
    ]
    single.optimizer.zero_grad()
    single._forward_backward(union, ranks[0]["denom"])
    for g, p in zip(ranks[0]["grads"], single.gpt.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    single.close()
