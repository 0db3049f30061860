"""The output layer and the cross-entropy in one autograd op, for training.

The usual path writes the (tokens x vocab) logits, reads them for the forward
log-sum-exp, keeps them until backward, and reads them again there to write their
gradient: at GPT-2 size (12,288 tokens x 50,304) that is 1.2 GB per pass. Here the forward
computes the logits, turns them in place into d(loss)/d(logits) with one kernel that also
gives each token's loss (two passes over a row, the second mostly from L2), and
multiplies that by the weight and the input right away. Backward only scales the two
small results by the incoming gradient (the gradient-accumulation factor). The logits are
never kept for backward.

The kernel is Triton on CUDA; elsewhere the same math runs in torch (tests use it, and
`_ce_grad_torch` is the reference the Triton kernel is tested against). Wrapped as a
torch custom op, torch.compile treats it as one opaque call (no graph break)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without Triton use the torch path
    triton = None

__all__ = ["IGNORE_INDEX", "ce_grad_", "linear_cross_entropy", "triton_available"]

IGNORE_INDEX = -100


def triton_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _ce_grad_kernel(
        logits_ptr, losses_ptr, targets_ptr, stride, V, ignore_index, BLOCK: tl.constexpr
    ):
        """One row: loss = lse - x[target]; the row becomes softmax(x) - onehot(target)
        (all zeros where the target is ignored)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
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
            g = tl.where(cols == t, g - 1.0, g) * keep
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < V)


def _ce_grad_triton(
    logits: torch.Tensor, targets: torch.Tensor, block: int = 0, num_warps: int = 0
) -> torch.Tensor:
    """Default block size and warps: the fastest of `scripts/bench_ce_gpu.py`'s sweep on
    the H100 (16,384 x 16 warps: 1.10 ms for 12,288 x 50,304 bf16 logits, 3.4 TB/s if
    the second read came from DRAM; 32,768 x 32 took 1.27 ms). A one-read variant that
    held the whole row in one block spilled registers: 1.9-2.3 ms."""
    n, v = logits.shape
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    block = block or min(16384, triton.next_power_of_2(v))
    num_warps = num_warps or (16 if block >= 8192 else 8)
    _ce_grad_kernel[(n,)](
        logits, losses, targets, logits.stride(0), v, IGNORE_INDEX, BLOCK=block, num_warps=num_warps
    )
    return losses


def _ce_grad_torch(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    lse = x.logsumexp(-1)
    valid = targets != IGNORE_INDEX
    t = torch.where(valid, targets, 0)
    losses = torch.where(valid, lse - x.gather(1, t[:, None])[:, 0], 0.0)
    g = torch.exp(x - lse[:, None])
    g[torch.arange(len(t), device=g.device), t] -= 1.0
    logits.copy_(g * valid[:, None])
    return losses


def ce_grad_(logits: torch.Tensor, targets: torch.Tensor, use_triton: bool | None = None):
    """Per-row cross-entropy losses (fp32) of (N, V) `logits` against (N,) `targets`;
    the logits are overwritten by the gradient of the summed loss (their own dtype).
    Targets equal to IGNORE_INDEX give loss 0 and a zero gradient row."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}")
    if not logits.is_contiguous():
        raise ValueError("ce_grad_ writes the gradient in place: logits must be contiguous")
    if use_triton is None:
        use_triton = triton_available(logits.device)
    return (_ce_grad_triton if use_triton else _ce_grad_torch)(logits, targets)


@torch.library.custom_op("pytrain::linear_ce", mutates_args=())
def _linear_ce(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed loss fp32, d/dx (N, C), d/dweight (V, C)), both gradients in x's dtype."""
    w = weight.to(x.dtype)
    logits = x @ w.t()
    losses = ce_grad_(logits, targets)
    return losses.sum(), logits @ w, logits.t() @ x


@_linear_ce.register_fake
def _(x, weight, targets):
    return (
        x.new_empty((), dtype=torch.float32),
        torch.empty_like(x),
        x.new_empty(weight.shape, dtype=x.dtype),
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets):
        loss, grad_x, grad_w = torch.ops.pytrain.linear_ce(x, weight, targets)
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
        )


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """sum over rows of cross_entropy(x @ weight.T, targets, ignore_index=-100), for
    training: x (N, C) in the compute dtype (bf16 under autocast), weight (V, C), targets
    (N,) int64. The gradients are computed in the forward (see the module docstring)."""
    return _LinearCrossEntropy.apply(x, weight, targets.long())
