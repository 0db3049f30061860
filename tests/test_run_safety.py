"""What a careful user expects of a run, tried as that user would, through the commands:
a checkpoint someone else made never runs code when loaded; SIGINT, SIGTERM and SIGUSR1
stop a run at a checkpoint it resumes from exactly (one process, and two under torchrun);
one run per run directory; a full disk ends a run in one line with the previous
checkpoint intact."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PORTS, losses_by_step
from test_ddp import assert_same_weights, cfg_args

from pytrain.train import checkpoint, disk
from pytrain.train.run_lock import RunDirInUse, RunLock

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

_ports = PORTS  # test_elastic and test_hsdp import it from here


def train_cmd(
    small_corpus, tmp_path, name: str, *flags: str, torchrun: int = 0, agent: tuple = ()
) -> list[str]:
    """`python -m pytrain.train` on the small corpus, or under torchrun with `torchrun`
    processes (and the agent's flags `agent`, e.g. --max-restarts)."""
    launch = [sys.executable, "-m", "pytrain.train"]
    if torchrun:
        launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}",
                  f"--master_port={next(_ports)}", *agent, "-m", "pytrain.train"]  # fmt: skip
    return [*launch, *cfg_args(small_corpus, tmp_path), "--name", name, "--log_every", "1",
            "--eval_every", "0", "--samples", "0", "--optim.warmup_steps", "2",
            "--deterministic", *flags]  # fmt: skip


def step_losses(run_dir: Path) -> dict[int, float]:
    return losses_by_step((run_dir / "train.log").read_text())


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, limit: float = 240) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        assert proc.poll() is None, proc.communicate()
        log = run_dir / "train.log"
        if log.exists() and max(step_losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {limit}s")


def children(pid: int) -> list[int]:
    """The child processes of `pid` (torchrun's workers), from /proc (no procps needed)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(x) for x in (task / "children").read_text().split()]
    return sorted(kids)


def one_line_error(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if x.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[-1]


# ---- 1. a checkpoint never runs code ----------------------------------------------------


class _Planted:
    """What a malicious checkpoint holds: unpickling it calls open(path, "w")."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.slow
def test_a_malicious_checkpoint_runs_nothing_in_sample_eval_export_or_resume(
    small_corpus, tmp_path
):
    run = tmp_path / "runs" / "evil"
    run.mkdir(parents=True)
    marker = tmp_path / "PWNED"
    torch.save({"model": _Planted(marker), "config": {}}, run / "ckpt-00000005.pt")
    ckpt = str(run / "ckpt-00000005.pt")
    commands = {
        "sample": [sys.executable, "-m", "pytrain.sample", ckpt, "--device", "cpu"],
        "eval": [sys.executable, "-m", "pytrain.eval", str(run), "--device", "cpu"],
        "export": [sys.executable, "-m", "pytrain.export", str(run), str(tmp_path / "hf")],
        "resume": train_cmd(small_corpus, tmp_path, "evil", "--max_steps", "8"),
    }
    for what, cmd in commands.items():
        r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
        assert r.returncode != 0, (what, r.stdout[-2000:])
        assert not marker.exists(), f"{what} ran the checkpoint's code"
        line = one_line_error(r.stderr)
        assert "ckpt-00000005.pt" in line and "refused to load" in line, (what, line)
        assert "open" in line, (what, line)  # what it contained
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_of_the_previous_version_still_loads(tmp_path):
    """Earlier checkpoints held numpy's RNG state as a pickled ndarray."""
    np.random.seed(7)
    legacy = {"numpy": np.random.get_state(), "python": (3, tuple(range(625)), None)}
    torch.save({"ranks": [{"rng": legacy}], "w": torch.ones(3)}, tmp_path / "ckpt-00000001.pt")
    state, _ = checkpoint.load_latest(tmp_path)
    expected = np.random.rand(3)
    np.random.seed(0)
    np.random.set_state(state["ranks"][0]["rng"]["numpy"])
    assert np.array_equal(np.random.rand(3), expected)
    # The current format needs no numpy global: it loads with nothing allowed.
    torch.save({"rng": checkpoint.rng_state()}, tmp_path / "new.pt")
    got = torch.load(tmp_path / "new.pt", weights_only=True)
    drawn = np.random.rand(4)
    checkpoint.set_rng_state(got["rng"])
    assert np.array_equal(np.random.rand(4), drawn)


# ---- 2. a signal stops a run at a checkpoint ---------------------------------------------


_RECORD_EACH_RANK = """
import json, os, runpy
from pytrain.train import trainer

fit, end = trainer.Trainer.fit, os._exit
ended = {{}}


def recorded_fit(self):
    result = fit(self)
    ended.update(step=result["step"], stopped_by=result["stopped_by"])
    return result


def recorded_exit(code):  # what `python -m pytrain.train` ends a torchrun rank with
    with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump({{**ended, "exit": code}}, f)
    end(code)


trainer.Trainer.fit = recorded_fit
os._exit = recorded_exit
runpy.run_module("pytrain.train", run_name="__main__", alter_sys=True)
"""
"""`python -m pytrain.train` for torchrun to start, writing in directory `out` each rank's
step and signal as fit() returned them and the code its process exits with. torchrun
itself exits 1, and reports its workers' codes only where they end before it does (not
where it is the one signalled)."""


def _stop_and_resume(
    small_corpus, tmp_path, sig: signal.Signals, torchrun: int = 0, to_one_rank=False
):
    """Trains, sends `sig` mid-run, and checks: the one-line stop, the exit code, a
    checkpoint at the stop step, and a resumed run whose losses equal an uninterrupted
    run's bit for bit at every later step (the loader continues exactly), ending with the
    same weights."""
    steps = 400
    name = f"stop-{sig.name}-{torchrun}"
    run = tmp_path / "runs" / name
    cmd = train_cmd(small_corpus, tmp_path, name, "--max_steps", str(steps), "--ckpt_every", "1000",
                    torchrun=torchrun)  # fmt: skip
    if torchrun:  # each rank's end recorded in tmp_path
        entry = tmp_path / "record_each_rank.py"
        entry.write_text(_RECORD_EACH_RANK.format(out=str(tmp_path)))
        at = cmd.index("pytrain.train")
        cmd[at - 1 : at + 1] = [str(entry)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for_step(run, 6, p)
    if to_one_rank:  # one worker of torchrun's, as a node-local signal would be
        os.kill(children(p.pid)[-1], sig)
    else:
        p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    # No traceback through our code (torchrun's agent prints its own SignalException).
    assert ("Traceback" if not torchrun else f'File "{ROOT / "pytrain"}') not in err, err[-3000:]
    m = re.search(r"stopped at step (\d+) by (\S+); checkpoint (\S+); run the same command", out)
    assert m, out[-2000:] + err[-2000:]
    stop = int(m.group(1))
    assert 6 <= stop < steps
    assert m.group(2) == sig.name  # a rank the signal missed takes the others' (their sum)
    if torchrun:
        # torchrun's own exit: a worker failed, or torchrun was signalled itself.
        assert p.returncode == 1, p.returncode
        ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(torchrun)]
        assert ranks == [{"step": stop, "stopped_by": sig.name, "exit": 128 + sig}] * torchrun
    else:
        assert p.returncode == 128 + sig, p.returncode
    assert [c.name for c in checkpoint.list_checkpoints(run)] == [f"ckpt-{stop:08d}.pt"]
    saved = checkpoint.read(run / f"ckpt-{stop:08d}.pt")
    assert saved["step"] == stop and saved["world_size"] == max(torchrun, 1)
    assert len(saved["ranks"]) == max(torchrun, 1)  # every rank's random state, at that step

    end = stop + 4
    # Both legs and the reference keep max_steps (the LR schedule) and halt after `end`.
    r = subprocess.run([*cmd, "--halt_after", "4"], capture_output=True, text=True, env=ENV,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"at step {stop}" in r.stdout + r.stderr
    whole = tmp_path / "runs" / f"{name}-whole"
    r = subprocess.run(
        train_cmd(small_corpus, tmp_path, whole.name, "--max_steps", str(steps),
                  "--halt_after", str(end), torchrun=torchrun),
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    resumed, reference = step_losses(run), step_losses(whole)
    for step in range(stop + 1, end + 1):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    assert_same_weights(run, whole, end)


def test_the_step_lines_give_back_each_loss_bit_for_bit(tmp_path):
    """What the resume tests compare: two losses one float32 step apart show the same 4
    decimals in train.log, and read_step_lines gives each back as it was."""
    from types import SimpleNamespace

    from pytrain.data.batch import FeedTime
    from pytrain.train.metrics import RunLog, StepLog, read_step_lines

    log = RunLog(tmp_path, True, False)
    steps = StepLog(log, lambda *a: None, flops_token=1.0, peak=None, world_size=1,
                    log_every=1, progress=False, device=torch.device("cpu"))  # fmt: skip
    first = torch.tensor(2 / 3)
    losses = [float(first), float(torch.nextafter(first, torch.tensor(1.0)))]
    for number, loss in enumerate(losses, 1):
        r = SimpleNamespace(tokens=1000, loss=loss, grad_norm=1.0, skipped=None, routing=None)
        steps.step(r, number, 1.0, FeedTime(), 1e-3, 0, 0)
    log.close()
    text = (tmp_path / "train.log").read_text()
    assert text.count(" loss 0.6667 ") == 2 and losses[0] != losses[1]
    assert [x["loss"] for x in read_step_lines(text)] == losses


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_one_process_at_a_checkpoint_it_resumes_from(small_corpus, tmp_path, sig):
    _stop_and_resume(small_corpus, tmp_path, sig)


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_at_one_checkpoint(small_corpus, tmp_path):
    _stop_and_resume(small_corpus, tmp_path, signal.SIGTERM, torchrun=2)


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_every_rank_at_the_same_step(small_corpus, tmp_path):
    """Slurm's early warning may reach one process: the ranks agree through a sum."""
    _stop_and_resume(small_corpus, tmp_path, signal.SIGUSR1, torchrun=2, to_one_rank=True)


_SLOW_STEPS = """
import sys, time
from pytrain.train import trainer
real = trainer.Trainer._forward_backward
def slow(self, *a, **k):
    time.sleep(1.0)
    return real(self, *a, **k)
trainer.Trainer._forward_backward = slow
from pytrain.train.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""`python -m pytrain.train` whose every step takes a second longer, idle: long enough for a
second signal to land in the step the first one ends with, without the CPU a model that slow
would burn."""


@pytest.mark.slow
def test_a_second_sigint_ends_at_once(small_corpus, tmp_path):
    run = tmp_path / "runs" / "twice"
    cmd = train_cmd(small_corpus, tmp_path, "twice", "--max_steps", "100000", "--ckpt_every", "5",
                    "--keep_ckpts", "1")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", _SLOW_STEPS, *cmd[3:]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=ENV)  # fmt: skip
    wait_for_step(run, 6, p)
    p.send_signal(signal.SIGINT)
    assert p.stderr is not None
    while "SIGINT received" not in p.stderr.readline():  # the first one was handled
        pass
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, (out[-1000:], err[-2000:])
    assert "interrupted by SIGINT" in one_line_error(err)
    newest = checkpoint.list_checkpoints(run)[-1]
    assert checkpoint.read(newest)["step"] >= 5
    assert "stopped at step" not in out  # it did not wait to write another


# ---- 3. one run per run directory ---------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_on_a_busy_run_directory_exits_and_a_killed_run_leaves_no_lock(
    small_corpus, tmp_path
):
    run = tmp_path / "runs" / "busy"
    cmd = train_cmd(small_corpus, tmp_path, "busy", "--max_steps", "100000", "--ckpt_every", "3")
    first = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    try:
        wait_for_step(run, 4, first)
        r = subprocess.run([*cmd[:-4], "--max_steps", "5"], capture_output=True, text=True,
                           env=ENV, timeout=120)  # fmt: skip
        assert r.returncode == 2
        line = one_line_error(r.stderr)
        assert f"run directory {run} is in use by pid {first.pid}" in line, line
        before = step_losses(run)
        assert "resumed" not in r.stdout
    finally:
        first.kill()  # SIGKILL: no handler runs, the kernel drops the lock
        first.communicate()
    assert max(step_losses(run)) >= max(before)  # the second run wrote nothing there
    newest = checkpoint.read(checkpoint.list_checkpoints(run)[-1])["step"]
    r = subprocess.run([*cmd[:-4], "--max_steps", str(newest + 2)], capture_output=True,
                       text=True, env=ENV, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"at step {newest}" in r.stdout


def test_the_run_lock_names_its_holder_and_is_free_after_release(tmp_path):
    a = RunLock(tmp_path)
    a.acquire()
    # Another process trying the same directory.
    code = (
        "import sys; from pytrain.train.run_lock import RunLock, RunDirInUse\n"
        f"try:\n    RunLock({str(tmp_path)!r}).acquire()\nexcept RunDirInUse as e:\n"
        "    print(e); sys.exit(7)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert r.returncode == 7 and f"pid {os.getpid()}" in r.stdout, r.stdout + r.stderr
    with pytest.raises(RunDirInUse):  # a second lock in this process conflicts too
        RunLock(tmp_path).acquire()
    a.release()
    b = RunLock(tmp_path)
    b.acquire()
    b.release()


# ---- 4. a full disk -------------------------------------------------------------------------


class _FullAfter:
    """A file whose writes fail with ENOSPC after `budget` bytes, as a full disk's do."""

    def __init__(self, path: Path, budget: int):
        self.f, self.left = open(path, "wb"), budget

    def write(self, b) -> int:
        self.left -= len(b)
        if self.left < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_a_checkpoint_write_that_runs_out_of_space(tmp_path, monkeypatch, writer):
    state = {"model": {"w": torch.randn(64, 64)}, "step": 1}
    checkpoint.save(tmp_path, 1, state, keep=3)
    monkeypatch.setattr(checkpoint, "_open_for_write", lambda p: _FullAfter(p, 4096))
    state2 = {"model": {"w": torch.randn(64, 64)}, "step": 2}
    with pytest.raises(disk.DiskFull) as e:
        if writer == "sync":
            checkpoint.save(tmp_path, 2, state2, keep=3)
        else:
            w = checkpoint.AsyncWriter()
            w.submit(tmp_path, 2, state2, keep=3)
            w.wait()
    msg = str(e.value)
    assert "\n" not in msg and "ckpt-00000002.pt not written" in msg
    assert "ckpt-00000001.pt is intact" in msg and "free" in msg and "needed" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]  # no partial
    assert torch.equal(checkpoint.load_latest(tmp_path)[0]["model"]["w"], state["model"]["w"])


_FAIL_SECOND_CHECKPOINT = """
import errno, os, sys
sys.path.insert(0, {tests!r})
from test_run_safety import _FullAfter
from pytrain.train import checkpoint
opened = []
def full_from_second(path):
    opened.append(path)
    return _FullAfter(path, 1 << 40 if len(opened) == 1 else 10_000)
checkpoint._open_for_write = full_from_second
from pytrain.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["sync", "async"])
def test_a_run_whose_disk_fills_ends_in_one_line_with_its_last_checkpoint(
    small_corpus, tmp_path, writer
):
    name = f"full-{writer}"
    flags = ["--max_steps", "12", "--ckpt_every", "4", "--keep_ckpts", "2"]
    flags += ["--ckpt_async"] if writer == "async" else ["--no-ckpt_async"]
    cmd = train_cmd(small_corpus, tmp_path, name, *flags)[3:]
    code = _FAIL_SECOND_CHECKPOINT.format(tests=str(ROOT / "tests"))
    r = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True,
                       env=ENV, timeout=300)  # fmt: skip
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-3000:]
    line = one_line_error(r.stderr)
    assert "no space left" in line and "ckpt-00000004.pt is intact" in line, line
    run = tmp_path / "runs" / name
    assert sorted(p.name for p in run.glob("*ckpt*")) == ["ckpt-00000004.pt"]
    assert checkpoint.read(run / "ckpt-00000004.pt")["step"] == 4


_FAIL_LOG_WRITE = """
import errno, os, sys
from pytrain.train import metrics
text = metrics.RunLog.text
def full_after_ten(self, line, calls=[]):
    calls.append(line)
    if len(calls) > 10:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.file.name))
    return text(self, line)
metrics.RunLog.text = full_after_ten
from pytrain.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_log_write_that_runs_out_of_space_ends_in_one_line(small_corpus, tmp_path):
    cmd = train_cmd(small_corpus, tmp_path, "full-log", "--max_steps", "30", "--ckpt_every", "5")
    r = subprocess.run([sys.executable, "-c", _FAIL_LOG_WRITE, *cmd[3:]], capture_output=True,
                       text=True, env=ENV, timeout=300)  # fmt: skip
    assert r.returncode == 4, r.stderr[-3000:]
    line = one_line_error(r.stderr)
    assert "no space left writing" in line and "train.log" in line and "free there" in line, line
    run = tmp_path / "runs" / "full-log"
    assert checkpoint.read(checkpoint.list_checkpoints(run)[-1])["step"] >= 5


def test_the_start_says_when_the_checkpoints_will_not_fit(tmp_path):
    free = disk.free_bytes(tmp_path)
    assert disk.space_note(tmp_path, per_checkpoint=1000, keep=3) is None
    note = disk.space_note(tmp_path, per_checkpoint=free, keep=3)
    assert note and str(tmp_path) in note and "not one fits" in note, note
    # Room for 3.5 checkpoints of this size (slack for other writers): 2 kept and the one
    # being written.
    note = disk.space_note(tmp_path, per_checkpoint=int(disk.free_bytes(tmp_path) / 3.5), keep=5)
    assert (
        note and "keeps 5" in note and "2 fit beside the one being written: --keep_ckpts 2" in note
    ), note
    assert disk.space_note(tmp_path, per_checkpoint=disk.free_bytes(tmp_path) // 4, keep=2) is None
    assert disk.fitting(free=100, existing=50, per_checkpoint=30) == 4
    model = torch.nn.Linear(100, 100)
    opt = torch.optim.AdamW(model.parameters())
    params = 100 * 100 + 100
    assert disk.checkpoint_estimate(model, opt, fp32_weights=False) == params * 4 * 3
    # MasterAdamW's moments exist from the start, in their dtype (optim.state_dtype).
    from pytrain.optim.master_adamw import MasterAdamW

    for state, moments in ((torch.float32, 8), (torch.bfloat16, 4)):
        m = torch.nn.Linear(100, 100)
        master = MasterAdamW([{"params": list(m.parameters()), "weight_decay": 0.0}], lr=1e-3,
                             use_triton=False, state_dtype=state)  # fmt: skip
        assert disk.checkpoint_estimate(m, master, fp32_weights=True) == params * (4 + moments)


def test_a_full_disk_is_named_in_a_compile_fallback_line(tmp_path):
    from pytrain.train.compile_policy import failure_line

    try:  # a write that fails for space, wrapped as a compiler wraps it
        try:
            with _FullAfter(tmp_path / "x", 10) as f:
                torch.save({"w": torch.zeros(1000)}, f)
        except Exception as inner:
            raise RuntimeError("backend='inductor' raised: a write failed") from inner
    except RuntimeError as e:
        line = failure_line(e)
    assert line.startswith("DISK FULL") and "free" in line, line
    assert failure_line(RuntimeError("other")) == "RuntimeError: other"


def test_a_file_torch_save_did_not_write_is_refused_in_one_line(tmp_path):
    """A text file given as a checkpoint: named as such, not torch's advice on weights_only."""
    bogus = tmp_path / "notes.txt"
    bogus.write_text('{"text": "hello"}\n')
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="not a file torch.save wrote"):
        checkpoint.read_file(bogus)


# ---- 5. out of memory -------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_out_of_host_memory_ends_in_one_line_naming_what_to_lower(small_corpus, tmp_path):
    """A real allocation the host refuses (the CPU attention's mask of a 1M-token row:
    931 GiB): exit 5 with one line, torch's traceback not shown. The process's address
    space is capped at 64 GiB, so that the refusal does not depend on the host's memory
    or overcommit policy (with overcommit on, the kernel might grant it, then kill)."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (64 << 30, 64 << 30))

    cmd = train_cmd(small_corpus, tmp_path, "oom", "--data.seq_len", "1000000",
                    "--data.batch_size", "1", "--max_steps", "2")  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, preexec_fn=cap)
    assert r.returncode == 5, (r.returncode, r.stderr[-3000:])
    line = one_line_error(r.stderr)
    assert line.startswith("pytrain.train: error: out of host memory at step 1, micro-batches "
                           "of 1 x 1000000 tokens (an allocation of"), line  # fmt: skip
    assert "--data.seq_len (now 1000000)" in line and "--activation_checkpointing" in line


def test_the_out_of_memory_line_names_the_settings_of_the_phase(monkeypatch):
    from pytrain.config import parse_args
    from pytrain.train.out_of_memory import kind, line

    refused = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 3221225472 bytes. Error code 12"
    )
    wrapped = ValueError("while compiling")
    wrapped.__cause__ = refused
    assert kind(refused) == kind(wrapped) == "host" and kind(ValueError("no")) is None
    another = ValueError("raised while the OOM was handled")
    another.__context__ = refused  # its own error, not the allocation's
    assert kind(another) is None
    cfg = parse_args(["--data.batch_size", "8", "--optim.grad_accum", "0"])
    setting_up = line(refused, cfg, None)
    assert "while setting up the model and optimizer (an allocation of 3.0 GiB" in setting_up
    assert "--optim.state_dtype bf16" in setting_up and "--fsdp" not in setting_up
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert "--fsdp" in line(refused, cfg, None)
    in_step = line(refused, cfg, 12)
    assert "at step 12, micro-batches of 8 x" in in_step and "intact" in in_step
    assert "(now 8; the gradient accumulation grows" in in_step
    assert "--activation_checkpointing selective, every-2 or full (now off;" in in_step
    halfway = parse_args(["--data.batch_size", "8", "--activation_checkpointing", "every-2"])
    assert "--activation_checkpointing full (now every-2;" in line(refused, halfway, 3)
    everything = parse_args(["--data.batch_size", "8", "--activation_checkpointing", "full"])
    assert "--activation_checkpointing" not in line(refused, everything, 3)
    assert "--ac_lean_blocks" not in line(refused, halfway, 3)  # only under selective
    selective = parse_args(["--activation_checkpointing", "selective", "--ac_lean_blocks", "1"])
    assert "a larger --ac_lean_blocks (now 1;" in line(refused, selective, 3)
    explicit = parse_args(["--data.batch_size", "8", "--optim.grad_accum", "4"])
    assert "a larger --optim.grad_accum keeps the step's tokens" in line(refused, explicit, 3)
    assert "expandable_segments" not in in_step  # the GPU's allocator only
    # The training state's share at a step too: bf16 moments; under FSDP2, more GPUs.
    assert in_step.endswith("--optim.state_dtype bf16 (AdamW's moments in bf16: 4 bytes a "
                            "parameter less); the checkpoints written so far are intact: the "
                            "same command with the change resumes")  # fmt: skip
    assert "--fsdp" not in in_step and "more GPUs" not in in_step
    sharded = parse_args(["--data.batch_size", "1", "--fsdp", "--optim.state_dtype", "bf16"])
    on_8 = line(refused, sharded, 1)
    assert "more GPUs (FSDP2 shards the training state over the ranks, now 8)" in on_8
    assert "--optim.state_dtype" not in on_8  # already bf16
    assert "more GPUs" in line(refused, sharded, None)
