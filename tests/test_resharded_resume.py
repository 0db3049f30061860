"""FSDP2 resumed on another number of ranks, through torchrun on the CPU (gloo): 4 ranks train
3 steps and stop at a sharded checkpoint (a shard file a rank), 2 ranks resume it to step 6.

What the project promises of such a resume (docs/DISTRIBUTED.md, docs/LOADER.md): the loader
continues its global order, so every optimizer step trains on the global batches an
uninterrupted run trains on; the accumulation derived from optim.tokens_per_step keeps the
step's tokens; so the losses are an uninterrupted run's, up to the order in which the
gradients' fp32 sums run (4 ranks x 2 micro-batches against 2 x 4). The reference here is an
uninterrupted run of 6 steps on the new world size, 2 ranks."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from test_run_safety import ENV, step_losses, train_cmd

WORKER = Path(__file__).resolve().parent / "elastic_worker.py"  # records each rank's rows
STEPS, STOP = 6, 3
TOKENS = 2048  # a step: 2 micro-batches of 4 x 64 a rank on 4 ranks, 4 on 2


def leg(small_corpus, tmp_path, name: str, tag: str, ranks: int, *flags: str) -> str:
    """A run of `ranks` FSDP2 processes through tests/elastic_worker.py (which trains as
    `python -m pytrain.train` does and saves the rows of every micro-batch it took)."""
    cmd = train_cmd(small_corpus, tmp_path, name, "--fsdp", "--max_steps", str(STEPS),
                    "--ckpt_every", "0", "--optim.grad_accum", "0",
                    "--optim.tokens_per_step", str(TOKENS), *flags, torchrun=ranks)  # fmt: skip
    at = cmd.index("pytrain.train")
    cmd[at - 1 : at + 1] = [str(WORKER), str(tmp_path), tag]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def rows_by_step(tmp_path, tag: str, ranks: int, first_step: int) -> dict[int, list[tuple]]:
    """The rows each optimizer step trained on, over all ranks (sorted): a rank takes
    TOKENS / (64 x 4 x ranks) micro-batches a step, in order."""
    accum = TOKENS // (64 * 4 * ranks)
    steps: dict[int, list[tuple]] = {}
    for rank in range(ranks):
        micro = torch.load(tmp_path / f"{tag}-rank{rank}.pt", weights_only=False)["rows"]
        for i, batch in enumerate(micro):
            steps.setdefault(first_step + i // accum, []).extend(map(tuple, batch.tolist()))
    return {step: sorted(rows) for step, rows in steps.items()}


@pytest.mark.slow
def test_fsdp2_stopped_on_4_ranks_resumes_on_2_with_the_batches_and_losses_of_a_whole_run(
    small_corpus, tmp_path
):
    runs = tmp_path / "runs"
    out = leg(small_corpus, tmp_path, "cut", "first", 4, "--halt_after", str(STOP))
    assert f"x 4 rank(s) = {TOKENS:,} tokens per optimizer step" in out, out[-3000:]
    ckpt = runs / "cut" / f"ckpt-{STOP:08d}"
    assert sorted(p.name for p in ckpt.glob("__*_0.distcp")) == [f"__{r}_0.distcp" for r in range(4)]  # fmt: skip
    out = leg(small_corpus, tmp_path, "cut", "second", 2)
    assert "resuming a run saved on 4 rank(s) on 2" in out and f"at step {STOP}" in out, out[-3000:]
    assert f"4 micro-batches of 4x64 per rank x 2 rank(s) = {TOKENS:,} tokens" in out
    leg(small_corpus, tmp_path, "whole", "whole", 2)

    # The same global batches in every step, each once: the 4 ranks' first 3 steps, then the
    # 2 ranks' next 3, are the uninterrupted run's 6.
    got = {**rows_by_step(tmp_path, "first", 4, 1), **rows_by_step(tmp_path, "second", 2, STOP + 1)}
    want = rows_by_step(tmp_path, "whole", 2, 1)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert len(got[step]) == TOKENS // 64 and got[step] == want[step], step

    # The losses: not bit for bit by promise, as the sums run in another order. Measured
    # here: the resumed run's losses equal the 2-rank run's but for one float32 ulp at
    # step 4 (4.8e-7 at a loss of 7.9; they equal a 4-rank uninterrupted run's bit for bit), so the
    # bound is 1e-6 of the loss. A step on other batches, or one that lost the optimizer's
    # state, moves the loss by far more: it falls by over 0.05 a step here.
    got_loss, want_loss = step_losses(runs / "cut"), step_losses(runs / "whole")
    assert sorted(got_loss) == sorted(want_loss) == list(range(1, STEPS + 1))
    for step in want_loss:
        assert abs(got_loss[step] - want_loss[step]) <= 1e-6 * abs(want_loss[step]), (
            step, got_loss, want_loss)  # fmt: skip
    assert all(want_loss[s] - want_loss[s + 1] > 0.05 for s in range(1, STEPS))
