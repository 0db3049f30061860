"""Faults a week-long run meets: SIGKILL at random points (checkpoint writes included),
corrupt frames skipped on request, odd input to pack-shards, and a loader that neither
leaks nor overwrites under many epochs and state reloads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import traceable_docs, write_synthetic

from pytrain.data import TokenLoader

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from kill_resume_sweep import kill_and_resume, losses_by_step, same_final_params, train_cmd  # noqa: E402


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_uninterrupted(small_corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = 160
    train, val = small_corpus
    ref = subprocess.run(
        train_cmd(train, val, tmp_path / "ref", steps), capture_output=True, text=True, env=env
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    # Each background checkpoint write pauses halfway for 0.15 s (of ~0.03 s a step). The
    # first two kills wait for a write to be under way, so they leave truncated temporary
    # files behind on a machine of any speed; the third lands wherever its moment falls.
    kills, mid_write = kill_and_resume(
        train_cmd(train, val, tmp_path / "killed", steps, slow_write=0.15),
        kills=3,
        seed=1,
        env=env,
        run_dir=tmp_path / "killed" / "k",
        in_writes=2,
    )
    assert kills == 3 and mid_write >= 2, (kills, mid_write)
    want = losses_by_step(tmp_path / "ref" / "k" / "train.log")
    got = losses_by_step(tmp_path / "killed" / "k" / "train.log")
    assert sorted(want) == list(range(1, steps + 1))
    assert got == want  # every step's loss, bit for bit (as printed)
    ckpt = f"ckpt-{steps:08d}.pt"
    assert same_final_params(tmp_path / "ref" / "k" / ckpt, tmp_path / "killed" / "k" / ckpt)


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
    from pytrain.data.documents import read_all_documents

    docs = read_all_documents(out)
    assert [len(d) for d in docs] == [len(big.encode()) + 1, 5]
