"""benchmarks/checkpoint.py --fsdp, small: two gloo ranks under torchrun save the CPU preset's
sharded state with the trainer's background writer, print each save's loop hold by phase,
and load it back by the resume path into a fresh model, checking the tensors it saved."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PORTS
from test_run_safety import ENV

from pytrain.train.sharded_checkpoint import WRITER_THREADS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_fsdp_mode_prints_each_save_and_loads_what_it_saved(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={next(PORTS)}", str(ROOT / "benchmarks" / "checkpoint.py"), "--fsdp",
           "--device", "cpu", "--preset", "configs/cpu-default.toml", "--saves", "3",
           "--cold", "--dir", str(tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    heads = "| save | loop held | previous | state_dict | start | host_memory | copy | copies done after | write done after |"
    assert heads in r.stdout, r.stdout
    for i in (1, 2, 3):
        row = next(line for line in r.stdout.splitlines() if line.startswith(f"| save {i} |"))
        assert len(row.split("|")) == len(heads.split("|")), row  # every phase has a figure
    rows = dict(
        line.strip("| ").split(" | ", 1) for line in r.stdout.splitlines() if line.count("|") == 3
    )
    assert rows["loaded state equals the saved"].startswith("yes ("), rows
    files = 2 * WRITER_THREADS + 2  # each rank's shard files, .metadata, state.pt
    assert rows["one checkpoint on disk"].endswith(f"in {files} files"), rows
    load = rows["load (resume: state.pt, then each rank's shards)"]
    assert float(load.split()[0]) > 0, rows
    # --cold: the checkpoint read back was the size of one on disk, dropped from the cache
    disk = rows["one checkpoint on disk"].split()[0]
    assert f"cold (its {disk} GB dropped from the page cache first)" in load, rows
    assert not (tmp_path / "checkpoint-bench").exists()  # its checkpoints are removed


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux's fincore")
def test_evict_drops_the_files_from_the_page_cache(tmp_path):
    """What --cold does before the load: after evict(), none of a just-written file's
    pages are in the page cache (util-linux's fincore reads the kernel's mincore)."""
    from conftest import load_script

    evict = load_script("benchmarks/checkpoint.py", "checkpoint_bench").evict
    (tmp_path / "shards").mkdir()
    f = tmp_path / "shards" / "a.distcp"
    f.write_bytes(os.urandom(4 << 20))
    f.read_bytes()

    def resident() -> int:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(f)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(out.split()[0])  # fmt: skip

    if resident() == 0:
        pytest.skip("this file system keeps no page cache for the file")
    assert evict(tmp_path) == 4 << 20
    assert resident() == 0
