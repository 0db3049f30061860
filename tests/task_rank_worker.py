"""Run by tests/test_task_ranks.py under torchrun (CPU ranks, gloo): trains with the flags
given (--eval.tasks among them) and saves this rank's last downstream scores: each task's
per-request log-likelihoods and accuracies, and the rows this rank scored itself."""

import sys

import torch

from pytrain.config import parse_args
from pytrain.train import distributed
from pytrain.train.trainer import Trainer

out = sys.argv[1]
t = Trainer(parse_args(sys.argv[2:]))
t.fit()
r = t.tasks.last
torch.save(
    {
        "plan": t.plan.kind,
        "rows": r.rows,
        "mine": r.mine,
        "tasks": {x.name: (x.loglik, x.acc, x.acc_norm, x.acc_bytes) for x in r.tasks},
        "core": r.core,
    },
    f"{out}/tasks-rank{t.dist.rank}.pt",
)
t.close("FINISHED")
distributed.exit_process(0)
