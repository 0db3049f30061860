"""One line, instead of torch's traceback, for a run that ran out of memory: which memory
(GPU or host), when (setting up, or at which step), how much this process held, and the
settings that lower it. A micro-batch too large for the GPU is what users of a new preset
meet first; torch's own message names an allocation size and the allocator's environment
variable, not the flag to change."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from pytrain.train import env_guards

HOST_REFUSED = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")
"""torch's CPU allocator's message when the host refused an allocation."""
GIB = 2**30


class OutOfMemory(Exception):
    """The run ran out of memory; the message is the line to print."""


def kind(e: BaseException) -> str | None:
    """'GPU' or 'host' where `e`, or an exception it was raised from, is an allocation
    that failed; else None."""
    import torch

    seen = 0
    # Explicit causes only (`raise ... from e`, as a compiler wrapping an OOM raises): an
    # error raised while another was being handled is its own error.
    while e is not None and seen < 5:
        if isinstance(e, torch.OutOfMemoryError):
            return "GPU"
        if isinstance(e, RuntimeError) and HOST_REFUSED.search(str(e)):
            return "host"
        e, seen = e.__cause__, seen + 1  # type: ignore[assignment]
    return None


def line(e: BaseException, cfg, step: int | None) -> str:
    """The line for out-of-memory error `e` of a run with settings `cfg`: `step` is the
    step in progress, None while the model and optimizer were being set up. (A smaller
    batch size resumes the run's checkpoint: the loader continues from its row.)"""
    import torch

    which = kind(e)
    if which == "GPU":
        dev = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(dev).total_memory
        peak = torch.cuda.max_memory_reserved(dev)
        held = (
            f" (cuda:{dev} has {total / GIB:.1f} GiB; this process held up to {peak / GIB:.1f} GiB)"
        )
    else:
        m = HOST_REFUSED.search(str(e))
        held = f" (an allocation of {int(m.group(1)) / GIB:.1f} GiB was refused)" if m else ""
    d, world = cfg.data, int(os.environ.get("WORLD_SIZE", "1"))
    fixes = []
    # The training state's share, in either phase: the 8B preset, say, trains on 2 GPUs only
    # with bf16 moments, and without them runs out of memory at its first step.
    state = []
    if cfg.optim.name == "adamw" and cfg.optim.state_dtype == "fp32":
        state.append("--optim.state_dtype bf16 (AdamW's moments in bf16: 4 bytes a parameter less)")
    if cfg.fsdp is True:
        state.append(f"more GPUs (FSDP2 shards the training state over the ranks, now {world})")
    if step is None:
        where = "while setting up the model and optimizer"
        fixes += state
        if world > 1 and cfg.fsdp is not True:
            fixes.append(
                "--fsdp (parameters, gradients and optimizer state sharded over the ranks)"
            )
        fixes.append("a smaller model")
    else:
        where = f"at step {step}, micro-batches of {d.batch_size} x {d.seq_len} tokens"
        if d.batch_size > 1:
            keep = (
                "the gradient accumulation grows so that each step keeps its tokens"
                if cfg.optim.grad_accum == 0  # derived from optim.tokens_per_step
                else "a larger --optim.grad_accum keeps the step's tokens"
            )
            fixes.append(f"a smaller --data.batch_size (now {d.batch_size}; {keep})")
        if (ac := cfg.activation_checkpointing) != "full":  # what recomputes more than now
            more = "selective, every-2 or full" if ac == "off" else "full"
            fixes.append(
                f"--activation_checkpointing {more} (now {ac}; blocks recompute their activations)"
            )
        if ac == "selective" and cfg.ac_lean_blocks < cfg.model.n_layer:
            fixes.append(f"a larger --ac_lean_blocks (now {cfg.ac_lean_blocks}; those blocks "
                         "recompute their MLP's up projection too)")  # fmt: skip
        if d.batch_size == 1:
            fixes.append(f"a shorter --data.seq_len (now {d.seq_len})")
        if which == "GPU" and not env_guards.expandable_in_force():  # fragmentation
            fixes.append("PYTORCH_ALLOC_CONF=expandable_segments:True (less memory lost "
                         "to fragmentation)")  # fmt: skip
        fixes += state
    kept = (
        ""
        if step is None
        else "; the checkpoints written so far are intact: the same command with the change resumes"
    )
    return f"out of {which} memory {where}{held}: try {', or '.join(fixes)}{kept}"


@contextlib.contextmanager
def explained(cfg, step=lambda: None) -> Iterator[None]:
    """Turns an out-of-memory error in the block into OutOfMemory with its line; `step()`
    says the step in progress (None: setting up)."""
    try:
        yield
    except Exception as e:
        if kind(e) is None:
            raise
        raise OutOfMemory(line(e, cfg, step())) from None
