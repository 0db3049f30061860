"""Sampling speed with the KV cache against recomputing the prefix for every token, side
by side in one run, on the CPU (or --device): greedy, from one prompt token, the same
tokens either way (checked).

    python benchmarks/sample.py [--tokens 256] [--config configs/gpt2-124m.toml]

Without --config: the CPU default model (4 layers, d_model 256). Weights are random: speed
does not depend on them."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line  # noqa: E402
from pytrain.config import apply_toml, parse_args  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--config", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args()
    print(machine_line(), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pytrain.model.gpt import GPT

    cfg = parse_args([])
    if args.config:
        apply_toml(cfg, args.config)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, args.tokens + 1)
    torch.manual_seed(0)
    gpt = GPT(cfg.model).to(args.device).eval()
    ids = torch.zeros(1, 1, dtype=torch.long, device=args.device)
    print(f"model: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, {gpt.num_params() / 1e6:.1f}M "
          f"parameters; {args.tokens} tokens greedy on {args.device}")  # fmt: skip
    out = {}
    for cache in (True, False):
        gpt.generate(ids, 8, temperature=0, use_cache=cache)  # warm-up
        t0 = time.perf_counter()
        out[cache] = gpt.generate(ids, args.tokens, temperature=0, use_cache=cache)
        dt = time.perf_counter() - t0
        print(
            f"  {'KV cache' if cache else 'no cache'}: {args.tokens / dt:8.1f} tokens/s ({dt:.2f} s)"
        )
    assert torch.equal(out[True], out[False]), "the cache changed the tokens"
    return 0


if __name__ == "__main__":
    sys.exit(main())
