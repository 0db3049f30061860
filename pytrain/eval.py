"""`python -m pytrain.eval CHECKPOINT [--data PATH] [--batches N]`: validation loss,
perplexity and bits per byte of a trained model on any packed dataset (or a mixture's
sets, NAME=PATH each), cut into batches as the run's training configuration cuts them:
the first N batches in stored order, the numbers the trainer logs for the same data.
Without --data: the validation sets the run itself evaluated on, with its eval_batches.

Bits per byte = loss / ln 2 x (the dataset's tokens / the text bytes pack-shards read),
so models with different tokenizers compare on the same text.

`--tasks FILE_OR_FOLDER...`: downstream tasks instead (pytrain.tasks, docs/DOWNSTREAM.md):
acc, acc_norm and acc_bytes of each, and their CORE-style mean; with --data as well, both."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def evaluate(model: str, data: list[str] | None, batches: int | None, device: str = "cpu") -> dict:
    """`data` None: the run's own validation sets; `batches` None: its eval_batches."""
    import torch

    from pytrain.config import ConfigError, DataConfig, dataset_dir, location_name
    from pytrain.data.batch import DeviceFeed
    from pytrain.data.loader import TokenLoader
    from pytrain.data.shards import read_manifest
    from pytrain.model.load import load

    m = load(model, device)
    base = m.config["data"] if m.config else {}
    d = DataConfig.from_saved(base)
    if data is None:  # the validation sets the run evaluated on
        data = [f"{name}={path}" for name, path in d.val_sources().items()]  # named as logged
        if not data:
            raise ConfigError(
                f"{m.source} has no validation set saved with it; give one with --data PATH"
            )
    if batches is None:
        batches = int(m.config.get("eval_batches", 20)) if m.config else 20
    sets: dict[str, Path | str] = {}
    for item in data:
        label, _, where = item.partition("=") if "=" in item else ("", "", item)
        sets[label or location_name(where)] = dataset_dir(where, "--data")
    out: dict = {"model": str(m.source), "step": m.step, "sets": {}, "notes": []}
    if m.tokenizer is not None:  # a set packed with another tokenizer: a loss of other tokens
        from pytrain.train.initial_weights import tokenizer_notes

        out["notes"] = tokenizer_notes(m.tokenizer, tuple(str(p) for p in sets.values()))
    total_loss = total_tokens = 0.0
    dtype = torch.bfloat16 if device != "cpu" and torch.cuda.is_bf16_supported() else None
    for name, path in sets.items():
        loss_sum = n = 0.0
        loader = TokenLoader(path, d, shuffle=False, num_epochs=1, threads=1, slots=2,
                             rank=0, world_size=1)  # fmt: skip
        with DeviceFeed(loader, device) as feed, torch.no_grad():
            for i, b in enumerate(feed):
                if i >= batches:
                    break
                with torch.autocast(
                    torch.device(device).type, dtype=dtype, enabled=dtype is not None
                ):
                    s = m.gpt.loss_sum(b.input_ids, b.targets, b.position_ids, b.loss_mask,
                                       m.gpt.make_mask(b.doc_ids, "sdpa_mask"))  # fmt: skip
                loss_sum += float(s)
                n += b.loss_tokens
        if not n:
            raise ConfigError(f"--data {path}: no batches")
        manifest = read_manifest(path)["totals"]
        loss = loss_sum / n
        row = {"loss": loss, "perplexity": math.exp(loss), "tokens": int(n)}
        if manifest.get("input_bytes"):
            row["bits_per_byte"] = loss / math.log(2) * manifest["tokens"] / manifest["input_bytes"]
        out["sets"][name] = row
        total_loss, total_tokens = total_loss + loss_sum, total_tokens + n
    out["loss"] = total_loss / total_tokens
    return out


def prefix_token(m) -> int | None:
    """The token an empty context is, as lm-evaluation-harness takes it: the tokenizer's
    begin-of-text token where it has one (an export's config.json, a run's dataset
    manifest), else its end-of-text token."""
    from pytrain.data.shards import read_manifest
    from pytrain.model.load import dataset_of

    if m.config is None:  # a Hugging Face directory
        bos = json.loads((m.source / "config.json").read_text()).get("bos_token_id")
    else:
        data = dataset_of(m.config["data"])
        bos = read_manifest(data).get("tokenizer", {}).get("bos_id") if data is not None else None
    return bos if bos is not None else m.eos_id


def score_tasks(model: str, tasks: list[str], device: str = "cpu", limit: int = 0,
                batch_rows: int = 8, row_tokens: int = 512, packed: bool = False):  # fmt: skip
    """The downstream tasks `tasks` names (files or folders), scored with `model`: a
    pytrain.tasks.suite.Results."""
    import torch

    from pytrain.model.load import load
    from pytrain.tasks.items import read_tasks
    from pytrain.tasks.suite import TaskSuite

    read = read_tasks(tasks)  # before the model: a bad file is said at once
    m = load(model, device)
    suite = TaskSuite.for_model(read, m.tokenizer, prefix_token(m), m.gpt.cfg.max_seq_len, limit)
    dtype = torch.bfloat16 if device != "cpu" and torch.cuda.is_bf16_supported() else None
    kind = torch.device(device).type
    return suite.score(m.gpt, torch.device(device), batch_rows=batch_rows, row_tokens=row_tokens,
                       packed=packed,
                       autocast=lambda: torch.autocast(kind, dtype=dtype, enabled=dtype is not None))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pytrain.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("model", help="run directory, ckpt-*.pt, or an exported Hugging Face directory")
    p.add_argument(
        "--data",
        nargs="+",
        default=None,
        help="dataset directory, or NAME=PATH per set (default: the run's own validation sets)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="batches per set (default: the run's eval_batches, else 20)",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="downstream task files (.jsonl, .parquet) or folders of them: their accuracies "
        "instead of the loss (with --data too: both)",
    )
    p.add_argument(
        "--limit", type=int, default=0, help="--tasks: the first N items of each task (0: all)"
    )
    p.add_argument("--batch_rows", type=int, default=8, help="--tasks: rows a forward")
    p.add_argument(
        "--pack",
        choices=("auto", "on", "off"),
        default="auto",
        help="--tasks: several requests a row under the document mask (on), or one a row, "
        "longest first, padded to the longest of its batch (off); auto: packed on a GPU (4x "
        "the items/s at llama-350m on an H100), one a row on a CPU, where it is faster "
        "(docs/DOWNSTREAM.md)",
    )
    p.add_argument(
        "--row_tokens",
        type=int,
        default=512,
        help="--tasks: tokens a row (requests packed into it; the longest request's where that "
        "is more)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    from pytrain.config import missing_model

    if missing := missing_model(args.model):  # at once: torch takes seconds to load
        print(f"pytrain.eval: error: {missing}", file=sys.stderr)
        return 2
    if args.limit < 0 or args.batch_rows < 1 or args.row_tokens < 1:
        print("pytrain.eval: error: --limit is 0 or more, --batch_rows and --row_tokens 1 or more",
              file=sys.stderr)  # fmt: skip
        return 2
    import torch

    from pytrain._loader import LoaderError
    from pytrain.config import ConfigError

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    try:
        packed = args.pack == "on" or (args.pack == "auto" and device.startswith("cuda"))
        tasks = (score_tasks(args.model, args.tasks, device, args.limit, args.batch_rows,
                             args.row_tokens, packed) if args.tasks else None)  # fmt: skip
        r = (
            evaluate(args.model, args.data, args.batches, device)
            if args.data or not tasks
            else None
        )
    except (ConfigError, LoaderError) as e:
        print(f"pytrain.eval: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        both = {"tasks": tasks.to_json(), **({"loss": r} if r else {})} if tasks else r
        print(json.dumps(both, indent=2))
        return 0
    if tasks:
        print("\n".join(tasks.lines()))
    if r is None:
        return 0
    for note in r["notes"]:
        print(note, file=sys.stderr)
    for name, s in r["sets"].items():
        bpb = f"  bits/byte {s['bits_per_byte']:.4f}" if "bits_per_byte" in s else ""
        print(
            f"{name}: loss {s['loss']:.4f}  perplexity {s['perplexity']:.2f}{bpb}  ({s['tokens']:,} tokens)"
        )
    if len(r["sets"]) > 1:
        print(f"all: loss {r['loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
