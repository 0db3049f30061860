"""How far the FP8 output layer's loss and gradients are from fp32, on the CPU: the bf16 op,
FP8 logits only, FP8 gradients only (the form `--model.float8_head` runs) and both (its
first form), at the 124M preset's output layer (768 -> 50,304) on logits as peaked as an
untrained, a half-trained and a trained model's.

    python scripts/fp8_head_error.py [--tokens 1024]

Inputs: RMS-normalised rows (as the final norm's) times weights of growing scale; targets
drawn from the softmax, so the loss is the distribution's entropy. docs/TRAINER.md, "FP8"."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pytrain.model import fused_ce  # noqa: E402


def linear_ce(x, w, t, fp8_logits: bool, fp8_grads: bool):
    """(summed loss, d/dx, d/dw) of the bf16 op with either part in FP8, as fused_ce does it."""
    xb, wb = x.bfloat16(), w.bfloat16()
    x8, x_inv = fused_ce._e4m3(xb)
    w8, w_inv = fused_ce._e4m3(wb)
    if fp8_logits:
        logits = torch._scaled_mm(
            x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=torch.bfloat16
        )
    else:
        logits = xb @ wb.t()
    if not fp8_grads:
        losses = fused_ce.ce_grad_(logits, t)
        return losses.sum(), logits @ wb, logits.t() @ xb
    g8 = torch.empty(logits.shape, dtype=torch.float8_e5m2)
    losses = fused_ce.ce_grad_(logits, t, out=g8, out_scale=fused_ce.G_SCALE)
    g_inv = torch.full((), 1.0 / fused_ce.G_SCALE)
    w8_t, x8_t = fused_ce.transpose(w8), fused_ce.transpose(x8)
    dx = torch._scaled_mm(g8, w8_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=torch.bfloat16)
    g8_t = fused_ce.transpose(g8)
    dw = torch._scaled_mm(g8_t, x8_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.bfloat16)
    return losses.sum(), dx, dw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    forms = {"bf16": (False, False), "FP8 logits only": (True, False),
             "FP8 gradients only (shipped)": (False, True), "FP8 both (first form)": (True, True)}  # fmt: skip
    print(f"{args.tokens} tokens x {args.width} -> {args.vocab}; error = |got - fp32| / |fp32|\n")
    print("| weight std | fp32 loss a token | form | loss a token | d/dx error | d/dw error |")
    print("|---|---|---|---|---|---|")
    for std in (0.02, 0.2, 0.3):
        x = torch.randn(args.tokens, args.width, generator=g)
        x = x / x.pow(2).mean(1, keepdim=True).sqrt()
        w = torch.randn(args.vocab, args.width, generator=g) * std
        t = torch.multinomial((x @ w.t()).softmax(-1), 1, generator=g).squeeze(1)
        exact = fused_ce._linear_ce(x, w, t)
        for name, (fl, fg) in forms.items():
            got = linear_ce(x, w, t, fl, fg)
            err = [float((got[i].float() - exact[i]).norm() / exact[i].norm()) for i in (1, 2)]
            print(f"| {std} | {float(exact[0]) / len(t):.4f} | {name} | {float(got[0]) / len(t):.4f} "
                  f"| {err[0]:.4f} | {err[1]:.4f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
