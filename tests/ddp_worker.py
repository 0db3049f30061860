"""Run by tests/test_ddp.py under torchrun (2 processes, gloo): one accumulated step per
rank (DDP; FSDP2 with --fsdp; bf16 replicas with --optim.master_weights on); saves this
rank's micro-batches and the all-reduced gradients by parameter name; after close(), the
names of the threads still running."""

import os
import sys

import torch

from pytrain.config import parse_args
from pytrain.train.trainer import Trainer

out = sys.argv[1]
cfg = parse_args(sys.argv[2:])
t = Trainer(cfg)
batches = [next(t.loader).to("cpu") for _ in range(cfg.optim.grad_accum)]
n = sum(int(b.loss_mask.sum()) for b in batches)
from pytrain.train import distributed  # noqa: E402

denom = distributed.all_sum(n, t.dist, t.device)
t.optimizer.zero_grad()
# FSDP2 names each unit's all-gather for the profiler: "FSDP::all_gather (unit)", the
# root's without a name
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    t._forward_backward(batches, denom)
gathers = sum(e.name.split(" (")[0] == "FSDP::all_gather" for e in prof.events())
names = {id(p): n for n, p in t.gpt.named_parameters()}
if t.plan.kind == "replicas":  # the fp32 sums in the optimizer, averaged over the ranks
    t.opt_step.masters.all_reduce_grads(t.dist.world_size)
    sums = t.optimizer.per_param(t.optimizer.flat_grad)
    grads = {names[i]: g.clone() for i, g in sums.items()}
else:  # FSDP2 keeps sharded gradients (DTensors); gather them whole to compare.
    grads = {
        names[id(p)]: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in t.gpt.parameters()
    }
torch.save(
    {
        "batches": [
            {
                k: getattr(b, k)
                for k in ("input_ids", "targets", "position_ids", "doc_ids", "loss_mask")
            }
            for b in batches
        ],
        "grads": grads,
        "plan": t.plan.kind,
        "plan_line": t.plan.line,  # the start-up line: what was chosen and why
        # FSDP2: whether the embedding is a unit of its own (gathered for the lookup only)
        "embed_unit": type(t.gpt.embed).__name__.startswith("FSDP"),
        "denom": denom,
        "all_gathers": gathers,
        # after the step every weight is a shard again (held or not while it ran)
        "resharded": all(type(p).__name__ == "DTensor" for p in t.gpt.parameters()),
        "loader_state": t.loader.state_dict(),
    },
    f"{out}/rank{t.dist.rank}.pt",
)
t.close()
# Thread names (Linux): gloo's ('gloo_tcp_loop', 'pt_gloo_runloop') must be gone.
names = sorted(
    open(f"/proc/self/task/{x}/comm").read().strip() for x in os.listdir("/proc/self/task")
)
with open(f"{out}/threads-rank{t.dist.rank}.txt", "w") as f:
    f.write("\n".join(names))
distributed.exit_process(0)  # as `python -m pytrain.train` ends under torchrun
