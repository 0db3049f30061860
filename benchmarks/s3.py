"""Reading a real-text dataset from S3-compatible object storage: tokens/s of the loader from
local disk, from a local S3 server (moto, started here) behind a proxy that adds 0, 20 and
80 ms to every request, the server's own ceiling at each latency (a plain parallel ranged
download of the same objects, same number of connections, through obstore: Python's
binding of the same object_store crate), and MosaicML Streaming reading the same tokens
from the same server. All in one command.

    pip install --no-deps --target .bench-site -r benchmarks/s3.requirements.txt
    python benchmarks/s3.py --streaming-site .bench-site [--text-mb 40] [--seconds 12]

Text: the Python sources of this environment (benchmarks/harness.py; real text, as JSONL),
a byte-level BPE of 8192 trained on its first megabytes, packed by pack-shards (zstd 3).
Our loader: the GPT-2 preset's data settings (32 rows of 1024, 4 threads, 32 frames a
block; `--threads`), as rank 0 of 1. Without a cache, every frame is fetched when it is
decoded. With its local frame cache (`data.cache_dir`), empty at the start, the first
epoch fills it and later epochs read the local disk. Streaming (`mosaicml-streaming`;
`--streaming-site DIR` where it is installed apart): each document one MDS sample
(`ndarray:uint16`, zstd, 8 MB shards), a fresh local cache per run; it yields documents,
not packed rows, which favours it. Its tokens/s is one epoch's tokens over the time to
read them, cold.

Every process here shares this machine's cores: moto, the proxy and the reader compete,
so the ceiling column is the figure to read each loader against."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import s3_local  # noqa: E402

from benchmarks.harness import machine_line, markdown_table, python_sources, read_for  # noqa: E402


def corpus(work: Path, mb: int) -> Path:
    out = work / "corpus.jsonl"
    if not out.exists():
        lines = [json.dumps({"text": text}) for _, text in python_sources(mb << 20)]
        out.write_text("\n".join(lines) + "\n")
    return out


def dataset(work: Path, text: Path) -> Path:
    ds = work / "ds"
    if (ds / "manifest.json").exists():
        return ds
    from pytrain.data.tokenizer import train_bpe

    sample = [json.loads(line)["text"] for line in text.read_text().splitlines()[:2000]]
    train_bpe(sample, 8192).save(str(work / "tokenizer.json"))
    subprocess.run([sys.executable, "-m", "pytrain.pack_shards", str(text), "-o", str(ds),
                    "--tokenizer", str(work / "tokenizer.json")], check=True)  # fmt: skip
    return ds


def ours(location, threads: int, seconds: float, cache: str = "") -> float:
    """Tokens/s of the loader over `seconds` after its first batch (`cache`: its frame
    cache's directory, emptied first)."""
    from pytrain.config import LoaderConfig
    from pytrain.data import TokenLoader

    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    cfg = LoaderConfig(seq_len=1024, batch_size=32, threads=threads, slots=8,
                       frames_per_block=32, cache_dir=cache)  # fmt: skip
    loader = TokenLoader(location, cfg)
    tokens, took, _ = read_for(loader, seconds)
    loader.close()
    return tokens / took


def ceiling(endpoint: str, prefix: str, ds: Path, threads: int, seconds: float) -> float:
    """Tokens/s that plain ranged GETs of the shards move (frame-sized ranges, `threads`
    at once), at the dataset's tokens per stored byte."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(s3_local.BUCKET, prefix=prefix, endpoint=endpoint, region="us-east-1",
                    access_key_id="test", secret_access_key="test",
                    client_options={"allow_http": True})  # fmt: skip
    m = json.loads((ds / "manifest.json").read_text())
    t = m["totals"]
    chunk = max(1, t["bytes"] // max(1, t["frames"]))
    ranges = [(s["file"], o, min(o + chunk, s["bytes"]))
              for s in m["shards"] for o in range(0, s["bytes"], chunk)]  # fmt: skip
    moved, t0 = 0, time.perf_counter()

    def get(r):
        return len(obstore.get_range(store, r[0], start=r[1], end=r[2]))

    with ThreadPoolExecutor(threads) as pool:
        while time.perf_counter() - t0 < seconds:
            moved += sum(pool.map(get, ranges[: threads * 4]))
            ranges = ranges[threads * 4 :] + ranges[: threads * 4]
    return moved / (time.perf_counter() - t0) * t["tokens"] / t["bytes"]


def mds(work: Path, ds: Path) -> Path:
    """The same documents as MosaicML Streaming's MDS shards."""
    out = work / "mds"
    if (out / "index.json").exists():
        return out
    import numpy as np
    from streaming import MDSWriter

    from pytrain.data.documents import read_all_documents

    with MDSWriter(out=str(out), columns={"tokens": "ndarray:uint16"}, compression="zstd",
                   size_limit="8mb") as w:  # fmt: skip
        for doc in read_all_documents(ds):
            w.write({"tokens": np.asarray(doc, dtype=np.uint16)})
    return out


def streaming(remote: str, endpoint: str, work: Path, seconds: float) -> float:
    """Tokens/s of one cold epoch of StreamingDataset (or `seconds` of it)."""
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    os.environ["S3_ENDPOINT_URL"] = endpoint
    local = work / "streaming-cache"
    shutil.rmtree(local, ignore_errors=True)
    ds = StreamingDataset(remote=remote, local=str(local), shuffle=True, batch_size=32,
                          predownload=256, download_timeout=120)  # fmt: skip
    tokens, t0 = 0, time.perf_counter()
    for sample in ds:
        tokens += len(sample["tokens"])
        if time.perf_counter() - t0 > 4 * seconds:
            break
    return tokens / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--text-mb", type=int, default=40)
    p.add_argument("--latency-ms", default="0,20,80")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-s3")
    p.add_argument("--streaming-site", type=Path, default=None,
                   help="where mosaicml-streaming and obstore are installed (pip --target)")  # fmt: skip
    args = p.parse_args()
    print(machine_line(), flush=True)
    if args.streaming_site:
        sys.path.insert(0, str(args.streaming_site))
    args.work.mkdir(parents=True, exist_ok=True)
    ds = dataset(args.work, corpus(args.work, args.text_mb))
    t = json.loads((ds / "manifest.json").read_text())["totals"]
    print(f"dataset: {t['documents']:,} documents, {t['tokens']:,} tokens, "
          f"{t['bytes'] / 2**20:.1f} MiB in {t['frames']} frames", flush=True)  # fmt: skip
    rows = [("local disk", "-", ours(ds, args.threads, args.seconds), None)]
    print(rows[-1], flush=True)
    server = s3_local.MotoServer()
    try:
        url = s3_local.upload(server.url, ds, "real")
        mds_url = s3_local.upload(server.url, mds(args.work, ds), "mds-real")
        for ms in (float(x) for x in args.latency_ms.split(",")):
            proxy = s3_local.Proxy(server.url, delay_s=ms / 1000)
            try:
                os.environ.update(s3_local.env(proxy.url))
                top = ceiling(proxy.url, "real", ds, args.threads, args.seconds)
                rows.append(("ours, S3", f"{ms:g}", ours(url, args.threads, args.seconds), top))
                print(rows[-1], flush=True)
                cached = ours(url, args.threads, args.seconds, str(args.work / "frame-cache"))
                rows.append(("ours, S3, frame cache (empty at start)", f"{ms:g}", cached, top))
                print(rows[-1], flush=True)
                rows.append(("Streaming, S3", f"{ms:g}", streaming(mds_url, proxy.url, args.work, args.seconds), top))  # fmt: skip
                print(rows[-1], flush=True)
            finally:
                proxy.close()
    finally:
        server.close()
    local = rows[0][2]
    print(f"\n{args.threads} connections / loader threads\n")
    table = [[name, ms, f"{rate:,.0f}", f"{rate / local:.0%}", f"{top:,.0f}" if top else "-",
              f"{rate / top:.0%}" if top else "-"] for name, ms, rate, top in rows]  # fmt: skip
    headers = ["reader", "added latency (ms)", "tokens/s", "of local disk",
               "server ceiling (tokens/s)", "of the ceiling"]  # fmt: skip
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
