"""scripts/gpu_acceptance.py's rows for 4 GPUs, checked without them: the commands they
launch parse as torchrun's and the trainer's flags with the settings the rows are for,
they are left out of the default rows, and the two-agent row's kill, restart and
bit-for-bit comparison run end to end on CPU ranks."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script
from torch.distributed import run as torchrun

from pytrain import _loader
from pytrain.config import derive_grad_accum, parse_args
from pytrain.train.distributed import DistInfo
from pytrain.train.parallel import shard_group

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def acc(monkeypatch):
    monkeypatch.setitem(sys.modules, "acceptance", None)  # as it was again after the test
    module = load_script("scripts/gpu_acceptance.py", "acceptance")
    monkeypatch.chdir(ROOT)  # the rows name their presets as configs/<name>.toml
    return module


def launched(cmd: list[str]):
    """torchrun's reading of `cmd`, and the trainer's configuration from its flags."""
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    launch = torchrun.parse_args(cmd[3:])
    assert launch.module and launch.training_script == "pytrain.train"
    return launch, parse_args(launch.training_script_args)


def test_the_multi_gpu_rows_are_rows_but_not_default_ones(acc, monkeypatch, tmp_path, capsys):
    assert set(acc.MULTI_GPU) <= set(acc.ROWS)
    monkeypatch.setattr(sys, "argv", ["gpu_acceptance.py", "--help"])
    with pytest.raises(SystemExit):
        acc.main()
    assert (
        "(default: all but llama-8b, two-agent, olmoe, which need more than one 80 GB GPU)"
        in " ".join(capsys.readouterr().out.split())
    )
    monkeypatch.setattr(sys, "argv", ["gpu_acceptance.py", "--work", str(tmp_path)])
    ran = []
    monkeypatch.setattr(acc, "ROWS", {k: lambda w, k=k: ran.append(k) or acc.Row(k, "", ok=True)
                                      for k in acc.ROWS})  # fmt: skip
    assert acc.main() == 0
    assert ran == [k for k in acc.ROWS if k not in acc.MULTI_GPU] and "llama-1b" in ran
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    row = acc.Row("x", "")
    assert acc.gpus_missing(row, 4) and row.note == "not run: needs 4 GPUs, this host has 1"
    # The OLMoE row on an 80 GB GPU: refused at once, before any data is made.
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 80 * 2**30})())  # fmt: skip
    row = acc.row_olmoe(tmp_path / "olmoe")
    assert not row.ok and row.note == "not run: needs a GPU of 120 GiB, this one has 80"
    assert not (tmp_path / "olmoe").exists()


def test_a_command_is_ended_with_everything_under_it_once_what_the_row_needs_is_done(acc, tmp_path):
    """run(done=...): once the check holds, the command and every process under it are
    killed (exit 0, said in the log), also one in a process group of its own (setsid, as
    torchrun starts its ranks) and its child; run returns only when none of them runs any
    more. Without a check the command's own exit code comes back."""
    import time

    child_pid, grand_pid, log = tmp_path / "child.pid", tmp_path / "grand.pid", tmp_path / "cmd.log"
    script = (
        f"setsid bash -c 'sleep 120 & echo $! > {grand_pid}; wait' & echo $! > {child_pid}; "
        "echo ready $((40 + 2)); wait"
    )
    t0 = time.perf_counter()
    rc, out = acc.run(["bash", "-c", script], log,
                      done=lambda: "ready 42" in log.read_text() and grand_pid.exists())  # fmt: skip
    assert rc == 0 and "ready 42" in out and time.perf_counter() - t0 < 30
    assert "stopped once done" in log.read_text()
    child, grand = int(child_pid.read_text()), int(grand_pid.read_text())
    assert not alive(child) and not alive(grand)  # gone before run returned
    assert acc.run(["bash", "-c", "exit 3"], tmp_path / "b.log")[0] == 3


def alive(pid: int) -> bool:
    """Whether `pid` runs: a killed process not yet reaped is a zombie ("Z"), dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_8b_row_trains_the_preset_on_4_ranks_then_exports_it(acc, monkeypatch, tmp_path):
    cmds = []

    def run(cmd, log, env=None):  # what the row launches, run as a failure
        cmds.append(cmd)
        log.write_text("")
        return (
            1,
            "[rank2]: Traceback (most recent call last):\n[rank2]: TypeError: boom\n" + "=" * 60,
        )

    monkeypatch.setattr(acc, "run", run)
    monkeypatch.setattr(acc, "gpus_missing", lambda row, need: False)
    monkeypatch.setattr(acc, "synthetic_dataset", lambda w: (w / "train", w / "val"))
    row = acc.row_llama_8b(tmp_path)
    assert not row.ok and "exit codes 1, 1" in row.note
    assert "traceback in output (TypeError: boom)" in row.note  # the rank's error, named
    first, second, export, _ = cmds
    assert first == second  # the same command resumes
    launch, cfg = launched(first)
    assert launch.standalone and launch.nproc_per_node == "4"
    assert (cfg.name, cfg.model.n_layer, cfg.model.d_model, cfg.fsdp) == (
        "llama-8b",
        32,
        4096,
        True,
    )
    assert (cfg.max_steps, cfg.halt_after, cfg.keep_ckpts, cfg.eval_every) == (6, 4, 1, 6)
    assert cfg.data.val_path == str(tmp_path / "val") and cfg.eval_batches == 2
    derive_grad_accum(cfg, world_size=4)
    assert cfg.optim.grad_accum == 4  # 4 micro-batches of 8192 tokens a rank
    assert export[1:] == ["-m", "pytrain.export", str(tmp_path / "runs" / "llama-8b"),
                          str(tmp_path / "llama-8b-hf")]  # fmt: skip


def test_the_two_agent_command_is_hsdp_over_two_agents_of_two(acc, tmp_path):
    args = acc.two_agent_args(tmp_path / "train", tmp_path / "cache")
    launch, cfg = launched(acc.agents_cmd(tmp_path, "two-agent", args, 29400))
    assert (launch.nnodes, launch.nproc_per_node, launch.max_restarts) == ("2", "2", 1)
    assert (launch.rdzv_backend, launch.rdzv_endpoint) == ("c10d", "localhost:29400")
    assert cfg.name == "two-agent" and cfg.model.n_layer == 16 and cfg.fsdp is True
    assert cfg.deterministic and not cfg.ckpt_async and cfg.max_steps == acc.AGENT_STEPS
    # The preset's attention (FA4 on Hopper), deterministic under --deterministic.
    assert cfg.model.attention == "auto"
    agent = DistInfo(rank=0, world_size=4, local_rank=0, launched=True, local_world_size=2)
    assert shard_group(cfg.fsdp_shard_size, agent)[0] == 2


@pytest.mark.slow
def test_the_two_agent_row_kills_a_rank_and_compares_the_losses_on_cpu(acc, monkeypatch, tmp_path):
    """The row as it runs, on a model of 2 small blocks and CPU ranks (gloo); pass or fail
    is the row's own."""
    data = tmp_path / "ids"
    _loader.write_synthetic(str(data), 3000, mu=5.0, sigma=0.5, vocab=256, seed=0)
    tiny = ["--fsdp", "--data.path", str(data), "--model.n_layer", "2", "--model.n_head", "2",
            "--model.d_model", "64", "--data.seq_len", "64", "--data.batch_size", "4",
            "--data.frames_per_block", "1", "--optim.grad_accum", "2", "--no-tensorboard",
            "--no-compile.safe_env", "--log_every", "1", "--eval_every", "0", "--samples", "0",
            "--deterministic", "--ckpt_every", str(acc.AGENT_CKPT), "--no-ckpt_async"]  # fmt: skip
    monkeypatch.setattr(acc, "gpus_missing", lambda row, need: False)
    monkeypatch.setattr(acc, "synthetic_dataset", lambda w: (data, data))
    monkeypatch.setattr(acc, "two_agent_args", lambda train, cache: tiny)
    monkeypatch.setattr(acc, "AGENT_LIMIT_S", 240)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    row = acc.row_two_agent(tmp_path)
    assert row.ok, row.note
    # The kill comes once the step after the first checkpoint is logged; a fast job may have
    # written a later checkpoint by then, which the restart resumes instead.
    m = re.fullmatch(r"at step (\d+)", row.resumed)
    assert m and int(m.group(1)) % acc.AGENT_CKPT == 0 and int(m.group(1)) < acc.AGENT_STEPS, row
    assert row.steps == acc.AGENT_STEPS
    assert f"steps {int(m.group(1)) + 1}-{acc.AGENT_STEPS} bit for bit" in row.note
    # The comparison fails on a loss one float apart.
    got = {s: 1.0 for s in range(1, 9)}
    want = {**got, 6: float.fromhex("0x1.0000000000001p+0")}
    assert acc.first_difference(got, want, range(4, 9))[0].startswith("step 6: loss 1.0")
