"""Ranks that fail, under torchrun itself (gloo, 2 processes, small model): a rank killed
with SIGKILL brings the job down at once and `--max-restarts` resumes it from the last
checkpoint; a rank that hangs (SIGSTOP) ends the job after the process group's timeout
instead of never. Each time the losses after the checkpoint equal an uninterrupted run's
bit for bit (the loader continues exactly), and so do the final weights."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed
from conftest import SLURM, learnable_docs, slurm_job_state, write_synthetic
from filelock import FileLock
from test_ddp import assert_same_weights, cfg_args
from test_run_safety import ENV, _ports, children, step_losses, train_cmd, wait_for_step

from pytrain.train import checkpoint

ROOT = Path(__file__).resolve().parent.parent

STEPS = 60


@pytest.fixture(scope="session")
def reference(small_corpus, tmp_path_factory) -> Path:
    """The run directory of the same 2-rank job, never interrupted. Made once a pytest run
    and shared by pytest-xdist's workers (under a file lock, in the directory their temporary
    directories share): three tests compare with it, and each run of it costs a dozen
    CPU-seconds. Every worker's small_corpus is the same, made from the same seeds."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    work = root / "elastic-reference"
    run, done = work / "runs" / "whole", work / "complete"
    with FileLock(str(root / "elastic-reference.lock")):
        if not done.exists():
            shutil.rmtree(work, ignore_errors=True)  # a run cut short would be resumed
            cmd = train_cmd(small_corpus, work, "whole", "--max_steps", str(STEPS), torchrun=2)
            r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            done.touch()
    return run


def _worker(torchrun: subprocess.Popen) -> int:
    """The pid of one of torchrun's worker processes."""
    return children(torchrun.pid)[-1]


def _same_after(run: Path, reference: Path, resumed_at: int) -> None:
    """`run` logged the reference run's losses after step `resumed_at`, bit for bit, and
    ended with its weights."""
    losses, want = step_losses(run), step_losses(reference)
    assert max(losses) == STEPS
    for step in range(resumed_at + 1, STEPS + 1):
        assert losses[step] == want[step], (step, losses[step], want[step])
    assert_same_weights(run, reference, STEPS)


@pytest.mark.slow
def test_a_killed_rank_ends_the_attempt_and_max_restarts_resumes_the_job(
    small_corpus, tmp_path, reference
):
    run = tmp_path / "runs" / "killed"
    # torchrun's default (static) rendezvous: its store outlives the restart.
    cmd = train_cmd(small_corpus, tmp_path, "killed", "--max_steps", str(STEPS),
                    "--ckpt_every", "5", "--no-ckpt_async", torchrun=2,
                    agent=("--max-restarts", "1"))  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_step(run, 12, p)
    victim = _worker(p)  # its peer fails its next collective (the connection resets)
    os.kill(victim, signal.SIGKILL)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, out[-2000:] + err[-3000:]
    assert "exitcode: -9" in err or "exitcode  : -9" in err, err[-3000:]
    m = re.findall(r"resumed from \S+ at step (\d+)", out)
    assert len(m) == 1, out[-3000:]
    resumed_at = int(m[0])
    assert resumed_at >= 10 and resumed_at % 5 == 0
    assert "connectFullMesh failed" not in err
    _same_after(run, reference, resumed_at)


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_after_the_timeout_and_the_rerun_resumes(
    small_corpus, tmp_path, reference
):
    run = tmp_path / "runs" / "hung"
    cmd = train_cmd(small_corpus, tmp_path, "hung", "--max_steps", str(STEPS), "--ckpt_every",
                    "5", "--no-ckpt_async", "--dist_timeout_s", "5", torchrun=2)  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_step(run, 12, p)
    victim = _worker(p)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        out, err = p.communicate(timeout=120)  # 5 s timeout + torchrun's 30 s grace to kill
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:  # torchrun already killed it
            pass
    took = time.monotonic() - t0
    assert p.returncode != 0 and took < 90, (p.returncode, took)
    newest = checkpoint.list_checkpoints(run)[-1]
    stopped_at = checkpoint.read(newest)["step"]
    assert stopped_at >= 10
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {newest} at step {stopped_at}" in r.stdout
    _same_after(run, reference, stopped_at)


def _two_nodes(small_corpus, tmp_path, name: str, data: tuple, *flags: str, nnodes="2"):
    """Two torchrun agents, one process each, meeting through c10d rendezvous on this host
    as two nodes would; node k reads the training set at data[k]. Returns both results."""
    port = next(_ports)
    procs = []
    for k in (0, 1):
        cmd = train_cmd(small_corpus, tmp_path, name, *flags)
        at = cmd.index("--data.path")
        cmd[at + 1] = str(data[k])
        agent = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                 "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                 f"--rdzv_id={name}-{port}", "-m", "pytrain.train"]  # fmt: skip
        procs.append(subprocess.Popen([*agent, *cmd[3:]], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=ENV))  # fmt: skip
    return [(p, *p.communicate(timeout=300)) for p in procs]


@pytest.mark.slow
def test_two_nodes_train_and_resume_like_one_and_must_read_the_same_data(
    small_corpus, tmp_path, reference
):
    train = small_corpus[0]
    copy = tmp_path / "node1-copy"
    shutil.copytree(train, copy)  # another path, the same content: allowed
    run = tmp_path / "runs" / "nodes"
    for leg in ("--halt_after", "--max_steps"):
        value = "7" if leg == "--halt_after" else str(STEPS)
        results = _two_nodes(small_corpus, tmp_path, "nodes", (train, copy),
                             "--max_steps", str(STEPS), "--ckpt_every", "5", leg, value)  # fmt: skip
        for p, out, err in results:
            assert p.returncode == 0, out[-2000:] + err[-3000:]
    out = "".join(o for _, o, _ in results)
    assert "resumed from" in out and "at step 7" in out, out[-2000:]
    _same_after(run, reference, 0)  # the same losses as one node

    other = tmp_path / "other"
    write_synthetic(other, learnable_docs(300, seed=9), frame_bytes=8192, dtype="uint16", vocab=256)
    results = _two_nodes(small_corpus, tmp_path, "mismatch", (train, other), "--max_steps", "3")
    assert all(p.returncode != 0 for p, _, _ in results)
    errs = "".join(e for _, _, e in results)
    line = next(x for x in errs.splitlines() if "pytrain.train: error:" in x)
    # Which node gets rank 0 is the rendezvous's choice: the line names both datasets.
    assert str(other) in line and str(train) in line and "rank 1 on" in line, line
    assert "every node must read the same dataset" in line
    assert f'File "{ROOT / "pytrain"}' not in errs  # one line, no traceback through our code


@pytest.mark.slow
def test_the_slurm_script_trains_and_resumes_on_this_host(small_corpus, tmp_path):
    """examples/slurm/pretrain.sbatch's torchrun line, run by bash on this host with the
    variables Slurm would set (one node, two processes) and no srun: it trains, and the
    requeued job (the same script again) resumes."""
    env = {**ENV, "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "slurm-test", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "localhost", "GPUS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(next(_ports)), "SRUN": "", "CONFIG": "configs/cpu-default.toml",
           "PATH": f"{Path(sys.executable).parent}:{ENV['PATH']}"}  # this venv's python  # fmt: skip
    flags = [*cfg_args(small_corpus, tmp_path), "--eval_every", "0", "--samples", "0",
             "--ckpt_every", "3", "--max_steps", "8", "--log_every", "1"]  # fmt: skip
    script = str(ROOT / "examples/slurm/pretrain.sbatch")
    run = tmp_path / "runs" / "slurm-test"
    for leg in (["--halt_after", "4"], []):
        r = subprocess.run(["bash", script, *flags, *leg], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 4" in r.stdout, r.stdout[-2000:]
    assert max(step_losses(run)) == 8 and "world 2" in r.stdout


@pytest.mark.slow
def test_with_nnodes_1_to_2_the_job_survives_a_node_leaving(small_corpus, tmp_path):
    """Two agents of an elastic job (`--nnodes 1:2`); the one that does not host the
    rendezvous store dies (SIGKILL, worker included, as a node that fails). The other
    restarts its worker, the rendezvous closes with one node, and the job resumes on one
    rank from the last checkpoint (the loader continues its global order on the new world
    size) and finishes."""
    port, run = next(_ports), tmp_path / "runs" / "elastic"
    cmd = train_cmd(small_corpus, tmp_path, "elastic", "--max_steps", "400", "--ckpt_every", "20")
    # last_call_timeout: how long a rendezvous that has its minimum of nodes waits for more
    # before it closes (30 s by default; both agents here join within a second or two).
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=el-{port}",
             "--max-restarts=3", "--rdzv_conf=last_call_timeout=5", "-m", "pytrain.train", *cmd[3:]]  # fmt: skip
    # The rendezvous store lives in this process, as on a cluster it lives where the
    # endpoint is: whichever agent dies, the store stays (an agent hosting it would take
    # the rendezvous down with it).
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    survivor, leaver = (subprocess.Popen(agent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=ENV) for _ in (0, 1))  # fmt: skip
    wait_for_step(run, 30, survivor)
    for worker in children(leaver.pid):  # the node fails: its worker and its agent
        os.kill(worker, signal.SIGKILL)
    leaver.kill()
    leaver.communicate()
    out, err = survivor.communicate(timeout=240)
    assert survivor.returncode == 0, out[-2000:] + err[-3000:]
    assert "resuming a run saved on 2 rank(s) on 1" in out, out[-3000:]
    assert max(step_losses(run)) == 400
    assert checkpoint.read(checkpoint.list_checkpoints(run)[-1])["world_size"] == 1
    del store


def test_more_ranks_than_gpus_is_one_line_naming_the_gpus(monkeypatch):
    """torchrun --nproc_per_node 3 on a 2-GPU host: rank 2 says what to change (seen on
    2 x H100 as CUDA's "invalid device ordinal" traceback)."""
    import torch

    from pytrain.config import ConfigError
    from pytrain.train import distributed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    info = distributed.DistInfo(rank=2, world_size=3, local_rank=2, launched=True)
    with pytest.raises(
        ConfigError, match=r"wants GPU 2, but this host has 2 GPU\(s\).*--nproc_per_node"
    ):
        distributed.check_gpu(info, torch.device("cuda:2"))
    distributed.check_gpu(
        distributed.DistInfo(rank=1, world_size=2, local_rank=1), torch.device("cuda:1")
    )


def _sbatch_script(small_corpus, tmp_path, name: str, minutes: int, *flags: str) -> str:
    """Submits examples/slurm/pretrain.sbatch (one node, two CPU ranks, no GPUs) from
    tmp_path with a time limit of `minutes`; returns the job id."""
    (tmp_path / "runs").mkdir(exist_ok=True)
    env = {**ENV, "CONFIG": str(ROOT / "configs/cpu-default.toml"), "NAME": name,
           "GPUS_PER_NODE": "2", "MASTER_PORT": str(next(_ports)),
           "PATH": f"{Path(sys.executable).parent}:{ENV['PATH']}"}  # fmt: skip
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2",
                        f"--time={minutes}", str(ROOT / "examples/slurm/pretrain.sbatch"),
                        *cfg_args(small_corpus, tmp_path), "--eval_every", "0", "--samples", "0",
                        "--log_every", "1", *flags],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _release_when_requeued(job: str) -> None:
    """Slurm holds a requeued job ~2 minutes (its BeginTime): start it now if it is pending."""
    if slurm_job_state(job) == "PENDING":
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)


def _stopped_then_resumed(log: str) -> None:
    stopped = re.search(r"stopped at step (\d+) by SIGTERM; checkpoint (\S+?);", log)
    assert stopped, log[-3000:]
    assert f"resumed from {stopped.group(2)} at step {stopped.group(1)}" in log, log[-3000:]


@pytest.mark.slow
@SLURM
def test_the_slurm_script_under_slurm_is_requeued_and_resumes(small_corpus, tmp_path):
    """examples/slurm/pretrain.sbatch submitted to a real Slurm: srun starts the torchrun
    agent; `scontrol requeue` (what a preemption does) sends SIGTERM through srun and the
    agent to the workers, which write a checkpoint; the requeued job runs the script again,
    resumes there and finishes."""
    job = _sbatch_script(small_corpus, tmp_path, "slurm-real", 10, "--ckpt_every", "5",
                         "--max_steps", "300")  # fmt: skip
    run, out = tmp_path / "runs" / "slurm-real", tmp_path / "runs" / f"slurm-pytrain-{job}.out"
    try:
        t0 = time.monotonic()
        while not ((run / "train.log").exists() and max(step_losses(run), default=0) >= 10):
            assert time.monotonic() - t0 < 240 and slurm_job_state(job) in ("PENDING", "RUNNING"), (
                out.read_text()[-3000:] if out.exists() else slurm_job_state(job)
            )
            time.sleep(0.5)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        t0 = time.monotonic()
        while slurm_job_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "GONE"):
            assert time.monotonic() - t0 < 400, out.read_text()[-3000:]
            _release_when_requeued(job)
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    _stopped_then_resumed(out.read_text())
    assert slurm_job_state(job) in ("COMPLETED", "GONE") and max(step_losses(run)) == 300


@pytest.mark.slow
@SLURM
def test_the_slurm_script_requeues_itself_before_its_time_limit(small_corpus, tmp_path):
    """The script's own time-limit path on a real Slurm: with --time=4, Slurm sends the batch
    shell USR1 3 minutes before the end (`--signal=B:USR1@180`), the trap requeues the job
    while `wait` keeps the shell alive, the workers checkpoint on SIGTERM, and the requeued
    job resumes from that checkpoint (then the test cancels it)."""
    job = _sbatch_script(small_corpus, tmp_path, "slurm-limit", 4, "--ckpt_every", "50",
                         "--max_steps", "1000000")  # fmt: skip
    out = tmp_path / "runs" / f"slurm-pytrain-{job}.out"
    try:
        t0 = time.monotonic()
        while "resumed from" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() - t0 < 300, out.read_text()[-3000:] if out.exists() else job
            assert slurm_job_state(job) in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"), (
                slurm_job_state(job)
            )
            _release_when_requeued(job)
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    log = out.read_text()
    assert f"time limit in 3 minutes: requeueing job {job}" in log, log[-3000:]
    _stopped_then_resumed(log)
