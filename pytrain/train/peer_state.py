"""What a rank of a replica group sends a healing peer's rank of the same place, and loads
from one (pytrain.train.replica_groups): its weights, optimizer state, loader position,
step, counters and RNG at a step boundary, read without a collective (torchft reads them on
its own thread while the main thread waits for the quorum). Under FSDP2 the weights and
the optimizer state are this rank's shards, as local tensors: the peer's rank of the same
place holds the same shards of the same layout, and puts them into its own DTensors."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pytrain.train import checkpoint, run_state


def collect(t) -> dict:
    """Trainer `t`'s state on this rank, for the same rank of a peer group."""
    state = {**run_state.local_state(t, tensors=not t.sharded), "rng": checkpoint.rng_state()}
    if t.sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(t.gpt, t.optimizer)  # DTensors, this rank's shards
        state["shards"] = tree_map(_local, {"model": model, "optimizer": optim})
    return state


def load(t, state: dict) -> None:
    """Puts a peer's `collect` into Trainer `t` (its loader's position too)."""
    if t.sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # This rank's own DTensors (the optimizer's state made, at zero, where it has none
        # yet), their shards overwritten by the peer's.
        model, optim = get_state_dict(t.gpt, t.optimizer)
        model, optim = (_into(mine, state["shards"][part])
                        for mine, part in ((model, "model"), (optim, "optimizer")))  # fmt: skip
        set_state_dict(t.gpt, t.optimizer, model_state_dict=model, optim_state_dict=optim)
    run_state.restore(t, state, weights=not t.sharded)
    t.feed.load_state_dict(state["loader"])
    checkpoint.set_rng_state(state["rng"])


def _local(x):
    """A DTensor's shard on this rank (a view: read before the optimizer's next update)."""
    return x.to_local() if hasattr(x, "to_local") else x


def _into(mine, theirs):
    """`mine` (a state dict tree) with the peer's leaves: tensors copied into this rank's
    own (a DTensor's shard in place), other leaves (learning rates, flags) taken."""
    leaves, spec = tree_flatten(mine)
    their_leaves, their_spec = tree_flatten(theirs)
    if spec != their_spec:
        raise ValueError(f"a peer's state is shaped otherwise: {their_spec} against {spec}")
    out = []
    for a, b in zip(leaves, their_leaves, strict=True):
        if isinstance(a, torch.Tensor):
            _local(a).copy_(b)
            out.append(a)
        else:
            out.append(b)
    return tree_unflatten(out, spec)
