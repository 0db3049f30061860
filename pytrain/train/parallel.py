"""How the ranks of a torchrun job share the work: which data-parallel wrapper, chosen once
at start-up and said in one line, and the wrapping itself.

- `single`: one process, no wrapper.
- `replicas`: each rank holds the whole model in bf16 with its fp32 masters in the optimizer
  (pytrain.optim.master_adamw), no wrapper. The micro-batches' gradients are summed into
  the optimizer's fp32 buffer and that buffer is all-reduced once per optimizer step, after
  the last backward (as Megatron-LM's DistributedDataParallel does with its fp32 gradient
  buffer and `overlap_grad_reduce` off). The compiled graph is then the single-GPU graph:
  torch.compile of a DDP module splits it at every gradient bucket so that DDP can overlap
  its all-reduces, which costs fusion in every micro-batch, while with gradient
  accumulation only the last micro-batch could overlap (the presets: 8 or more per rank at
  up to 2 GPUs). The all-reduce is one buffer of 4 bytes a parameter (the 124M preset:
  0.5 GB, ~2 ms over NVLink, against a step of ~0.8 s).
- `ddp`: torch's DistributedDataParallel, where the parameters are fp32 (fp32 or fp16 runs,
  `--optim.master_weights off`, Muon): it averages gradients on the last micro-batch
  (`no_sync` before), in buckets that overlap the backward.
- `fsdp2`: FSDP2's `fully_shard` per block (and on an untied embedding): each rank holds a
  shard of the parameters, gradients and optimizer state; with bf16, parameters are
  gathered in bf16 and gradients reduce-scattered in fp32 (or bf16: fsdp_reduce_dtype)
  after every micro-batch's backward (its MixedPrecisionPolicy, as torchtitan sets it;
  `no_sync` below says why every micro-batch). Over several nodes it is HSDP: a 2-D device
  mesh (replicate x shard), FSDP2 within each group of `fsdp_shard_size` ranks and the
  groups replicas of each other. Gradients are reduce-scattered within a group and the
  shards all-reduced between the groups, so the per-block all-gathers of the forward and
  backward stay on a node's links (NVLink) and only one all-reduce of a shard's gradients a
  step crosses the network.
  fsdp_shard_size 0 (auto) takes a node's ranks (torchrun's LOCAL_WORLD_SIZE) where the job
  has several nodes, and all ranks on one node (plain FSDP2); a number N takes groups of N
  ranks (N = the world's size: FSDP2 over every rank of every node, the most memory saved).
  With `--ep N` (a mixture of experts) each block's routed experts are first split over
  groups of N ranks and sharded over the rest (pytrain.train.expert_parallel).

`--fsdp` asks for FSDP2, `--no-fsdp` for the replicated kinds; by default (auto) FSDP2 is
used when the model's training state would take more than a quarter of one GPU's memory,
where sharding it is what lets the model train, and otherwise not: for a model that fits,
FSDP2's per-block gathers cost more than they save (BENCHMARKS.md, "Scaling
over GPUs")."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pytrain.config import ConfigError
from pytrain.optim.master_adamw import STATE_DTYPES
from pytrain.train import expert_parallel
from pytrain.train.distributed import DistInfo

if TYPE_CHECKING:
    from pytrain.config import TrainConfig

AUTO_FSDP_SHARE = 0.25
"""fsdp auto: FSDP2 when the training state exceeds this share of one device's memory."""

FSDP2_VS_REPLICAS = "0.54x"
"""FSDP2's tokens/s against replicas for the GPT-2 124M preset as shipped on 2 H100s of one
host, FSDP2 as it runs (without CUDA graphs), 2026-11-25 (BENCHMARKS.md, "Scaling
over GPUs"); said in the start-up line."""


@dataclass
class Plan:
    kind: str
    """'single', 'replicas', 'ddp' or 'fsdp2'."""
    line: str
    """What was chosen and why, for the start-up lines ('' in one process)."""
    shard: int = 0
    """FSDP2: the ranks that shard the model together; the world's ranks / shard groups
    hold replicas of each other (HSDP where there are several)."""
    hold_weights: bool = False
    """FSDP2: gathered weights kept through each optimizer step (fsdp_hold_weights)."""
    reduce_dtype: str = "fp32"
    """FSDP2 in bf16: the gradients' reduce-scatter dtype (fsdp_reduce_dtype)."""
    ep: int = 1
    """FSDP2: the ranks that split the routed experts between them (expert parallelism,
    pytrain.train.expert_parallel); 1: none."""

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp2"


def state_bytes(model: torch.nn.Module, master: bool, state_dtype: str = "fp32") -> int:
    """Bytes of parameters, gradients and AdamW moments: 2 + 4 (masters) + 4 (fp32 gradient
    sums) + 8 with master weights, 4 + 4 + 8 with fp32 parameters; bf16 moments 4 less."""
    per_param = (10 if master else 8) + 2 * STATE_DTYPES[state_dtype].itemsize
    return per_param * sum(p.numel() for p in model.parameters())


def shard_group(asked: int, info: DistInfo) -> tuple[int, str]:
    """(the ranks that shard the model together under FSDP2, why): fsdp_shard_size `asked`,
    or for 0 (auto) a node's ranks where the job spans several nodes, else every rank."""
    world, node = info.world_size, info.per_node
    if asked:
        if world % asked:
            raise ConfigError(
                f"fsdp_shard_size {asked} does not divide the job's {world} ranks: use a "
                f"divisor of {world} ({node} is a node's ranks), or 0 (auto)"
            )
        return asked, f"fsdp_shard_size {asked}"
    if node < world and world % node == 0:
        return node, f"fsdp_shard_size auto: a node's {node} ranks"
    return world, "fsdp_shard_size auto: one node"


def choose(
    cfg: TrainConfig, info: DistInfo, device: torch.device, state: int, master: bool
) -> Plan:
    """The wrapper for this run (cfg.fsdp: True, False or None = auto; cfg.fsdp_shard_size:
    the ranks of a shard group, 0 = auto)."""
    if not info.enabled:
        expert_parallel.check_ranks(cfg.ep, 1, 1)
        return Plan("single", "")
    # Expert parallelism needs FSDP2 (checks.check_expert_parallel refuses --no-fsdp).
    fsdp = True if cfg.ep > 1 else cfg.fsdp
    replicated = "replicas" if master else "ddp"
    shard, why_shard = shard_group(cfg.fsdp_shard_size, info)
    expert_parallel.check_ranks(cfg.ep, info.world_size, shard)
    replicas = info.world_size // shard
    how = {
        "replicas": "replicated, bf16 weights with fp32 masters, fp32 gradients all-reduced "
        "once per optimizer step",
        "ddp": "DDP, gradients all-reduced in buckets during the last micro-batch's backward",
        "fsdp2": "FSDP2, parameters, gradients and optimizer state sharded over the ranks"
        if replicas == 1
        else f"HSDP, FSDP2 within each group of {shard} ranks (parameters, gradients and "
        f"optimizer state sharded), {replicas} groups holding replicas, the gradients' "
        "shards all-reduced between them",
    }
    hold, reduce = cfg.fsdp_hold_weights, cfg.fsdp_reduce_dtype
    if hold:
        how["fsdp2"] += ", the gathered weights held through each step (fsdp_hold_weights)"
    if reduce != "fp32":
        how["fsdp2"] += f", gradients reduced in {reduce} (fsdp_reduce_dtype)"
    if cfg.ep > 1:
        how["fsdp2"] += expert_parallel.description(cfg.ep, info.world_size, shard)
    if fsdp is not None:
        kind = "fsdp2" if fsdp else replicated
        asked = "--fsdp" if cfg.fsdp else f"fsdp auto: --ep {cfg.ep} needs FSDP2"
        why = f"{asked}; {why_shard}" if fsdp else "--no-fsdp"
        return Plan(kind, f"data parallel: {how[kind]} ({why})", shard, hold, reduce, cfg.ep)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    gb = f"{state / 1e9:.1f} GB"
    if total and state > AUTO_FSDP_SHARE * total:
        why = f"the training state, {gb}, is over a quarter of one GPU's {total / 1e9:.0f} GB"
        return Plan(
            "fsdp2",
            f"data parallel: {how['fsdp2']} (fsdp auto: {why}; {why_shard})",
            shard,
            hold,
            reduce,
        )
    where = f"one GPU's {total / 1e9:.0f} GB" if total else "one device"
    return Plan(
        replicated,
        f"data parallel: {how[replicated]} (fsdp auto: the training state, {gb}, fits {where}; "
        f"FSDP2 measured {FSDP2_VS_REPLICAS} these tokens/s for the GPT-2 124M preset on 2 GPUs; "
        "--fsdp to shard anyway)",
    )


def wrap(
    model: torch.nn.Module, plan: Plan, device: torch.device, dtype: torch.dtype | None
) -> torch.nn.Module:
    """The model as `plan` shares it; `dtype`: the run's autocast dtype (None: fp32)."""
    if plan.kind == "single":
        return model
    if plan.kind == "replicas":
        # What DDP does when it wraps: every rank starts from rank 0's weights.
        for t in (*model.parameters(), *model.buffers()):
            dist.broadcast(t.data, src=0)
        return model
    if plan.kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # The mesh on the training device: FSDP2's default takes the machine's accelerator,
        # which breaks a run on the CPU (--device cpu) of a host that has GPUs. Two
        # dimensions (replicate, shard) make fully_shard HSDP; torchrun numbers a node's
        # ranks consecutively, so a shard group of a node's size is one node.
        replicas = dist.get_world_size() // plan.shard
        mesh = (
            init_device_mesh(
                device.type, (replicas, plan.shard), mesh_dim_names=("replicate", "shard")
            )
            if replicas > 1
            else init_device_mesh(device.type, (plan.shard,))
        )
        mp = (
            MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.bfloat16 if plan.reduce_dtype == "bf16" else torch.float32,
            )
            if dtype == torch.bfloat16
            else MixedPrecisionPolicy()
        )
        if plan.ep > 1:  # the experts first: the blocks' units leave them to their own
            expert_parallel.shard_experts(model, device.type, plan.shard, plan.ep, mp)
        gpt = model.gpt
        for block in gpt.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, mp_policy=mp)
        if gpt.embed.weight is not gpt.head.weight:  # type: ignore[union-attr]
            # An untied embedding is a unit of its own, gathered for the lookup and freed
            # after it (as torchtitan shards it), rather than held with the root's output
            # layer through the whole forward and backward: 1 GB at 8B's vocabulary.
            fully_shard(gpt.embed, mesh=mesh, mp_policy=mp)  # type: ignore[union-attr,arg-type]
            # Its backward reads only the token ids: no second all-gather of the weight (1 GB
            # at 8B's vocabulary) at the end of every backward, where torch can skip it.
            if hasattr(gpt.embed, "set_unshard_in_backward"):  # type: ignore[union-attr]
                gpt.embed.set_unshard_in_backward(False)  # type: ignore[union-attr,operator]
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        # The gradients are views of DDP's buckets: no copy into them, no second copy
        # of the gradients in memory.
        gradient_as_bucket_view=True,
    )


def no_sync(model: torch.nn.Module, plan: Plan, last_micro_step: bool):
    """What each micro-step of an optimizer step leaves for the last one.

    DDP skips its all-reduce (each rank sums its full gradients, as large as the model).
    FSDP2 still reduce-scatters every micro-step's gradients, so that each rank only ever
    holds its shard of them: skipping that (`set_requires_gradient_sync(False)`) would
    keep every parameter's unsharded gradient in fp32 across the micro-steps, the whole
    model's size on every GPU (32 GB at 8B), which sharding is there to avoid. Under HSDP
    the shards' all-reduce between replica groups (the traffic that crosses nodes) waits
    for the last micro-step: FSDP2 sums the reduce-scattered shards until then. With
    `plan.hold_weights` the gathered weights stay from the forward to the backward, and
    from each backward to the next micro-step's forward, until the last backward."""
    if plan.kind == "fsdp2":
        return _FSDP2MicroStep(model, last_micro_step, plan.hold_weights)
    if not last_micro_step and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()  # type: ignore[operator]
    return nullcontext()


class _FSDP2MicroStep:
    """FSDP2's settings for one micro-step, put back after it: the all-reduce between
    replica groups on the last only (a no-op without groups); with `hold`, no resharding
    after the forward, nor after the backward but the last. The units below the root are
    set one by one: the root keeps FSDP2's own choice (it reshards after the backward only,
    its weights being the first the backward needs)."""

    def __init__(self, model, last: bool, hold: bool):
        from torch.distributed.fsdp import FSDPModule

        self.model, self.last, self.hold = model, last, hold
        self.units = (
            [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
            if hold
            else []
        )

    def _set(self, accumulating: bool, held: bool) -> None:
        self.model.set_requires_all_reduce(not accumulating)
        if self.hold:
            for unit in self.units:
                unit.set_reshard_after_forward(not held, recurse=False)
            self.model.set_reshard_after_backward(not (held and accumulating))

    def __enter__(self):
        self._set(accumulating=not self.last, held=True)
        return self

    def __exit__(self, *exc):
        self._set(accumulating=False, held=False)
