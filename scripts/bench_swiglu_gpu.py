"""SwiGLU MLP, forward and backward, compiled, on the GPU: Inductor's own kernels against
`--model.fused_swiglu` (pytrain.model.fused_swiglu), at Llama-3.2-1B's layer by default;
then the two Triton kernels alone against the memory traffic they must move.

    python scripts/bench_swiglu_gpu.py [--tokens 16384] [--d-model 2048] [--hidden 8192]

The MLP is the model's own module (pytrain.model.gpt.MLP) in bf16 parameters, compiled,
and each row times one forward and backward of one micro-batch of `--tokens` tokens
(median of 30 after 5 warm-up calls, CUDA events), with the peak memory it allocated.
With torchao installed, the same with the block's linear layers in float8 (tensorwise):
the fused op sits between torchao's layers there, which cast its output themselves.

With quack-kernels installed (flash-attn-4 depends on it), one more bf16 row: the same
weights through quack's MLP (`quack.mlp.mlp_func`, the SwiGLU inside the epilogues of its
own CuTe GEMMs, no cuBLAS), with its largest difference from ours."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from bench_ce_gpu import time_ms  # noqa: E402

from pytrain.model import fused_swiglu, quack_swiglu  # noqa: E402
from pytrain.model.config import ModelConfig  # noqa: E402
from pytrain.model.gpt import MLP  # noqa: E402


def setup(args, fused: str = "off") -> tuple[MLP, torch.Tensor, torch.Tensor]:
    """Our MLP in bf16 parameters, an input that wants its gradient, the output's gradient."""
    cfg = ModelConfig(
        d_model=args.d_model, mlp="swiglu", mlp_ratio=args.hidden * 1.5 / args.d_model,
        fused_swiglu=fused,
    )  # fmt: skip
    assert cfg.mlp_hidden == args.hidden, cfg.mlp_hidden
    mlp = MLP(cfg).cuda().bfloat16().train()
    x = torch.randn(args.tokens, args.d_model, device="cuda", dtype=torch.bfloat16)
    return mlp, x.requires_grad_(True), torch.randn_like(x)


def timed(step) -> tuple[float, float]:
    """(ms a call, peak GiB allocated during the calls)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def mlp_row(args, fused: str, float8: bool) -> tuple[float, float]:
    """(ms per forward + backward, peak GiB allocated during it) of one compiled MLP."""
    mlp, x, grad = setup(args, fused)
    if float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(mlp)
    return timed(torch.compile(lambda: mlp(x).backward(grad)))


def quack_row(args) -> tuple[float, float, float, str] | str | None:
    """(ms, peak GiB, largest |difference| from our MLP over its largest |output|, how it
    ran) of quack's gated-GEMM MLP on our MLP's weights, as `--model.fused_swiglu quack`
    calls it (pytrain.model.quack_swiglu); why, where quack's own call fails (0.6.5,
    installed outside a folder named site-packages, raised a TypeError building its
    epilogue); None where quack does not run on this GPU."""
    if quack_swiglu.why_not(torch.device("cuda")):
        return None
    mlp, x, grad = setup(args)

    def quack(x):
        return quack_swiglu.mlp(x, mlp.up.weight, mlp.down.weight, torch.bfloat16)

    try:
        with torch.no_grad():
            ref, out = mlp(x), quack(x)
    except Exception as e:  # noqa: BLE001 - a row that says why, not a stopped benchmark
        return f"{type(e).__name__}: {str(e)[:100]}"
    err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    how = "compiled"
    try:
        step = torch.compile(lambda: quack(x).backward(grad))
        step()
    except Exception as e:  # noqa: BLE001 - a row that says why, not a stopped benchmark
        how = f"eager ({type(e).__name__} under compile)"
        step = lambda: quack(x).backward(grad)  # noqa: E731
    return (*timed(step), err, how)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=8192)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens, "
          f"d_model {args.d_model}, hidden {args.hidden}\n")  # fmt: skip
    try:
        import torchao  # noqa: F401

        variants = (False, True)
    except ImportError:
        variants = (False,)
    print("| linear layers | SwiGLU | ms fwd+bwd | peak GiB |\n|---|---|---|---|")
    bf16_base = None
    for float8 in variants:
        base = None
        for fused in ("off", "on"):
            ms, gib = mlp_row(args, fused, float8)
            base = base or ms
            bf16_base = bf16_base or ms
            print(f"| {'float8' if float8 else 'bf16'} | {'fused' if fused == 'on' else 'Inductor'} "
                  f"| {ms:.3f} ({base / ms:.2f}x) | {gib:.2f} |", flush=True)  # fmt: skip
    q = quack_row(args)
    if isinstance(q, str):
        print(f"| bf16 | quack's gated GEMMs | did not run ({q}) | - |", flush=True)
    elif q:
        ms, gib, err, how = q
        print(f"| bf16 | quack's gated GEMMs ({how}; max diff {err:.1e}) "
              f"| {ms:.3f} ({bf16_base / ms:.2f}x) | {gib:.2f} |", flush=True)  # fmt: skip
    # The kernels alone: bytes they must move at least, and the bandwidth that makes.
    u = torch.randn(args.tokens, 2 * args.hidden, device="cuda").bfloat16()
    g = torch.randn(args.tokens, args.hidden, device="cuda").bfloat16()
    unit = args.tokens * args.hidden * 2  # one (tokens x hidden) bf16 tensor, bytes
    print("\n| kernel | ms | bytes moved (at least) | GB/s |\n|---|---|---|---|")
    for name, fn, moved in (
        ("forward: h = silu(a) * b", lambda: fused_swiglu._swiglu_triton(u), 3 * unit),
        ("backward: du = [da | db]", lambda: fused_swiglu._swiglu_backward_triton(u, g), 5 * unit),
    ):
        ms = time_ms(fn)
        print(f"| {name} | {ms:.3f} | {moved / 1e9:.2f} GB | {moved / ms / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
