"""`python -m pytrain.sample CHECKPOINT_OR_HF_DIR --prompt "..."`: text from a trained
model (a run directory, a ckpt-*.pt file, or a directory from pytrain.export), with a KV
cache (the prompt is run once; each new token attends to cached keys and values), on the
GPU if there is one.

    python -m pytrain.sample runs/default --prompt "def fib(n):" --max_new_tokens 80
    python -m pytrain.sample runs/default --prompt "import os" --temperature 0   # greedy"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pytrain.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("model", help="run directory, ckpt-*.pt, or an exported Hugging Face directory")
    p.add_argument(
        "--prompt", default="", help="text to continue (empty: starts after an end-of-text token)"
    )
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--no-cache",
        dest="cache",
        action="store_false",
        help="recompute the prefix for every token",
    )
    args = p.parse_args(argv)
    from pytrain.config import missing_model

    if missing := missing_model(args.model):  # at once: torch takes seconds to load
        print(f"pytrain.sample: error: {missing}", file=sys.stderr)
        return 2
    import torch
    from tokenizers import Tokenizer

    from pytrain._loader import LoaderError
    from pytrain.config import ConfigError
    from pytrain.model.load import load

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    try:
        m = load(args.model, device)
    except (ConfigError, LoaderError) as e:
        print(f"pytrain.sample: error: {e}", file=sys.stderr)
        return 2
    if m.tokenizer is None:
        print(
            f"pytrain.sample: error: no tokenizer.json for {args.model} (its dataset moved?)",
            file=sys.stderr,
        )
        return 2
    tok = Tokenizer.from_file(str(m.tokenizer))
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        if m.eos_id is None:
            print(
                "pytrain.sample: error: give a --prompt (the model has no end-of-text token to start from)",
                file=sys.stderr,
            )
            return 2
        ids = [m.eos_id]
    context = m.gpt.cfg.max_seq_len  # the KV cache holds the prompt and the new tokens
    if args.cache and len(ids) + args.max_new_tokens > context:
        if len(ids) >= context:
            print(f"pytrain.sample: error: the prompt is {len(ids)} tokens and the model's "
                  f"context {context}: shorten it, or --no-cache (a window of the last "
                  f"{context} tokens)", file=sys.stderr)  # fmt: skip
            return 2
        print(f"note: at most {context - len(ids)} new tokens: the model's context is "
              f"{context} tokens and the prompt {len(ids)}", file=sys.stderr)  # fmt: skip
    g = torch.Generator(device=device).manual_seed(args.seed)
    dtype = torch.bfloat16 if device != "cpu" and torch.cuda.is_bf16_supported() else None
    for i in range(args.num_samples):
        x = torch.tensor([ids], device=device)
        t0 = time.perf_counter()
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            out = m.gpt.generate(x, args.max_new_tokens, args.temperature, args.top_k, stop=m.eos_id,
                                 use_cache=args.cache, generator=g)  # fmt: skip
        new = out[0, len(ids) :].tolist()
        dt = time.perf_counter() - t0
        if i:
            print("-" * 40)
        print(tok.decode(ids + [t for t in new if t != m.eos_id], skip_special_tokens=False))
        print(
            f"[{len(new)} tokens in {dt:.2f}s, {len(new) / max(dt, 1e-9):.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
