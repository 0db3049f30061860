"""Run by tests/test_ddp.py under torchrun (2 processes, gloo): the same FSDP2-sharded model
stepped by OptimizerStep twice over, with torch's fused AdamW (clipping and the guard's skip
inside the kernel, on each rank's shards) and with the plain one (clip_grad_norm_, then
step); the second step's loss is NaN, so both must skip it. Saves each way's gathered
weights, gradient norms and skips."""

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from pytrain.optim.step import OptimizerStep
from pytrain.train import distributed
from pytrain.train.guard import StepGuard

dist.init_process_group("gloo")
x = torch.randn(8, 24, generator=torch.Generator().manual_seed(dist.get_rank()))
out = {}
for fused in (True, False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    opt_step = OptimizerStep(optimizer, model, None, grad_clip=0.05)
    guard = StepGuard(0.0, 5, 0)
    norms, skips = [], []
    for step in range(1, 5):
        opt_step.zero_grads(keep=False)
        loss = model(x).square().mean()
        loss.backward()
        shown = torch.tensor(math.nan) if step == 2 else loss.detach()
        norm, bad, _ = opt_step.step(guard, step, shown)
        norms.append(float(norm))
        skips.append(bool(bad))
    out["fused" if fused else "plain"] = {
        "weights": [p.full_tensor() for p in model.parameters()],
        "norms": norms,
        "skips": skips,
        "state_steps": [float(s["step"]) for s in optimizer.state.values()],
    }
if dist.get_rank() == 0:
    torch.save(out, sys.argv[1])
dist.barrier()
distributed.exit_process(0)  # no interpreter teardown with gloo's threads alive
