"""The output layer and the cross-entropy in one autograd op, for training.

The usual path writes the (tokens x vocab) logits, reads them for the forward
log-sum-exp, keeps them until backward, and reads them again there to write their
gradient: at GPT-2 size (12,288 tokens x 50,304) that is 1.2 GB per pass. Here the forward
computes the logits, turns them in place into d(loss)/d(logits) with one kernel that also
gives each token's loss (two passes over a row, the second mostly from L2), and
multiplies that by the weight and the input right away. Backward only scales the two
small results by the incoming gradient (the gradient-accumulation factor). The logits are
never kept for backward. An FP8 form of the op (`--model.float8_head`) runs its two
gradient matmuls through torch._scaled_mm (see G_SCALE's comment).

The kernel is Triton on CUDA; elsewhere the same math runs in torch (tests use it, and
`_ce_grad_torch` is the reference the Triton kernel is tested against). Wrapped as a
torch custom op, torch.compile treats it as one opaque call (no graph break)."""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch path
    triton = None

__all__ = [
    "IGNORE_INDEX",
    "ce_grad_",
    "fp8_shapes_ok",
    "linear_cross_entropy",
    "row_chunks",
    "triton_available",
]

IGNORE_INDEX = -100


def triton_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _ce_grad_kernel(
        logits_ptr, out_ptr, losses_ptr, targets_ptr, stride, out_stride, out_scale, V,
        ignore_index, BLOCK: tl.constexpr
    ):  # fmt: skip
        """One row: loss = lse - x[target]; the output row (the logits row itself, or a row
        of an FP8 copy) becomes (softmax(x) - onehot(target)) * out_scale, all zeros where
        the target is ignored."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        out = out_ptr + row * out_stride
        target = tl.load(targets_ptr + row).to(tl.int64)
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK):  # online log-sum-exp, in fp32
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        valid = target != ignore_index
        t = tl.where(valid, target, 0)
        x_t = tl.load(base + t).to(tl.float32)
        tl.store(losses_ptr + row, tl.where(valid, lse - x_t, 0.0))
        keep = tl.where(valid, 1.0, 0.0)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == t, g - 1.0, g) * (keep * out_scale)
            tl.store(
                out + cols,
                g.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                mask=cols < V,
            )

    @triton.jit
    def _transpose_kernel(src, dst, M, N, BM: tl.constexpr, BN: tl.constexpr):
        """dst (N, M) = src (M, N) transposed, one BM x BN tile per program: read along
        src's rows, written along dst's rows (Triton exchanges the tile through shared
        memory), so both sides move whole cache lines."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tile = tl.load(src + rm[:, None].to(tl.int64) * N + rn[None, :], mask=mask)
        out = dst + rn[None, :].to(tl.int64) * M + rm[:, None]
        tl.store(out, tile, mask=mask)

    @triton.jit
    def _e4m3_t_kernel(
        src, amax_ptr, dst_t, inv_ptr, M, N, MAX: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr,
    ):  # fmt: skip
        """One BM x BN tile of src (M, N) scaled by the power of two that takes its absolute
        maximum to at most MAX, rounded to e4m3 and written transposed into dst_t (N, M);
        the first program stores the dequantisation scale (_e4m3's math, in one pass)."""
        amax = tl.maximum(tl.load(amax_ptr).to(tl.float32), 1e-30)
        scale = tl.exp2(tl.floor(tl.log2(MAX / amax)))
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(inv_ptr, 1.0 / scale)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tile = tl.load(src + rm[:, None].to(tl.int64) * N + rn[None, :], mask=mask)
        q = (tile.to(tl.float32) * scale).to(dst_t.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(dst_t + rn[None, :].to(tl.int64) * M + rm[:, None], q, mask=mask)


def _ce_grad_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    block: int = 0,
    num_warps: int = 0,
    out: torch.Tensor | None = None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """Default block size and warps: the fastest of a sweep on
    an H100 (16,384 x 16 warps: 1.10 ms for 12,288 x 50,304 bf16 logits, 3.4 TB/s if
    the second read came from DRAM; 32,768 x 32 took 1.27 ms). A one-read variant that
    held the whole row in one block spilled registers: 1.9-2.3 ms."""
    n, v = logits.shape
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    block = block or min(16384, triton.next_power_of_2(v))
    num_warps = num_warps or (16 if block >= 8192 else 8)
    out = logits if out is None else out
    _ce_grad_kernel[(n,)](
        logits, out, losses, targets, logits.stride(0), out.stride(0), out_scale, v, IGNORE_INDEX,
        BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return losses


def _ce_grad_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    out: torch.Tensor | None = None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    x = logits.float()
    lse = x.logsumexp(-1)
    valid = targets != IGNORE_INDEX
    t = torch.where(valid, targets, 0)
    losses = torch.where(valid, lse - x.gather(1, t[:, None])[:, 0], 0.0)
    g = torch.exp(x - lse[:, None])
    g[torch.arange(len(t), device=g.device), t] -= 1.0
    (logits if out is None else out).copy_(g * valid[:, None] * out_scale)
    return losses


def ce_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    use_triton: bool | None = None,
    out: torch.Tensor | None = None,
    out_scale: float = 1.0,
):
    """Per-row cross-entropy losses (fp32) of (N, V) `logits` against (N,) `targets`.
    The gradient of the summed loss, times `out_scale`, goes to `out` (an (N, V) tensor of
    any dtype: FP8 for fused_linear_ce_fp8) or, without `out`, over the logits (their own
    dtype). Targets equal to IGNORE_INDEX give loss 0 and a zero gradient row."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}")
    if not logits.is_contiguous() or (out is not None and not out.is_contiguous()):
        raise ValueError("ce_grad_ needs contiguous logits (and output)")
    if out is not None and out.shape != logits.shape:
        raise ValueError(f"out {tuple(out.shape)} is not the logits' {tuple(logits.shape)}")
    if use_triton is None:
        use_triton = triton_available(logits.device)
    return (_ce_grad_triton if use_triton else _ce_grad_torch)(
        logits, targets, out=out, out_scale=out_scale
    )


CHUNK_BYTES = 2**30
"""The most logits one pass holds (1 GiB in the compute dtype). The op goes over the
tokens in chunks of rows: at the 8B's micro-batch (8,192 tokens x 128,256) the logits are 2
GiB, and with the output layer's gradient (and, in FP8, the e5m2 gradient) beside them the
forward's end was the step's peak of memory. The matmuls stay large (4,096 rows a chunk
there), and where the logits fit one chunk the op is the single pass it was."""


def row_chunks(n: int, v: int, itemsize: int) -> list[slice]:
    """Slices of `n` rows, as few as keep each chunk's (rows x `v`) logits within
    CHUNK_BYTES, equal in size, multiples of 16 rows (FP8 matmuls need them) but the last."""
    chunks = max(1, math.ceil(n * v * itemsize / CHUNK_BYTES))
    rows = math.ceil(math.ceil(n / chunks) / 16) * 16
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


@torch.library.custom_op("pytrain::linear_ce", mutates_args=())
def _linear_ce(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss fp32, d/dx (N, C), d/dweight (V, C)), both gradients in x's dtype.
    Chunk by chunk of rows (row_chunks); d/dweight adds each chunk's product into the
    first's in its own dtype (under bf16, one rounding more a chunk: one at the 8B)."""
    w = weight.to(x.dtype)
    losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x)
    grad_w: torch.Tensor | None = None
    for rows in row_chunks(x.shape[0], w.shape[0], x.element_size()):
        logits = x[rows] @ w.t()
        losses[rows] = ce_grad_(logits, targets[rows])
        torch.mm(logits, w, out=grad_x[rows])
        if grad_w is None:
            grad_w = logits.t() @ x[rows]
        else:
            grad_w.addmm_(logits.t(), x[rows])
        del logits
    assert grad_w is not None  # x has rows: the fake and the callers make sure of it
    return losses.sum(), grad_x, grad_w


@_linear_ce.register_fake
def _linear_ce_fake(x, weight, targets):
    return (
        x.new_empty((), dtype=torch.float32),
        torch.empty_like(x),
        x.new_empty(weight.shape, dtype=x.dtype),
    )


# The FP8 form (model.float8_head): the logits in bf16, the two gradient matmuls through
# torch._scaled_mm. The logits stay bf16 because they set the loss and the softmax: e4m3
# logits (3 mantissa bits in both operands) raised a trained model's loss by ~1% and put
# 7-14% of error into both gradients (7x the bf16 op's), which cost 2.2% of validation
# loss at equal steps in the 124M preset's time-to-quality run (BENCHMARKS.md).
# The gradients take FP8 well: the input and the weight go to e4m3 with per-tensor
# power-of-two scales from their absolute maxima (a power of two scales exactly, so the
# cast never overflows); the logits' gradient goes to e5m2 straight from the
# cross-entropy kernel with a fixed scale, since every entry of softmax - onehot lies in
# [-1, 1]: 2**15 keeps the largest under e5m2's 57,344, and probabilities down to ~5e-10
# stay representable. The gradient is half the logits' size. cuBLAS's FP8 matmuls take
# both operands K-major only, hence the transposed copies (the gradient's is the one
# large extra pass).
G_SCALE = 2.0**15
E4M3_MAX = 448.0


def _e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in float8_e4m3fn, the fp32 dequantisation scale _scaled_mm takes)."""
    amax = torch.linalg.vector_norm(t, float("inf")).float().clamp(min=1e-30)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (t * scale.to(t.dtype)).to(torch.float8_e4m3fn), scale.reciprocal()


def _e4m3_t(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t transposed in e4m3, contiguous; the dequantisation scale): _e4m3 then transpose;
    on CUDA one amax reduction and one Triton pass instead of a dozen kernels."""
    if not (triton_available(t.device) and t.is_contiguous()):
        t8, inv = _e4m3(t)
        return transpose(t8), inv
    m, n = t.shape
    amax = torch.linalg.vector_norm(t, float("inf"))
    t8_t = torch.empty((n, m), dtype=torch.float8_e4m3fn, device=t.device)
    inv = torch.empty((), dtype=torch.float32, device=t.device)
    grid = (triton.cdiv(m, 64), triton.cdiv(n, 128))
    _e4m3_t_kernel[grid](t, amax, t8_t, inv, m, n, MAX=E4M3_MAX, BM=64, BN=128)
    return t8_t, inv


def transpose(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the 2-D `t` transposed. On CUDA, 1-byte elements (FP8) through
    the Triton kernel above: for the 824 MB gradient of 16,384 tokens on the H100, 0.67 ms
    against 6.05 for ATen's copy of the transposed view."""
    if not (triton_available(t.device) and t.element_size() == 1 and t.is_contiguous()):
        return t.t().contiguous()
    m, n = t.shape
    out = torch.empty((n, m), dtype=t.dtype, device=t.device)
    src, dst = t.view(torch.uint8), out.view(torch.uint8)
    _transpose_kernel[(triton.cdiv(m, 128), triton.cdiv(n, 128))](src, dst, m, n, BM=128, BN=128)
    return out


def fp8_shapes_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """_scaled_mm needs every dimension divisible by 16."""
    return x.shape[0] % 16 == 0 and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0


@torch.library.custom_op("pytrain::linear_ce_fp8", mutates_args=())
def _linear_ce_fp8(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_ce with FP8 gradient matmuls (see above); the same outputs and dtypes, and
    the same loss (the logits are the bf16 op's). The logits are made chunk by chunk of rows
    (row_chunks), each turned at once into its rows of the e5m2 gradient; the quantised
    operands are made only when their matmul is next, and each tensor is let go once used,
    so at most two tensors of the gradient's size (1 byte an element) are held at a time."""
    w = weight.to(x.dtype)
    losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    g8 = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float8_e5m2, device=x.device)
    for rows in row_chunks(x.shape[0], w.shape[0], x.element_size()):
        logits = x[rows] @ w.t()
        losses[rows] = ce_grad_(logits, targets[rows], out=g8[rows], out_scale=G_SCALE)
        del logits
    g_inv = torch.full((), 1.0 / G_SCALE, device=x.device)
    # (N, V) @ (V, C): the weight as a column-major (V, C), i.e. a row-major (C, V) copy.
    w8_t, w_inv = _e4m3_t(w)
    grad_x = torch._scaled_mm(g8, w8_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=x.dtype)
    del w8_t
    # (V, N) @ (N, C): the gradient transposed (row-major (V, N)), x column-major.
    g8_t = transpose(g8)
    del g8
    x8_t, x_inv = _e4m3_t(x)
    grad_w = torch._scaled_mm(g8_t, x8_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=x.dtype)
    return losses.sum(), grad_x, grad_w


@_linear_ce_fp8.register_fake
def _(x, weight, targets):
    return _linear_ce_fake(x, weight, targets)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, fp8):
        op = torch.ops.pytrain.linear_ce_fp8 if fp8 else torch.ops.pytrain.linear_ce
        loss, grad_x, grad_w = op(x, weight, targets)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        g = grad_loss.float()
        return (
            (grad_x.float() * g).to(grad_x.dtype),
            (grad_w.float() * g).to(ctx.weight_dtype),
            None,
            None,
        )


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, fp8: bool = False
):
    """sum over rows of cross_entropy(x @ weight.T, targets, ignore_index=-100), for
    training: x (N, C) in the compute dtype (bf16 under autocast), weight (V, C), targets
    (N,) int64. The gradients are computed in the forward (see the module docstring).
    `fp8`: the gradient matmuls in FP8 (see G_SCALE's comment) where the shapes allow it."""
    fp8 = fp8 and fp8_shapes_ok(x, weight)
    return _LinearCrossEntropy.apply(x, weight, targets.long(), fp8)
