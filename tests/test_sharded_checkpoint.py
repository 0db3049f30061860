"""FSDP2 checkpoints through torch.distributed.checkpoint, under torchrun itself (gloo,
small model): each rank writes its own shards (no rank gathers the whole state), a
checkpoint of 2 ranks resumes on 1 and back on 2, a single-file checkpoint of an earlier
run still resumes, sample and export read the shards in one process, and a tampered
`.metadata` runs nothing."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_run_safety import ENV, _Planted, children, one_line_error, step_losses, train_cmd

from pytrain.train import checkpoint, sharded_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def _leg(small_corpus, tmp_path, name: str, world: int, *flags: str) -> str:
    cmd = train_cmd(small_corpus, tmp_path, name, "--max_steps", "40", "--ckpt_every", "2",
                    *flags, torchrun=world)  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def _worker(small_corpus, tmp_path, name: str, script: str, *flags: str):
    """A 2-rank FSDP2 run under torchrun through one of the tests' worker scripts (in place
    of `-m pytrain.train`, with the same flags)."""
    cmd = train_cmd(small_corpus, tmp_path, name, "--max_steps", "40", "--fsdp", *flags,
                    torchrun=2)  # fmt: skip
    at = cmd.index("pytrain.train")
    cmd[at - 1 : at + 1] = [str(ROOT / "tests" / script)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.slow
def test_fsdp2_checkpoints_are_sharded_and_reshard_from_2_to_1_to_2_ranks(small_corpus, tmp_path):
    run = tmp_path / "runs" / "dcp"
    _leg(small_corpus, tmp_path, "dcp", 2, "--fsdp", "--halt_after", "4")
    ckpts = checkpoint.list_checkpoints(run)
    assert [c.name for c in ckpts] == ["ckpt-00000002", "ckpt-00000004"]  # directories
    files = sorted(p.name for p in ckpts[-1].iterdir())
    threads = sharded_checkpoint.WRITER_THREADS  # DCP's writer threads: a file each, per rank
    shards = [f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(threads)]
    assert files == [".metadata", *shards, "state.pt"], files
    # Written in the background by default, as single-file checkpoints are.
    log = (run / "train.log").read_text()
    assert "(sharded, written in the background;" in log
    # The line says where the loop's wait went (ShardedWriter.phases).
    assert re.search(r"the loop waited [\d.]+s, previous [\d.]+s, state_dict [\d.]+s, "
                     r"start [\d.]+s, host_memory [\d.]+s, copy [\d.]+s\)", log), log[-2000:]  # fmt: skip
    before = step_losses(run)
    out = _leg(small_corpus, tmp_path, "dcp", 1, "--fsdp", "--halt_after", "2")
    assert "resuming a run saved on 2 rank(s) on 1" in out and "at step 4" in out, out[-2000:]
    out = _leg(small_corpus, tmp_path, "dcp", 2, "--fsdp", "--halt_after", "2")
    assert "resuming a run saved on 1 rank(s) on 2" in out and "at step 6" in out, out[-2000:]
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, 9))
    # The loss continues where it was: no jump at either resume (a model or optimizer
    # state that did not load would start over near ln(4096) = 8.3, the model's vocabulary).
    assert abs(float(losses[5]) - float(before[4])) < 0.3 and float(losses[8]) < float(losses[1])
    assert checkpoint.read(checkpoint.list_checkpoints(run)[-1])["step"] == 8

    # One process reads the shards whole (pytrain.eval; export: tests/test_ddp.py).
    val = str(small_corpus[1])
    r = subprocess.run([sys.executable, "-m", "pytrain.eval", str(run), "--device", "cpu",
                        "--data", val, "--batches", "2", "--json"],
                       capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout[r.stdout.index("{") :])["loss"]
    # Trained weights (a model left at its initialisation scores ln(4096) = 8.3 here).
    assert got < 8.0 and abs(got - float(losses[8])) < 0.5, (got, losses[8])

    # A tampered .metadata (a pickle that calls open) is refused; nothing runs.
    marker = tmp_path / "PWNED"
    newest = checkpoint.list_checkpoints(run)[-1]
    (newest / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))  # DCP's format: pickle
    r = subprocess.run([sys.executable, "-m", "pytrain.eval", str(newest), "--device", "cpu",
                        "--data", val], capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert r.returncode != 0 and not marker.exists()
    line = one_line_error(r.stderr)
    assert ".metadata: refused to load" in line, line


@pytest.mark.slow
def test_a_ddp_checkpoint_is_refused_under_fsdp2_in_one_line(small_corpus, tmp_path):
    run = tmp_path / "runs" / "ddp"
    _leg(small_corpus, tmp_path, "ddp", 2, "--halt_after", "2")  # DDP: one file, rank 0's
    assert [c.name for c in checkpoint.list_checkpoints(run)] == ["ckpt-00000002.pt"]
    cmd = train_cmd(small_corpus, tmp_path, "ddp", "--max_steps", "40", "--fsdp", torchrun=2)
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode != 0
    line = next(x for x in r.stderr.splitlines() if "pytrain.train: error:" in x)
    assert "ckpt-00000002.pt was saved by a run without --fsdp" in line, line
    # Once (of three suites, 3 workers on 2 cores) rank 1 printed a traceback here; its
    # end, whole, says which exception escaped.
    assert f'File "{ROOT / "pytrain"}' not in r.stderr, r.stderr[-6000:]


@pytest.mark.slow
def test_a_single_file_fsdp2_checkpoint_of_the_previous_version_still_resumes(
    small_corpus, tmp_path
):
    run = tmp_path / "runs" / "legacy"
    r = _worker(small_corpus, tmp_path, "legacy", "legacy_fsdp_worker.py", "--halt_after", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c.name for c in checkpoint.list_checkpoints(run)] == ["ckpt-00000004.pt"]
    before = step_losses(run)
    out = _leg(small_corpus, tmp_path, "legacy", 2, "--fsdp", "--halt_after", "2")
    assert "ckpt-00000004.pt at step 4" in out, out[-2000:]
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, 7)) and abs(float(losses[5]) - float(before[4])) < 0.3
    assert checkpoint.list_checkpoints(run)[-1].name == "ckpt-00000006"  # now sharded


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["--ckpt_async", "--no-ckpt_async"])
def test_a_sharded_checkpoint_write_that_runs_out_of_space(small_corpus, tmp_path, writer):
    """In the background (the default: the error raised at the next wait)
    and written in the loop."""
    run = tmp_path / "runs" / "full"
    r = _worker(small_corpus, tmp_path, "full", "dcp_full_worker.py", "--ckpt_every", "2", writer)
    assert r.returncode != 0
    assert "exitcode  : 4" in r.stderr, r.stderr[-3000:]  # both ranks: the disk-full code
    line = next(x for x in r.stderr.splitlines() if "pytrain.train: error:" in x)
    assert "ckpt-00000004 not written: no space left" in line and "ckpt-00000002 is intact" in line
    assert [c.name for c in checkpoint.list_checkpoints(run)] == ["ckpt-00000002"]
    assert not list(run.glob(".ckpt-*"))  # no partial directory
    assert checkpoint.read(run / "ckpt-00000002")["step"] == 2


@pytest.mark.slow
def test_a_sharded_write_killed_midway_leaves_a_directory_the_next_start_removes(
    small_corpus, tmp_path
):
    """SIGKILL (an out-of-memory kill, a node lost) while ranks write their shards leaves the
    write's temporary directory; the next start of the run removes it, and only it."""
    run = tmp_path / "runs" / "killed"
    cmd = train_cmd(small_corpus, tmp_path, "killed", "--max_steps", "40", "--fsdp",
                    "--ckpt_every", "2", torchrun=2)  # fmt: skip
    at = cmd.index("pytrain.train")
    cmd[at - 1 : at + 1] = [str(ROOT / "tests" / "dcp_stall_worker.py")]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    unfinished = run / ".ckpt-00000004.tmp"
    try:
        t0 = time.monotonic()
        while not list(unfinished.glob("*.distcp")):  # the shards are being written
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() - t0 < 240, "no write of step 4's checkpoint began"
            time.sleep(0.05)
    finally:
        if p.poll() is None:  # both ranks (each started with start_new_session), then torchrun
            for pid in [*children(p.pid), p.pid]:
                os.kill(pid, signal.SIGKILL)
        p.communicate()
    assert unfinished.is_dir()  # what the killed write left
    assert [c.name for c in checkpoint.list_checkpoints(run)] == ["ckpt-00000002"]
    alike = [run / ".ckpt-notes.tmp", run / ".ckpt-00000006.tmp.keep"]  # not the writer's names
    for d in alike:
        d.mkdir()
    out = _leg(small_corpus, tmp_path, "killed", 2, "--fsdp", "--halt_after", "1")
    assert re.search(rf"resumed from {re.escape(str(run / 'ckpt-00000002'))} at step 2 "
                     r"\(read in \d+\.\ds\)", out), out[-2000:]  # fmt: skip
    assert not unfinished.exists()
    assert all(d.is_dir() for d in alike)
    assert [c.name for c in checkpoint.list_checkpoints(run)] == ["ckpt-00000002", "ckpt-00000003"]


def test_only_the_sharded_writers_unfinished_directories_are_removed(tmp_path):
    ours = [tmp_path / ".ckpt-00000004.tmp", tmp_path / ".ckpt-00000010.tmp"]
    others = [
        tmp_path / ".ckpt-4.tmp",
        tmp_path / "ckpt-00000004",
        tmp_path / ".ckpt-00000004.tmpx",
    ]
    for d in ours + others:
        d.mkdir()
    (ours[0] / "__0_0.distcp").write_bytes(b"part of a shard")
    single = tmp_path / ".ckpt-00000004.pt.tmp-123"  # a single-file write's (checkpoint.save's)
    single.write_bytes(b"x")
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / ".ckpt-00000008.tmp"  # a link named as ours: what it points to is not
    link.symlink_to(tmp_path / "elsewhere")
    sharded_checkpoint.remove_unfinished(tmp_path, is_main=False)  # rank 0 removes them
    assert all(d.exists() for d in ours)
    sharded_checkpoint.remove_unfinished(tmp_path, is_main=True)
    assert not any(d.exists() for d in ours)
    assert all(d.is_dir() for d in others) and single.exists() and link.is_symlink()
    assert (tmp_path / "elsewhere").is_dir()


def test_the_metadata_unpickler_rebuilds_dcp_classes_and_refuses_their_modules_functions():
    """Names DCP's modules define or import (a function that writes files, say) are not
    classes of its metadata: a pickle that calls one is refused."""
    import torch.distributed.checkpoint.filesystem as fs
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from pytrain.train.sharded_checkpoint import _MetadataUnpickler

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    assert _MetadataUnpickler(io.BytesIO(pickle.dumps(chunk))).load() == chunk

    class CallsAFunction:
        def __reduce__(self):
            return (fs._write_item, ())

    with pytest.raises(pickle.UnpicklingError, match="_write_item"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(CallsAFunction()))).load()


def test_the_host_buffer_is_registered_in_pieces_that_split_no_tensor():
    """HostCopies pins its buffer in pieces of at most CHUNK bytes (one larger tensor alone
    excepted) that meet at tensors' starts: every tensor starts on a page of its own (the
    buffer too), so that no copy spans two registrations and no two share a page. The
    pieces cover the buffer in order; copies into the buffer keep their values."""
    g = torch.Generator().manual_seed(0)
    sizes = [3, 5000, 1, 70_000, 257, 0, 9000, 130_000, 12, 4096]
    tensors = {"a": {str(i): torch.randn(n, generator=g) for i, n in enumerate(sizes)},
               "b": torch.arange(10, dtype=torch.int64)}  # fmt: skip
    layout = sharded_checkpoint.HostCopies.layout_of(tensors)
    host = sharded_checkpoint.HostCopies(layout, pin=False)
    page = sharded_checkpoint.HostCopies.ALIGN
    assert host.buffer.data_ptr() % page == 0
    assert all(offset % page == 0 for offset, _, _ in layout.values())
    spans = sorted((o, o + sharded_checkpoint._nbytes(d, s)) for o, d, s in layout.values())
    size = host.buffer.numel()
    for chunk in (1, 100_000, 300_000, 1 << 30):
        pieces = sharded_checkpoint.HostCopies.pieces(layout, size, chunk)
        assert pieces[0][0] == 0 and pieces[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
        for start, stop in pieces:
            inside = [(o, e) for o, e in spans if start <= o < stop]
            assert stop - start <= chunk or len([e for o, e in inside if e > o]) == 1
            assert all(e <= stop for o, e in inside), (chunk, start, stop)  # none split
            assert start % page == 0
    assert len(sharded_checkpoint.HostCopies.pieces(layout, size, 1 << 30)) == 1
    copies = host.copy(tensors)
    for k, t in tensors["a"].items():
        assert torch.equal(copies["a"][k], t)
    assert torch.equal(copies["b"], tensors["b"])


def test_the_writers_gloo_group_is_made_with_it_where_a_process_group_is_up(tmp_path):
    """The background writer's gloo group (DCP's collectives) is made when the writer is,
    at set-up where every rank is in step, not at the first save; without a process group
    (one process) there is none to make until a save."""
    import torch.distributed as dist

    assert sharded_checkpoint.ShardedWriter()._group is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        group = sharded_checkpoint.ShardedWriter()._group
        assert group is not None and dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()
