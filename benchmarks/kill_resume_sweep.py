"""SIGKILL a CPU training run at random moments (checkpoint writes included) until it
finishes, then check that every step's loss and the final parameters equal an
uninterrupted run's.

    python benchmarks/kill_resume_sweep.py [--kills 20] [--steps 400] [--seed 0] [--slow-write 0.5]

Checkpoints are written in the background (ckpt_async). `--slow-write S` makes each write
stop for S seconds halfway through the file, so most kills land inside a write and leave
a truncated temporary file: the sweep counts those, and resume must take the checkpoint
before it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, read_steps  # noqa: E402

SLOW_WRITE = """
import io, runpy, sys, time, torch
real_save, pause = torch.save, float(sys.argv.pop(1))
def halting_save(obj, f, *a, **k):  # half the bytes, a pause, the rest
    buf = io.BytesIO(); real_save(obj, buf, *a, **k); data = buf.getvalue()
    f.write(data[: len(data) // 2]); f.flush(); time.sleep(pause); f.write(data[len(data) // 2 :])
torch.save = halting_save
runpy.run_module("pytrain.train", run_name="__main__")
"""


def train_cmd(train: Path, val: Path, out: Path, steps: int, slow_write: float = 0.0) -> list[str]:
    # The wrapper imports torch before the trainer, whose environment guards refuse that
    # (they matter for the compiler only, which is off on the CPU).
    python = (
        [sys.executable, "-c", SLOW_WRITE, str(slow_write), "--no-compile.safe_env"]
        if slow_write
        else [sys.executable, "-m", "pytrain.train"]
    )
    return [*python, "--data.path", str(train), "--data.val_path", str(val),
            "--out_dir", str(out), "--name", "k", "--model.n_layer", "2", "--model.n_head", "2",
            "--model.d_model", "64", "--data.seq_len", "64", "--data.batch_size", "4",
            "--data.frames_per_block", "2", "--max_steps", str(steps), "--eval_every", "0",
            "--ckpt_every", "1", "--keep_ckpts", "2", "--log_every", "1", "--no-progress", "--no-tensorboard",
            "--samples", "0", "--deterministic", "--optim.grad_accum", "2"]  # fmt: skip


def losses_by_step(log: Path) -> dict[int, float]:
    """The last logged loss of every step (steps rerun after a kill log again)."""
    return {int(x["step"]): x["loss"] for x in read_steps(log)}


def kill_and_resume(
    cmd: list[str],
    kills: int,
    seed: int,
    env: dict,
    run_dir: Path,
    window=(3.0, 6.0),
    in_writes: int = 0,
) -> tuple[int, int]:
    """Runs `cmd` to completion, SIGKILLing it `kills` times at random moments. Returns
    (kills, kills that left a checkpoint write unfinished: a temporary file in run_dir).

    The first `in_writes` kills wait, after their random moment, until a write is under
    way (a temporary file exists), so that a test gets its kills inside writes however
    slowly the machine starts the run (a busy CI host took longer than the window)."""
    rng = random.Random(seed)
    done = mid_write = 0
    while True:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        if done < kills:
            time.sleep(rng.uniform(*window))
            if done < in_writes:
                wait_for_write(p, run_dir)
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
                done += 1
                mid_write += any(run_dir.glob(f".ckpt-*.tmp-{p.pid}"))  # this process's
                continue
        _, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(err.decode()[-3000:])
        return done, mid_write


def wait_for_write(p: subprocess.Popen, run_dir: Path, timeout: float = 60.0) -> None:
    """Returns once process p writes a checkpoint (its temporary file exists in run_dir;
    one a killed predecessor left does not count), or p ended, or `timeout` passed."""
    end = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < end:
        if any(run_dir.glob(f".ckpt-*.tmp-{p.pid}")):
            return
        time.sleep(0.002)


def same_final_params(a: Path, b: Path) -> bool:
    import torch

    from pytrain.train import checkpoint

    sa, sb = (checkpoint.read(p) for p in (a, b))
    return (
        all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
        and sa["loader"] == sb["loader"]
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-write", type=float, default=0.0)
    p.add_argument("--work", type=Path, default=Path(tempfile.mkdtemp(prefix="pytrain-kill-")))
    args = p.parse_args()
    print(machine_line(), flush=True)
    from pytrain import _loader

    for split, seed in (("train", 1), ("val", 2)):
        _loader.write_synthetic(
            str(args.work / split),
            800 if split == "train" else 100,
            mu=4.5,
            sigma=0.7,
            vocab=256,
            frame_bytes=8192,
            seed=seed,
        )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = subprocess.run(
        train_cmd(args.work / "train", args.work / "val", args.work / "ref", args.steps),
        capture_output=True,
        text=True,
        env=env,
    )
    if ref.returncode != 0:
        print(ref.stderr[-3000:])
        return 1
    t0 = time.perf_counter()
    kills, mid_write = kill_and_resume(
        train_cmd(
            args.work / "train",
            args.work / "val",
            args.work / "killed",
            args.steps,
            args.slow_write,
        ),
        args.kills,
        args.seed,
        env,
        args.work / "killed" / "k",
        window=(2.5, 5.0),
    )
    want = losses_by_step(args.work / "ref" / "k" / "train.log")
    got = losses_by_step(args.work / "killed" / "k" / "train.log")
    ckpt = f"ckpt-{args.steps:08d}.pt"
    params = same_final_params(args.work / "ref" / "k" / ckpt, args.work / "killed" / "k" / ckpt)
    ok = got == want and params
    print(
        f"{kills} SIGKILLs ({mid_write} inside a checkpoint write) over {time.perf_counter() - t0:.0f}s; losses of all {len(want)} steps equal: {got == want}; final parameters and loader state equal: {params}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
