"""Does the GPU wait for data? A small GPT whose step takes a few milliseconds, trained
with batches from: (a) synthetic ids made on the device, (b) our loader in pack mode,
(c) our loader in bucket mode, (d) a torch DataLoader over the same shards (4 workers,
pinned), (e) nanoGPT-style np.memmap random windows (pinned, non-blocking copy).

Timing is on the GPU timeline with CUDA events: an event after each optimizer step and one
just before each forward. The gap between the previous step's end and this step's start is
time the GPU had nothing to do because the host had not yet handed it the batch: the data
wait. The host never synchronises inside the timed loop, so a fast loader keeps the GPU
queue full and its gaps are ~0.

    python benchmarks/stall_gpu.py [--steps 300] [--layers 6] [--d-model 512] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import bar_chart, machine_line, markdown_table, save_chart  # noqa: E402
from benchmarks.loader import ShardWindows, flat_tokens  # noqa: E402
from pytrain import _loader  # noqa: E402
from pytrain.data import DeviceFeed, TokenLoader  # noqa: E402
from pytrain.model.gpt import GPT, ModelConfig  # noqa: E402

VOCAB = 50257


def synthetic(batch, seq, device):
    while True:
        x = torch.randint(VOCAB, (batch, seq + 1), device=device)
        yield x[:, :-1], x[:, 1:], None


def ours(path, batch, seq, device, mode):
    kw = dict(mode=mode, seq_len=seq, batch_size=batch, threads=4, slots=8, frames_per_block=4)
    if mode == "bucket":
        kw.update(bucket_lengths=(256, 512, 1024), token_budget=batch * seq)
    # The loader releases each slot once its copy has landed (waiting for the oldest
    # copy when the host runs all slots but one ahead).
    for db in DeviceFeed(TokenLoader(path, **kw), device):
        yield db.input_ids, db.targets, db


def memmap(data, batch, seq, device):
    rng = np.random.default_rng(0)
    while True:
        ix = rng.integers(0, len(data) - seq - 1, batch)
        x = torch.stack(
            [torch.from_numpy(data[i : i + seq + 1].astype(np.int64)) for i in ix]
        ).pin_memory()
        x = x.to(device, non_blocking=True)
        yield x[:, :-1], x[:, 1:], None


def dataloader(path, batch, seq, device):
    dl = torch.utils.data.DataLoader(
        ShardWindows(path, seq), batch_size=batch, num_workers=4, pin_memory=True
    )
    while True:
        for x in dl:
            x = x.to(device, non_blocking=True)
            yield x[:, :-1], x[:, 1:], None


def run(name, batches, model, opt, steps, warmup):
    starts, ends, tokens = [], [], 0
    prev_end = torch.cuda.Event(enable_timing=True)
    prev_end.record()
    t0 = time.perf_counter()
    for i in range(steps + warmup):
        x, y, _ = next(batches)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten().long())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        if i >= warmup:
            starts.append((prev_end, start))
            ends.append((prev_end, end))
            tokens += x.numel()
        prev_end = end
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    waits = [a.elapsed_time(b) for a, b in starts]
    step_ms = [a.elapsed_time(b) for a, b in ends]
    total = sum(step_ms)
    return {
        "name": name,
        "step_ms": statistics.median(step_ms),
        "tokens_per_s": tokens / (total / 1e3),
        "wait_share": sum(waits) / total,
        "wall_s": wall,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--docs", type=int, default=100_000)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-stall")
    p.add_argument(
        "--plot", type=Path, default=None, help="write the step-time breakdown here (PNG)"
    )
    args = p.parse_args()
    print(machine_line(), flush=True)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    path = args.work / f"synthetic-{args.docs}"
    if not (path / "manifest.json").exists():
        _loader.write_synthetic(str(path), args.docs, mu=6.0, sigma=1.0, vocab=VOCAB, seed=0)
    data = flat_tokens(path, args.work / f"synthetic-{args.docs}.bin")
    cfg = ModelConfig(
        vocab_size=VOCAB,
        n_layer=args.layers,
        n_head=args.d_model // 64,
        d_model=args.d_model,
        mlp="gelu",
        attention="causal",
        max_seq_len=args.seq,
    )
    sources = {
        "synthetic on device": lambda: synthetic(args.batch, args.seq, device),
        "ours pack": lambda: ours(path, args.batch, args.seq, device, "pack"),
        "ours bucket (3 shapes)": lambda: ours(path, args.batch, args.seq, device, "bucket"),
        "DataLoader, 4 workers, pinned": lambda: dataloader(path, args.batch, args.seq, device),
        "np.memmap windows, pinned": lambda: memmap(data, args.batch, args.seq, device),
    }
    results = []
    for name, make in sources.items():
        torch.manual_seed(0)
        gpt = GPT(cfg).to(device)
        opt = torch.optim.AdamW(gpt.parameters(), lr=3e-4, fused=True)
        model = torch.compile(gpt)
        results.append(run(name, make(), model, opt, args.steps, args.warmup))
        print(results[-1], flush=True)
    base = results[0]
    print(
        f"\nmodel: {args.layers} layers, d_model {args.d_model}, batch {args.batch} x {args.seq}, bf16, compiled"
    )
    rows = [[r["name"], f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}", f"{r['wait_share']:.2%}"]
            for r in results]  # fmt: skip
    headers = ["data source", "step ms (median)", "tokens/s", "vs synthetic",
               "GPU data wait (share of step)"]  # fmt: skip
    print(markdown_table(headers, rows))
    if args.plot:
        title = f"{args.layers} layers, d {args.d_model}, {args.batch} x {args.seq}, {torch.cuda.get_device_name()}"
        plot_breakdown(results, args.plot, title)
    return 0


def plot_breakdown(results: list[dict], path: Path, title: str) -> None:
    """Stacked bars: GPU busy and GPU waiting for data per step (ms), per data source."""
    names = [r["name"] for r in results][::-1]
    step = [r["step_ms"] for r in results][::-1]
    wait = [r["step_ms"] * r["wait_share"] for r in results][::-1]
    busy = [s - w for s, w in zip(step, wait, strict=True)]
    fig, ax = bar_chart(len(names))
    ax.barh(names, busy, label="GPU busy", color="tab:blue")
    ax.barh(names, wait, left=busy, label="GPU waiting for data", color="tab:red")
    for i, (s, w) in enumerate(zip(step, wait, strict=True)):
        ax.text(s, i, f" {s:.2f} ms ({w / s:.2%} wait)", va="center", fontsize=8)
    ax.set_xlabel("step time (ms, median; CUDA events)")
    ax.set_xlim(0, max(step) * 1.35)
    ax.legend(loc="lower right", fontsize=8)
    save_chart(fig, ax, title, path)


if __name__ == "__main__":
    sys.exit(main())
