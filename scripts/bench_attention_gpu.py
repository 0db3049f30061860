"""Attention kernels at the GPT-2 124M shape, forward + backward, side by side in one run:
SDPA restricted to FlashAttention-2, cuDNN and memory-efficient kernels (plain causal), and
FlexAttention (compiled) with a causal mask and with a document mask like packed rows, and
FlashAttention-4 (flash-attn-4, where installed) causal and over document segments.

    python scripts/bench_attention_gpu.py [--batch 12] [--seq 1024] [--heads 12] [--head-dim 64]

q, k, v are strided views of one qkv projection, as in pytrain.model.gpt, so each kernel sees the
layout it gets in training. TFLOP/s counts the causal half of the score matrix (for the
document-masked rows too, which compute less: their figure is the causal work's rate):
4 * B * H * T^2 * D / 2 for the forward, 2.5x that for the backward. Prints a table last."""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from pytrain import data
from pytrain.model.gpt import sdpa


def qkv(b: int, t: int, h: int, d: int) -> tuple[torch.Tensor, ...]:
    x = torch.randn(b, t, 3, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return x, *x.permute(2, 0, 3, 1, 4)


def timed(fn, x: torch.Tensor, iters: int) -> float:
    """Median ms of fn() forward + backward, CUDA events."""
    for _ in range(3):
        fn().sum().backward()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn().sum().backward()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        x.grad = None
    return statistics.median(times)


def doc_ids(b: int, t: int, mean_len: int) -> torch.Tensor:
    """Packed-row document ids: log-normal document lengths, numbered per row."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(b):
        lens = torch.distributions.LogNormal(torch.log(torch.tensor(float(mean_len))), 1.0).sample(
            (t,)
        )
        ids = torch.repeat_interleave(
            torch.arange(t), lens.clamp(1, t).long() + torch.randint(0, 2, (t,), generator=g)
        )[:t]
        rows.append(ids)
    return torch.stack(rows).to("cuda", torch.int32)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    B, T, H, D = args.batch, args.seq, args.heads, args.head_dim
    results: dict[str, float | str] = {}
    # Contiguous (B, H, T, D) tensors too: a kernel that is slow only on the strided
    # views would show here, and the model could then make them contiguous.
    xc = torch.randn(3, B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x, q, k, v = qkv(B, T, H, D)
    for layout, (src, qq, kk, vv) in {"qkv views": (x, q, k, v), "contiguous": (xc, *xc)}.items():
        for backend in ("flash", "cudnn", "efficient"):
            name = f"sdpa {backend}, causal, {layout}"
            try:
                results[name] = timed(
                    lambda b=backend, qq=qq, kk=kk, vv=vv: sdpa(qq, kk, vv, b, is_causal=True),
                    src,
                    args.iters,
                )
            except RuntimeError as e:
                results[name] = f"unavailable: {str(e).splitlines()[0][:80]}"
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cuda")
    results["flex (compiled), causal"] = timed(
        lambda: flex(q, k, v, block_mask=causal), x, args.iters
    )
    docs = doc_ids(B, T, mean_len=300)

    def doc_causal(b, h, q, kv):
        return (q >= kv) & (docs[b, q] == docs[b, kv])

    dmask = create_block_mask(doc_causal, B, None, T, T, device="cuda")
    results["flex (compiled), document mask"] = timed(
        lambda: flex(q, k, v, block_mask=dmask), x, args.iters
    )
    from pytrain.model import flash4

    if flash4.available():
        # (B, T, H, D) views of the same projection: FA4's own layout, no transpose.
        q4, k4, v4 = x.unbind(2)
        results["FA4 (flash-attn-4), causal"] = timed(
            lambda: flash4.attention(q4, k4, v4, None), x, args.iters
        )
        cu = torch.from_numpy(data.cu_seqlens(docs.cpu().numpy())).cuda()
        seg = flash4.Segments(cu, T)
        results["FA4, document segments (varlen)"] = timed(
            lambda: flash4.attention(q4, k4, v4, seg), x, args.iters
        )
    else:
        results["FA4 (flash-attn-4)"] = "unavailable: flash-attn-4 not importable"
    flops = 4 * B * H * T * T * D / 2 * 3.5
    print(
        f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}; B={B} T={T} H={H} D={D} bf16"
    )
    print("| kernel | fwd+bwd ms (median) | TFLOP/s (causal) |")
    print("|---|---|---|")
    for name, ms in results.items():
        if isinstance(ms, str):
            print(f"| {name} | {ms} | |")
        else:
            print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
