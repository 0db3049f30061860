"""Downstream scoring (pytrain.tasks) with requests packed several to a row under the
document mask, against one request a row padded to the longest of its batch (lm-evaluation-
harness's way), on the same requests and model: seconds, items a second, rows, the tokens the
forwards read (padding included), and the largest difference of a log-likelihood between
the two (they must agree).

    python benchmarks/task_packing.py [--items 200] [--config configs/gpt2-124m.toml]

The items are HellaSwag-sized multiple choice (a context of about 80 tokens, 4 endings of
about 30), cut from Python sources with a BPE tokenizer trained on them. Without --config:
the embedded default's model (4 layers, d_model 256, vocabulary 4096). Weights are random:
speed does not depend on them."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_table, python_sources  # noqa: E402


def hellaswag_sized(n: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    """`n` items of 4 choices cut from Python sources (context about 320 characters, each
    ending about 120), and the text a tokenizer is trained on."""
    texts = [t for _, t in python_sources(4_000_000)]
    rng = random.Random(seed)
    joined = "".join(texts)
    items = []
    for _ in range(n):
        at = rng.randrange(len(joined) - 2000)
        ctx = joined[at : at + rng.randint(240, 400)]
        ends = [joined[(b := rng.randrange(len(joined) - 300)) : b + rng.randint(80, 160)]
                for _ in range(4)]  # fmt: skip
        items.append({"context": ctx, "choices": [e or "x" for e in ends], "gold": 0})
    return items, texts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--config", default=None, help="a preset's model (default: the CPU default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch_rows", type=int, default=8)
    p.add_argument("--row_tokens", type=int, nargs="+", default=[256, 512, 1024])
    args = p.parse_args()
    print(machine_line(), flush=True)
    import json
    import tempfile
    import time

    from pytrain.config import apply_toml, parse_args
    from pytrain.data.tokenizer import train_bpe
    from pytrain.model.gpt import GPT
    from pytrain.tasks.items import read_tasks
    from pytrain.tasks.suite import TaskSuite, tokenizer_encode

    cfg = parse_args([])
    if args.config:
        apply_toml(cfg, args.config)
    items, texts = hellaswag_sized(args.items)
    with tempfile.TemporaryDirectory() as d:
        tok = train_bpe(texts[:400], vocab_size=min(cfg.model.vocab_size, 8192))
        tok.save(f"{d}/tokenizer.json")
        Path(f"{d}/hs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
        suite = TaskSuite(read_tasks([f"{d}/hs.jsonl"]), tokenizer_encode(f"{d}/tokenizer.json"),
                          0, cfg.model.max_seq_len)  # fmt: skip
    torch.manual_seed(0)
    device = torch.device(args.device)
    gpt = GPT(cfg.model).to(device).eval()
    lengths = [len(s.inputs) for s in suite.segments]
    print(f"model: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, "
          f"{gpt.num_params() / 1e6:.1f}M parameters; {args.items} items, {len(lengths)} requests "
          f"of {min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f}); "
          f"{args.batch_rows} rows a forward on {args.device}", flush=True)  # fmt: skip
    runs = [("one request a row", False, 0)] + [(f"packed, rows of {n}", True, n)
                                                for n in args.row_tokens]  # fmt: skip
    rows, base = [], None
    for name, packed, n in runs:
        suite.score(gpt, device, batch_rows=args.batch_rows, row_tokens=n or 1, packed=packed)
        t0 = time.perf_counter()  # the second run: allocator and threads warm
        r = suite.score(gpt, device, batch_rows=args.batch_rows, row_tokens=n or 1, packed=packed)
        dt = time.perf_counter() - t0
        ll = r.tasks[0].loglik
        base = base or (dt, ll)
        diff = max(abs(a - b) for a, b in zip(ll, base[1], strict=True))
        rows.append([name, f"{dt:.2f}", f"{args.items / dt:.1f}", r.rows, f"{r.tokens:,}",
                     f"{sum(lengths) / r.tokens:.0%}", f"{base[0] / dt:.2f}x", f"{diff:.1e}"])  # fmt: skip
        print(rows[-1], flush=True)
    print(markdown_table(["scoring", "s", "items/s", "rows", "tokens read", "of them requests",
                          "speed-up", "max |loglik diff|"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
