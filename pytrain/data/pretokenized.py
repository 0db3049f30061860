"""`pack-shards import`: datasets that are already tokenized, token for token, with their
document boundaries.

Formats (documented layouts; the tests write each one):
- nanoGPT `.bin`: raw little-endian uint16 ids, no header; `prepare.py` appends the
  end-of-text id after every document, so documents end at it (`--split after`).
- llm.c / modded-nanogpt `.bin`: 256 int32 header (magic 20240520 with uint16 ids for
  GPT-2, or 20240801 with uint32 ids for Llama 3; header[1] the version, header[2] the
  number of tokens), then the ids; `fineweb.py` puts the end-of-text id *before* every
  document, so documents start at it (`--split before`). Documents continue across files:
  the inputs are read as one stream, in the order given.
- Megatron-LM indexed dataset (`prefix.bin` + `prefix.idx`): the `.idx` starts with
  b"MMIDIDX\\x00\\x00", version <Q = 1, dtype code <B, sequence count <Q, document count <Q,
  then int32 sequence lengths, int64 sequence byte offsets into `.bin`, and int64 document
  indices (sequence index where each document starts, with the total count last).

Nothing is re-tokenized: the shards hold exactly the ids of the input, the same number of
them, in the same order; only the document boundaries are made explicit."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pytrain.data.inputs import InputError
from pytrain.data.shards import TokenBatch

LLMC_MAGIC: dict[int, np.dtype] = {20240520: np.dtype("<u2"), 20240801: np.dtype("<u4")}
LLMC_EOT = {20240520: 50256, 20240801: 128000}  # GPT-2 <|endoftext|>, Llama 3 <|begin_of_text|>
LLMC_HEADER_INTS = 256
GPT2_VOCAB, GPT2_EOT = 50257, 50256
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16,
}  # fmt: skip
FORMATS = ("auto", "nanogpt", "llmc", "megatron")
CHUNK_TOKENS = 16 << 20
"""Tokens read at a time: memory is bounded whatever the size of the input."""


@dataclass(frozen=True)
class Source:
    """One input: where its ids are and how documents are delimited in it."""

    path: Path
    format: str
    dtype: np.dtype
    offset: int
    """Byte offset of the first id."""
    count: int
    """Number of ids."""
    eot: int | None = None
    """The llm.c header's default end-of-text id."""
    documents: np.ndarray | None = None
    """Megatron: the token offset at which each document starts, and the total last."""


def detect(path: Path, fmt: str) -> Source:
    """Reads the header of `path` (or the `.idx` beside it) and checks it against the file."""
    path = Path(path)
    if fmt == "megatron" or (fmt == "auto" and path.with_suffix(".idx").is_file()):
        return _megatron(path.with_suffix(".bin"))
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_INTS * 4)
    magic = struct.unpack("<i", head[:4])[0] if len(head) >= 4 else None
    if fmt == "llmc" or (fmt == "auto" and magic in LLMC_MAGIC):
        if magic not in LLMC_MAGIC:
            raise InputError(
                f"{path}: not an llm.c token file (magic {magic}, expected one of {sorted(LLMC_MAGIC)})"
            )
        dtype = LLMC_MAGIC[magic]
        count = struct.unpack("<i", head[8:12])[0]
        want = LLMC_HEADER_INTS * 4 + count * dtype.itemsize
        if size != want:
            raise InputError(
                f"{path}: llm.c header says {count:,} tokens ({want:,} bytes), the file has {size:,} bytes"
            )
        return Source(path, "llmc", dtype, LLMC_HEADER_INTS * 4, count, eot=LLMC_EOT[magic])
    if size % 2:
        raise InputError(
            f"{path}: {size:,} bytes is not a whole number of uint16 ids (nanoGPT .bin)"
        )
    return Source(path, "nanogpt", np.dtype("<u2"), 0, size // 2)


def _megatron(bin_path: Path) -> Source:
    idx = bin_path.with_suffix(".idx")
    if not idx.is_file() or not bin_path.is_file():
        raise InputError(f"{bin_path.with_suffix('')}: a Megatron dataset needs both .bin and .idx")
    raw = np.memmap(idx, dtype=np.uint8, mode="r")
    if bytes(raw[:9]) != MEGATRON_MAGIC:
        raise InputError(f"{idx}: not a Megatron index (header {bytes(raw[:9])!r})")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", bytes(raw[9:34]))
    if version != 1 or code not in MEGATRON_DTYPES:
        raise InputError(
            f"{idx}: unsupported Megatron index (version {version}, dtype code {code})"
        )
    dtype = np.dtype(MEGATRON_DTYPES[code]).newbyteorder("<")
    at = 34
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=at)
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=at + 4 * n_seq)
    doc_idx = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=at + 12 * n_seq)
    if n_doc == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        raise InputError(f"{idx}: document indices do not run from 0 to {n_seq:,} sequences")
    expect = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * dtype.itemsize
    if not np.array_equal(pointers, expect):
        # preprocess_data.py writes sequences back to back; anything else is not supported
        raise InputError(f"{idx}: sequences are not stored back to back in {bin_path.name}")
    total = int(lengths.astype(np.int64).sum())
    size = bin_path.stat().st_size
    if size != total * dtype.itemsize:
        raise InputError(
            f"{bin_path}: the index describes {total:,} tokens ({total * dtype.itemsize:,} bytes), "
            f"the file has {size:,} bytes"
        )
    seq_starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
    return Source(bin_path, "megatron", dtype, 0, total, documents=seq_starts[doc_idx])


def batches(sources: list[Source], split: str, eot: int | None) -> Iterator[TokenBatch]:
    """The documents of `sources`, in order, as token batches. Token-delimited formats are
    read as one stream (a document may continue in the next file) and cut `after` or
    `before` every `eot`; Megatron datasets carry their own document starts."""
    carry = np.zeros(0, np.uint32)  # the open document of a token stream
    for src in sources:
        ids = np.memmap(src.path, dtype=src.dtype, mode="r", offset=src.offset, shape=(src.count,))
        if src.documents is not None:
            if carry.size:
                yield _batch([carry], src)
                carry = np.zeros(0, np.uint32)
            yield from _by_offsets(ids, src)
            continue
        for lo in range(0, src.count, CHUNK_TOKENS):
            chunk = np.asarray(ids[lo : lo + CHUNK_TOKENS], dtype=np.uint32)
            hits = np.flatnonzero(chunk == eot)
            cuts = hits + 1 if split == "after" else hits
            pieces = np.split(chunk, cuts)
            pieces[0] = np.concatenate([carry, pieces[0]])
            carry = pieces.pop()  # may continue in the next chunk or file
            docs = [p for p in pieces if p.size]
            if docs:
                yield _batch(docs, src, lo)
    if carry.size:
        yield _batch([carry], sources[-1])


def _by_offsets(ids: np.ndarray, src: Source) -> Iterator[TokenBatch]:
    starts = src.documents
    assert starts is not None
    i = 0
    n = len(starts) - 1
    while i < n:
        # documents whose tokens fit a chunk (at least one document per batch)
        j = int(np.searchsorted(starts, starts[i] + CHUNK_TOKENS, side="right")) - 1
        j = min(max(j, i + 1), n)
        chunk = np.asarray(ids[starts[i] : starts[j]], dtype=np.uint32)
        docs = [d for d in np.split(chunk, starts[i + 1 : j] - starts[i]) if d.size]
        if docs:
            yield _batch(docs, src, int(starts[i]))
        i = j


def _batch(docs: list[np.ndarray], src: Source, at: int = 0) -> TokenBatch:
    b = TokenBatch.of(docs)
    b.where = f"{src.path} (tokens from {at:,})"
    return b


def import_dataset(
    inputs: list[Path],
    out_dir: Path,
    *,
    fmt: str = "auto",
    tokenizer: str | None = None,
    vocab_size: int | None = None,
    eot: int | None = None,
    split: str = "auto",
    dtype: str = "auto",
    frame_mib: float = 2.0,
    shard_mib: float = 256.0,
    zstd_level: int = 3,
    overwrite: bool = False,
    say=None,
):
    """Writes the documents of already tokenized `inputs` as a dataset at `out_dir`."""
    from pytrain.data.shards import PackOptions, choose_dtype, write_dataset
    from pytrain.data.tokenizer import TokenizerInfo, describe, for_packing, load_tokenizer

    sources = [detect(Path(p), fmt) for p in inputs]
    kinds = {s.format for s in sources}
    if len(kinds) > 1:
        raise InputError(f"inputs mix formats ({', '.join(sorted(kinds))}); import them separately")
    kind = kinds.pop()
    tok = None
    if tokenizer is not None:
        tok, name = load_tokenizer(tokenizer)
        info = describe(
            tok, name, eos=None if eot is None else str(eot), switched_off=for_packing(tok)
        )
    elif vocab_size is not None:
        info = TokenizerInfo(name=f"imported {kind} ids (no tokenizer)", sha256=None,
                             vocab_size=vocab_size, eos_id=None, bos_id=None)  # fmt: skip
    else:
        raise InputError(
            "name the vocabulary: --tokenizer tokenizer.json, or --vocab-size N (50257 for GPT-2)"
        )
    if kind != "megatron":
        if eot is None:
            eot = sources[0].eot if kind == "llmc" else info.eos_id
        if eot is None and info.vocab_size == GPT2_VOCAB:  # nanoGPT's GPT-2 data
            eot = GPT2_EOT
        if eot is None:
            raise InputError(
                "which id delimits documents? pass --eot-id (50256 for GPT-2's <|endoftext|>)"
            )
        if split == "auto":
            split = "before" if kind == "llmc" else "after"
        if say:
            where = "starts" if split == "before" else "ends"
            say(f"{kind}: every document {where} at id {eot} (--eot-id, --split to change)")
    out_dtype = choose_dtype(info, dtype)
    opts = PackOptions(
        tokenizer=info.name, dtype=out_dtype, append_eos=False, frame_mib=frame_mib,
        shard_mib=shard_mib, zstd_level=zstd_level,
    )  # fmt: skip
    expected = sum(s.count for s in sources)
    checked = _checked(batches(sources, split, eot), info.vocab_size, expected)
    return write_dataset(
        checked, out_dir, info, out_dtype, opts, overwrite=overwrite, tokenizer=tok
    )


def _checked(items: Iterator[TokenBatch], vocab: int, expected: int) -> Iterator[TokenBatch]:
    """Ids inside the vocabulary, and every id of the input once (checked before the
    dataset is moved into place, not assumed)."""
    seen = 0
    for b in items:
        if b.ids.size and int(b.ids.max()) >= vocab:
            raise InputError(
                f"{b.where}: id {int(b.ids.max())} is outside the vocabulary (size {vocab})"
            )
        seen += int(b.ids.size)
        yield b
    if seen != expected:
        raise AssertionError(f"import read {seen:,} tokens of {expected:,}")
