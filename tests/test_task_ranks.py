"""Downstream tasks scored under torchrun (2 CPU ranks, gloo): each rank scores its share
of the rows and one all-reduce gathers them; every rank ends with the scores that one
process gives the same weights (the run's last checkpoint, scored afterwards)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PORTS
from test_task_training import args, dataset  # noqa: F401 (a fixture)

from pytrain.eval import score_tasks

HERE = Path(__file__).parent


def torchrun_scores(d: Path, tmp_path: Path, *flags: str) -> list[dict]:
    """tests/task_rank_worker.py on 2 ranks: a 2-step run scoring d's tasks at its end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    run = args(d, tmp_path, "--eval.tasks", str(d / "tasks"), "--max_steps", "2",
               "--eval_every", "0", "--no-tensorboard", *flags)  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={next(PORTS)}", str(HERE / "task_rank_worker.py"), str(tmp_path), *run]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [torch.load(tmp_path / f"tasks-rank{i}.pt") for i in (0, 1)]


def assert_one_process_scores(ranks: list[dict], d: Path, run: Path) -> None:
    # Each rank scored some of the rows, together all of them ...
    assert all(r["mine"] > 0 for r in ranks), [r["mine"] for r in ranks]
    assert sum(r["mine"] for r in ranks) == ranks[0]["rows"]
    # ... and every rank has every request's score, equal to one process's on the same
    # weights (the run's end is its last checkpoint).
    assert ranks[0]["tasks"] == ranks[1]["tasks"] and ranks[0]["core"] == ranks[1]["core"]
    one = score_tasks(str(run), [str(d / "tasks")], batch_rows=4)
    assert list(ranks[0]["tasks"]) == [t.name for t in one.tasks] == ["code", "words"]
    for t in one.tasks:
        loglik, *accs = ranks[0]["tasks"][t.name]
        assert len(loglik) == len(t.loglik) and loglik == pytest.approx(t.loglik, abs=1e-5)
        assert accs == [t.acc, t.acc_norm, t.acc_bytes]
    assert ranks[0]["core"] == one.core


@pytest.mark.slow
def test_ddp_ranks_score_their_share_and_gather_one_process_s_scores(dataset, tmp_path):  # noqa: F811
    ranks = torchrun_scores(dataset, tmp_path)
    assert ranks[0]["plan"] == "ddp"
    assert_one_process_scores(ranks, dataset, tmp_path / "run")


@pytest.mark.slow
def test_fsdp2_ranks_run_in_lockstep_and_gather_one_process_s_scores(dataset, tmp_path):  # noqa: F811
    # 11 requests a row, 4 rows a forward: 3 forwards, rows 0-3 and 8-10 on rank 0, 4-7 on
    # rank 1, which runs a spare one (FSDP2 gathers each block's weights in each forward,
    # on every rank; a rank short of one would leave the other waiting in its all-gather).
    ranks = torchrun_scores(dataset, tmp_path, "--fsdp", "--dist_timeout_s", "30")
    assert ranks[0]["plan"] == "fsdp2"
    assert [r["mine"] for r in ranks] == [7, 4]
    assert_one_process_scores(ranks, dataset, tmp_path / "run")
