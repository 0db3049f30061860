"""The optimizer's step alone, on one GPU, over one rank's shards of a model under FSDP2:
torch's fused AdamW (fp32 moments) against CompactAdamW (bf16 moments) as shipped, in chunks
of 16 and with a compiled call a tensor (CHUNK: host time against compile time), as the
trainer calls them
(pytrain.optim.adamw.fused_step: clipping scale and skip on the device).

    python benchmarks/optimizer.py                       # the 8B preset's shards of 4 GPUs
    python benchmarks/optimizer.py --preset configs/llama-1b.toml --shards 2

Each parameter is a plain fp32 tensor of its shard's length (FSDP2 splits dim 0 over the
ranks), with a random gradient. Prints the step's device time (CUDA events around it: its
kernels, and the device's waits for the host to launch them) and its host time (the launches: where the host is slower, the device
waits for it), medians over --steps after a warm-up, and the bytes a step moves at HBM
speed, against which both are compared; and the seconds the optimizer took to be made (its
compiling, cold unless TORCHINDUCTOR_CACHE_DIR holds it)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.harness import machine_line, markdown_table  # noqa: E402
from pytrain.optim import compact_adamw  # noqa: E402
from pytrain.optim.adamw import fused_step  # noqa: E402
from pytrain.optim.compact_adamw import CompactAdamW  # noqa: E402


def shard_sizes(preset: Path, shards: int) -> list[int]:
    """Each parameter's shard length on the first rank, in the model's order: the preset's
    model at Llama 3's vocabulary, built on the meta device (shapes only), each parameter's
    dim 0 split over `shards` as FSDP2 splits it (the first ranks take the extra rows)."""
    from pytrain.config import parse_args
    from pytrain.model.gpt import GPT

    cfg = parse_args(["--config", str(preset), "--model.vocab_size", "128256"]).model
    with torch.device("meta"):
        model = GPT(cfg)
    return [-(-p.shape[0] // shards) * (p.numel() // p.shape[0]) for p in model.parameters()]


def time_steps(opt, params, steps: int) -> tuple[float, float]:
    """(device ms, host ms) a step, medians."""
    norm = torch.ones((), device="cuda")
    skip = torch.zeros((), dtype=torch.bool, device="cuda")
    dev, host = [], []
    for i in range(steps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        fused_step(opt, skip, norm, 1.0)
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 3:
            dev.append(start.elapsed_time(end))
            host.append((t1 - t0) * 1e3)
    return statistics.median(dev), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", type=Path, default=ROOT / "configs/llama-8b.toml")
    ap.add_argument("--shards", type=int, default=4, help="ranks the parameters are split over")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print each optimizer's top kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/optimizer.py needs a CUDA GPU")
    sizes = shard_sizes(args.preset, args.shards)
    n = sum(sizes)
    print(f"{machine_line()}\n{args.preset.name} over {args.shards}: {len(sizes)} tensors, "
          f"{n / 1e9:.2f}B parameters a rank")  # fmt: skip

    def compact(ps):
        return CompactAdamW(ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            state_dtype=torch.bfloat16)  # fmt: skip

    # (name, bytes a parameter: p, g, m, v read and p, m, v written; CHUNK; the optimizer)
    runs = [
        ("torch fused AdamW, fp32 moments", 28, None, lambda ps: torch.optim.AdamW(
            ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)),
        (f"CompactAdamW, bf16 moments (chunks of {compact_adamw.CHUNK})", 20, None, compact),
        ("CompactAdamW, bf16 moments, chunks of 16", 20, 16, compact),
        ("CompactAdamW, bf16 moments, a call a tensor (chunks of 1)", 20, 1, compact),
    ]  # fmt: skip
    rows = []
    shipped_chunk = compact_adamw.CHUNK
    for name, nbytes, chunk, make in runs:
        compact_adamw.CHUNK = chunk or compact_adamw.CHUNK
        torch._dynamo.reset()
        params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        t0 = time.perf_counter()
        opt = make(params)  # CompactAdamW compiles its update here
        made_s = time.perf_counter() - t0
        if isinstance(opt, torch.optim.AdamW):
            for p in params:  # the state, made before timing as CompactAdamW makes it
                opt.state[p] = {"step": torch.zeros((), device="cuda"),
                                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
        dev_ms, host_ms = time_steps(opt, params, args.steps)
        if args.profile:
            with torch.profiler.profile() as prof:
                time_steps(opt, params, 1)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
        floor = n * nbytes / 3.35e12 * 1e3  # H100 SXM's HBM3
        rows.append([name, f"{dev_ms:.1f}", f"{host_ms:.1f}", f"{floor:.1f}", f"{made_s:.1f}",
                     f"{torch.cuda.max_memory_allocated() / 2**30:.1f}"])  # fmt: skip
        print(name, rows[-1][1:], flush=True)
        del params, opt
        compact_adamw.CHUNK = shipped_chunk
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print()
    print(markdown_table(["optimizer", "device ms a step", "host ms a step",
                          "HBM floor ms (3.35 TB/s)", "made in s", "peak GiB"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
