"""Run by tests/test_ddp.py under torchrun (gloo): trains with the given flags and saves
the micro-batches this rank trained on (rows of tokens), so the test can check that a
run stopped on one number of processes and resumed on another saw every batch of the
global stream once."""

import sys

import torch

from pytrain.config import parse_args
from pytrain.train import distributed
from pytrain.train.trainer import Trainer

out, tag = sys.argv[1], sys.argv[2]
t = Trainer(parse_args(sys.argv[3:]))
rows: list[torch.Tensor] = []
take = t.feed.take


def recording_take(n: int):
    batches, wait = take(n)
    for b in batches:  # a row is its inputs plus the last target
        rows.append(torch.cat([b.input_ids, b.targets[:, -1:]], dim=1).cpu())
    return batches, wait


t.feed.take = recording_take  # type: ignore[method-assign]
t.fit()
torch.save(
    {"rows": rows, "step": t.step, "params": t.gpt.state_dict()},
    f"{out}/{tag}-rank{t.dist.rank}.pt",
)
t.close()
distributed.exit_process(0)  # as `python -m pytrain.train` ends under torchrun
