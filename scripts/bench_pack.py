"""pack-shards throughput next to bare `encode_batch` of the same tokenizer on the same
cores, and the compression ratio, on >= 50 MB of real text (Python sources).

    python scripts/bench_pack.py [--mb 60] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from realtext import python_sources  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=60)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-pack")
    args = p.parse_args()
    from pytrain.shards import PackOptions, pack
    from pytrain.tokenizer import train_bpe

    docs = list(python_sources(int(args.mb * 1e6)))
    mb = sum(len(t.encode()) for _, t in docs) / 1e6
    args.work.mkdir(parents=True, exist_ok=True)
    tok_path = args.work / f"bpe{args.vocab}.json"
    if not tok_path.exists():
        t0 = time.perf_counter()
        train_bpe((t for _, t in docs[: len(docs) // 8]), args.vocab).save(str(tok_path))
        print(f"trained BPE {args.vocab} in {time.perf_counter() - t0:.1f}s")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    texts = [t for _, t in docs]
    t0 = time.perf_counter()
    n_tokens = 0
    for i in range(0, len(texts), 512):
        n_tokens += sum(
            len(e.ids) for e in tok.encode_batch_fast(texts[i : i + 512], add_special_tokens=False)
        )
    bare = time.perf_counter() - t0
    out = args.work / "ds"
    t0 = time.perf_counter()
    r = pack(iter(docs), out, PackOptions(tokenizer=str(tok_path)), overwrite=True)
    packed = time.perf_counter() - t0
    disk = sum(s["bytes"] for s in r.shards)
    cores = os.cpu_count()
    print(
        f"\ninput: {len(docs):,} Python source files, {mb:.1f} MB; BPE vocab {args.vocab}; {cores} cores"
    )
    print("| stage | seconds | MB/s | M tokens/s |")
    print("|---|---|---|---|")
    print(
        f"| bare encode_batch_fast | {bare:.1f} | {mb / bare:.1f} | {n_tokens / bare / 1e6:.2f} |"
    )
    print(
        f"| pack-shards (tokenize + compress + write) | {packed:.1f} | {mb / packed:.1f} | {r.tokens / packed / 1e6:.2f} |"
    )
    print(f"pack-shards / bare encode: {bare / packed:.2f}x of the tokenizer's throughput")
    print(
        f"tokens {r.tokens:,} (+{r.documents:,} EOS); disk {disk / 1e6:.1f} MB; text/disk {mb * 1e6 / disk:.2f}x; uint16 tokens/disk {r.tokens * 2 / disk:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
