"""Expert parallelism (`--ep N`): the routed experts of every MoE block split over groups of
N ranks, FSDP2 over the rest, as torchtitan's `distributed/expert_parallel.py` and its
deepseek_v3 / llama4 `parallelize` do it.

The mesh. The ranks form a device mesh (efsdp, ep), (replicate, efsdp, ep) under HSDP,
whose last dimension groups N consecutive ranks: a node's, where N is at most its GPUs, so
the all-to-alls stay on its links. Each MoE block's expert tensors [E, ...] become DTensors
placed Shard(0) on `ep`: rank j of a group holds experts j·E/N to (j+1)·E/N - 1, whole.
FSDP2 then shards each rank's slice over `efsdp`, the world / N ranks that hold the same
experts, in a unit of its own per block made before the block's (`fully_shard` leaves the
experts to it): the block's other weights (attention, router, shared experts) stay sharded
over all ranks as without EP. The parameters stay DTensors of global shape [E, ...] (placed
(_StridedShard(0), Shard(0)) on (efsdp, ep)), so a sharded checkpoint (DCP) holds every
tensor by its global offsets and loads at any EP size, or whole in one process.

A step. MoE.forward sorts its tokens' slots by expert and calls its Experts; around that
call, hooks installed here send each row to the rank of its expert (`dispatch`, an
all-to-all over the group) and the experts' outputs back (`combine`, the reverse one). Both
are autograd-aware: the backward runs the reverse exchanges. The received rows come by
source rank, each source's by expert; they are regrouped by expert for the experts, and
back after them. The all-to-alls' split sizes (the rows for each rank of the group, and from
each) are host numbers: one device-to-host copy a block and micro-batch, the one host sync
expert parallelism cannot avoid (torchtitan's has it too). In one process nothing of this
is installed.

The loads of the balancing bias are counted in MoE.forward before the dispatch: each rank
counts its own tokens, by global expert id, so MoEGPT.after_update's all-reduce over all
ranks sums every token once, as without EP.

Gradients. A rank's slice receives its gradient from its whole group's tokens; FSDP2 sums
it over `efsdp` and divides by the world's size rather than by efsdp's (its default), as
every other gradient is divided: each rank's loss is scaled by world size / tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pytrain.config import ConfigError
from pytrain.model.moe import Experts

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


def check_ranks(ep: int, world: int, shard: int) -> None:
    """ConfigError unless `ep` divides the job's `world` ranks and FSDP2's shard groups of
    `shard` ranks (an expert group lies within one: under HSDP, within a node)."""
    if ep == 1:
        return
    if world % ep:
        other = f", or set --ep to a divisor of {world}" if world > 1 else ""
        raise ConfigError(
            f"ep {ep} does not divide the job's {world} rank(s): start a multiple of {ep} "
            f"ranks under torchrun{other}"
        )
    if shard % ep:
        raise ConfigError(
            f"ep {ep} does not divide FSDP2's shard groups of {shard} ranks (an expert group "
            f"lies within one): set --fsdp_shard_size to a multiple of {ep}"
        )


def description(ep: int, world: int, shard: int) -> str:
    """The start-up line's words for EP (FSDP2's shard groups of `shard` ranks)."""
    holders = shard // ep
    held = (
        f"each expert sharded over the {holders} ranks that hold it"
        if holders > 1
        else "each rank holding its experts whole"
    )
    return (
        f", the routed experts split over groups of {ep} ranks (expert parallelism: tokens "
        f"sent to their experts by all-to-all), {held}{' in each group' if world > shard else ''}"
    )


def shard_experts(
    model: nn.Module, device_type: str, shard: int, ep: int, mp: MixedPrecisionPolicy
) -> None:
    """Every Experts module of `model` split over groups of `ep` ranks and sharded by FSDP2
    over the ranks holding the same experts (within FSDP2's shard groups of `shard` ranks,
    replicated across them); to be called before `fully_shard` wraps the blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    replicas = world // shard
    if replicas > 1:
        mesh = init_device_mesh(
            device_type, (replicas, shard // ep, ep), mesh_dim_names=("replicate", "efsdp", "ep")
        )
        holders = mesh["replicate", "efsdp"]
    else:
        mesh = init_device_mesh(device_type, (shard // ep, ep), mesh_dim_names=("efsdp", "ep"))
        holders = mesh["efsdp"]
    _profiler_ranges_uncounted_by_checkpointing()
    # Both dimensions as one group as well: DTensor then makes the experts' gradient norm
    # whole in one all-reduce over it rather than one a dimension (and says so each run).
    mesh["efsdp", "ep"]._flatten()
    for experts in [m for m in model.modules() if isinstance(m, Experts)]:
        for name, p in list(experts.named_parameters(recurse=False)):
            # Every rank built the same weights (one seed until the model is built): each
            # keeps its slice, with no collective.
            split = distribute_tensor(p.data, mesh["ep"], [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(split))
        exchange = TokenExchange(mesh["ep"].get_group(), ep)
        # Eager under torch.compile, as FSDP2's hooks are: the split sizes change every
        # step, and a graph specialised on them would be compiled again at each.
        experts.register_forward_pre_hook(torch.compiler.disable(exchange.dispatch))
        experts.register_forward_hook(torch.compiler.disable(exchange.combine))
        unit = fully_shard(experts, mesh=holders, mp_policy=mp)
        unit.set_gradient_divide_factor(float(world))
        if shard > ep:
            # A factor other than the group's size makes FSDP2 reduce-scatter with
            # PREMUL_SUM, which gloo lacks: a plain sum, then the division of each rank's
            # reduced shard (1 / efsdp of the experts' gradients) instead. Not where efsdp is
            # one rank: FSDP2 (torch 2.15) then divides its copy for the reduce-scatter it
            # skips, and would divide again after it.
            unit.set_force_sum_reduction_for_comms(True)


def _profiler_ranges_uncounted_by_checkpointing() -> None:
    """The experts' FSDP2 unit sits inside its block, so a block that activation
    checkpointing recomputes runs the unit's hooks in the recompute too, and those open more
    profiler ranges there than in the forward (their state differs in the backward).
    Selective checkpointing (torch 2.15) counts every op of a region and refuses a recompute
    whose counts differ ("profiler._record_function_enter_new ... not found in storage"):
    the profiler's two ops, which compute nothing, are left out of its count, as torch
    leaves out the detaches that checkpointing itself adds."""
    from torch.utils import checkpoint

    profiler = torch.ops.profiler
    checkpoint.SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter_new.default,
            profiler._record_function_exit._RecordFunction,
        }
    )


class TokenExchange:
    """One MoE block's all-to-alls around its Experts module (its forward pre-hook and
    hook): `dispatch` sends each row, sorted by global expert, to the rank of its expert
    and hands the experts the rows they received, by expert; `combine` sends their outputs
    back, in the order the rows came."""

    def __init__(self, group: dist.ProcessGroup, ep: int):
        self.group, self.ep = group, ep
        self.pending: tuple[list[int], list[int], torch.Tensor] | None = None
        """Between dispatch and combine: the rows sent to each rank, received from each,
        and the order that regrouped the received rows by expert."""

    def dispatch(self, module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x, counts = args  # (rows, d) sorted by expert; (E,) rows of each expert
        ep = self.ep
        with torch.no_grad():
            # From each rank of the group, how many of its rows go to each of this rank's
            # experts: (ep, E / ep).
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.group)
            got = got.view(ep, -1)
            # The split sizes on the host: the one device-to-host copy (and host sync) a
            # block and micro-batch that expert parallelism cannot avoid.
            send, recv = torch.stack([counts.view(ep, -1).sum(1), got.sum(1)]).tolist()
        rows = _all_to_all(x, recv, send, self.group)
        order = by_expert(got, sum(recv))
        self.pending = (send, recv, order)
        return rows[order], got.sum(0)

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        assert self.pending is not None, "combine without a dispatch"
        (send, recv, order), self.pending = self.pending, None
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _all_to_all(out[back], send, recv, self.group)


def _all_to_all(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    """torch's autograd-aware all-to-all (imported here: its module costs a second at
    start-up, which runs without expert parallelism need not pay)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x, recv, send, group)


def by_expert(got: torch.Tensor, total: int) -> torch.Tensor:
    """The order that regroups received rows by expert: `got[i, l]` rows came from rank i
    for this rank's expert l, in `total` rows ordered by source rank, each source's by
    expert. Computed on the device (`total` is known on the host: no further sync)."""
    sizes = got.flatten()
    came_at = (sizes.cumsum(0) - sizes).view_as(got).t().flatten()  # each chunk's first row
    sizes = got.t().flatten()  # the chunks by expert, then source
    goes_to = sizes.cumsum(0) - sizes
    step = torch.repeat_interleave(came_at - goes_to, sizes, output_size=total)
    return step + torch.arange(total, device=got.device)
