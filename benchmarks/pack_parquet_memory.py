"""Peak memory of pack-shards on a parquet file of several GB, FineWeb-style: many row
groups, a `text` column among metadata columns, snappy pages.

    python benchmarks/pack_parquet_memory.py [--gb 2] [--tokenizer byte]

The file is made once from real text (random slices of Python sources, so pages do not
compress away) and kept in --work. pack-shards then runs as a user runs it, in a child
process whose peak RSS (wait4) is printed with the file's size and row-group layout."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, python_sources  # noqa: E402

ROWS_PER_GROUP = 20_000


def make_file(path: Path, gb: float) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = "\n".join(t for _, t in python_sources(64_000_000))
    rng = np.random.default_rng(0)
    schema = pa.schema([("id", pa.string()), ("text", pa.string()), ("url", pa.string()),
                        ("language", pa.string()), ("language_score", pa.float64()),
                        ("token_count", pa.int64())])  # fmt: skip
    tmp = path.with_suffix(".tmp")
    row = 0
    with pq.ParquetWriter(tmp, schema, compression="snappy") as w:
        while not tmp.exists() or tmp.stat().st_size < gb * 1e9:
            lens = rng.exponential(4000, ROWS_PER_GROUP).astype(int) + 50
            starts = rng.integers(0, len(source) - lens.max(), ROWS_PER_GROUP)
            texts = [source[s : s + n] for s, n in zip(starts, lens, strict=True)]
            ids = [f"<urn:doc:{row + i}>" for i in range(ROWS_PER_GROUP)]
            w.write_table(
                pa.table(
                    {
                        "id": ids,
                        "text": texts,
                        "url": [f"https://example.org/{i}" for i in ids],
                        "language": ["en"] * ROWS_PER_GROUP,
                        "language_score": rng.random(ROWS_PER_GROUP),
                        "token_count": lens // 4,
                    },
                    schema=schema,
                )  # fmt: skip
            )
            row += ROWS_PER_GROUP
    tmp.rename(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument(
        "--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-parquet"
    )
    args = p.parse_args()
    print(machine_line(), flush=True)
    import pyarrow.parquet as pq

    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / f"fineweb-like-{args.gb:g}gb.parquet"
    if not path.exists():
        t0 = time.perf_counter()
        make_file(path, args.gb)
        print(f"made {path.name} in {time.perf_counter() - t0:.0f}s")
    md = pq.ParquetFile(path).metadata
    text_col = [md.schema.column(i).name for i in range(md.num_columns)].index("text")
    text_bytes = sum(
        md.row_group(g).column(text_col).total_uncompressed_size for g in range(md.num_row_groups)
    )
    print(
        f"{path.name}: {path.stat().st_size / 1e9:.2f} GB on disk, {md.num_rows:,} rows in "
        f"{md.num_row_groups} row groups, {md.num_columns} columns, text column "
        f"{text_bytes / 1e9:.2f} GB uncompressed"
    )
    cmd = [sys.executable, "-m", "pytrain.pack_shards", str(path), "-o", str(args.work / "ds"),
           "--tokenizer", args.tokenizer, "--overwrite", "--no-progress"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if status != 0:
        print(f"pack-shards failed ({status})")
        return 1
    print(
        f"pack-shards: {seconds:.0f}s, {path.stat().st_size / 1e6 / seconds:.1f} MB/s of parquet, "
        f"peak RSS {usage.ru_maxrss / 1024:.0f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
