"""Run by tests/test_expert_parallel.py under torchrun (gloo): trains several runs one after
another in the same ranks (one job, so torch is imported once a rank), each with the common
flags plus its own. A run may start from a copy of another's checkpoint (`from`: resumed in
its own run directory). Rank 0 saves each run's end: the gradients of its last step made
whole, its validation loss, the start-up line of the plan and how the experts' weights are
placed.

argv: out_dir, a JSON list of {"name", "flags", "from"?}, then the common flags."""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pytrain.config import parse_args
from pytrain.model.moe import Experts
from pytrain.train import distributed
from pytrain.train.trainer import Trainer


def train(run: dict, common: list[str], out: Path) -> Trainer:
    cfg = parse_args([*common, "--name", run["name"], *run["flags"]])
    if "from" in run and os.environ["RANK"] == "0":
        shutil.copytree(Path(cfg.out_dir) / run["from"],
                        Path(cfg.out_dir) / run["name"] / Path(run["from"]).name)  # fmt: skip
    if dist.is_initialized():
        dist.barrier()
    t = Trainer(cfg)
    grads: dict = {}
    evaluate = t.evaluate

    def evaluate_after_the_gradients():
        """The gradients of the last step, made whole, before the evaluation at the end
        (FSDP2's evaluation forward drops the root unit's)."""
        for name, p in t.gpt.named_parameters():
            grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        return evaluate()

    t.evaluate = evaluate_after_the_gradients  # type: ignore[method-assign]
    result = t.fit()
    up = next(m for m in t.gpt.modules() if isinstance(m, Experts)).up
    if t.dist.is_main:
        experts = {
            "shape": tuple(up.shape),
            "placements": [str(p) for p in getattr(up, "placements", [])],
            "mesh": getattr(getattr(up, "device_mesh", None), "mesh_dim_names", None),
        }
        torch.save({"grads": grads, "val_loss": result["val_loss"], "step": result["step"],
                    "plan_line": t.plan.line, "experts": experts}, out / f"{run['name']}.pt")  # fmt: skip
    # Trainer.close but for the process group, which the next run goes on using.
    t.stop.restore()
    t.ckpt_writer.wait()
    t.feed.close()
    t.log.close()
    t.run_lock.release()
    return t


out, runs, common = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
for run in runs:
    t = train(run, common, out)
distributed.shutdown(t.dist, t.module)
distributed.exit_process(0)  # as `python -m pytrain.train` ends under torchrun
