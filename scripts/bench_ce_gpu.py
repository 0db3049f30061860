"""The fused cross-entropy kernel (pytrain.model.fused_ce) on the GPU: block size and warps,
against torch's compiled cross-entropy forward + backward over the same logits; then the
whole output-layer op (logits, loss, both gradients) in bf16 against FP8
(`--model.float8_head`), with the FP8 op's parts.

    python scripts/bench_ce_gpu.py [--tokens 12288] [--vocab 50304] [--op-only]

Each row: median of 30 timed calls (CUDA events) after 5 warm-up calls, and the
effective bandwidth if the logits were read twice and written once."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pytrain.model import fused_ce  # noqa: E402


def time_ms(fn, reps: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=12288)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--op-only", action="store_true", help="only the bf16 vs FP8 op table")
    args = p.parse_args()
    if args.op_only:
        return op_table(args.tokens, args.vocab, args.d_model)
    n, v = args.tokens, args.vocab
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, v, device="cuda", generator=g).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    work = torch.empty_like(logits)
    gb = 3 * logits.numel() * logits.element_size() / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, logits {n} x {v} bf16")
    print("| kernel | block | warps | ms | GB/s (3 passes) |\n|---|---|---|---|---|")
    rows = []
    for block in (4096, 8192, 16384, 32768):
        for warps in (8, 16, 32):
            ms = time_ms(lambda b=block, w=warps: (work.copy_(logits),
                         fused_ce._ce_grad_triton(work, targets, b, w)))  # fmt: skip
            copy = time_ms(lambda: work.copy_(logits))
            rows.append((ms - copy, block, warps))
            print(
                f"| fused (loss + grad in place) | {block} | {warps} | {ms - copy:.3f} | {gb / ((ms - copy) / 1e3):.0f} |"
            )
    x = logits.detach().requires_grad_()

    def torch_ce():
        loss = F.cross_entropy(x, targets, reduction="sum")
        loss.backward()
        x.grad = None

    compiled = torch.compile(torch_ce)
    print(f"| torch.compile(cross_entropy) fwd + bwd | - | - | {time_ms(compiled):.3f} | - |")
    best = min(rows)
    print(f"\nbest fused: block {best[1]}, {best[2]} warps, {best[0]:.3f} ms")
    return op_table(n, v, args.d_model)


def op_table(n: int, v: int, c: int) -> int:
    """The output layer + loss op, bf16 vs FP8, and what the FP8 op spends where."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, c, device="cuda", generator=g).bfloat16()
    w = torch.randn(v, c, device="cuda", generator=g) * 0.02
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    flops = 3 * 2 * n * c * v
    print(f"\n{torch.cuda.get_device_name()}, the output layer op: {n} tokens x {c} -> {v}")
    print("| op | ms | TFLOP/s of its 3 matmuls |\n|---|---|---|")
    for name, op in (
        ("bf16", torch.ops.pytrain.linear_ce),
        ("fp8", torch.ops.pytrain.linear_ce_fp8),
    ):
        ms = time_ms(lambda op=op: op(x, w, t))
        print(
            f"| {name} (linear_ce{'_fp8' if name == 'fp8' else ''}) | {ms:.3f} | {flops / ms / 1e9:.0f} |"
        )
    x8t, xi = fused_ce._e4m3_t(x)
    w8t, wi = fused_ce._e4m3_t(w.bfloat16())
    g8 = torch.empty(n, v, dtype=torch.float8_e5m2, device="cuda")
    gi = torch.full((), 1 / fused_ce.G_SCALE, device="cuda")
    logits = x @ w.bfloat16().t()
    g8t = fused_ce.transpose(g8)
    parts = {
        "x and w to e4m3, transposed (Triton)": lambda: (fused_ce._e4m3_t(x), fused_ce._e4m3_t(w.bfloat16())),
        "x and w to e4m3 (torch ops, for reference)": lambda: (fused_ce._e4m3(x), fused_ce._e4m3(w.bfloat16())),
        "logits (bf16 matmul)": lambda: x @ w.bfloat16().t(),
        "loss + e5m2 gradient (kernel)": lambda: fused_ce.ce_grad_(logits, t, out=g8, out_scale=fused_ce.G_SCALE),
        "d/dx (fp8 matmul)": lambda: torch._scaled_mm(g8, w8t.t(), scale_a=gi, scale_b=wi, out_dtype=torch.bfloat16),
        "gradient transposed (Triton)": lambda: fused_ce.transpose(g8),
        "gradient transposed (ATen copy, for reference)": lambda: g8.t().contiguous(),
        "d/dw (fp8 matmul)": lambda: torch._scaled_mm(g8t, x8t.t(), scale_a=gi, scale_b=xi, out_dtype=torch.bfloat16),
    }  # fmt: skip
    print("\n| part of the fp8 op | ms |\n|---|---|")
    for name, fn in parts.items():
        print(f"| {name} | {time_ms(fn):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
