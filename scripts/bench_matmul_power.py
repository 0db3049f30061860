"""One linear layer's three matmuls on the GPU, sustained, with the power and clock they run
at: is a training step's matmul rate set by the power cap, by the operands' values, by
memory in use, or by the layout cuBLAS gets?

    python scripts/bench_matmul_power.py [--rows 16384] [--d-in 2048] [--d-out 16384] [--seconds 5]

Shape by default: the 1B preset's gate/up matmul over one 8 x 2048 micro-batch. Sections:
1. the forward (x @ W.t()) into one output buffer, then with outputs or inputs spread
   round-robin over 8-48 GiB (address translation);
2. the forward (into a row-major and into a column-major output), dx = g @ W and
   dW = g.t() @ x, each sustained for --seconds (the layouts a step may run), with
   nvidia-smi's power, SM clock and clock-limit reasons at the end, and the kernel cuBLAS ran;
3. the forward on operands of training's magnitudes (random, weights at init, 1e-5
   gradients, zeros): under a power cap the values set the power drawn, and so the clock.
BENCHMARKS.md (issue 33, "Eighth session") has the figures."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_ce_gpu import time_ms  # noqa: E402


def smi() -> str:
    # nvidia-smi numbers GPUs as the host does: CUDA_VISIBLE_DEVICES names the host's index.
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    query = "--query-gpu=power.draw,clocks.sm,clocks_throttle_reasons.active"
    out = subprocess.run(
        ["nvidia-smi", "-i", gpu, query, "--format=csv,noheader"], capture_output=True, text=True
    )
    return out.stdout.strip()


def sustained(fn: Callable[[], object], flop: float, seconds: float) -> list[int]:
    """TFLOP/s of batches of 100 calls, for `seconds`: the rate as the clock settles."""
    t_end, rates = time.time() + seconds, []
    while time.time() < t_end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(100):
            fn()
        e.record()
        e.synchronize()
        rates.append(round(100 * flop / (s.elapsed_time(e) * 1e-3) / 1e12))
    return rates


def kernel_times(fn: Callable[[], object], reps: int = 3) -> dict[str, float]:
    """Microseconds of each device kernel over `reps` profiled calls of `fn`. The kernels'
    own time, not CUDA events around a call: those would also time the host launching it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.self_device_time_total for e in prof.key_averages()}
    return {k: us for k, us in times.items() if us > 0}


def kernel_of(fn: Callable[[], object]) -> str:
    """The device kernel that took most of three calls: cuBLAS picks it by shape, layout,
    alignment and workspace, so a step's profile (its matmul table names the kernels too)
    shows whether the step ran the same one."""
    times = kernel_times(fn)
    return max(times, key=times.__getitem__) if times else "-"


def cycling(bufs: list[torch.Tensor], call: Callable[[torch.Tensor], object]) -> Callable[[], None]:
    """A call that uses the next buffer of `bufs` each time: memory not touched lately."""
    i = [0]

    def fn() -> None:
        call(bufs[i[0] % len(bufs)])
        i[0] += 1

    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--d-in", type=int, default=2048)
    p.add_argument("--d-out", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument(
        "--skip-memory", action="store_true", help="leave out section 1's 48 GiB round-robin"
    )
    args = p.parse_args()
    M, K, N = args.rows, args.d_in, args.d_out
    flop = 2.0 * M * K * N
    bf: dict = {"device": "cuda", "dtype": torch.bfloat16}
    x, W, g = torch.randn(M, K, **bf), torch.randn(N, K, **bf), torch.randn(M, N, **bf)
    y, dx, dW = torch.empty(M, N, **bf), torch.empty(M, K, **bf), torch.empty(N, K, **bf)
    print(f"{torch.cuda.get_device_name()}, {M} x {K} -> {N}, bf16", flush=True)

    print(
        "forward, one output buffer:",
        round(flop / time_ms(lambda: torch.mm(x, W.t(), out=y)) / 1e9),
        "TFLOP/s",
    )
    for gib in () if args.skip_memory else (8, 24, 48):
        outs = [torch.empty(M, N, **bf) for _ in range(max(1, int(gib * 2**30 / y.nbytes)))]
        rate = round(flop / time_ms(cycling(outs, lambda o: torch.mm(x, W.t(), out=o))) / 1e9)
        print(f"forward, outputs round-robin over {gib} GiB: {rate} TFLOP/s")
        outs.clear()
        ins = [torch.randn(M, K, **bf) for _ in range(max(1, int(gib * 2**30 / x.nbytes)))]
        rate = round(flop / time_ms(cycling(ins, lambda a: torch.mm(a, W.t(), out=y))) / 1e9)
        print(f"forward, inputs round-robin over {gib} GiB: {rate} TFLOP/s", flush=True)
        ins.clear()
        torch.cuda.empty_cache()

    yT = torch.empty(N, M, **bf)
    layouts = {
        "forward y = x @ W.t()": lambda: torch.mm(x, W.t(), out=y),
        "forward, y column-major: y.t() = W @ x.t()": lambda: torch.mm(W, x.t(), out=yT),
        "backward dx = g @ W": lambda: torch.mm(g, W, out=dx),
        "backward dW = g.t() @ x": lambda: torch.mm(g.t(), x, out=dW),
    }
    for name, fn in layouts.items():
        r = sustained(fn, flop, args.seconds)
        print(
            f"{name}: TFLOP/s {r[:3]} ... {r[-3:]}; smi at end: {smi()}; kernel {kernel_of(fn)}",
            flush=True,
        )

    cases = {
        "random x random": (x, W),
        "activations x weights at init (0.02)": (x, W * 0.02),
        "1e-5 gradients x weights": (x * 1e-5, W * 0.02),
        "zeros": (torch.zeros_like(x), torch.zeros_like(W)),
    }
    for name, (a, b) in cases.items():
        r = sustained(lambda: torch.mm(a, b.t(), out=y), flop, args.seconds)  # noqa: B023 (run before the next case)
        print(f"forward, {name}: TFLOP/s {r[:3]} ... {r[-3:]}; smi at end: {smi()}", flush=True)


if __name__ == "__main__":
    main()
