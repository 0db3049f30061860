"""What the global order and mixtures cost the loader, side by side in one run.

Every rank walks the whole global stream (it plans every block and copies only its own
rows), so a rank's loader CPU grows with the world size. This measures rank 0's loader at
world sizes 1, 8 and 64 (simulated in one process: rank 0 of W delivers every W-th global
batch), and a 3-source mixture next to one dataset, on synthetic GPT-2-like data
(log-normal document lengths, Zipf ids, uint16, zstd level 3):

    python benchmarks/loader_scaling.py [--docs 60000] [--seq 1024] [--batch 12] [--seconds 5]

Per configuration: tokens delivered to this rank per second of loader-thread CPU (threads
named ptl-*, from /proc), and the loader cores one GPU needs at 0.5 M tokens/s (the 124M
preset on an H100)."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_row, markdown_table  # noqa: E402
from pytrain import _loader  # noqa: E402
from pytrain.data import TokenLoader  # noqa: E402
from pytrain.train.metrics import loader_cpu_seconds  # noqa: E402

GPU_TOKENS_PER_S = 0.5e6


def measure(source, seconds: float, weights=None, **kw) -> tuple[float, float, dict]:
    """(tokens delivered per loader-CPU second, per wall second) over `seconds` of taking
    batches as fast as the loader gives them."""
    with TokenLoader(source, weights=weights, threads=1, pin_memory=False, **kw) as loader:
        for _, b in zip(range(3), loader, strict=False):  # threads started, blocks in flight
            b.release()
        cpu0, t0, tokens = loader_cpu_seconds(), time.perf_counter(), 0
        for b in loader:
            tokens += b.tokens.numel()
            b.release()
            if time.perf_counter() - t0 > seconds:
                break
        cpu = (loader_cpu_seconds() or 0.0) - (cpu0 or 0.0)
        wall = time.perf_counter() - t0
        by_source = loader.stats()["tokens_by_source"]
    return tokens / max(cpu, 1e-9), tokens / wall, by_source


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--docs", type=int, default=60_000, help="documents per source")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seconds", type=float, default=5.0, help="per configuration")
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args()
    print(machine_line(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    paths = {}
    for i, name in enumerate(["web", "code", "math"]):
        paths[name] = work / name
        if not (paths[name] / "manifest.json").exists():
            _loader.write_synthetic(
                str(paths[name]), args.docs, mu=6.0, sigma=1.0, vocab=50257, seed=i
            )
    kw = dict(seq_len=args.seq, batch_size=args.batch)
    print(
        f"rank 0's loader, 1 thread, batches of {args.batch}x{args.seq + 1}, {args.seconds:.0f} s each"
    )
    headers = ["configuration", "tokens/s per loader core", "tokens/s (wall)",
               "loader cores per GPU at 0.5 M tok/s"]  # fmt: skip
    print(markdown_table(headers, []))
    rows = [
        (f"one dataset, world {w}", paths["web"], None, dict(rank=0, world_size=w))
        for w in (1, 8, 64)
    ]
    rows.append(
        (
            "3-source mixture (0.6/0.3/0.1), world 1",
            paths,
            {"web": 0.6, "code": 0.3, "math": 0.1},
            {},
        )
    )
    rows.append(
        (
            "3-source mixture, world 8",
            paths,
            {"web": 0.6, "code": 0.3, "math": 0.1},
            dict(rank=0, world_size=8),
        )
    )
    shares: list[str] = []
    for label, source, weights, extra in rows:
        per_core, per_wall, by_source = measure(source, args.seconds, weights, **kw, **extra)
        cells = [label, f"{per_core / 1e6:.1f} M", f"{per_wall / 1e6:.1f} M",
                 f"{GPU_TOKENS_PER_S / per_core:.3f}"]  # fmt: skip
        print(markdown_row(cells), flush=True)
        if weights:
            total = sum(by_source.values())
            shares.append(
                f"{label}: "
                + ", ".join(
                    f"{n} {by_source[n] / total:.4f} (weight {w}, off by {abs(by_source[n] / total - w):.4f})"
                    for n, w in weights.items()
                )
            )
    for line in shares:
        print(f"delivered shares of tokens: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
