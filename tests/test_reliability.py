"""Faults a week-long run meets: SIGKILL at random points (checkpoint writes included), a
stop during set-up, corrupt frames skipped on request, odd input to pack-shards, and a
loader that neither leaks nor overwrites under many epochs and state reloads."""

from __future__ import annotations

import os
import signal
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


_SLOW_SET_UP = """
import sys, time
from pytrain.train import run_state, trainer
phase = sys.argv.pop(1)
def slowed(real):
    def slow(*a, **k):
        print("in set-up:", phase, file=sys.stderr, flush=True)
        time.sleep(5)
        return real(*a, **k)
    return slow
if phase == "resume":
    run_state.resume = slowed(run_state.resume)
else:
    trainer.Trainer.warm_up = slowed(trainer.Trainer.warm_up)
from pytrain.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase,sig", [("resume", signal.SIGTERM), ("warm_up", signal.SIGINT)], ids=["resume", "warm_up"]
)
def test_a_signal_during_set_up_ends_the_run_before_its_first_step_in_one_line(
    small_corpus, tmp_path, phase, sig
):
    """A scheduler's SIGTERM (or a Ctrl-C) while the run resumes or compiles: exit 128 + the
    signal, one line, no traceback; the run directory as it was, its lock free."""
    from test_run_safety import ENV, step_losses, train_cmd

    from pytrain.train import checkpoint
    from pytrain.train.run_lock import RunLock

    cmd = train_cmd(small_corpus, tmp_path, "setup", "--max_steps", "6", "--ckpt_every", "2")
    first = subprocess.run([*cmd, "--halt_after", "2"], capture_output=True, text=True,
                           env=ENV, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "runs" / "setup"
    ckpt = run / "ckpt-00000002.pt"
    before = {p.name: p.read_bytes() for p in run.glob("ckpt-*")}
    assert list(before) == [ckpt.name]
    # Set-up made slow where `phase` starts (the wrapper says when it is there).
    p = subprocess.Popen([sys.executable, "-c", _SLOW_SET_UP, phase, *cmd[3:]], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stderr is not None
    while not (line := p.stderr.readline()).startswith("in set-up:"):
        assert line, p.communicate()  # it ended before getting there
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, (p.returncode, out[-2000:], err[-3000:])
    assert err.strip().splitlines() == [
        f"pytrain.train: stopped by {sig.name} during set-up, before the first step: nothing "
        "to save; run the same command to continue"
    ], err[-3000:]
    assert "Traceback" not in out + err and "stopped at step" not in out
    # Nothing written is lost or added: the same checkpoint, no temporary; the lock is free.
    assert {p.name: p.read_bytes() for p in run.glob("*ckpt-*")} == before
    lock = RunLock(run)
    lock.acquire()
    lock.release()
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ckpt} at step 2" in r.stdout
    assert sorted(step_losses(run)) == list(range(1, 7))
    assert checkpoint.read(checkpoint.list_checkpoints(run)[-1])["step"] == 6


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
