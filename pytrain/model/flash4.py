"""FlashAttention-4 (the CuTe DSL kernels of the optional `flash-attn-4` package) as torch
custom ops, so that torch.compile keeps the model in one graph around them.

Why: its variable-length form takes document boundaries (`cu_seqlens`), which is document
masking of packed rows that computes only each document's own causal blocks. On the H100 it
made document masking free against plain causal attention in the GPT-2 124M step, where
FlexAttention's document mask cost 23-34% (BENCHMARKS.md); the kernel alone is not faster
than cuDNN's at head sizes 64 and 128.

Layout: q, k, v are (batch, seq, heads, head_dim), the layout a fused qkv projection makes, so
no transpose is needed. With `cu_seqlens` the batch and sequence dimensions are flattened and
each segment [cu[i], cu[i+1]) attends causally within itself; trailing repeats of the total
are empty segments (padding that keeps the number of shapes small); `pytrain.data.cu_seqlens`
derives them from a batch's document ids."""

import functools
import os
from pathlib import Path
from typing import NamedTuple, Optional  # custom-op schemas of older torch read Optional

import torch

__all__ = ["Segments", "attention", "available"]


class Segments(NamedTuple):
    """Document boundaries of a flattened batch: int32 offsets and the longest segment's
    length bound (the row length: a bound, so reading it needs no device sync)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int


NEEDS = "attention 'fa4' needs a Hopper or Blackwell GPU and the flash-attn-4 package"
"""Why --model.attention fa4 cannot run here (said where the model is built, and earlier by
the CLI, before any data is touched)."""


def _gpu_runs_it(device_index: int) -> bool:
    """A Hopper or Blackwell GPU (sm90/sm100), the ones FA4 has kernels for."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _enable_kernel_cache() -> None:
    """FA4's on-disk kernel cache, in this user's own cache directory: it holds shared
    objects FA4 loads, and FA4's default folder under /tmp could have been made first by
    another user. Left off where that directory cannot be made."""
    cache = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    if cache is None:
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        try:
            (home / "pytrain").mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            return
        cache = str(home / "pytrain" / "flash-attn-4")
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = cache
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"


@functools.cache
def _imports() -> bool:
    # FA4 compiles its kernels at a run's first call (the CuTe DSL: tens of seconds for the
    # forward and backward); its own on-disk cache, off unless asked for, lets the next
    # start on this machine load them, as Inductor's cache does for the rest. Read at import.
    if "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" not in os.environ:
        _enable_kernel_cache()
    try:
        from flash_attn.cute import interface  # noqa: F401
    except Exception:  # ImportError, or the CuTe DSL runtime failing to load
        return False
    return True


def available(device_index: int = 0) -> bool:
    """True when flash-attn-4 imports and the GPU is a Hopper or Blackwell (sm90/sm100)."""
    return _gpu_runs_it(device_index) and _imports()


def install_hint(device_index: int = 0) -> str:
    """What `attention = auto` leaves on the table on this GPU: a line when FA4 would run
    here but flash-attn-4 is not installed, else ''."""
    if not _gpu_runs_it(device_index) or _imports():
        return ""
    return (
        "flash-attn-4 is not installed: `pip install '.[fa4]'` gives document masking through "
        "FlashAttention-4 on this GPU (on an H100, the GPT-2 preset runs 6% faster: BENCHMARKS.md)"
    )


@torch.library.custom_op("pytrain::fa4_fwd", mutates_args=(), device_types="cuda")
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: Optional[torch.Tensor],
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_seqlen if cu is not None else None,
        max_seqlen_k=max_seqlen if cu is not None else None,
        causal=True,
        return_lse=True,
    )
    return out, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, cu, max_seqlen):
    # The shapes _flash_attn_fwd allocates: out contiguous like q, lse in fp32 with heads
    # before tokens.
    if cu is None:
        b, t, h, _ = q.shape
        lse = q.new_empty((b, h, t), dtype=torch.float32)
    else:
        total, h, _ = q.shape
        lse = q.new_empty((h, total), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("pytrain::fa4_bwd", mutates_args=(), device_types="cuda")
def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: Optional[torch.Tensor],
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        causal=True,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=max_seqlen if cu is not None else None,
        max_seqlen_k=max_seqlen if cu is not None else None,
        # Its gradients are summed across blocks with atomic adds, in an order that can
        # change from run to run; under `--deterministic` (torch's deterministic mode) in a
        # fixed order (semaphores), so that a resumed run can equal an uninterrupted one.
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return dq, dk, dv


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, cu, max_seqlen):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, cu, max_seqlen = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.max_seqlen = max_seqlen


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu, ctx.max_seqlen)
    return dq, dk, dv, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Optional[Segments],
) -> torch.Tensor:
    """Causal attention of (B, T, H, D) q, k, v, within documents when `segments` is given
    (else over whole rows). Returns (B, T, H, D)."""
    if segments is None:
        out, _ = _fwd(q, k, v, None, q.shape[1])
        return out
    b, t, h, d = q.shape
    # k and v keep their own head count: FA4 serves grouped-query attention natively.
    flat = [x.reshape(b * t, x.shape[2], x.shape[3]) for x in (q, k, v)]
    out, _ = _fwd(*flat, segments.cu_seqlens, segments.max_seqlen)
    return out.view(b, t, h, d)
