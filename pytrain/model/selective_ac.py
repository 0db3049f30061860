"""Selective activation checkpointing (`activation_checkpointing = "selective"`): every block
is recomputed in the backward, but the outputs of its expensive ops are kept from the
forward, so the recompute runs only the cheap ops between them.

Why: recomputing a whole block ('full', 'every-N') repeats its attention and matmuls, a
second forward (a third more FLOPs); keeping everything ('off') holds every elementwise
op's output (RMSNorm's fp32 copies, RoPE's halves, the activation's inputs and output,
casts). The outputs of attention and of the matmuls are what the backward needs and the
cheap ops recompute from, so keeping those and recomputing the rest costs a few percent of
compute and frees the memory of everything between them (torchtitan's per-op policy does
the same).

The policy is per op (`torch.utils.checkpoint.create_selective_checkpoint_contexts`): eager
checkpointing sees each op through a dispatch mode, torch.compile tags the traced graph's
nodes with it. Ops are named as 'namespace::name' so that one registered later (quack's, on
import) or absent here (FA4's kernels need a GPU, quack is optional) is still recognised."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = [
    "KEPT",
    "OUT_WIDTH_ARG",
    "UP_PROJECTIONS",
    "context",
    "kept",
    "lean_context",
    "lean_policy",
    "policy",
    "traced",
]

ATTENTION = {
    # The forward's one O(T^2) op: recomputing it would repeat the costliest kernel of the
    # block, and its outputs (the output and the log-sum-exp) are what its backward reads.
    "pytrain::fa4_fwd",  # FlashAttention-4 (pytrain.model.flash4)
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",  # other accelerators' SDPA
    "aten::_scaled_dot_product_flash_attention_for_cpu",  # CPU SDPA, with or without a mask
    "higher_order::flex_attention",  # FlexAttention's operator
    # SDPA's math path never reaches the policy as one op: it decomposes into bmm (kept
    # below) and a softmax (recomputed).
}
MATMULS = {
    # The block's FLOPs: each projection's output is what the cheap ops after it read
    # (RoPE the qkv projection's, the activation the up projection's).
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::_scaled_mm",  # torchao's float8 linear layers
    # A mixture of experts' grouped GEMMs (pytrain.model.moe), bf16 and FP8: the experts'
    # FLOPs; recomputed, the backward would run the experts' whole forward again.
    "aten::_grouped_mm",
    "aten::_scaled_grouped_mm",
    "pytrain::gelu_up",  # the GELU MLP's up projection with GELU in its epilogue (fused_gelu)
    # quack's GEMMs: the SwiGLU MLP of pytrain.model.quack_swiglu (its up projection with
    # the activation in its epilogue, gemm_gated_out; its down projection, gemm_out). Only a
    # compiled graph shows them to the policy as ops that can be kept: in eager,
    # quack-kernels 0.6.4 launches its kernels without the dispatcher, and older versions
    # call the out-variants, which eager recomputes (`kept`); there its MLP is recomputed.
    # pytrain::swiglu is elementwise: recomputed.
    "quack::gemm",
    "quack::gemm_add",
    "quack::gemm_out",
    "quack::gemm_act_out",
    "quack::gemm_gated_out",
    "quack::gemm_epi",
    "quack::gemm_epi_f",
}
KEPT = ATTENTION | MATMULS
"""The ops whose outputs selective checkpointing keeps from the forward ('namespace::name',
every overload); every other op of a block is recomputed in the backward."""

UP_PROJECTIONS = {
    # The MLP's up projections with their activation in the epilogue: the largest outputs a
    # block keeps (at 8B, quack's SwiGLU pre-activations are 448 MiB of a block's 736).
    "quack::gemm_gated_out",
    "quack::gemm_act_out",
    "pytrain::gelu_up",
}
"""What the lean blocks (ac_lean_blocks) recompute too, with the plain matmul as wide as the
up projection (lean_policy): one GEMM more in their backward for the memory of its output."""

OUT_WIDTH_ARG = {"aten::mm": 1, "aten::_scaled_mm": 1, "aten::addmm": 2}
"""The plain matmuls, each with the argument whose last dimension is its output's: an up
projection through nn.Linear, or torchao's Float8Linear (float8), is one of them."""

COLLECTIVES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
"""Namespaces whose every op's output is kept, so that a recompute never communicates again
(a collective inside a block: tensor parallelism, FSDP2 traced into the graph, or expert
parallelism's autograd-aware all-to-alls, whose exchange of the tokens is then not repeated
by the recompute)."""

_facts: dict[Any, tuple[bool, bool]] = {}
"""Per op: (listed in KEPT or a collective, writes into its arguments). A plain dict, not
functools.cache: the policy asks for every op of every checkpointed block's forward."""


def _name(op: Any) -> str:
    """'namespace::name' of an OpOverload ('aten::mm') or a higher-order operator."""
    name = op.name()
    return name if "::" in name else f"{getattr(op, 'namespace', '')}::{name}"


def _facts_of(op: Any) -> tuple[bool, bool]:
    facts = _facts.get(op)
    if facts is None:
        listed = getattr(op, "namespace", "") in COLLECTIVES or _name(op) in KEPT
        schema = getattr(op, "_schema", None)  # higher-order operators have none
        facts = _facts[op] = (listed, schema is not None and schema.is_mutable)
    return facts


def kept(op: Any) -> bool:
    """Whether selective checkpointing keeps this op's outputs (else they are recomputed).
    An op that writes into its arguments (an out= or in-place overload, quack's GEMMs) is
    kept only while torch.compile traces: the graph's functional form of it keeps the
    buffers it wrote. Eager checkpointing would cache its return (nothing) and skip the
    write on recompute, leaving the recomputed buffers unwritten."""
    listed, writes = _facts_of(op)
    return listed and (not writes or traced())


def traced() -> bool:
    """Whether ops are being traced into a compiled graph: Dynamo's tracing, or tracing
    under a proxy dispatch mode, as AOTAutograd traces the joint graph where the policy is
    asked (the test torch.utils.checkpoint makes itself); torch.compiler.is_compiling()
    alone is False under such tracing outside Dynamo (make_fx). At 8B on 4 H100s (torch
    2.11) quack's SwiGLU up projection, an op that writes its arguments, was recomputed
    about twice a block under 'selective' without this check (its forward 527 ms a step
    against 198 under every-2); with it the step ran 1.15x faster (BENCHMARKS.md)."""
    if torch.compiler.is_compiling():
        return True
    key = getattr(torch._C, "_TorchDispatchModeKey", None)
    return key is not None and torch._C._get_dispatch_mode(key.PROXY) is not None


def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """MUST_SAVE for the kept ops (torch.compile may not recompute them either),
    PREFER_RECOMPUTE for the rest."""
    return CheckpointPolicy.MUST_SAVE if kept(op) else CheckpointPolicy.PREFER_RECOMPUTE


def lean_policy(up_width: int):
    """policy, but the MLP's up projection is recomputed too: the ops of UP_PROJECTIONS,
    and a plain matmul whose output is `up_width` wide (the up projection's out_features,
    where it runs through nn.Linear or float8's layers). A block's other matmuls are
    narrower at every preset's shape (the 8B's: q/k/v 6144, the output and down projections
    4096, the up projection 28672); a shape where one is as wide recomputes it too."""

    def lean(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        name = _name(op)
        i = OUT_WIDTH_ARG.get(name)
        wide = i is not None and len(args) > i and args[i].shape[-1] == up_width
        if wide or name in UP_PROJECTIONS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        return policy(ctx, op, *args, **kwargs)

    return lean


def context():
    """`torch.utils.checkpoint.checkpoint`'s context_fn: a fresh pair of contexts for each
    checkpointed call."""
    return create_selective_checkpoint_contexts(policy)


def lean_context(up_width: int):
    """context() for a lean block: its up projection, `up_width` wide, recomputed as well
    (lean_policy)."""
    return create_selective_checkpoint_contexts(lean_policy(up_width))


class _InPlaceWarning(logging.Filter):
    """Drops torch.compile's warning that a checkpoint with a context_fn must not hold
    in-place ops: `kept` above is what answers it (an op that writes its arguments is kept
    only while traced; COMPILE.md), and every rank printed it four lines long at each
    start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_InPlaceWarning())
