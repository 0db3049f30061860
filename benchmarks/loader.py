"""Loader throughput per CPU core, delivered as (batch, seq_len+1) tensors in pinned memory
(plain memory where there is no CUDA), side by side in one run:

  - ours: TokenLoader, pack mode (best-fit), 1 and 2 threads, over frames written at zstd
    level 3 (pack-shards' default) and -1 (literals stored raw: faster decoding);
  - nanoGPT-style np.memmap random windows (torch.stack + pin_memory, as nanoGPT's train.py);
  - torch.utils.data.DataLoader over the same shards (zstandard decode in workers,
    num_workers=2, pin_memory where CUDA exists).

Per core = tokens / CPU seconds of the process and its children (getrusage), so a loader
that keeps two cores busy counts both.

    python benchmarks/loader.py [--docs 100000] [--seq 2048] [--batch 16] [--batches 2000]
                                   [--dataset PATH_TO_A_REAL_UINT16_DATASET]

Disk size of both datasets is printed too.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import bar_chart, machine_line, markdown_table, save_chart  # noqa: E402
from pytrain import _loader  # noqa: E402
from pytrain.data import TokenLoader  # noqa: E402


def cpu_seconds() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def measure(name: str, make_iter, n_batches: int, tokens_per_batch: int) -> dict:
    t_first = time.perf_counter()
    c0 = cpu_seconds()
    it = make_iter()
    next(it)
    first = time.perf_counter() - t_first
    t0, c1 = time.perf_counter(), cpu_seconds()
    for _ in range(n_batches):
        next(it)
    wall = time.perf_counter() - t0
    del it  # DataLoader workers exit here, so their CPU time is counted below
    cpu = cpu_seconds() - c1
    total = cpu_seconds() - c0
    return {
        "name": name,
        "tokens_per_s": n_batches * tokens_per_batch / wall,
        "per_core": n_batches * tokens_per_batch / max(cpu, 1e-9),
        "first_batch_s": first,
        "cpu_s": total,
    }


def ours(path: Path, seq: int, batch: int, threads: int, pin: bool):
    def gen():
        loader = TokenLoader(
            path,
            seq_len=seq,
            batch_size=batch,
            threads=threads,
            slots=4,
            frames_per_block=4,
            pin_memory=pin,
        )
        for b in loader:
            b.release()
            yield b

    return gen


def flat_tokens(path: Path, out: Path) -> np.memmap:
    if not out.exists():
        ds = _loader.Dataset(str(path))
        with open(out, "wb") as f:
            for fr in range(ds.n_frames):
                f.write(ds.read_frame(fr)[0])
    return np.memmap(out, dtype=np.uint16, mode="r")


def recompress(src: Path, dst: Path, level: int) -> None:
    """The documents of `src` written again with frames at zstd `level`."""
    from pytrain.data.documents import read_all_documents
    from pytrain.data.shards import PackOptions, document_batches, write_dataset
    from pytrain.data.tokenizer import TokenizerInfo

    m = json.loads((src / "manifest.json").read_text())
    info = TokenizerInfo.from_manifest(m["tokenizer"])
    batches = document_batches(read_all_documents(src))
    write_dataset(batches, dst, info, m["dtype"], PackOptions(zstd_level=level))


def memmap_windows(data: np.memmap, seq: int, batch: int, pin: bool):
    def gen():
        rng = np.random.default_rng(0)
        while True:
            ix = rng.integers(0, len(data) - seq - 1, batch)
            x = torch.stack([torch.from_numpy(data[i : i + seq + 1].astype(np.int64)) for i in ix])
            yield x.pin_memory() if pin else x

    return gen


class ShardWindows(torch.utils.data.IterableDataset):
    """What a hand-written loader over the same shards does: decode frames with
    zstandard in worker processes and cut the token stream into windows."""

    def __init__(self, path: Path, seq: int):
        self.path, self.seq = str(path), seq

    def __iter__(self):
        ds = _loader.Dataset(self.path)
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        dctx = zstandard.ZstdDecompressor()
        buf = np.zeros(0, dtype=np.int64)
        files: dict[str, bytes] = {}
        while True:  # epoch after epoch, as a training loader does
            for fr in range(wid, ds.n_frames, nw):
                shard, off, length, _ = ds.frame_location(fr)
                if shard not in files:
                    files[shard] = Path(self.path, shard).read_bytes()
                toks = np.frombuffer(
                    dctx.decompress(files[shard][off : off + length]), dtype="<u2"
                ).astype(np.int64)
                buf = np.concatenate([buf, toks])
                while len(buf) >= self.seq + 1:
                    yield torch.from_numpy(buf[: self.seq + 1].copy())
                    buf = buf[self.seq + 1 :]


def dataloader(path: Path, seq: int, batch: int, pin: bool):
    def gen():
        dl = torch.utils.data.DataLoader(
            ShardWindows(path, seq), batch_size=batch, num_workers=2, pin_memory=pin
        )
        yield from dl

    return gen


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--docs", type=int, default=100_000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--batches",
        type=int,
        default=2000,
        help="timed batches (a few epochs' worth of frames, so buffers are warm)",
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="a uint16 pack-shards dataset (real text) to use instead of the synthetic one; "
        "it is re-encoded at zstd 3 and -1",
    )
    p.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-loader"
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="write a bar chart of tokens/s per core here (PNG)"
    )
    args = p.parse_args()
    print(machine_line(), flush=True)
    pin = torch.cuda.is_available()
    paths = {}
    name = f"real-{args.dataset.name}" if args.dataset else f"synthetic-{args.docs}"
    for level in (3, -1):  # pack-shards' default, and raw literals (fast decoding)
        paths[level] = args.work / f"{name}-zstd{level}"
        if (paths[level] / "manifest.json").exists():
            continue
        if args.dataset:
            recompress(args.dataset, paths[level], level)
        else:
            _loader.write_synthetic(
                str(paths[level]), args.docs, mu=6.0, sigma=1.0, vocab=50257, seed=0, level=level
            )
    path = paths[3]
    data = flat_tokens(path, args.work / f"{name}.bin")
    tpb = args.batch * (args.seq + 1)
    runs = {
        "ours pack, zstd 3 (1 thread)": ours(path, args.seq, args.batch, 1, pin),
        "ours pack, zstd 3 (2 threads)": ours(path, args.seq, args.batch, 2, pin),
        "ours pack, zstd -1 (1 thread)": ours(paths[-1], args.seq, args.batch, 1, pin),
        "ours pack, zstd -1 (2 threads)": ours(paths[-1], args.seq, args.batch, 2, pin),
        "np.memmap windows (nanoGPT)": memmap_windows(data, args.seq, args.batch, pin),
        "DataLoader over shards (2 workers)": dataloader(path, args.seq, args.batch, pin),
    }
    results: dict[str, list[dict]] = {k: [] for k in runs}
    for _ in range(args.repeats):
        for name, make in runs.items():
            results[name].append(measure(name, make, args.batches, tpb))
    import os

    print(
        f"\n{len(data):,} tokens; batch {args.batch} x {args.seq + 1}; pinned {pin}; {args.repeats} repeats (min / median)"
    )
    best_baseline, rows = 0.0, []
    for name, rs in results.items():
        pc = sorted(r["per_core"] for r in rs)
        ts = sorted(r["tokens_per_s"] for r in rs)
        fb = sorted(r["first_batch_s"] for r in rs)
        if not name.startswith("ours"):
            best_baseline = max(best_baseline, pc[len(pc) // 2])
        rows.append([name, f"{ts[0] / 1e6:.1f} / {ts[len(ts) // 2] / 1e6:.1f}",
                     f"{pc[0] / 1e6:.1f} / {pc[len(pc) // 2] / 1e6:.1f}", f"{fb[len(fb) // 2]:.3f}"])  # fmt: skip
    headers = ["loader", "M tokens/s", "M tokens/s per core", "first batch s"]
    print(markdown_table(headers, rows))
    ours_pc = max(
        sorted(r["per_core"] for r in results[k])[len(results[k]) // 2]
        for k in results
        if k.startswith("ours")
    )
    print(f"ours per core / best baseline per core: {ours_pc / best_baseline:.1f}x")
    for level, p in paths.items():
        mb = sum(f.stat().st_size for f in p.glob("*.tks")) / 1e6
        print(
            f"zstd {level}: {mb:.1f} MB on disk, uint16 tokens/disk {2 * len(data) / 1e6 / mb:.2f}x"
        )
    if args.plot:
        medians = {
            k: sorted(r["per_core"] for r in rs)[len(rs) // 2] / 1e6 for k, rs in results.items()
        }
        title = f"tokens/s per core into {'pinned' if pin else 'plain'} memory, {os.cpu_count()} cores, batch {args.batch} x {args.seq + 1}"
        plot_per_core(medians, "M tokens/s per CPU core (median)", title, args.plot)
    return 0


def plot_per_core(values: dict[str, float], xlabel: str, title: str, path: Path) -> None:
    fig, ax = bar_chart(len(values))
    names = list(values)[::-1]
    bars = ax.barh(
        names,
        [values[n] for n in names],
        color=["tab:blue" if n.startswith("ours") else "tab:gray" for n in names],
    )
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_xlabel(xlabel)
    save_chart(fig, ax, title, path)


if __name__ == "__main__":
    sys.exit(main())
