"""The block's residual add and RMSNorm, forward and backward, on the GPU: our RMSNorm
module compiled by Inductor (what the model runs; and with `triton.multi_kernel`, which
`--compile.inductor` can pass) against quack's fused kernel
(`quack.rmsnorm.rmsnorm(..., residual=, prenorm=True)`, CuTe DSL; flash-attn-4 depends on
quack-kernels), at Llama-3.2-1B's width by default, bf16 throughout (the Llama presets'
`residual = "compute"`).

    python scripts/bench_norm_gpu.py [--tokens 16384] [--d-model 2048]

Each row times `r = x + d; y = norm(r)` and the backward of both outputs (the next layer
reads y, the residual stream carries r) by the device time of their kernels in a profile of
20 calls after 5 warm-up calls. A call's launch cost on the host (a compiled function's
guards, the CuTe DSL's argument packing) is about as long as these kernels, and in the
model's step the host runs ahead of the GPU, so CUDA-event timings of a lone call would
measure the host. The bandwidth column counts the bytes each direction must move at least:
forward reads x and d and writes r and y; backward reads dy, dr and r and writes one gradient,
which x and d share. In the 1B model's step, Inductor's norm kernels took ~23 ms of a
924 ms step on an H100 (BENCHMARKS.md, issue 33, tenth session); by this script, its
forward moves 2.9 TB/s there and quack's forward + backward is 7% faster (eleventh session)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_matmul_power import kernel_times  # noqa: E402

from pytrain.model.gpt import RMSNorm  # noqa: E402


def kernel_ms(fn, reps: int = 20) -> float:
    """Milliseconds of device kernels a call of `fn`, from a profile of `reps` calls after
    5 unprofiled ones (compilation, autotuning)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()  # no warm-up kernel still running inside the profile
    return sum(kernel_times(fn, reps).values()) / reps / 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} x "
          f"{args.d_model}, bf16\n")  # fmt: skip
    norm = RMSNorm(args.d_model, 1e-5).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    shape = (args.tokens, args.d_model)
    x, d = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "xd")  # fmt: skip
    dy, dr = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "yr")

    def ours():
        r = x + d
        return norm(r), r

    # Inductor reduces a row of more than 1024 elements in a loop (two passes over it); with
    # triton.multi_kernel it also builds a one-pass (persistent) kernel and keeps the faster.
    rows = {
        "ours (Inductor)": torch.compile(ours),
        "ours (Inductor, triton.multi_kernel=1)": torch.compile(
            ours, options={"triton.multi_kernel": 1}
        ),
    }
    try:
        from quack.rmsnorm import rmsnorm

        def quack():
            y, r = rmsnorm(d, norm.weight, residual=x, eps=norm.eps, prenorm=True)
            return y, r

        rows["quack (CuTe DSL)"] = torch.compile(quack)
    except ImportError as e:
        print(f"quack-kernels not installed ({e}): one row\n")
    unit = x.numel() * x.element_size()
    outs = {}
    print(
        "| kernel | forward ms | GB/s | forward + backward ms | backward GB/s |\n|---|---|---|---|---|"
    )
    for name, fn in rows.items():
        fwd = kernel_ms(lambda fn=fn: fn())
        # autograd.grad, not backward: no kernels that add into .grad from the last call.
        both = kernel_ms(lambda fn=fn: torch.autograd.grad(fn(), (x, d, norm.weight), (dy, dr)))
        bwd = both - fwd
        print(f"| {name} | {fwd:.3f} | {4 * unit / fwd / 1e6:.0f} | {both:.3f} "
              f"| {4 * unit / bwd / 1e6:.0f} |", flush=True)  # fmt: skip
        y, r = fn()
        dx, dw = torch.autograd.grad((y, r), (x, norm.weight), (dy, dr))
        outs[name] = [t.detach().float() for t in (y, r, dx, dw)]
    if "quack (CuTe DSL)" in outs:
        a, b = outs["ours (Inductor)"], outs["quack (CuTe DSL)"]
        diffs = [float((u - v).abs().max() / u.abs().max()) for u, v in zip(a, b, strict=True)]
        y, r, dx, dw = (f"{v:.1e}" for v in diffs)
        print(f"\nlargest difference over largest value: y {y}, r {r}, dx {dx}, dweight {dw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
