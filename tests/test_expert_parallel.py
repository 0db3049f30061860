"""Expert parallelism (`--ep`, pytrain.train.expert_parallel) on CPU ranks: gloo, torchrun.

A tiny mixture of experts (2 blocks, d_model 64, 8 experts top-2 of width 32) trains on 4
ranks under FSDP2 at EP 1, 2 and 4 and under HSDP at EP 2, in one torchrun job
(tests/expert_parallel_worker.py runs them one after another), and in one process over the
same global batches; the EP-4 run's sharded checkpoint of step 2 resumes at EP 2. The
settings that cannot work end in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PORTS, losses_by_step
from test_run_safety import ENV

from pytrain.config import ConfigError, parse_args
from pytrain.train.distributed import DistInfo
from pytrain.train.expert_parallel import by_expert
from pytrain.train.parallel import choose

STEPS, SAVED = 4, 2
RANKS, ACCUM = 4, 2
WORKER = Path(__file__).resolve().parent / "expert_parallel_worker.py"
MOE = ["--model.family", "moe", "--model.n_layer", "2", "--model.n_head", "2",
       "--model.d_model", "64", "--model.experts", "8", "--model.top_k", "2",
       "--model.expert_hidden", "32"]  # fmt: skip


def common(small_corpus, tmp_path) -> list[str]:
    """The flags of every run here: the tiny MoE with its global balancing loss (each rank's
    share of it computed on its own micro-batches, as one process computes it on each of
    its), the balancing bias moved after every step (the default), a step of 2
    micro-batches of 2 x 64 a rank, a sharded checkpoint every 2 steps, an evaluation at
    the end."""
    train, val = small_corpus
    return [
        *MOE, "--model.aux_loss", "0.01",
        "--data.path", str(train), "--data.val_path", str(val), "--out_dir", str(tmp_path / "runs"),
        "--data.seq_len", "64", "--data.batch_size", "2", "--data.frames_per_block", "1",
        "--optim.grad_accum", str(ACCUM), "--max_steps", str(STEPS), "--ckpt_every", str(SAVED),
        "--keep_ckpts", "0", "--log_every", "1", "--eval_every", "0", "--eval_batches", "2",
        "--samples", "0", "--optim.warmup_steps", "2", "--deterministic",
        "--no-tensorboard", "--no-progress", "--no-compile.safe_env",
    ]  # fmt: skip


LOSS_TOL, GRAD_TOL = 1e-6, 1e-5
"""The bounds, relative: on a loss, and on each parameter's gradient (the norm of the
difference over the norm); the test's docstring says why."""


def close_to(got: float, want: float) -> bool:
    return abs(got - want) <= LOSS_TOL * abs(want)


def assert_same_grads(got: dict, want: dict, run: str) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        off = float((got[name] - g).norm() / g.norm())
        assert off <= GRAD_TOL, (run, name, off)


@pytest.mark.slow
def test_experts_over_2_and_4_ranks_train_as_one_process_and_resume_at_another_ep(
    small_corpus, tmp_path
):
    """Step by step, the losses of 4 ranks at EP 1, 2 and 4, and under HSDP at EP 2 with
    every block recomputed (selective), are one process's over the same global batches
    (its 8 micro-batches are the ranks' 2 each), as are the gradients of the last step, made
    whole, and the validation loss; the EP-4 run saved at step 2 and resumed at EP 2 goes on
    with the uninterrupted EP-4 run's losses and ends with its gradients; the EP-4 run's
    checkpoint reads whole in one process, with one process's weights.

    Not bit for bit: sums run in another order. An expert's rows of a micro-batch meet in
    one matmul on the rank that holds it, coming from every rank of its group, where one
    process runs a matmul a micro-batch and adds them up; the ranks' gradients are
    reduce-scattered and divided by the world's size. Measured: every loss (and the
    validation loss) within 1.2e-7 of one process's, one float32 ulp; each parameter's
    gradient within 8.8e-7 of its norm, and each weight at the end within 1.1e-6 (HSDP;
    EP 4: 7.7e-7); the resumed run's losses bit for bit the EP-4 run's. The bounds:
    LOSS_TOL 1e-6 of the loss (as tests/test_hsdp.py), GRAD_TOL 1e-5 of the norm, for
    gradients and weights. The gradients are what catch a wrong scale: AdamW's update hardly depends on
    it, so the experts' gradients twice too large move a loss by about 1e-7, and divided
    twice at EP 4 (one rank a slice) by 1.7e-6, while their gradients are then off by their
    norm, and by 3/4 of it. A resume that mixed the scales moved the loss by 1.7e-5."""
    runs = [
        {"name": "ep1", "flags": ["--fsdp", "--ep", "1"]},
        {"name": "ep2", "flags": ["--ep", "2"]},  # fsdp auto takes FSDP2
        {"name": "ep4", "flags": ["--ep", "4"]},
        # HSDP, two groups of 2 ranks holding replicas (each group splits the experts), each
        # block recomputed in the backward (its all-to-alls too)
        {
            "name": "hsdp",
            "flags": [
                "--fsdp",
                "--fsdp_shard_size",
                "2",
                "--ep",
                "2",
                "--activation_checkpointing",
                "selective",
            ],
        },
        {"name": "resumed", "flags": ["--ep", "2"], "from": f"ep4/ckpt-{SAVED:08d}"},
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}",
           f"--master_port={next(PORTS)}", str(WORKER), str(tmp_path), json.dumps(runs),
           *common(small_corpus, tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = {run["name"]: torch.load(tmp_path / f"{run['name']}.pt") for run in runs}

    from pytrain.train.trainer import Trainer

    one = Trainer(parse_args([*common(small_corpus, tmp_path), "--name", "one",
                              "--optim.grad_accum", str(ACCUM * RANKS)]))  # fmt: skip
    try:
        val = one.fit()["val_loss"]
        grads = {name: p.grad for name, p in one.gpt.named_parameters()}
        weights = one.gpt.state_dict()
    finally:
        one.close()
    losses = {name: losses_by_step((tmp_path / "runs" / name / "train.log").read_text())
              for name in [*got, "one"]}  # fmt: skip
    assert sorted(losses["one"]) == list(range(1, STEPS + 1))
    assert losses["one"][1] - losses["one"][STEPS] > 0.05  # it learns: the steps differ

    for ep, name in ((1, "ep1"), (2, "ep2"), (4, "ep4"), (2, "hsdp")):
        run = got[name]
        assert run["step"] == STEPS
        assert sorted(losses[name]) == sorted(losses["one"]), name
        for step, want in losses["one"].items():
            assert close_to(losses[name][step], want), (name, step, losses[name], want)
        assert close_to(run["val_loss"], val), (name, run["val_loss"], val)
        assert_same_grads(run["grads"], grads, name)
        # The experts' weights: DTensors of every expert, [E, 2h, d], split over `ep`.
        assert run["experts"]["shape"] == (8, 64, 64)
        if ep > 1:
            assert f"the routed experts split over groups of {ep} ranks" in run["plan_line"]
            assert run["experts"]["placements"][-1] == "S(0)"  # Shard(0) on ep
    assert got["ep2"]["experts"]["mesh"] == got["ep4"]["experts"]["mesh"] == ("efsdp", "ep")
    assert "(fsdp auto: --ep 2 needs FSDP2;" in got["ep2"]["plan_line"]
    assert "HSDP, FSDP2 within each group of 2 ranks" in got["hsdp"]["plan_line"]
    assert got["hsdp"]["experts"]["mesh"] == ("replicate", "efsdp", "ep")

    # Resumed at EP 2 from the EP-4 run's step 2: its log goes on at step 3.
    resumed, whole = losses["resumed"], losses["ep4"]
    assert sorted(resumed) == list(range(SAVED + 1, STEPS + 1))
    for step in resumed:
        assert close_to(resumed[step], whole[step]), (step, resumed, whole)
    assert got["resumed"]["step"] == STEPS
    assert close_to(got["resumed"]["val_loss"], got["ep4"]["val_loss"])
    assert_same_grads(got["resumed"]["grads"], got["ep4"]["grads"], "resumed")
    # The checkpoint holds each expert tensor whole by its global shape, whatever the EP.
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "runs" / "ep4" / f"ckpt-{SAVED:08d}"))
    sizes = {k: tuple(m.size) for k, m in saved.read_metadata().state_dict_metadata.items()
             if k.endswith("experts.up")}  # fmt: skip
    assert len(sizes) == 2 and set(sizes.values()) == {(8, 64, 64)}, sizes
    # ... and reads whole in one process (sample, eval, export): the EP-4 run's last weights
    # are one process's.
    from pytrain.model.load import load

    read = load(tmp_path / "runs" / "ep4").gpt.state_dict()
    assert read.keys() == weights.keys()
    for name, want in weights.items():
        assert float((read[name] - want).norm()) <= GRAD_TOL * float(want.norm()), name


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--ep", "2"], "ep 2 splits a mixture of experts' routed experts over ranks: it needs "
         "--model.family moe (this model's family is dense)"),
        ([*MOE, "--model.experts", "6", "--ep", "4"], "ep 4 does not divide model.experts 6"),
        ([*MOE, "--ep", "2", "--no-fsdp"], "ep 2 needs FSDP2, which shards the rest of the model"),
        ([*MOE, "--ep", "0"], "ep is 0; expected a number >= 1"),
        ([*MOE, "--model.top_k", "9"], "model.top_k 9 with model.experts 8"),
    ],
)  # fmt: skip
def test_settings_ep_cannot_run_with_end_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        parse_args(flags)
    assert "\n" not in str(e.value)


def test_ep_divides_the_ranks_and_the_shard_groups_and_takes_fsdp2():
    cfg = parse_args([*MOE, "--ep", "4"])
    cpu = torch.device("cpu")
    for info, message in [
        (DistInfo(), "ep 4 does not divide the job's 1 rank(s)"),  # one process, no torchrun
        (DistInfo(world_size=6, launched=True), "ep 4 does not divide the job's 6 rank(s)"),
        # two nodes of 2 ranks: HSDP's shard groups are a node's 2 ranks
        (DistInfo(world_size=8, launched=True, local_world_size=2),
         "ep 4 does not divide FSDP2's shard groups of 2 ranks"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            choose(cfg, info, cpu, 0, master=False)
    plan = choose(cfg, DistInfo(world_size=8, launched=True), cpu, 0, master=False)
    assert (plan.kind, plan.ep, plan.shard) == ("fsdp2", 4, 8)
    assert "each expert sharded over the 2 ranks that hold it" in plan.line
    assert "(fsdp auto: --ep 4 needs FSDP2;" in plan.line
    assert choose(parse_args(MOE), DistInfo(world_size=8, launched=True), cpu, 0, False).ep == 1


def test_received_rows_are_regrouped_by_expert():
    # From rank 0: 1 row for this rank's expert 0, 2 for its expert 1; from rank 1: 3, then 1.
    # They arrive as [0 | 1 2 | 3 4 5 | 6]; the experts take [0 3 4 5 | 1 2 6].
    got = torch.tensor([[1, 2], [3, 1]])
    assert by_expert(got, 7).tolist() == [0, 3, 4, 5, 1, 2, 6]
    assert by_expert(torch.tensor([[0, 2], [1, 0]]), 3).tolist() == [2, 0, 1]
