"""Packing quality on a real corpus: share of padding and share of documents cut, for
best-fit packing next to plain concatenate-and-split, over one epoch at seq_len 2048.
A document longer than a row must be cut by any packer; the table shows those apart.

    python benchmarks/packing_quality.py DATASET [--seq 2048] [--batch 8] [--frames-per-block 4]
(DATASET: e.g. ds/ in the --work directory of benchmarks/pack.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_row, markdown_table  # noqa: E402
from pytrain.data import TokenLoader  # noqa: E402
from pytrain.data.documents import doc_lengths  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("dataset", type=Path)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--frames-per-block", type=int, default=4)
    args = p.parse_args()
    print(machine_line(), flush=True)
    lens = doc_lengths(args.dataset)
    must_cut = int((lens > args.seq + 1).sum())
    print(
        f"{args.dataset}: {len(lens):,} documents, {int(lens.sum()):,} tokens, median length {int(np.median(lens))}; {must_cut:,} longer than a row of {args.seq + 1}"
    )
    headers = ["strategy", "padding share", "documents cut", "cut beyond those longer than a row"]
    print(markdown_table(headers, []))
    for strategy in ("best_fit", "concat"):
        loader = TokenLoader(
            args.dataset,
            seq_len=args.seq,
            batch_size=args.batch,
            strategy=strategy,
            num_epochs=1,
            frames_per_block=args.frames_per_block,
            threads=2,
        )
        for b in loader:
            b.release()
        s = loader.stats()
        pad = s["pad_tokens"] / (s["pad_tokens"] + s["doc_tokens"])
        cut = s["documents_cut"] / s["documents_packed"]
        cells = [strategy, f"{pad:.3%}", f"{cut:.2%} ({s['documents_cut']:,})",
                 f"{s['documents_cut'] - must_cut:,}"]  # fmt: skip
        print(markdown_row(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
