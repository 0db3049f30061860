"""Background checkpoint writes (pytrain/train/checkpoint.py AsyncWriter): the file holds
the state as it was when saved, errors reach the training thread, one write at a time."""

from __future__ import annotations

import pytest
import torch

from pytrain.train import checkpoint


def test_the_file_holds_the_state_at_submit_time(tmp_path):
    w = torch.arange(6.0)
    state = {"model": {"w": w}, "step": 1, "nested": [torch.ones(2), (3, "x")]}
    writer = checkpoint.AsyncWriter()
    writer.submit(tmp_path, 1, state, keep=2)
    w.add_(100)  # training goes on while the file is written
    state["nested"][0].zero_()
    writer.wait()
    saved = checkpoint.read(checkpoint.ckpt_path(tmp_path, 1))
    assert torch.equal(saved["model"]["w"], torch.arange(6.0))
    assert torch.equal(saved["nested"][0], torch.ones(2)) and saved["nested"][1] == (3, "x")
    assert saved["step"] == 1 and writer.last is not None


def test_keep_n_and_one_write_at_a_time(tmp_path):
    writer = checkpoint.AsyncWriter()
    for step in range(1, 6):
        writer.submit(tmp_path, step, {"step": step, "t": torch.full((3,), step)}, keep=2)
    writer.wait()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "ckpt-00000004.pt",
        "ckpt-00000005.pt",
    ]
    state, path = checkpoint.load_latest(tmp_path)
    assert state["step"] == 5 and path.name == "ckpt-00000005.pt"


def test_a_failed_write_is_raised_in_the_training_thread(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    writer = checkpoint.AsyncWriter()
    writer.submit(not_a_dir, 1, {"step": 1}, keep=2)  # returns: the write fails later
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # raised once


def test_stale_temporary_files_of_killed_writes_are_removed(tmp_path):
    stale = tmp_path / ".ckpt-00000003.pt.tmp-999999"
    stale.write_bytes(b"half a checkpoint")
    checkpoint.save(tmp_path, 4, {"step": 4}, keep=2)
    assert not stale.exists()
    assert checkpoint.load_latest(tmp_path)[0]["step"] == 4
