"""pack-shards as a user runs it (the CLI on JSONL files of real text) next to a bare
`encode_batch_fast` of the same texts, already in memory, on the same cores; with peak RSS.

    python benchmarks/pack.py [--mb 40] [--tokenizer tokenizer.json] [--repeats 3]

The texts are Python sources (the standard library, then installed packages) written as
JSONL files of ~8 MB. Without --tokenizer a byte-level BPE of --vocab tokens is trained on
an eighth of them. Each repeat runs the two side by side in fresh processes (alternating,
so drift on a shared machine hits both); medians are printed, and the ratio of
throughputs. "bare" times only the encode calls (batches of 512 documents, ids not read);
"bare + ids" also reads every id into Python, which any consumer of the tokens must do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table, python_sources  # noqa: E402


def write_corpus(work: Path, mb: float) -> list[Path]:
    files: list[Path] = []
    out, size = None, 0
    for i, (_, text) in enumerate(python_sources(int(mb * 1e6))):
        if out is None or size > 8e6:
            if out:
                out.close()
            files.append(work / f"part-{len(files):03d}.jsonl")
            out, size = open(files[-1], "w"), 0
        line = json.dumps({"id": i, "text": text}) + "\n"
        out.write(line)
        size += len(line)
    if out:
        out.close()
    return files


def child_bare(files: list[str], tokenizer: str, with_ids: bool) -> dict:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    tok.no_truncation()
    tok.no_padding()
    texts = [json.loads(line)["text"] for f in files for line in open(f, "rb")]
    texts = [t for t in texts if t]
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), 512):
        encs = tok.encode_batch_fast(texts[i : i + 512], add_special_tokens=False)
        if with_ids:
            tokens += sum(len(e.ids) for e in encs)
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


def child_pack(files: list[str], tokenizer: str, out: str) -> dict:
    from pytrain.pack_shards import main

    t0 = time.perf_counter()
    rc = main([*files, "-o", out, "--tokenizer", tokenizer, "--overwrite", "--no-progress"])
    seconds = time.perf_counter() - t0
    m = json.loads((Path(out) / "manifest.json").read_text())
    return {
        "seconds": seconds,
        "tokens": m["totals"]["tokens"],
        "rc": rc,
        "disk": m["totals"]["bytes"],
    }


def run_child(args: list[str]) -> dict:
    """Runs this script as a child; returns its result and its peak RSS (wait4)."""
    p = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(args)], stdout=subprocess.PIPE
    )
    out = p.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"child {args[0]} failed ({status})")
    r = json.loads(out.decode().strip().splitlines()[-1])
    r["rss_mb"] = usage.ru_maxrss / 1024
    return r


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=40)
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: train a BPE)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-pack")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = json.loads(args.child)
        fn = {"bare": lambda: child_bare(rest[0], rest[1], False),
              "bare+ids": lambda: child_bare(rest[0], rest[1], True),
              "pack": lambda: child_pack(rest[0], rest[1], rest[2])}[kind]  # fmt: skip
        print(json.dumps(fn()))
        return 0
    print(machine_line(), flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / f"corpus-{args.mb:g}mb"
    if not corpus.exists():
        tmp = corpus.with_suffix(".tmp")
        tmp.mkdir(exist_ok=True)
        write_corpus(tmp, args.mb)
        tmp.rename(corpus)
    files = [str(f) for f in sorted(corpus.glob("*.jsonl"))]
    mb = sum(len(json.loads(line)["text"].encode()) for f in files for line in open(f, "rb")) / 1e6
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = str(args.work / f"bpe{args.vocab}.json")
        if not Path(tokenizer).exists():
            from pytrain.data.tokenizer import train_bpe

            texts = [json.loads(line)["text"] for line in open(files[0], "rb")]
            train_bpe(texts, args.vocab).save(tokenizer)
    results: dict[str, list[dict]] = {"bare": [], "bare+ids": [], "pack": []}
    for _ in range(args.repeats):
        results["bare"].append(run_child(["bare", files, tokenizer]))
        results["bare+ids"].append(run_child(["bare+ids", files, tokenizer]))
        results["pack"].append(run_child(["pack", files, tokenizer, str(args.work / "ds")]))
    tokens = results["pack"][0]["tokens"]
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items()}
    print(
        f"\n{len(files)} JSONL files, {mb:.1f} MB of real text (Python sources); tokenizer "
        f"{Path(tokenizer).name}; {tokens:,} tokens (with EOS); "
        f"median of {args.repeats}"
    )
    rows = []
    for k, label in (("bare", "bare `encode_batch_fast` (texts in memory)"),
                     ("bare+ids", "bare + reading every id"),
                     ("pack", "pack-shards CLI (read JSONL + tokenize + compress + write)")):  # fmt: skip
        s = med[k]
        rss = max(r["rss_mb"] for r in results[k])
        rows.append([label, f"{s:.2f}", f"{mb / s:.2f}", f"{tokens / s / 1e6:.2f}", f"{rss:.0f}",
                     f"{s / med['pack']:.3f}x"])  # fmt: skip
    headers = ["run", "seconds", "MB/s", "M tokens/s", "peak RSS MB", "pack-shards vs this"]
    print(markdown_table(headers, rows))
    print(
        "per repeat (s): "
        + "; ".join(
            f"{k} " + ", ".join(f"{r['seconds']:.2f}" for r in v) for k, v in results.items()
        )
    )
    disk = results["pack"][0]["disk"]
    print(f"disk {disk / 1e6:.1f} MB: text/disk {mb * 1e6 / disk:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
