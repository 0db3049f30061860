"""Our loader next to MosaicML Streaming (MDS, zstd), litdata (optimize + TokensLoader) and
Hugging Face datasets (Arrow), each written by its own writer from the same synthetic corpus
(log-normal document lengths, Zipf ids, fixed seed), each read as (batch, seq_len + 1) token
tensors. Per loader: tokens/s, tokens/s per CPU core (process + worker processes), time to the
first batch, peak RSS and size on disk. Each loader runs in its own process, twice.

The peers are benchmark-only dependencies; run this with a Python that has them (and pytrain):

    peers/venv/bin/python benchmarks/loader_peers.py [--docs 20000] [--seq 2048] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table  # noqa: E402


def corpus(path: Path, docs: int) -> list[np.ndarray]:
    from pytrain import _loader

    if not (path / "manifest.json").exists():
        _loader.write_synthetic(str(path), docs, mu=6.0, sigma=1.0, vocab=50257, seed=0)
    ds = _loader.Dataset(str(path))
    out = []
    for f in range(ds.n_frames):
        raw, lens = ds.read_frame(f)
        toks = np.frombuffer(raw, dtype="<u2")
        out.extend(np.split(toks, np.cumsum(lens)[:-1]))
    return out


def write_mds(docs, out: Path) -> None:
    from streaming import MDSWriter

    with MDSWriter(
        out=str(out), columns={"tokens": "ndarray:uint16"}, compression="zstd", size_limit=1 << 26
    ) as w:
        for d in docs:
            w.write({"tokens": d})


def _litdata_docs(d):
    import torch

    yield torch.from_numpy(d.astype(np.int64)).to(torch.int32)


def write_litdata(docs, out: Path, seq: int) -> None:
    from litdata import TokensLoader, optimize

    optimize(
        fn=_litdata_docs,
        inputs=docs,
        output_dir=str(out),
        chunk_size=(seq + 1) * 2048,
        item_loader=TokensLoader(),
        num_workers=2,
    )


def write_hf(docs, out: Path, seq: int) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"tokens": [d.tolist() for d in docs]})

    def group(batch):  # the standard "group_texts" step of HF language-model examples
        flat = [t for d in batch["tokens"] for t in d]
        n = len(flat) // (seq + 1) * (seq + 1)
        return {"tokens": [flat[i : i + seq + 1] for i in range(0, n, seq + 1)]}

    ds.map(group, batched=True, batch_size=1000).save_to_disk(str(out))


def windows(doc_iter, seq: int, batch: int):
    """Concatenates documents and yields (batch, seq + 1) int64 tensors."""
    import torch

    buf = np.zeros(0, dtype=np.int64)
    rows = []
    for d in doc_iter:
        buf = np.concatenate([buf, np.asarray(d, dtype=np.int64)])
        while len(buf) >= seq + 1:
            rows.append(buf[: seq + 1])
            buf = buf[seq + 1 :]
            if len(rows) == batch:
                yield torch.from_numpy(np.stack(rows))
                rows = []


def reader(name: str, path: Path, seq: int, batch: int):
    import torch

    if name == "ours":
        from pytrain.data import TokenLoader

        loader = TokenLoader(path, seq_len=seq, batch_size=batch, threads=1, slots=4)
        for b in loader:
            b.release()
            yield b.tokens
    elif name == "mosaicml-streaming":
        from streaming import StreamingDataset

        # In the main process: built inside DataLoader workers it hung under gVisor.
        ds = StreamingDataset(local=str(path), shuffle=False, batch_size=batch)
        yield from windows((s["tokens"] for s in ds), seq, batch)
    elif name == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

        ds = StreamingDataset(
            input_dir=str(path), item_loader=TokensLoader(block_size=seq + 1), shuffle=False
        )
        yield from StreamingDataLoader(ds, batch_size=batch, num_workers=2)
    elif name == "hf-datasets":
        import datasets

        ds = datasets.load_from_disk(str(path)).with_format("torch")
        yield from (
            b["tokens"] for b in torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=2)
        )


def cpu_seconds() -> float:
    """CPU time of this process and its (finished) worker processes."""
    return sum(
        getattr(resource.getrusage(w), f)
        for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for f in ("ru_utime", "ru_stime")
    )


def measure_child(name: str, path: Path, seq: int, batch: int, n: int) -> dict:
    t0 = time.perf_counter()
    it = reader(name, path, seq, batch)
    first = next(it)
    t_first = time.perf_counter() - t0
    assert tuple(first.shape) == (batch, seq + 1), first.shape
    c0, t1 = cpu_seconds(), time.perf_counter()
    got = 0
    for _ in range(n):
        got += next(it).numel()
    wall = time.perf_counter() - t1
    del it
    cpu = cpu_seconds() - c0
    rss = (
        max(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        )
        / 1024
    )
    return {
        "tokens_per_s": got / wall,
        "per_core": got / max(cpu, 1e-9),
        "first_batch_s": t_first,
        "peak_rss_mb": rss,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--docs", type=int, default=20_000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-peers")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(
            json.dumps(
                measure_child(
                    args.child[0], Path(args.child[1]), args.seq, args.batch, args.batches
                )
            )
        )
        return 0
    print(machine_line(), flush=True)
    ours = args.work / "ours"
    docs = corpus(ours, args.docs)
    paths = {
        "ours": ours,
        "mosaicml-streaming": args.work / "mds",
        "litdata": args.work / "litdata",
        "hf-datasets": args.work / "hf",
    }
    writers = {
        "mosaicml-streaming": lambda o: write_mds(docs, o),
        "litdata": lambda o: write_litdata(docs, o, args.seq),
        "hf-datasets": lambda o: write_hf(docs, o, args.seq),
    }
    for name, w in writers.items():
        if not paths[name].exists():
            t0 = time.perf_counter()
            w(paths[name])
            print(f"wrote {name} in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = {}
    for _ in range(args.repeats):
        for name, path in paths.items():
            r = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    name,
                    str(path),
                    "--seq",
                    str(args.seq),
                    "--batch",
                    str(args.batch),
                    "--batches",
                    str(args.batches),
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                print(f"{name} failed: {r.stderr[-1500:]}", flush=True)
                continue
            rows.setdefault(name, []).append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(name, rows[name][-1], flush=True)
    tokens = sum(len(d) for d in docs)
    print(
        f"\n{len(docs):,} documents, {tokens:,} tokens; batch {args.batch} x {args.seq + 1}; min / median of {args.repeats}"
    )
    table = []
    for name, rs in rows.items():
        med = lambda k, rs=rs: sorted(r[k] for r in rs)[len(rs) // 2]  # noqa: E731
        lo = lambda k, rs=rs: min(r[k] for r in rs)  # noqa: E731
        disk = sum(f.stat().st_size for f in paths[name].rglob("*") if f.is_file()) / 1e6
        table.append([name, f"{lo('tokens_per_s') / 1e6:.1f} / {med('tokens_per_s') / 1e6:.1f}",
                      f"{lo('per_core') / 1e6:.1f} / {med('per_core') / 1e6:.1f}",
                      f"{med('first_batch_s'):.2f}", f"{med('peak_rss_mb'):,.0f}", f"{disk:,.1f}"])  # fmt: skip
    headers = ["loader", "M tokens/s", "M tokens/s per core", "first batch s", "peak RSS MB",
               "disk MB"]  # fmt: skip
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
