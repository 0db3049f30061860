"""The output layer and its cross-entropy alone, on one GPU, at one micro-batch of a preset:
torch's compiled linear + cross_entropy (the usual path) against the fused op
(pytrain/model/fused_ce.py), compiled as the trainer compiles it with the model, in bf16
and in FP8 (`--model.float8_head`), each at several CHUNK_BYTES (the most logits one pass
of the op holds).

    python benchmarks/loss_head.py                      # the 8B: 8,192 tokens x 4,096 -> 128,256
    python benchmarks/loss_head.py --tokens 16384 --dim 2048

Prints, for a forward and backward in bf16: the device time (CUDA events, median of
--steps after a warm-up); the peak of allocated memory above the inputs (the gradients
included), over the whole and over the forward (in the trainer, every block's activations
are held while this op runs); what the op holds for the backward; and the error of the two
gradients and of the loss against the same computation in fp32 (relative L2 norm of the
difference)."""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.harness import machine_line, markdown_table  # noqa: E402
from pytrain.model import fused_ce  # noqa: E402

GIB = 2**30


def torch_loss(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")


class Result(NamedTuple):
    ms: float
    peak: float
    peak_fwd: float
    held: float
    loss: torch.Tensor
    gx: torch.Tensor
    gw: torch.Tensor


def measure(loss_fn, x, w, t, steps: int) -> Result:
    """Device ms of forward + backward (median); GiB above the inputs at the peak, at the
    forward's peak and held between the forward and the backward; the last step's loss and
    gradients."""
    times = []
    for i in range(steps + 3):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = loss_fn(x, w, t)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        peak_fwd = torch.cuda.max_memory_allocated() - base
        (loss / t.numel()).backward()
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if i >= 3:
            times.append(start.elapsed_time(end))
    assert x.grad is not None and w.grad is not None
    return Result(statistics.median(times), peak / GIB, peak_fwd / GIB, held / GIB,
                  loss.detach().float(), x.grad.float(), w.grad.float())  # fmt: skip


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="rows: tokens a micro-batch")
    ap.add_argument("--dim", type=int, default=4096, help="the model's width")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunks-mib", default="0,1024,512,256",
                    help="CHUNK_BYTES to run, MiB (0: one pass, whatever the size)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/loss_head.py needs a CUDA GPU")
    n, c, v = args.tokens, args.dim, args.vocab
    print(f"{machine_line()}\n{n} tokens x {c} -> {v}: the logits are "
          f"{n * v * 2 / GIB:.2f} GiB in bf16")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(n, c, device="cuda", generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(v, c, device="cuda", generator=g) * c**-0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[:7] = fused_ce.IGNORE_INDEX  # as documents' padding would

    # The reference: the same math in fp32 from the same bf16 inputs.
    xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss_r = F.cross_entropy(xr @ wr.t(), t, reduction="sum")
    (loss_r / n).backward()
    ref = {"loss": loss_r.detach(), "gx": xr.grad, "gw": wr.grad}
    del xr, wr, loss_r
    torch.cuda.empty_cache()

    runs: list[tuple[str, Callable[..., torch.Tensor]]] = [
        ("torch: compiled linear + cross_entropy", torch.compile(torch_loss))
    ]
    shipped = fused_ce.CHUNK_BYTES
    for fp8 in (False, True):
        for mib in (int(m) for m in args.chunks_mib.split(",")):
            label = "one pass" if mib == 0 else f"chunks of {mib} MiB"
            if mib * 2**20 == shipped:
                label += " (as shipped)"
            name = f"fused {'FP8' if fp8 else 'bf16'}, {label}"

            def fn(x, w, t, fp8=fp8, mib=mib):
                fused_ce.CHUNK_BYTES = mib * 2**20 if mib else 2**62
                return fused_ce.linear_cross_entropy(x, w, t, fp8=fp8)

            runs.append((name, torch.compile(fn)))
    rows = []
    for name, fn in runs:
        r = measure(fn, x, w, t, args.steps)
        fused_ce.CHUNK_BYTES = shipped
        rows.append([name, f"{r.ms:.2f}", f"{r.peak:.2f}", f"{r.peak_fwd:.2f}", f"{r.held:.2f}",
                     f"{rel(r.gw, ref['gw']):.2e}", f"{rel(r.gx, ref['gx']):.2e}",
                     f"{rel(r.loss, ref['loss']):.1e}"])  # fmt: skip
        print(*rows[-1], sep="  |  ", flush=True)
        del r
        torch.cuda.empty_cache()
    print()
    print(markdown_table(["op", "ms fwd+bwd", "peak GiB above inputs", "forward's peak",
                          "held for backward",
                          "d(weight) error", "d(input) error", "loss error"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
