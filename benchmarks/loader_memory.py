"""Loader memory against dataset size: synthetic datasets of 1M, 10M (and 100M) short
documents; for each, the process's anonymous memory (heap: what the loader allocates) and
file-backed resident memory (mapped shard pages) after opening the dataset and after 200
batches, plus the size of the mapped indexes.

    python benchmarks/loader_memory.py [--docs 1000000,10000000] [--seq 1024] [--batch 8]

Each size runs in a fresh process so the figures do not mix.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table  # noqa: E402

CHILD = r"""
import json, sys
from pathlib import Path
def status():
    out = {}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('RssAnon', 'RssFile', 'VmRSS'):
            out[k] = int(v.split()[0]) / 1024
    return out
path, seq, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import torch  # noqa: F401  (imported first so its memory is in the baseline)
from pytrain.data import TokenLoader
base = status()
loader = TokenLoader(path, seq_len=seq, batch_size=batch, threads=2, slots=4)
opened = status()
for _ in range(200):
    next(loader).release()
after = status()
print(json.dumps({'base': base, 'opened': opened, 'after': after, 'docs': loader.dataset.n_docs, 'tokens': loader.dataset.n_tokens}))
"""


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--docs", default="1000000,10000000")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-memory"
    )
    args = p.parse_args()
    print(machine_line(), flush=True)
    from pytrain import _loader

    rows = []
    for n in (int(x) for x in args.docs.split(",")):
        path = args.work / f"docs-{n}"
        if not (path / "manifest.json").exists():
            _loader.write_synthetic(
                str(path), n, mu=3.0, sigma=0.8, vocab=50257, docs_per_shard=5_000_000, seed=0
            )
        index_mb = n * 4 / 2**20
        disk_mb = sum(f.stat().st_size for f in path.glob("*.tks")) / 2**20
        r = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(args.seq), str(args.batch)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            print(r.stderr[-2000:])
            return 1
        m = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append((n, m, index_mb, disk_mb))
        print(n, m, flush=True)
    cells = []
    for n, m, index_mb, disk_mb in rows:
        b = m["base"]["RssAnon"]
        cells.append([f"{n:,}", f"{m['tokens']:,}", f"{disk_mb:,.0f}", f"{index_mb:,.0f}",
                      f"{m['opened']['RssAnon'] - b:,.1f}", f"{m['after']['RssAnon'] - b:,.1f}",
                      f"{m['after']['RssFile'] - m['base']['RssFile']:,.1f}"])  # fmt: skip
    headers = ["documents", "tokens", "shards on disk MiB", "doc-length index MiB",
               "heap after open MiB", "heap after 200 batches MiB",
               "mapped resident after 200 batches MiB"]  # fmt: skip
    print("\n" + markdown_table(headers, cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
