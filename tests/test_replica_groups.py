"""Replica groups on torchft, on the CPU: three groups, each its own torchrun job of one gloo
rank, meet at torchft's Lighthouse on localhost (`torchft_lighthouse`, a process of its
own), and train a global batch of 6 rows a step (2 rows x 1 micro-batch x 3 groups).

Every test reads the groups' ledgers (pytrain.train.replica_groups): the committed steps
cover the global order's rows [0, STEPS x 6) once each, every row of the first epoch among
them, and each group's share has the CRC of the rows a world-size-1 loader reads there. The
losses follow one process training the same global batch (grad_accum 3) within LOSS_RTOL:
the sums over groups are the same sums in another order (measured: at most 1.5e-7 over 90
steps). The groups end with the same weights and optimizer state, bit for bit. The figures
these tests print (-s) are the recovery's seconds and torchft's DistributedSampler's count
in the same run."""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import PORTS, SLURM, learnable_docs, losses_by_step, slurm_job_state, write_synthetic
from filelock import FileLock
from test_run_safety import children

from pytrain.config import ConfigError, parse_args
from pytrain.data.loader import TokenLoader
from pytrain.train import checkpoint
from pytrain.train.replica_groups import quorum_mismatch, quorum_tag
from pytrain.train.step_rows import Kept, StepRows, runs, share

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).parent / "replica_group_worker.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
# torchft's Rust side logs every quorum and vote at INFO: warnings only.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RUST_LOG": "warn"}
STEPS, GROUPS, ROWS = 90, 3, 6
LOSS_RTOL = 1e-6
EPOCH_ROWS = 192  # the first epoch of ft_data at 32 tokens a row (a loader's batches say so)


@pytest.fixture(scope="session")
def ft_data(tmp_path_factory) -> Path:
    """A corpus of 40 short documents: an epoch is 192 rows of 33 tokens, 32 steps."""
    out = tmp_path_factory.mktemp("ft") / "train"
    return write_synthetic(out, learnable_docs(40, seed=3), frame_bytes=2048, dtype="uint16", vocab=256)  # fmt: skip


def _flags(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data.path", str(data), "--out_dir", str(out), "--name", "ft",
            "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64",
            "--data.seq_len", "32", "--data.batch_size", "2", "--data.frames_per_block", "1",
            "--no-tensorboard", "--no-progress", "--no-compile.safe_env", "--log_every", "1",
            "--eval_every", "0", "--samples", "0", "--optim.warmup_steps", "2", "--deterministic",
            "--max_steps", str(STEPS), "--ckpt_every", "0", *extra]  # fmt: skip


@pytest.fixture(scope="session")
def reference(ft_data, tmp_path_factory):
    """reference(rows): the losses of one process training a global batch of `rows` rows (as
    micro-batches of 2), made once a pytest run and shared by pytest-xdist's workers (ft_data
    is the same in each: the same seeds)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def losses(rows: int = ROWS, *extra: str) -> dict[int, float]:
        name = f"ft-reference-{rows}" + ("-moe" if extra else "")
        work = root / name
        with FileLock(str(root / f"{name}.lock")):
            if not (work / "complete").exists():
                shutil.rmtree(work, ignore_errors=True)
                cmd = [sys.executable, "-m", "pytrain.train", *_flags(ft_data, work),
                       "--optim.grad_accum", str(rows // 2), *extra]  # fmt: skip
                r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
                assert r.returncode == 0, r.stderr[-3000:]
                (work / "complete").touch()
        return losses_by_step((work / "ft" / "train.log").read_text())

    return losses


@contextmanager
def lighthouse(tmp_path: Path, min_replicas: int, port: int | None = None):
    """torchft's Lighthouse on localhost; yields (address, its process). A replica that
    stops heartbeating is dead after 1 s, stragglers are waited for 1 s."""
    port = port or next(PORTS)
    p = _start_lighthouse(tmp_path, min_replicas, port)
    try:
        yield f"http://localhost:{port}", p
    finally:
        p.kill()
        p.wait()


def _start_lighthouse(tmp_path: Path, min_replicas: int, port: int) -> subprocess.Popen:
    log = open(tmp_path / f"lighthouse-{port}.log", "a")  # noqa: SIM115
    cmd = [str(LIGHTHOUSE), "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}",
           "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "1000", "--quorum_tick_ms", "50"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=ENV)


def start_group(addr, k, data, tmp_path, *extra, restarts=0, pace=0.0, ranks=1, env=None,
                out="group{k}") -> subprocess.Popen:  # fmt: skip
    """Replica group k: a torchrun job of `ranks` ranks (tests/replica_group_worker.py, each
    step of a smaller quorum held to `pace` seconds, `env` added to its environment), its
    output in tmp_path/group{k}.out (`out`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
           f"--master_port={next(PORTS)}", f"--max-restarts={restarts}", str(WORKER), str(pace),
           *_flags(data, tmp_path / "runs", "--optim.grad_accum", "1", "--ft.lighthouse", addr,
                   "--ft.group", str(k), "--ft.groups", str(GROUPS), "--ft.min_replicas", "2",
                   "--ft.timeout_s", "10", "--ft.quorum_timeout_s", "60", *extra)]  # fmt: skip
    log = open(tmp_path / f"{out.format(k=k)}.out", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                            text=True)  # fmt: skip


def output(tmp_path: Path, k: int) -> str:
    return (tmp_path / f"group{k}.out").read_text(errors="replace")


def ledger(tmp_path: Path, k: int) -> list[dict]:
    path = tmp_path / "runs" / "ft" / f"group{k}" / "ledger.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]


def wait_for(what, procs, tmp_path, limit: float = 240.0):
    """Polls `what()` until it returns something true; fails if a group ends first."""
    t0 = time.monotonic()
    while not (got := what()):
        for k, p in enumerate(procs):
            assert p.poll() is None, output(tmp_path, k)[-3000:]
        assert time.monotonic() - t0 < limit, f"waited {limit}s"
        time.sleep(0.05)
    return got


def finish(procs, tmp_path) -> list[int]:
    codes = []
    for k, p in enumerate(procs):
        try:
            codes.append(p.wait(timeout=300))
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(output(tmp_path, k)[-3000:]) from None
    return codes


def global_order(data: Path, rows: int) -> torch.Tensor:
    """The first `rows` rows of the global order, as one process's loader reads them."""
    out = []
    with TokenLoader(data, seq_len=32, batch_size=2, frames_per_block=1) as loader:
        for _ in range(rows // 2):
            b = next(loader)
            out.append(b.tokens.clone())
            b.release()
    return torch.cat(out)


def trained(line: dict) -> list[int]:
    """The rows of the global order a ledger line's group trained for its step: its share,
    and where it kept a failed attempt's work, the lost groups' rows it took (`extra`)."""
    first, last = line["share"]
    return [
        *range(first, last + 1),
        *(i for a, b in line.get("extra", []) for i in range(a, b + 1)),
    ]


def assert_every_row_once(tmp_path: Path, data: Path, groups=range(GROUPS), rows=ROWS) -> dict:
    """Every step s of the run committed once with the rows [s x rows, (s + 1) x rows), the
    shares of each step's quorum disjoint within them and each the rows the global order has
    there. Returns the committed lines by step."""
    by_step: dict[int, list] = collections.defaultdict(list)
    for k in groups:
        for line in ledger(tmp_path, k):
            if line["committed"]:
                by_step[line["step"]].append(line)
    assert sorted(by_step) == list(range(STEPS))
    order = global_order(data, STEPS * rows)
    for step, lines in by_step.items():
        assert {tuple(x["rows"]) for x in lines} == {(step * rows, step * rows + rows - 1)}
        assert len({x["groups"] for x in lines}) == 1, lines  # one quorum committed it
        taken = [i for x in lines for i in trained(x)]
        assert len(taken) == len(set(taken)) and set(taken) <= set(
            range(step * rows, step * rows + rows)
        )
        for x in lines:
            first, last = x["share"]
            assert x["crc"] == zlib.crc32(order[first : last + 1].contiguous().numpy().tobytes())
            if "extra" in x:  # an attempt that kept a failed one's work: the lost rows it took
                extra = [i for a, b in x["extra"] for i in range(a, b + 1)]
                assert x["extra_crc"] == zlib.crc32(order[extra].contiguous().numpy().tobytes())
    # STEPS x rows rows, each once: the first epoch's rows are all among them.
    assert STEPS * rows >= EPOCH_ROWS
    return by_step


def final_state(tmp_path: Path, k: int) -> dict:
    return checkpoint.read(checkpoint.list_checkpoints(tmp_path / "runs" / "ft" / f"group{k}")[-1])


def final_tensors(tmp_path: Path, k: int) -> dict[str, torch.Tensor]:
    """The weights and optimizer state of group k's last checkpoint, whole (an FSDP2 run's
    sharded one put together by torch.distributed.checkpoint), by name."""
    path = checkpoint.list_checkpoints(tmp_path / "runs" / "ft" / f"group{k}")[-1]
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, tmp_path / f"group{k}-whole.pt")
        state = torch.load(tmp_path / f"group{k}-whole.pt", weights_only=False)
    else:
        state = checkpoint.read(path)
        state = {"model": state["model"], "optimizer": state["optimizer"]["state"]}

    def flat(d: dict, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {}
        for key, v in d.items():
            if isinstance(v, dict):
                out |= flat(v, f"{prefix}{key}.")
            elif isinstance(v, torch.Tensor):
                out[f"{prefix}{key}"] = v
        return out

    return flat({"model": state["model"], "optimizer": state["optimizer"]})


def assert_same_state(tmp_path: Path, groups) -> None:
    """The groups' last checkpoints, of the run's last step, hold the same weights and
    optimizer state, bit for bit."""
    first, *rest = (final_tensors(tmp_path, k) for k in groups)
    assert any(name.startswith("optimizer.") for name in first)
    for other in rest:
        assert first.keys() == other.keys()
        for name, t in first.items():
            assert torch.equal(t, other[name]), name


def assert_losses_follow(tmp_path: Path, reference: dict[int, float], rtol=LOSS_RTOL) -> None:
    losses = losses_by_step((tmp_path / "runs" / "ft" / "group0" / "train.log").read_text())
    assert max(losses) == STEPS
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= rtol * abs(reference[step]), (step, loss)


# A mixture of experts, balanced by its bias: the groups sum their loads with the gradients,
# so every group's bias moves as one process's would (a group's own loads alone would part
# the groups' routing), and the bias is in the state compared bit for bit.
MOE = ("--model.family", "moe", "--model.experts", "4", "--model.top_k", "2",
       "--model.expert_hidden", "64", "--model.balance_rate", "0.01")  # fmt: skip


@pytest.mark.slow
def test_groups_of_experts_train_every_row_once_as_one_process_through_a_death(
    ft_data, tmp_path, reference
):
    """Three groups of a mixture of experts (the dense model: the other tests); group 2 dies
    where it joins step 30's all-reduce, and is not restarted. The two others keep that
    attempt's gradients and expert loads, train group 2's rows between them (each its
    `extra`), and go on as two: every row once, their losses and bias one process's."""
    died = tmp_path / "died"
    with lighthouse(tmp_path, 2) as (addr, _):
        procs = [
            start_group(addr, k, ft_data, tmp_path, *MOE,
                        env={"DIE_AT": "30", "DIED": str(died)} if k == 2 else None)
            for k in range(3)
        ]  # fmt: skip
        assert finish(procs, tmp_path)[:2] == [0, 0], output(tmp_path, 0)[-3000:]
    by_step = assert_every_row_once(tmp_path, ft_data)
    # (the first step from 30 on that all three trained: under load a group may come late)
    failed = ledger_failures(tmp_path, range(30, STEPS))
    died_in = min(x["step"] for x in failed)
    assert {x["groups"] for x in failed if x["step"] == died_in} == {3}
    assert all(len(by_step[s]) == 2 for s in range(died_in, STEPS))
    assert all("extra" in x for x in by_step[died_in]), by_step[died_in]
    assert not any("extra" in x for s in range(died_in + 1, STEPS) for x in by_step[s])
    assert_same_state(tmp_path, range(2))
    bias = final_tensors(tmp_path, 0)["model.blocks.0.mlp.expert_bias"]
    assert bias.any()  # it moved, alike in every group
    assert_losses_follow(tmp_path, reference(ROWS, *MOE))


@pytest.mark.slow
def test_a_group_dead_between_two_steps_holds_the_others_up_for_the_heartbeat_and_half_a_step(
    ft_data, tmp_path, reference
):
    """Group 2 dies once it has committed a step of all three (from step 40 on), before the
    next asks for its quorum. The two others train that next step ahead of its quorum under
    the last one's cut while the Lighthouse waits out group 2's heartbeat, then keep it and
    train group 2's rows between them (each its `extra`, kept from the last step's quorum):
    every row once, losses one process's. Before, they waited for the quorum and trained the
    step whole at half again their share."""
    died = tmp_path / "died"
    with lighthouse(tmp_path, 2) as (addr, _):
        procs = [
            start_group(addr, k, ft_data, tmp_path,
                        env={"DIE_AFTER": "40", "DIED": str(died)} if k == 2 else None)
            for k in range(3)
        ]  # fmt: skip
        assert finish(procs, tmp_path)[:2] == [0, 0], output(tmp_path, 0)[-3000:]
    by_step = assert_every_row_once(tmp_path, ft_data)
    last = max(x["step"] for x in ledger(tmp_path, 2) if x["committed"])  # where group 2 died
    assert last >= 39 and {x["group"] for x in by_step[last]} == {0, 1, 2}
    assert all(len(by_step[s]) == 2 for s in range(last + 1, STEPS))
    (quorum,) = {x["quorum"] for x in by_step[last]}
    assert [x.get("kept_from") for x in by_step[last + 1]] == [quorum] * 2, by_step[last + 1]
    assert not any(ledger_failures(tmp_path, s) for s in range(last, STEPS))
    when = float(died.read_text())
    back = max(x["time"] for x in by_step[last + 1]) - when
    print(f"groups 0 and 1 committed again {back:.2f}s after group 2 died between two steps")
    assert_same_state(tmp_path, range(2))
    assert_losses_follow(tmp_path, reference())


def ledger_failures(tmp_path: Path, steps: range | int) -> list[dict]:
    """The attempts of `steps` (counted from 0) that did not commit, in any group's ledger."""
    steps = range(steps, steps + 1) if isinstance(steps, int) else steps
    return [x for k in range(GROUPS) for x in ledger(tmp_path, k)
            if x["step"] in steps and not x["committed"]]  # fmt: skip


def test_a_step_is_cut_into_contiguous_shares_that_differ_by_one_row_at_most():
    for rows in (6, 7, 12, 512):
        for parts in range(1, 7):
            cuts = [share(rows, parts, i) for i in range(parts)]
            assert cuts[0][0] == 0 and cuts[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:], strict=False))
            assert max(e - f for f, e in cuts) - min(e - f for f, e in cuts) <= 1


def test_an_all_reduce_of_groups_that_cut_the_step_differently_commits_nowhere():
    """The tags of the groups that summed a step: where any of them cut it otherwise (another
    quorum's size, step or places, a group missing or twice), every group's check fails."""
    tags = lambda *views: sum(quorum_tag(g, 3, place, n, step) for g, place, n, step in views)  # noqa: E731
    views = [(0, 0, 3, 5), (1, 1, 3, 5), (2, 2, 3, 5)]
    assert quorum_mismatch(tags(*views), 3, 3, 5) is None
    assert quorum_mismatch(tags((2, 0, 2, 7), (0, 1, 2, 7)), 3, 2, 7) is None
    # Seen: the Lighthouse restarted mid-step; group 2 of the old quorum of three summed with
    # groups 0 and 1 of the new quorum of two, whose shares overlap its own.
    mixed = tags((0, 0, 2, 5), (1, 1, 2, 5), (2, 2, 3, 5))
    assert "quorums of [2, 2, 3] groups" in quorum_mismatch(mixed, 3, 3, 5)
    assert "summed 3 group(s) of a quorum of 2" in quorum_mismatch(mixed, 3, 2, 5)
    assert "summed 2 group(s) of a quorum of 3" in quorum_mismatch(tags(*views[:2]), 3, 3, 5)
    assert "steps [5, 5, 6]" in quorum_mismatch(tags(*views[:2], (2, 2, 3, 6)), 3, 3, 5)
    assert "places [0, 1, 1]" in quorum_mismatch(tags(*views[:2], (2, 1, 3, 5)), 3, 3, 5)
    assert "more than one process of group(s) [1]" in quorum_mismatch(
        tags(*views, views[1]), 3, 3, 5
    )


def test_survivors_keep_their_shares_and_cut_the_lost_groups_rows_between_them(ft_data):
    """An attempt of G groups failed and the next quorum is its survivors: each keeps its old
    share and takes its part of the lost groups' rows (StepRows under Kept). Over the
    survivors and their ranks, the rows of the step are each trained once, every micro-batch
    holds the global order's rows at the indices it claims, and no rank is left without
    one."""
    rows, size = 24, 2
    order = global_order(ft_data, rows)
    for old, lost in [(3, (2,)), (3, (0,)), (4, (1, 2)), (4, (3,)), (5, (0, 2, 4))]:
        survivors = [p for p in range(old) if p not in lost]
        n = len(survivors)
        taken: list[int] = []
        for place, was in enumerate(survivors):
            kept = Kept(was, old, lost)
            for rank in range(2):
                with TokenLoader(ft_data, seq_len=32, batch_size=size, frames_per_block=1) as ld:
                    feed = StepRows(ld, torch.device("cpu"), False, rows, rank, 2)
                    feed.quorum = lambda p=place, n=n, k=kept: (p, n, k)  # noqa: E731
                    batches, _ = feed.take()
                    got = torch.cat([b.input_ids for b in batches])
                    assert batches and all(len(b.input_ids) <= size for b in batches)
                    mine = feed.extra_rows[slice(*share(len(feed.extra_rows), 2, rank))]
                    assert torch.equal(got.long(), order[mine][:, :-1].long())
                    if rank == 0:
                        taken += [*range(*feed.group_rows), *feed.extra_rows.tolist()]
                        assert feed.group_rows == share(rows, old, was)
        assert sorted(taken) == list(range(rows)), (old, lost)
    assert runs(torch.tensor([0, 1, 2, 5, 7, 8])) == [[0, 2], [5, 5], [7, 8]]


def test_groups_that_keep_a_failed_attempt_differently_commit_nowhere():
    """Where a step's groups keep a failed attempt's work (Kept), every one of them does, from
    the same quorum (its size and torchft's id), from places of their own there."""

    def tags(*views):
        return sum(quorum_tag(g, 3, place, 2, 5, kept, q) for g, place, kept, q in views)

    a, b = (0, 0, Kept(0, 3, (2,)), 7), (1, 1, Kept(1, 3, (2,)), 7)
    assert quorum_mismatch(tags(a, b), 3, 2, 5) is None
    assert quorum_mismatch(tags((0, 0, None, 0), (1, 1, None, 0)), 3, 2, 5) is None
    assert "of [3, 0] groups" in quorum_mismatch(tags(a, (1, 1, None, 0)), 3, 2, 5)
    assert "ids [7, 8]" in quorum_mismatch(tags(a, (1, 1, Kept(1, 3, (2,)), 8)), 3, 2, 5)
    assert "places [0, 0] of a quorum of 3" in quorum_mismatch(
        tags(a, (1, 1, Kept(0, 3, (2,)), 7)), 3, 2, 5
    )
    assert "of a quorum of 2" in quorum_mismatch(
        tags((0, 0, Kept(0, 2, ()), 7), (1, 1, Kept(1, 2, ()), 7)), 3, 2, 5
    )


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--ft.lighthouse", "localhost:29510"], "ft.lighthouse"),
        (["--ft.lighthouse", "http://h:1", "--ft.group", "3", "--ft.groups", "3"], "ft.group 3"),
        (["--ft.lighthouse", "http://h:1", "--ft.groups", "2", "--ft.min_replicas", "3"], "ft.min_replicas 3"),
        (["--ft.lighthouse", "http://h:1", "--ft.quorum_timeout_s", "0"], "ft.quorum_timeout_s"),
        (["--ft.lighthouse", "http://h:1", "--data.mode", "bucket"], "data.mode pack"),
        (["--ft.groups", "0"], "ft.groups"),
    ],
)  # fmt: skip
def test_bad_ft_settings_are_one_line_naming_the_setting(flags, names):
    with pytest.raises(ConfigError, match=names):
        parse_args(flags)


def test_without_torchft_or_torchrun_a_group_does_not_start(monkeypatch, tmp_path):
    from pytrain.train import replica_groups

    cfg = parse_args(["--ft.lighthouse", "http://localhost:1", "--out_dir", str(tmp_path)])
    monkeypatch.setitem(sys.modules, "torchft", None)  # what a missing package raises
    with pytest.raises(ConfigError, match=r"needs torchft.*pip install 'pytrain\[ft\]'"):
        replica_groups.ReplicaGroupTrainer(cfg)
    monkeypatch.undo()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match="start each replica group with torchrun"):
        replica_groups.ReplicaGroupTrainer(cfg)


def _heal(tmp_path: Path, victim: int, after: float) -> dict | None:
    """Group 2's first committed ledger line of a process other than `victim`, after `after`."""
    lines = [x for x in ledger(tmp_path, 2) if x["committed"] and x["pid"] != victim]
    return next((x for x in lines if x["time"] > after), None)


def sampler_count(tmp_path: Path) -> tuple[int, int]:
    """(rows repeated, rows of the run's first STEPS x 6 never trained) had each group read
    torchft's DistributedSampler over those rows, in the same run: its own fixed shard, the
    full-strength share of 2 rows a step attempt, a fresh iterator in each process (the
    state of torchft's examples, where a peer's heal sends no loader position), a step that
    did not commit losing the rows taken for it."""
    from torchft.data import DistributedSampler

    rows = STEPS * ROWS
    trained: collections.Counter = collections.Counter()
    for k in range(GROUPS):
        sampler = DistributedSampler(range(rows), replica_rank=k, num_replica_groups=GROUPS,
                                     group_rank=0, num_replicas=1, shuffle=False)  # fmt: skip
        pid, it = None, iter(())
        for line in ledger(tmp_path, k):
            if line["pid"] != pid:  # a restarted process starts its shard over
                pid, it = line["pid"], iter(sampler)
            batch = []
            while len(batch) < ROWS // GROUPS:
                if (i := next(it, None)) is None:
                    it = iter(sampler)  # the shard's end: its next epoch
                else:
                    batch.append(i)
            if line["committed"]:
                trained.update(batch)
    repeated = sum(c - 1 for c in trained.values() if c > 1)
    return repeated, sum(1 for i in range(rows) if trained[i] == 0)


@pytest.mark.slow
def test_a_group_killed_twice_heals_from_a_peer_and_every_row_is_trained_once(
    ft_data, tmp_path, reference
):
    """Group 2's rank is SIGKILLed at a random step, twice; torchrun restarts it
    (--max-restarts 2) while the others go on with 3 rows each, and it heals from a peer
    (weights, optimizer, loader position, step, RNG) at the step the others have reached."""
    rng = random.Random(20261203)
    with lighthouse(tmp_path, 2) as (addr, _):
        procs = [start_group(addr, k, ft_data, tmp_path, restarts=2 if k == 2 else 0, pace=1.0)
                 for k in range(GROUPS)]  # fmt: skip
        at = rng.randint(3, 8)
        for _ in range(2):
            wait_for(lambda: any(x["step"] >= at for x in ledger(tmp_path, 2)), procs, tmp_path)  # noqa: B023
            victim = children(procs[2].pid)[-1]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            healed = wait_for(lambda: _heal(tmp_path, victim, killed), procs, tmp_path)  # noqa: B023
            print(f"killed at step {at}, healed at step {healed['step']}: "
                  f"{healed['time'] - killed:.1f}s from the kill to its first committed step")  # fmt: skip
            at = healed["step"] + rng.randint(2, 5)
        assert finish(procs, tmp_path) == [0, 0, 0], output(tmp_path, 2)[-3000:]
    # Three processes of group 2 trained (the last two healed; the first too, where it came
    # after the others had started).
    assert len({x["pid"] for x in ledger(tmp_path, 2)}) == 3
    assert output(tmp_path, 2).count("healed from a peer at step") >= 2
    for k in range(2):  # each sent group 2 its state twice
        assert_quiet(tmp_path, k)
    by_step = assert_every_row_once(tmp_path, ft_data)
    assert {lines[0]["groups"] for lines in by_step.values()} == {2, 3}  # the global batch kept
    assert_same_state(tmp_path, range(GROUPS))
    assert_losses_follow(tmp_path, reference())
    repeated, never = sampler_count(tmp_path)
    print(f"torchft's DistributedSampler in this run: {repeated} rows repeated, {never} of "
          f"{STEPS * ROWS} never trained; the ledger: none repeated, none left out")  # fmt: skip
    assert repeated > 0 and never > 0


@pytest.mark.slow
@SLURM
def test_under_slurm_a_killed_group_heals_and_every_row_is_trained_once(
    ft_data, tmp_path, reference
):
    """examples/slurm/replica_groups.sbatch submitted to a real Slurm: one node, three tasks
    (the groups, one CPU rank each; srun starts their torchrun jobs) and the Lighthouse as a
    step of its own. Group 2's rank is SIGKILLed; its torchrun restarts it, it heals from a
    peer, and the job completes with every row trained once."""
    env = {**ENV, "CONFIG": str(ROOT / "configs/cpu-default.toml"), "NAME": "ft",
           "GPUS_PER_NODE": "1", "MIN_REPLICAS": "2", "RESTARTS": "1", "LH_PORT": str(next(PORTS)),
           "TRAIN": f"{WORKER} 1.0", "PATH": f"{Path(sys.executable).parent}:{ENV['PATH']}"}  # fmt: skip
    flags = _flags(ft_data, tmp_path / "runs", "--optim.grad_accum", "1", "--ft.timeout_s", "10",
                   "--ft.quorum_timeout_s", "60")  # fmt: skip
    out = tmp_path / "slurm.out"
    r = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=3",
                        "--gpus-per-node=0", "--cpus-per-task=1", "--overcommit", "--time=10",
                        f"--output={out}", str(ROOT / "examples/slurm/replica_groups.sbatch"), *flags],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    text = lambda: out.read_text(errors="replace")[-3000:] if out.exists() else slurm_job_state(job)  # noqa: E731
    try:
        t0 = time.monotonic()
        while not any(x["step"] >= 5 for x in ledger(tmp_path, 2)):
            assert time.monotonic() - t0 < 240 and slurm_job_state(job) in ("PENDING", "RUNNING"), (
                text()
            )
            time.sleep(0.2)
        victim, killed = ledger(tmp_path, 2)[-1]["pid"], time.time()
        os.kill(victim, signal.SIGKILL)
        while slurm_job_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE"):
            assert time.monotonic() - t0 < 400, text()
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job], timeout=30)
    assert slurm_job_state(job) in ("COMPLETED", "GONE"), text()
    healed = _heal(tmp_path, victim, killed)
    assert healed is not None and "healed from a peer at step" in out.read_text(), text()
    assert "error" not in out.read_text().split("done: 90 steps")[-1], text()  # a quiet end
    assert (tmp_path / f"lighthouse-{job}.log").exists()
    print(f"under Slurm: killed at step 5+, healed at step {healed['step']}, "
          f"{healed['time'] - killed:.1f}s from the kill to its first committed step")  # fmt: skip
    by_step = assert_every_row_once(tmp_path, ft_data)
    assert {lines[0]["groups"] for lines in by_step.values()} >= {2, 3}
    assert_same_state(tmp_path, range(GROUPS))
    assert_losses_follow(tmp_path, reference())


@pytest.mark.slow
def test_a_group_killed_in_the_all_reduce_holds_the_others_up_seconds_and_a_late_restart_ends(
    ft_data, tmp_path
):
    """Four groups, three needed for a quorum; group 3's rank dies where it would join a
    step's all-reduce (tests/replica_group_worker.py DIE_AT), the three others inside it.
    gloo's all-reduce is a ring: its two neighbours see the connection reset at once, the
    third waits on a receive from one of them, and the two cannot form a quorum without it.
    All three commit again within the Lighthouse's heartbeat timeout (1 s) and a step, with
    a margin for a loaded machine, not after ft.timeout_s (30 s here): a group aborts its
    all-reduce's connections as the all-reduce fails, and the third's receive fails too.

    After the job's end, group 3 is started again (a restart that came too late: the peers'
    checkpoints are at the last step), and group 0 (its own is): each says in one line that
    the job is complete and ends with 0 at once, writing nothing, not after
    ft.quorum_timeout_s with a checkpoint of step 0 and exit 2."""
    died, groups = tmp_path / "died", 4
    flags = ("--max_steps", "16", "--ft.groups", str(groups), "--ft.min_replicas", "3",
             "--ft.timeout_s", "30", "--ft.quorum_timeout_s", "30")  # fmt: skip
    with lighthouse(tmp_path, 3) as (addr, _):
        procs = [start_group(addr, k, ft_data, tmp_path, *flags, pace=0.5,
                             env={"DIE_AT": "4", "DIED": str(died)} if k == groups - 1 else None)
                 for k in range(groups)]  # fmt: skip
        codes = finish(procs, tmp_path)
        assert codes[:-1] == [0] * (groups - 1) and codes[-1] != 0, output(tmp_path, 0)[-3000:]
        before, t0 = files(tmp_path / "runs"), time.monotonic()
        late = {k: start_group(addr, k, ft_data, tmp_path, *flags, out="late{k}") for k in (3, 0)}
        for k, p in late.items():
            said = lambda: (tmp_path / f"late{k}.out").read_text()  # noqa: B023, E731
            assert p.wait(timeout=120) == 0, said()
            print(f"group {k} started after the end: exit 0 in {time.monotonic() - t0:.1f}s")
            assert said().splitlines() == [
                f"pytrain.train: the job is complete: {tmp_path}/runs/ft/group0/ckpt-00000016.pt "
                f"is at its last step (max_steps 16); group {k} has nothing to train and wrote "
                "nothing"
            ], said()
        assert files(tmp_path / "runs") == before
    when = float(died.read_text())
    for k in range(groups - 1):
        back = min(x["time"] for x in ledger(tmp_path, k) if x["committed"] and x["time"] > when)
        print(f"group {k} committed again {back - when:.2f}s after group {groups - 1} died")
        assert back - when < 8.0, output(tmp_path, k)[-3000:]
        assert assert_quiet(tmp_path, k) > 0  # the step group 3 died in
    # The ledger names each attempt's quorum: torchft's id and its groups by place, alike in
    # every line of the quorum; the step group 3 died in failed under a quorum of all four,
    # and was tried again under a new one of the three others.
    lines = [x for k in range(groups) for x in ledger(tmp_path, k)]
    assert all(len(x["members"]) == x["groups"] and x["members"][x["place"]] == x["group"]
               for x in lines)  # fmt: skip
    quorums = collections.defaultdict(set)
    for x in lines:
        quorums[x["step"], x["quorum"]].add(tuple(x["members"]))
    assert all(len(members) == 1 for members in quorums.values()), quorums
    failed = [x for x in lines if not x["committed"]]
    after = [x for x in lines if x["step"] == failed[0]["step"] and x["committed"]]
    assert {len(x["members"]) for x in failed} == {4} and {x["group"] for x in failed} == {0, 1, 2}
    assert {tuple(sorted(x["members"])) for x in after} == {(0, 1, 2)}
    assert {x["quorum"] for x in failed}.isdisjoint(x["quorum"] for x in after)


def assert_quiet(tmp_path: Path, k: int) -> int:
    """Group k's terminal says a line for each step attempt that failed (its ledger's), the
    detail in its torchft.log; no traceback, warning or HTTP request line of torchft, gloo or
    torch, and no DDP announced for a group of one rank. Returns the failed attempts."""
    out, failed = output(tmp_path, k), [x for x in ledger(tmp_path, k) if not x["committed"]]
    said = [x for x in out.splitlines() if " not committed under this quorum " in x]
    assert len(said) == len(failed), out
    log = tmp_path / "runs" / "ft" / f"group{k}" / "torchft.log"
    assert all(x.endswith(f"tried again (detail in {log})") for x in said), said
    assert not failed or "Traceback" in log.read_text()
    for noise in ("Traceback", "Warning", "HTTP/1.1", "DDP"):
        assert noise not in out, out
    return len(failed)


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*")}  # fmt: skip


def _committed_after(tmp_path: Path, k: int, when: float) -> bool:
    return any(x["committed"] and x["time"] > when for x in ledger(tmp_path, k))


@pytest.mark.slow
def test_the_job_waits_for_a_restarted_lighthouse_and_goes_on_without_a_lost_group(
    ft_data, tmp_path, reference
):
    """The Lighthouse is SIGKILLed and started again on its port 2 s later: the groups wait
    (torchft asks again about once a second, up to ft.quorum_timeout_s) and go on, every row
    still once. Then group 2's rank is SIGKILLed with no restart left: the two others train
    the rest at the same global batch, 3 rows each. The first Lighthouse forms no quorum
    without all three groups (a group that starts late on a busy machine would otherwise
    find the two others training without it), the second one quorums of two."""
    port = next(PORTS)
    with lighthouse(tmp_path, GROUPS, port) as (addr, first):
        procs = [start_group(addr, k, ft_data, tmp_path) for k in range(GROUPS)]
        wait_for(lambda: len(ledger(tmp_path, 0)) >= 5, procs, tmp_path)
        first.kill()
        down = time.time()
        time.sleep(2)
        second = _start_lighthouse(tmp_path, 2, port)
        try:
            wait_for(lambda: _committed_after(tmp_path, 0, down + 2), procs, tmp_path)
            times = [x["time"] for x in ledger(tmp_path, 0)]
            stalled = max(b - a for a, b in zip(times, times[1:], strict=False))
            print(f"the Lighthouse down 2 s: {stalled:.1f}s between two steps of group 0")
            os.kill(children(procs[2].pid)[-1], signal.SIGKILL)
            assert finish(procs, tmp_path)[:2] == [0, 0], output(tmp_path, 0)[-3000:]
            assert procs[2].returncode != 0
        finally:
            second.kill()
            second.wait()
    by_step = assert_every_row_once(tmp_path, ft_data, groups=range(2))
    assert {lines[0]["groups"] for lines in by_step.values()} >= {2, 3}
    assert by_step[STEPS - 1][0]["groups"] == 2  # the end without group 2
    assert_same_state(tmp_path, range(2))
    assert_losses_follow(tmp_path, reference())


@pytest.mark.slow
def test_too_few_groups_stop_with_one_line_and_a_checkpoint(ft_data, tmp_path):
    with lighthouse(tmp_path, 2) as (addr, _):
        p = start_group(addr, 0, ft_data, tmp_path, "--ft.quorum_timeout_s", "3")
        assert finish([p], tmp_path) != [0]
    out = output(tmp_path, 0)
    line = next(x for x in out.splitlines() if x.startswith("pytrain.train: error:"))
    assert "no quorum of ft.min_replicas 2 replica group(s)" in line, line
    assert "within ft.quorum_timeout_s 3" in line and "run the same command to resume" in line
    assert f'File "{ROOT / "pytrain"}' not in out  # one line, no traceback through our code
    assert final_state(tmp_path, 0)["step"] == 0


def test_a_group_whose_peers_end_the_job_while_it_starts_commits_nothing(ft_data, tmp_path):
    """Group 1 starts first, passes the start's check (no peer has ended the job) and is held
    as it builds (tests/replica_group_worker.py HELD, GO) while group 0 trains the whole
    job alone and exits. Its first quorum is then of itself alone, at step 0: it
    ends with 0 in one line, committing nothing, and does not train the job a second time
    (as it did, alone, from step 0, on a busy machine where a group took longer to start
    than its peers took to finish)."""
    held, go, steps = tmp_path / "held", tmp_path / "go", 16
    flags = ("--max_steps", str(steps), "--ft.groups", "2", "--ft.min_replicas", "1")
    with lighthouse(tmp_path, 1) as (addr, _):
        late = start_group(
            addr, 1, ft_data, tmp_path, *flags, env={"HELD": str(held), "GO": str(go)}
        )
        t0 = time.monotonic()
        while not held.exists():
            assert late.poll() is None and time.monotonic() - t0 < 240, output(tmp_path, 1)
            time.sleep(0.05)
        first = start_group(addr, 0, ft_data, tmp_path, *flags)
        assert first.wait(timeout=300) == 0, output(tmp_path, 0)[-3000:]
        go.touch()
        assert late.wait(timeout=120) == 0, output(tmp_path, 1)[-3000:]
    last = output(tmp_path, 1).splitlines()[-1]
    assert last == (
        f"pytrain.train: the job is complete: {tmp_path}/runs/ft/group0/ckpt-{steps:08d}.pt is "
        f"at its last step (max_steps {steps}); group 1 started as its peers ended and "
        "committed no step"
    ), output(tmp_path, 1)
    assert ledger(tmp_path, 1) == []
    committed = [x["step"] for x in ledger(tmp_path, 0) if x["committed"]]
    assert committed == list(range(steps))
    assert not checkpoint.list_checkpoints(tmp_path / "runs" / "ft" / "group1")


@pytest.mark.slow
def test_groups_of_two_fsdp2_ranks_heal_each_rank_from_its_peer(ft_data, tmp_path, reference):
    """Two groups of two ranks each under FSDP2 (each rank a shard of the weights and of the
    optimizer state); group 1 starts after group 0 has trained alone for a few steps (4 rows
    a rank) and heals, each of its ranks from group 0's rank of the same place. Group 0
    waits at step 5 until group 1 has imported and starts building (its HELD file), then
    steps every 0.5 s: however slowly a busy machine starts group 1, group 0 does not end
    the job first. The global batch is 8 rows; FSDP2's reduce-scatters sum in another
    order than one process: measured 1.5e-6 over 90 steps, 2.2e-6 over 300."""
    ready = tmp_path / "group1-building"
    with lighthouse(tmp_path, 1) as (addr, _):
        flags = ("--fsdp", "--ft.groups", "2", "--ft.min_replicas", "1")
        procs = [start_group(addr, 0, ft_data, tmp_path, *flags, ranks=2, pace=0.5,
                             env={"WAIT_FOR": str(ready), "WAIT_AT": "5"})]  # fmt: skip
        wait_for(lambda: len(ledger(tmp_path, 0)) >= 5, procs, tmp_path)
        procs.append(start_group(addr, 1, ft_data, tmp_path, *flags, ranks=2,
                                 env={"HELD": str(ready), "GO": str(ready)}))  # fmt: skip
        assert finish(procs, tmp_path) == [0, 0], output(tmp_path, 1)[-3000:]
    assert "healed from a peer at step" in output(tmp_path, 1)
    by_step = assert_every_row_once(tmp_path, ft_data, groups=range(2), rows=8)
    assert {lines[0]["groups"] for lines in by_step.values()} == {1, 2}
    assert_same_state(tmp_path, range(2))
    assert_losses_follow(tmp_path, reference(8), rtol=1e-5)


def test_the_cost_benchmark_runs_a_named_preset_as_shipped(monkeypatch, tmp_path):
    """benchmarks/replica_groups.py's runs are a small GPT unless --flags name a preset: then
    the preset's own shape and accumulation (flags override a preset, so the small GPT's
    would have replaced them)."""
    from conftest import load_script

    import pytrain.data.corpus

    bench = load_script("benchmarks/replica_groups.py", "replica_groups_bench")
    data = tmp_path / "train"
    monkeypatch.setattr(pytrain.data.corpus, "build_default", lambda: (data, None))
    preset = parse_args(
        bench.train_flags(tmp_path, "ft", 30, ["--config", "configs/llama-350m.toml"])
    )
    assert (preset.model.n_layer, preset.model.d_model, preset.data.seq_len) == (24, 1024, 2048)
    assert (preset.optim.grad_accum, preset.max_steps, preset.eval_every) == (0, 30, 0)
    small = parse_args(bench.train_flags(tmp_path, "ft", 30, []))
    assert (small.model.n_layer, small.model.d_model, small.optim.grad_accum) == (4, 128, 1)
