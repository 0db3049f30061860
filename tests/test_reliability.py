"""Faults a week-long run meets: SIGKILL at random points (checkpoint writes included),
corrupt frames skipped on request, odd input to pack-shards, and a loader that neither
leaks nor overwrites under many epochs and state reloads."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import traceable_docs, write_synthetic

from pytrain.data import TokenLoader


def train_cmd(small_corpus, out: Path, steps: int) -> list[str]:
    train, val = small_corpus
    return [sys.executable, "-m", "pytrain.train", "--data.path", str(train), "--data.val_path", str(val),
            "--out_dir", str(out), "--name", "k", "--model.n_layer", "2", "--model.n_head", "2",
            "--model.d_model", "64", "--data.seq_len", "64", "--data.batch_size", "4",
            "--data.frames_per_block", "2", "--max_steps", str(steps), "--eval_every", "0",
            "--ckpt_every", "1", "--keep_ckpts", "2", "--log_every", "1", "--no-progress", "--no-tensorboard",
            "--samples", "0", "--deterministic", "--optim.grad_accum", "2"]  # fmt: skip


def losses_by_step(log: Path) -> dict[int, str]:
    """The last logged loss of every step (steps rerun after a kill log again)."""
    out = {}
    for step, loss in re.findall(r"step (\d+) loss (\S+)", log.read_text()):
        out[int(step)] = loss
    return out


def kill_and_resume(cmd: list[str], kills: int, seed: int, env: dict) -> int:
    """Runs `cmd` to completion, SIGKILLing it `kills` times at random moments."""
    rng = random.Random(seed)
    done_kills = 0
    while True:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        if done_kills < kills:
            time.sleep(rng.uniform(3.0, 6.0))  # start-up is ~3 s; steps take ~20 ms
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
                done_kills += 1
                continue
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
        return done_kills


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_uninterrupted(small_corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = 160
    ref = subprocess.run(
        train_cmd(small_corpus, tmp_path / "ref", steps), capture_output=True, text=True, env=env
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    kills = kill_and_resume(
        train_cmd(small_corpus, tmp_path / "killed", steps), kills=3, seed=1, env=env
    )
    assert kills == 3
    want = losses_by_step(tmp_path / "ref" / "k" / "train.log")
    got = losses_by_step(tmp_path / "killed" / "k" / "train.log")
    assert sorted(want) == list(range(1, steps + 1))
    assert got == want  # every step's loss, bit for bit (as printed)
    a = torch.load(tmp_path / "ref" / "k" / f"ckpt-{steps:08d}.pt", weights_only=False)
    b = torch.load(tmp_path / "killed" / "k" / f"ckpt-{steps:08d}.pt", weights_only=False)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["ranks"][0]["loader"] == b["ranks"][0]["loader"]


def test_skip_corrupt_frames_counts_them_and_delivers_the_rest(tmp_path):
    docs = traceable_docs([100] * 400)
    path = write_synthetic(tmp_path / "ds", docs, frame_bytes=4000)
    shard = path / "shard-00000.tks"
    data = bytearray(shard.read_bytes())
    data[50] ^= 0x01  # inside frame 0
    shard.write_bytes(bytes(data))
    loader = TokenLoader(
        path, seq_len=99, batch_size=4, num_epochs=1, skip_corrupt=True, shuffle=False
    )
    got = []
    for b in loader:
        got.append(b.tokens.numpy()[b.doc_ids.numpy() >= 0].copy())
        b.release()
    s = loader.stats()
    assert s["frames_skipped"] == 1
    assert "shard-00000.tks frame 0" in s["last_skipped"]
    delivered = np.concatenate(got)
    per_frame = 4000 // 4 // 100  # documents of 100 uint32 tokens per frame
    assert len(delivered) == (400 - per_frame) * 100
    assert delivered.min() >= per_frame * 10_000  # exactly frame 0's documents are missing


def test_loader_memory_stays_flat_over_epochs_and_state_reloads(tmp_path):
    path = write_synthetic(tmp_path / "ds", traceable_docs([300] * 600), frame_bytes=16384)
    loader = TokenLoader(path, seq_len=127, batch_size=8, frames_per_block=2)

    def rss_mb() -> float:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def cycle():
        for _ in range(200):  # more than an epoch (180k tokens, 1k per batch)
            next(loader).release()
        loader.load_state_dict(loader.state_dict())

    for _ in range(5):
        cycle()
    before = rss_mb()
    for _ in range(30):
        cycle()
    grown = rss_mb() - before
    assert loader.epoch >= 30
    assert grown < 20, f"RSS grew {grown:.1f} MiB over 30 reload cycles"


def test_pack_shards_unwritable_output_and_enormous_document(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytrain.pack_shards",
            str(tmp_path / "a.txt"),
            "-o",
            str(blocker / "ds"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and str(blocker) in r.stderr
    big = "word " * 1_500_000  # 7.5 MB, larger than a frame: gets a frame of its own
    (tmp_path / "big.txt").write_text(big)
    (tmp_path / "small.txt").write_text("tiny")
    out = tmp_path / "ds"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytrain.pack_shards",
            str(tmp_path / "big.txt"),
            str(tmp_path / "small.txt"),
            "-o",
            str(out),
            "--frame-mib",
            "1",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    from pytrain.shards import read_all_documents

    docs = read_all_documents(out)
    assert [len(d) for d in docs] == [len(big.encode()) + 1, 5]
