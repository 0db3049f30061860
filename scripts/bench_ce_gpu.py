"""The fused cross-entropy kernel (pytrain.model.fused_ce) on the GPU: block size and warps,
against torch's compiled cross-entropy forward + backward over the same logits.

    python scripts/bench_ce_gpu.py [--tokens 12288] [--vocab 50304]

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
    args = p.parse_args()
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
