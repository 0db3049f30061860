"""`pack-shards`: pretokenize raw text into a token-shard dataset, and check one.

    pack-shards INPUT... -o OUT [--tokenizer tokenizer.json|byte] [options]
    pack-shards import FILE.bin... -o OUT [--vocab-size N | --tokenizer tokenizer.json]
    pack-shards verify DATASET
    pack-shards inspect DATASET [--plot lengths.png]
    pack-shards INPUT... -o OUT --task I --tasks N   (one of N tasks, on any machine)
    pack-shards merge OUT                            (then one dataset of the N parts)
    pack-shards eval-tasks DATASET INPUT -o OUT.jsonl  (a benchmark as a task file: pytrain.tasks)

Every token of every document is kept: a tokenizer.json's truncation and padding are
switched off for packing, its post-processor template adds nothing
(add_special_tokens=False), and the only tokens added are the end-of-document token
(--eos, on by default; --eos-token to choose it) and, with --bos, a begin-of-document token.

Exit codes: 0 success; 1 bad input (file:line in the message); 2 bad arguments;
3 the output already exists; 4 verification failed."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from pytrain.config import REMOTE_SCHEMES, location
from pytrain.data.inputs import BAD_INPUT_POLICIES

EXIT_INPUT, EXIT_USAGE, EXIT_EXISTS, EXIT_CORRUPT = 1, 2, 3, 4


def _pack_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pack-shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="files, directories or globs (.txt .jsonl .jsonl.gz .jsonl.zst .parquet)",
    )
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="path to a Hugging Face tokenizer.json, or 'byte' (built in)",
    )
    p.add_argument(
        "--text-field", default="text", help="JSON field / parquet column holding the text"
    )
    p.add_argument(
        "--txt-per-line",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="one document per line of a .txt file (default: one per file)",
    )
    p.add_argument(
        "--eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-text token to every document",
    )
    p.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN_OR_ID",
        help="the end-of-text token (a token string such as '</s>', or an id); default: the "
        "tokenizer's, found by name (<|endoftext|>, <|end_of_text|>, </s>, <eos>, ..., [SEP]); "
        "the choice is printed and recorded in the manifest",
    )
    p.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prepend the begin-of-text token",
    )
    p.add_argument(
        "--bos-token",
        default=None,
        metavar="TOKEN_OR_ID",
        help="the begin-of-text token (token string or id); implies --bos",
    )
    p.add_argument(
        "--on-bad-input",
        choices=BAD_INPUT_POLICIES,
        default="stop",
        help="stop: exit at the first bad document with file:line (default); skip: leave bad "
        "documents (and unreadable rests of files) out, list them in the manifest, print a summary",
    )
    p.add_argument("--batch-docs", type=int, default=512, help="documents per encode_batch call")
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count(),
        help="tokenizer threads (output does not depend on it)",
    )
    p.add_argument("--task", type=int, default=None,
                   help="pack only part I of --tasks N (0-based) into OUT/part-I-of-N/; "
                   "`pack-shards merge OUT` joins the parts (pytrain/data/parts.py)")  # fmt: skip
    p.add_argument("--tasks", type=int, default=None, help="how many tasks share the inputs")
    _add_output_args(p)
    return p


def _add_output_args(p: argparse.ArgumentParser, progress: bool = True) -> None:
    """Options of the dataset written (shared by packing and import)."""
    p.add_argument("-o", "--output", required=True, type=location,
                   help="dataset directory to create, or an s3:// URL (packed in a temporary "
                        "directory, then uploaded with the manifest last)")  # fmt: skip
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token dtype on disk"
    )
    p.add_argument(
        "--frame-mib", type=float, default=2.0, help="uncompressed MiB of tokens per zstd frame"
    )
    p.add_argument("--shard-mib", type=float, default=256.0, help="compressed MiB per shard file")
    p.add_argument(
        "--zstd-level",
        type=int,
        default=3,
        help="zstd level of the frames (up to 22); negative levels (e.g. -1) store literals raw: "
        "faster decoding (1.3x on real BPE text, 2.6x on near-random ids) for 1.25-1.4x the disk "
        "(see BENCHMARKS.md)",
    )
    p.add_argument(
        "--overwrite",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="replace an existing output directory (atomically)",
    )
    if progress:
        p.add_argument(
            "--progress",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="show a progress bar (default: when stderr is a terminal; in a log file the "
            "bar's carriage returns would share lines with the messages)",
        )


ZSTD_LEVELS = (-(1 << 17), 22)  # libzstd's ZSTD_minCLevel() and ZSTD_maxCLevel()


def _check_zstd_level(parser: argparse.ArgumentParser, level: int) -> None:
    if not ZSTD_LEVELS[0] <= level <= ZSTD_LEVELS[1]:
        parser.error(f"--zstd-level {level} is outside zstd's {ZSTD_LEVELS[0]}..{ZSTD_LEVELS[1]}")


def pack_main(argv: list[str]) -> int:
    parser = _pack_parser()
    args = parser.parse_args(argv)
    _check_zstd_level(parser, args.zstd_level)
    if args.eos_token is not None and not args.eos:
        parser.error("--eos-token names the token --no-eos leaves out; give one or the other")
    if (args.task is None) != (args.tasks is None) or (args.tasks is not None and args.tasks < 1):
        parser.error("--task I and --tasks N come together (N >= 1, 0 <= I < N)")
    remote, staging = None, None
    if isinstance(args.output, str):  # object storage: pack here, then upload
        if args.tasks is not None:
            parser.error("--task/--tasks write parts to a shared directory: pack and merge there, "
                         "then `pack-shards upload DIR s3://...`")  # fmt: skip
        if (code := _refuse_existing(args.output, args.overwrite)) is not None:
            return code
        remote = args.output
        staging = tempfile.TemporaryDirectory(prefix="pack-shards-")
        args.output = Path(staging.name) / "dataset"
    _set_workers(args.workers)
    from pytrain.data.inputs import BadInputs, InputError, ReadOptions
    from pytrain.data.parts import PartError, pack_part
    from pytrain.data.shards import DatasetExistsError, PackOptions, iter_documents, pack
    from pytrain.data.tokenizer import TokenizerError

    opts = PackOptions(
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        text_field=args.text_field,
        txt_per_line=args.txt_per_line,
        append_eos=args.eos,
        prepend_bos=args.bos or args.bos_token is not None,
        eos_token=args.eos_token,
        bos_token=args.bos_token,
        frame_mib=args.frame_mib,
        shard_mib=args.shard_mib,
        zstd_level=args.zstd_level,
        batch_docs=args.batch_docs,
        on_bad_input=args.on_bad_input,
    )
    bad = BadInputs(args.on_bad_input)
    read = ReadOptions(text_field=args.text_field, txt_per_line=args.txt_per_line)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    bar = _progress_bar() if show else None
    try:
        if args.tasks is not None:
            report = pack_part(args.inputs, args.output, args.task, args.tasks, opts, read, bad,
                               progress=bar, say=bar.write if bar else _say)  # fmt: skip
            if report is None:
                _close(bar)
                print(
                    f"task {args.task} of {args.tasks}: its part is complete already; nothing written"
                )
                return 0
        else:
            docs = iter_documents(args.inputs, read, bad)
            report = pack(
                docs, args.output, opts, overwrite=args.overwrite, progress=bar,
                say=bar.write if bar else _say, bad=bad,
            )  # fmt: skip
    except DatasetExistsError as e:
        _close(bar)
        print(f"pack-shards: {e}", file=sys.stderr)
        return EXIT_EXISTS
    except (InputError, TokenizerError, PartError, ValueError, OSError) as e:
        _close(bar)  # ends the bar's line, so the error starts a line of its own
        print(f"pack-shards: error: {e}", file=sys.stderr)
        print("pack-shards: nothing was written to the output directory", file=sys.stderr)
        return EXIT_INPUT
    _close(bar)
    if remote:
        if (code := _upload(args.output, remote)) != 0:
            return code
        args.output = remote
    mb = report.input_bytes / 1e6
    secs = max(report.seconds, 1e-9)
    comp = sum(s["bytes"] for s in report.shards)
    print(
        f"packed {report.documents:,} documents ({report.skipped_empty:,} empty skipped), "
        f"{report.tokens:,} tokens from {mb:,.1f} MB in {secs:.1f}s "
        f"({mb / secs:,.1f} MB/s, {report.tokens / secs / 1e6:,.2f} M tokens/s) into {len(report.shards)} shard(s), "
        f"{comp / 1e6:,.1f} MB on disk -> {args.output}"
    )
    if bad.count:
        print(f"pack-shards: {bad.summary()}", file=sys.stderr)
    return 0


def _refuse_existing(remote: str, overwrite: bool) -> int | None:
    """An exit code where `remote` cannot be written (a dataset there, unless `overwrite`;
    the store unreachable or refusing), with one line saying why; None to go on."""
    from pytrain import _loader

    try:
        there = _loader.read_file(remote, "manifest.json") is not None
    except _loader.LoaderError as e:
        print(f"pack-shards: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    if there and not overwrite:
        print(f"pack-shards: {remote} holds a dataset already (manifest.json); "
              "--overwrite replaces it", file=sys.stderr)  # fmt: skip
        return EXIT_EXISTS
    return None


def _upload(local: Path, remote: str) -> int:
    from pytrain import _loader

    try:
        _loader.upload_dataset(str(local), remote)
    except (_loader.LoaderError, OSError) as e:
        print(f"pack-shards: error: {e}", file=sys.stderr)
        print(f"pack-shards: {remote}: the manifest was not uploaded; readers see no dataset there",
              file=sys.stderr)  # fmt: skip
        return EXIT_INPUT
    return 0


def upload_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pack-shards upload",
        description="upload a finished dataset directory to object storage, the manifest last",
    )
    p.add_argument("dataset", type=Path)
    p.add_argument("url", help="s3://bucket/prefix")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already there")
    args = p.parse_args(argv)
    if not (args.dataset / "manifest.json").is_file():
        p.error(f"{args.dataset}: not a dataset made by pack-shards (no manifest.json in it)")
    if not args.url.startswith(REMOTE_SCHEMES):
        p.error(f"{args.url}: not an s3:// URL")
    if (code := _refuse_existing(args.url, args.overwrite)) is not None:
        return code
    if (code := _upload(args.dataset, args.url)) == 0:
        print(f"{args.dataset} -> {args.url}")
    return code


def _set_workers(workers: int) -> None:
    # Tokenizers' thread pool reads these once, at first use: set them before importing.
    os.environ["RAYON_NUM_THREADS"] = str(max(1, workers))
    os.environ["RAYON_RS_NUM_THREADS"] = str(max(1, workers))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def _close(bar) -> None:
    if bar:
        bar.close()


class _progress_bar:
    """tqdm bar over input bytes showing documents, tokens and MB/s."""

    def __init__(self):
        from tqdm import tqdm

        self.bar = tqdm(
            unit="B", unit_scale=True, desc="pack-shards", file=sys.stderr, mininterval=0.5
        )
        self.seen = 0

    def __call__(self, r) -> None:
        self.bar.update(r.input_bytes - self.seen)
        self.seen = r.input_bytes
        self.bar.set_postfix(docs=f"{r.documents:,}", tokens=f"{r.tokens:,}", refresh=False)

    def write(self, line: str) -> None:
        self.bar.write(f"pack-shards: {line}", file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def _say(line: str) -> None:
    print(f"pack-shards: {line}", file=sys.stderr)


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pack-shards verify", description="check every checksum and count of a dataset"
    )
    p.add_argument("dataset", type=location, help="a directory, or an s3:// URL")
    args = p.parse_args(argv)
    from pytrain import _loader
    from pytrain.data.shards import verify

    if isinstance(args.dataset, Path) and not (args.dataset / "manifest.json").exists():
        what = ("not a dataset made by pack-shards (no manifest.json in it)"
                if args.dataset.is_dir() else "no such directory")  # fmt: skip
        print(f"pack-shards verify: error: {args.dataset}: {what}", file=sys.stderr)
        return EXIT_INPUT
    try:
        r = verify(args.dataset)
    except (_loader.LoaderError, OSError) as e:
        print(f"pack-shards verify: FAILED: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    print(
        f"{args.dataset}: OK ({r['shards']} shards, {r['frames']} frames, {r['documents']:,} documents, {r['tokens']:,} tokens)"
    )
    return 0


def inspect_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pack-shards inspect", description="counts and document-length histogram"
    )
    p.add_argument("dataset", type=location, help="a directory, or an s3:// URL")
    p.add_argument("--plot", type=Path, default=None, help="write the histogram as a PNG here")
    args = p.parse_args(argv)
    import numpy as np

    from pytrain import _loader
    from pytrain.data.documents import doc_lengths
    from pytrain.data.shards import read_manifest

    try:
        m = read_manifest(args.dataset)
        tk, t = m["tokenizer"], m["totals"]
        lens = doc_lengths(args.dataset)
    except (_loader.LoaderError, OSError, ValueError, KeyError) as e:
        print(f"pack-shards inspect: error: {args.dataset}: not a readable dataset ({e})",
              file=sys.stderr)  # fmt: skip
        return EXIT_INPUT
    print(f"dataset     {args.dataset}")
    print(
        f"tokenizer   {tk['name']} (vocab {tk['vocab_size']}, sha256 {(tk.get('sha256') or 'none')[:12]})"
    )
    added = [
        f"{what} {tk.get(f'{key}_token')!r} (id {tk[f'{key}_id']})"
        for key, what, flag in (("eos", "end", "append_eos"), ("bos", "start", "prepend_bos"))
        if m["args"].get(flag) and tk.get(f"{key}_id") is not None
    ]
    print(f"added       {', '.join(added) or 'no tokens'} per document")
    off = tk.get("packing", {}).get("file_settings_switched_off", {})
    if off:
        print(f"switched off {', '.join(f'{k} {json.dumps(v)}' for k, v in off.items())}")
    if m.get("bad_input", {}).get("skipped"):
        print(
            f"bad input   {m['bad_input']['skipped']:,} skipped (listed in manifest.json bad_input)"
        )
    print(f"dtype       {m['dtype']}")
    print(f"shards      {len(m['shards'])}   frames {t['frames']}   bytes {t['bytes']:,}")
    print(f"documents   {t['documents']:,} ({t['skipped_empty']:,} empty skipped)")
    print(
        f"tokens      {t['tokens']:,}   compression {t['tokens'] * np.dtype(m['dtype']).itemsize / max(t['bytes'], 1):.2f}x"
    )
    print(
        f"doc length  min {lens.min()}  median {int(np.median(lens))}  mean {lens.mean():.1f}  p99 {int(np.percentile(lens, 99))}  max {lens.max()}"
    )
    edges = 2 ** np.arange(0, int(np.log2(max(lens.max(), 1))) + 2)
    counts, _ = np.histogram(lens, bins=edges)
    width = max(counts.max(), 1)
    print("length histogram (tokens per document):")
    for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True):
        print(f"  [{lo:>8}, {hi:>8})  {c:>10,}  {'#' * int(40 * c / width)}")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            print("pack-shards inspect: --plot needs matplotlib: pip install matplotlib "
                  "(or the extra: pytrain[plot])", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.hist(lens, bins=edges.tolist(), edgecolor="black")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("document length (tokens)")
        ax.set_ylabel("documents")
        ax.set_title(f"{args.dataset.name}: {t['documents']:,} documents, {t['tokens']:,} tokens")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot        {args.plot}")
    return 0


def import_main(argv: list[str]) -> int:
    from pytrain.data.pretokenized import FORMATS

    p = argparse.ArgumentParser(
        prog="pack-shards import",
        description="Convert already tokenized data, token for token, keeping document "
        "boundaries: nanoGPT .bin (raw uint16), llm.c/modded-nanogpt .bin (256-int32 header) "
        "and Megatron-LM indexed datasets (.bin + .idx). See docs/FORMAT.md.",
    )
    p.add_argument("inputs", nargs="+", type=Path, help=".bin files (read as one stream, in order)")
    p.add_argument(
        "--format", choices=FORMATS, default="auto", help="input format (default: from the header)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer.json the ids come from (copied into the dataset, sets the vocabulary)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary size when no --tokenizer is given"
    )
    p.add_argument(
        "--eot-id",
        type=int,
        default=None,
        help="the id that delimits documents (default: the llm.c header's model, or the "
        "tokenizer's end-of-text token)",
    )
    p.add_argument(
        "--split",
        choices=["auto", "after", "before"],
        default="auto",
        help="documents end with the id (after: nanoGPT) or start with it (before: llm.c); "
        "Megatron datasets carry their own boundaries",
    )
    _add_output_args(p, progress=False)
    args = p.parse_args(argv)
    _check_zstd_level(p, args.zstd_level)
    from pytrain.data.inputs import InputError
    from pytrain.data.pretokenized import import_dataset
    from pytrain.data.shards import DatasetExistsError
    from pytrain.data.tokenizer import TokenizerError

    try:
        r = import_dataset(
            args.inputs, args.output, fmt=args.format, tokenizer=args.tokenizer,
            vocab_size=args.vocab_size, eot=args.eot_id, split=args.split, dtype=args.dtype,
            frame_mib=args.frame_mib, shard_mib=args.shard_mib, zstd_level=args.zstd_level,
            overwrite=args.overwrite, say=_say,
        )  # fmt: skip
    except DatasetExistsError as e:
        print(f"pack-shards import: {e}", file=sys.stderr)
        return EXIT_EXISTS
    except (InputError, TokenizerError, ValueError, OSError) as e:
        print(f"pack-shards import: error: {e}", file=sys.stderr)
        print("pack-shards import: nothing was written to the output directory", file=sys.stderr)
        return EXIT_INPUT
    print(
        f"imported {r.documents:,} documents, {r.tokens:,} tokens into {len(r.shards)} shard(s), "
        f"{sum(s['bytes'] for s in r.shards) / 1e6:,.1f} MB on disk -> {args.output}"
    )
    return 0


def merge_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="pack-shards merge",
        description="One dataset from the parts that `--task I --tasks N` wrote into OUT (no shard is copied).",
    )
    p.add_argument("output", type=Path, help="the directory the tasks wrote their parts into")
    args = p.parse_args(argv)
    from pytrain.data.parts import PartError, merge

    try:
        m = merge(args.output)
    except (PartError, OSError, ValueError) as e:
        print(f"pack-shards: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    t = m["totals"]
    print(f"merged {m['parts']} part(s): {t['documents']:,} documents, {t['tokens']:,} tokens, "
          f"{len(m['shards'])} shard(s) -> {args.output}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # stdout's reader left early (`pack-shards inspect ds | head`)
        # Point stdout at /dev/null so that the flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a process killed by SIGPIPE, the shell's convention


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "import":
        return import_main(argv[1:])
    if argv and argv[0] == "verify":
        return verify_main(argv[1:])
    if argv and argv[0] == "inspect":
        return inspect_main(argv[1:])
    if argv and argv[0] == "merge":
        return merge_main(argv[1:])
    if argv and argv[0] == "upload":
        return upload_main(argv[1:])
    if argv and argv[0] == "eval-tasks":
        from pytrain.tasks.convert import main as eval_tasks_main

        return eval_tasks_main(argv[1:])
    return pack_main(argv)


if __name__ == "__main__":
    sys.exit(main())
