"""Downstream scoring (pytrain.tasks) with requests packed several to a row under the
document mask, against one request a row padded to the longest of its batch (lm-evaluation-
harness's way), on the same requests and model: seconds, items a second, rows, the tokens the
forwards read (padding included), and the largest difference of a log-likelihood between
the two (they must agree). With --compile, each way again through the compiled forward the
trainer uses where it compiles (rows of a few fixed widths).

    python benchmarks/task_packing.py [--items 200] [--config configs/gpt2-124m.toml]
    python benchmarks/task_packing.py --synthetic --items 1000 --config configs/llama-350m.toml \
        --device cuda --compile

The items are HellaSwag-sized multiple choice (a context of about 80 tokens, 4 endings of
about 30), cut from Python sources with a BPE tokenizer trained on them. With --synthetic
they are random token ids instead, no tokenizer: 4 endings to a context, contexts of
--context_tokens (80) and endings of --ending_tokens (20) on average, each drawn uniformly
from half to one and a half times that; 80 and 20 are an estimate of a HellaSwag validation
item under a GPT-2-sized BPE, not a measurement (pass a real set's sizes where known).
Without --config: the embedded default's model (4 layers, d_model 256, vocabulary 4096); a
preset without a vocabulary (its dataset's) takes --vocab (50257, GPT-2's). Weights are
random: speed does not depend on them. Precision: bf16 autocast on a GPU, fp32 on the CPU,
as a run's `auto`."""

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


def synthetic_segments(n: int, context: int, ending: int, vocab: int, seed: int = 0):
    """`n` items of random token ids as scoring segments: 4 endings after each context, the
    lengths drawn uniformly from half to one and a half times `context` and `ending`."""
    from pytrain.tasks.scoring import Segment

    rng = random.Random(seed)

    def draw(mean: int) -> list[int]:
        n = rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))
        return [rng.randrange(vocab) for _ in range(n)]

    out = []
    for _ in range(n):
        ctx = draw(context)
        for _ in range(4):
            end = draw(ending)
            out.append(Segment((ctx + end)[:-1], end, False))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--config", default=None, help="a preset's model (default: the CPU default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch_rows", type=int, default=0,
                   help="rows a forward (default: the preset's data.batch_size, as --eval.tasks scores; 8 without --config)")  # fmt: skip
    p.add_argument("--row_tokens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--synthetic", action="store_true", help="random token ids, no tokenizer")
    p.add_argument("--context_tokens", type=int, default=80)
    p.add_argument("--ending_tokens", type=int, default=20)
    p.add_argument("--vocab", type=int, default=50257, help="where the preset has none")
    p.add_argument("--compile", action="store_true", help="also through the compiled forward")
    args = p.parse_args()
    print(machine_line(), flush=True)
    import json
    import tempfile
    import time

    from pytrain.config import apply_toml, parse_args
    from pytrain.model.gpt import GPT
    from pytrain.tasks import scoring
    from pytrain.train.compile_policy import compile_model, ensure_graph_room

    cfg = parse_args([])
    if args.config:
        apply_toml(cfg, args.config)
    cfg.model.vocab_size = cfg.model.vocab_size or args.vocab
    batch_rows = args.batch_rows or (cfg.data.batch_size if args.config else 8)
    window = cfg.model.max_seq_len
    if args.synthetic:
        vocab = cfg.model.vocab_size
        segments = synthetic_segments(args.items, args.context_tokens, args.ending_tokens, vocab)
    else:
        from pytrain.data.tokenizer import train_bpe
        from pytrain.tasks.items import read_tasks
        from pytrain.tasks.suite import TaskSuite, tokenizer_encode

        items, texts = hellaswag_sized(args.items)
        with tempfile.TemporaryDirectory() as d:
            tok = train_bpe(texts[:400], vocab_size=min(cfg.model.vocab_size, 8192))
            tok.save(f"{d}/tokenizer.json")
            Path(f"{d}/hs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
            segments = TaskSuite(read_tasks([f"{d}/hs.jsonl"]),
                                 tokenizer_encode(f"{d}/tokenizer.json"), 0, window).segments  # fmt: skip
    torch.manual_seed(0)
    device = torch.device(args.device)
    gpt = GPT(cfg.model).to(device).eval()
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)  # noqa: E731
    lengths = [len(s.inputs) for s in segments]
    print(f"model: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, vocabulary "
          f"{cfg.model.vocab_size}, {gpt.num_params() / 1e6:.1f}M parameters; {args.items} items, "
          f"{len(lengths)} requests of {min(lengths)}-{max(lengths)} tokens (mean "
          f"{sum(lengths) / len(lengths):.0f}); {batch_rows} rows a forward on {args.device}, "
          f"{'bf16' if bf16 else 'fp32'}", flush=True)  # fmt: skip
    ways = [("one request a row", False, 0)] + [(f"packed, rows of {n}", True, n)
                                                for n in args.row_tokens]  # fmt: skip
    compiled = compile_model(scoring.Continuations(gpt), "default") if args.compile else None
    ensure_graph_room(8 * len(ways))  # a graph a width and picked count, a few a way
    runs = [(name, packed, n, None) for name, packed, n in ways]
    runs += (
        [(name, packed, n, compiled) for name, packed, n in ways] if compiled is not None else []
    )
    rows, base = [], None
    for name, packed, n, forward in runs:
        row_len = max(max(lengths), min(n or 1, window))  # as TaskSuite.score sets it

        kw = dict(row_len=row_len, batch_rows=batch_rows, device=device, packed=packed,
                  autocast=autocast, forward=forward, fixed_shapes=forward is not None)  # fmt: skip
        scoring.score(gpt, segments, **kw)  # allocator and threads warm; compiled: every graph
        sync(device)
        t0 = time.perf_counter()
        r = scoring.score(gpt, segments, **kw)
        sync(device)
        dt = time.perf_counter() - t0
        base = base or (dt, r.loglik)
        diff = max(abs(a - b) for a, b in zip(r.loglik, base[1], strict=True))
        rows.append([name, "yes" if forward is not None else "no", f"{dt:.2f}",
                     f"{args.items / dt:.1f}", r.rows, f"{r.tokens:,}",
                     f"{sum(lengths) / r.tokens:.0%}", f"{base[0] / dt:.2f}x", f"{diff:.1e}"])  # fmt: skip
        print(rows[-1], flush=True)
    print(markdown_table(["scoring", "compiled", "s", "items/s", "rows", "tokens read",
                          "of them requests", "speed-up", "max |loglik diff|"], rows))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
