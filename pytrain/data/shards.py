"""Packing documents into a token-shard dataset (see docs/FORMAT.md), and checking one.

The Rust `ShardWriter` compresses and indexes; this module reads inputs, tokenizes in
batches with `encode_batch_fast` (parallel in Rust, GIL released), rotates shards, writes the
manifest, and makes the whole dataset appear atomically. Reading, encoding and writing
overlap (see `encoded_batches`), so packing runs at the tokenizer's own speed."""

from __future__ import annotations

import functools
import json
import os
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pytrain import _loader
from pytrain.data.inputs import BadInputs, ReadOptions, expand, read_documents
from pytrain.data.tokenizer import (
    EOS_CANDIDATES,
    TokenizerError,
    TokenizerInfo,
    describe,
    for_packing,
    load_tokenizer,
)

MANIFEST = "manifest.json"
ENCODES_IN_FLIGHT = max(2, min(8, (os.cpu_count() or 2) // 2))
"""Tokenizer calls running at once (each parallel over its documents in the tokenizer's
thread pool), so other batches keep the cores busy while one call finishes its longest
document. Measured on 16 cores (BENCHMARKS.md): 2 in flight ran at 0.78x of a bare
`encode_batch_fast`, 8 at 0.91-1.14x. Memory grows with it: about 8 x batch_mib of text
and its encodings."""


class DatasetExistsError(FileExistsError):
    """The output directory already exists and --overwrite was not given."""


@dataclass
class PackOptions:
    """The arguments that decide the bytes of a dataset (recorded in the manifest)."""

    tokenizer: str = "byte"
    dtype: str = "auto"
    text_field: str = "text"
    txt_per_line: bool = False
    append_eos: bool = True
    prepend_bos: bool = False
    eos_token: str | None = None
    """Token string or id ending every document (None: the tokenizer's, found by name)."""
    bos_token: str | None = None
    frame_mib: float = 2.0
    shard_mib: float = 256.0
    zstd_level: int = 3
    batch_docs: int = 512
    batch_mib: float = 2.0
    """A batch to the tokenizer closes at batch_docs documents or this much text."""
    on_bad_input: str = "stop"


@dataclass
class PackReport:
    documents: int = 0
    tokens: int = 0
    skipped_empty: int = 0
    input_bytes: int = 0
    shards: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    bad: BadInputs | None = None
    part: dict | None = None
    """For a part written by one of several tasks (pytrain.data.parts): which one and what
    it read; recorded in its manifest."""


def choose_dtype(info: TokenizerInfo, requested: str) -> str:
    fits16 = info.vocab_size <= 1 << 16
    if requested == "auto":
        return "uint16" if fits16 else "uint32"
    if requested == "uint16" and not fits16:
        raise TokenizerError(
            f"tokenizer {info.name} has {info.vocab_size} tokens, which does not fit uint16; use --dtype uint32"
        )
    if requested not in ("uint16", "uint32"):
        raise ValueError(f"--dtype {requested!r} is not auto, uint16 or uint32")
    return requested


def iter_documents(
    inputs: list[str], opts: ReadOptions, bad: BadInputs | None = None
) -> Iterator[tuple[str, str]]:
    """Every document of every input, in order. With `bad` in skip mode, a bad document
    (or the unreadable rest of a file) is recorded there and left out."""
    for path in expand(inputs):
        yield from read_documents(path, opts, bad)


def _batches(
    docs: Iterable[tuple[str, str]], n: int, max_chars: int
) -> Iterator[list[tuple[str, str]]]:
    batch: list[tuple[str, str]] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d[1])
        if len(batch) == n or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def in_thread(items: Iterable, depth: int) -> Iterator:
    """`items`, produced on a background thread up to `depth` ahead (for reading and
    parsing while the tokenizer runs). Its exceptions reach the consumer; closing the
    consumer stops the thread."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(msg) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run():
        try:
            for x in items:
                if not put(("item", x)):
                    return
            put(("done", None))
        except BaseException as e:  # handed to the consumer, raised there
            put(("error", e))

    t = threading.Thread(target=run, name="pack-read", daemon=True)
    t.start()
    try:
        while True:
            kind, x = q.get()
            if kind == "done":
                return
            if kind == "error":
                raise x
            yield x
    finally:
        stop.set()
        t.join()


@dataclass
class TokenBatch:
    """Documents of one batch as token ids, back to back (uint32), and their lengths."""

    ids: np.ndarray
    lengths: np.ndarray
    skipped_empty: int = 0
    input_bytes: int = 0
    where: str = ""
    """Where the batch came from ("file:line..file:line"), for error messages."""

    @classmethod
    def of(cls, docs: list[np.ndarray], **fields) -> TokenBatch:
        """The batch of `docs` (arrays of token ids), back to back."""
        ids = np.concatenate(docs).astype(np.uint32, copy=False) if docs else np.zeros(0, np.uint32)
        lengths = np.fromiter((len(d) for d in docs), dtype=np.uint32, count=len(docs))
        return cls(ids=ids, lengths=lengths, **fields)


def document_batches(docs: list[np.ndarray], per: int = 512) -> Iterator[TokenBatch]:
    """Already tokenized documents as batches of `per` (for `write_dataset`)."""
    for i in range(0, len(docs), per):
        yield TokenBatch.of(docs[i : i + per])


def pack(
    docs: Iterable[tuple[str, str]],
    out_dir: Path,
    opts: PackOptions,
    *,
    overwrite: bool = False,
    progress: Callable[[PackReport], None] | None = None,
    say: Callable[[str], None] | None = None,
    bad: BadInputs | None = None,
    part: dict | None = None,
) -> PackReport:
    """Tokenizes `docs` ((location, text) pairs) and writes a dataset at `out_dir`, atomically.
    `say` hears which end/begin tokens were chosen and which file settings were switched
    off; `bad` is the record of skipped inputs `docs` was read with (for the manifest);
    `part` makes it one task's part of a dataset (it may then hold no document)."""
    tok, info = packing_tokenizer(opts)
    if say:
        for line in tokenizer_choices(info, opts):
            say(line)
    dtype = choose_dtype(info, opts.dtype)
    batches = encoded_batches(tok, docs, info, opts)
    return write_dataset(
        batches, out_dir, info, dtype, opts, overwrite=overwrite, progress=progress,
        tokenizer=tok, bad=bad, part=part,
    )  # fmt: skip


def packing_tokenizer(opts: PackOptions):
    """The tokenizer with truncation and padding off, and what the manifest says of it."""
    tok, tok_name = load_tokenizer(opts.tokenizer)
    switched_off = for_packing(tok)
    info = describe(
        tok,
        tok_name,
        eos=opts.eos_token,
        bos=opts.bos_token,
        switched_off=switched_off,
    )
    if opts.append_eos and info.eos_id is None:
        raise TokenizerError(
            f"tokenizer {tok_name} has no end-of-text token (none of "
            f"{', '.join(EOS_CANDIDATES)}); name one with --eos-token TOKEN_OR_ID, "
            "or pass --no-eos to pack documents without one"
        )
    if opts.prepend_bos and info.bos_id is None:
        raise TokenizerError(
            f"tokenizer {tok_name} has no begin-of-text token; name one with "
            "--bos-token TOKEN_OR_ID, or drop --bos"
        )
    return tok, info


def tokenizer_choices(info: TokenizerInfo, opts: PackOptions) -> list[str]:
    """What pack-shards prints before packing: the tokens it adds and the settings it overrides."""
    lines = []
    if opts.append_eos:
        how = info.chosen.get("eos", "")
        lines.append(f"end of every document: {info.eos_token!r} (id {info.eos_id}, {how})")
    else:
        lines.append("end of every document: no token (--no-eos)")
    if opts.prepend_bos:
        how = info.chosen.get("bos", "")
        lines.append(f"start of every document: {info.bos_token!r} (id {info.bos_id}, {how})")
    for key, was in info.switched_off.items():
        lines.append(
            f"tokenizer file sets {key} {json.dumps(was)}: switched off for packing "
            "(every token of every document is kept)"
        )
    return lines


def encoded_batches(
    tok, docs: Iterable[tuple[str, str]], info: TokenizerInfo, opts: PackOptions
) -> Iterator[TokenBatch]:
    """The documents as token batches, in input order. Reading and batching run on a
    thread; ENCODES_IN_FLIGHT encode calls run at once (they release the GIL and share the
    tokenizer's thread pool, so the long last document of one batch does not leave the
    other cores idle); the caller compresses and writes (also without the GIL). Encoding runs in the
    extension (`_loader.Encoder`, the tokenizers crate on the same tokenizer.json), so no
    Python object is made per token."""
    encode = _encoder(tok, info, opts)
    text_batches = _batches(docs, opts.batch_docs, int(opts.batch_mib * (1 << 20)))
    pending: deque = deque()
    with ThreadPoolExecutor(ENCODES_IN_FLIGHT, thread_name_prefix="pack-encode") as pool:
        try:
            for b in in_thread(text_batches, depth=4):
                pending.append(pool.submit(encode, b))
                if len(pending) == ENCODES_IN_FLIGHT:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


@functools.lru_cache(maxsize=2)
def warm_encoder(tokenizer_json: str, eos: int | None, bos: int | None) -> _loader.Encoder:
    """One encoder per tokenizer for the whole process, so that its BPE cache (words
    already split) stays warm from one pack to the next. The `tokenizers` crate keeps that
    cache per thread and per BPE instance (a thread-local map keyed by the instance's id),
    so a new encoder starts every thread's cache cold, and the old entries stay behind.
    A process that packs several parts one after the other (a Ray worker's tasks) paid
    that on every part: on Python sources about 0.5 CPU-seconds a part, as much as 16
    parts' other overheads together (BENCHMARKS.md, "What a part costs"). The cache
    changes no id."""
    return _loader.Encoder(tokenizer_json, eos, bos)


def _encoder(tok, info: TokenizerInfo, opts: PackOptions) -> Callable[[list], TokenBatch]:
    eos = info.eos_id if opts.append_eos else None
    bos = info.bos_id if opts.prepend_bos else None
    try:
        encoder = warm_encoder(tok.to_str(), eos, bos)
    except ValueError as e:  # a tokenizer.json newer than the tokenizers crate built in
        raise TokenizerError(
            f"{info.name}: the tokenizers library built into pytrain cannot read it ({e}); "
            "re-save it with the tokenizers version pytrain installs"
        ) from e

    def encode(batch: list[tuple[str, str]]) -> TokenBatch:
        texts = [t for _, t in batch if t]
        ids, lengths, empty, text_bytes = encoder.encode(texts)
        return TokenBatch(
            ids=np.frombuffer(ids, dtype="<u4"),
            lengths=np.frombuffer(lengths, dtype="<u4"),
            skipped_empty=len(batch) - len(texts) + empty,
            input_bytes=text_bytes,
            where=f"{batch[0][0]}..{batch[-1][0]}",
        )

    return encode


def write_dataset(
    batches: Iterable[TokenBatch],
    out_dir: Path,
    info: TokenizerInfo,
    dtype: str,
    opts: PackOptions,
    *,
    overwrite: bool = False,
    progress: Callable[[PackReport], None] | None = None,
    tokenizer=None,
    bad: BadInputs | None = None,
    part: dict | None = None,
) -> PackReport:
    """Writes already tokenized batches as a dataset: into a temporary sibling directory,
    renamed into place only once shards, tokenizer and manifest are complete and synced."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DatasetExistsError(f"{out_dir} already exists; pass --overwrite to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        report = _write_shards(batches, tmp, dtype, opts, progress, empty_ok=part is not None)
        report.bad, report.part = bad, part
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
        _write_manifest(tmp, info, dtype, opts, report)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _write_shards(
    batches: Iterable[TokenBatch], tmp: Path, dtype: str, opts: PackOptions, progress,
    empty_ok: bool = False,
):  # fmt: skip
    report = PackReport()
    t0 = time.perf_counter()
    frame_bytes = int(opts.frame_mib * (1 << 20))
    shard_bytes = int(opts.shard_mib * (1 << 20))
    writer = None

    def close_shard():
        nonlocal writer
        if writer is not None and writer.documents > 0:
            summary = writer.finish()
            summary["file"] = f"shard-{len(report.shards):05d}.tks"
            report.shards.append(summary)
        writer = None

    for b in batches:
        report.input_bytes += b.input_bytes
        report.skipped_empty += b.skipped_empty
        if b.lengths.size:
            if writer is None:
                path = tmp / f"shard-{len(report.shards):05d}.tks"
                writer = _loader.ShardWriter(str(path), dtype, frame_bytes, opts.zstd_level)
            try:
                writer.add_documents(
                    b.ids.astype("<u4", copy=False).tobytes(),
                    b.lengths.astype("<u4", copy=False).tobytes(),
                )
            except ValueError as e:
                raise ValueError(f"{b.where}: {e}") from e
            report.documents += int(b.lengths.size)
            report.tokens += int(b.ids.size)
            if writer.bytes_written >= shard_bytes:
                close_shard()
        if progress:
            report.seconds = time.perf_counter() - t0
            progress(report)
    close_shard()
    report.seconds = time.perf_counter() - t0
    if not report.shards and not empty_ok:
        raise ValueError("no non-empty documents in the input")
    return report


def _write_manifest(tmp: Path, info: TokenizerInfo, dtype: str, opts: PackOptions, r: PackReport):
    """Through the extension's writer, the format's one (it adds the format, its version
    and the shards' totals, and syncs the file)."""
    fields = {
        "dtype": dtype,
        "tokenizer": info.to_json(),
        "totals": {"skipped_empty": r.skipped_empty, "input_bytes": r.input_bytes},
        "shards": [
            {k: s[k] for k in ("file", "documents", "tokens", "frames", "bytes", "xxh3_64")}
            for s in r.shards
        ],
        "args": asdict(opts),
        "created_by": "pytrain pack-shards",
    }
    if r.bad is not None:
        fields["bad_input"] = r.bad.to_json()
    if r.part is not None:
        fields["part"] = r.part
    _loader.write_manifest(str(tmp), json.dumps(fields))


def _replace_dir(tmp: Path, out: Path) -> None:
    """Moves the finished dataset into place; an old one is removed only afterwards."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    tmp.rename(out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)


def fsync_dir(d: Path) -> None:
    """Makes a rename in `d` durable (the directory entry, not only the file's bytes); the
    checkpoint writers of pytrain.train use it too."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path: Path | str) -> dict:
    """The manifest of the dataset at `path` (a directory, or an s3:// URL)."""
    data = _loader.read_file(str(path), MANIFEST)
    if data is None:
        raise FileNotFoundError(f"{str(path).rstrip('/')}/{MANIFEST}: no such file")
    return json.loads(data)


def manifest_tokenizer(path: Path | str) -> dict | None:
    """The manifest's tokenizer block ({} where it has none), or None where the manifest
    cannot be read: the start-time tokenizer checks leave that dataset to the loader, which
    names what is wrong with it."""
    try:
        return read_manifest(path).get("tokenizer", {})
    except (OSError, ValueError, _loader.LoaderError):
        return None


def verify(path: Path | str) -> dict:
    """Checks every checksum and that the manifest's totals match the shards."""
    ds = _loader.Dataset(str(path))
    ds.verify()
    m = read_manifest(path)
    t = m["totals"]
    for key, got in (("documents", ds.n_docs), ("tokens", ds.n_tokens), ("frames", ds.n_frames)):
        if t[key] != got:
            raise _loader.ManifestError(
                f"manifest {path}/{MANIFEST}: totals.{key} is {t[key]}, shards hold {got}"
            )
    return {
        "documents": ds.n_docs,
        "tokens": ds.n_tokens,
        "frames": ds.n_frames,
        "shards": len(m["shards"]),
    }
