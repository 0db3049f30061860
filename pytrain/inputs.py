"""Reading raw documents for pack-shards: .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet.
Every document comes with where it came from ("file:line" or "file:row"), and every
error names the file and the line or row."""

from __future__ import annotations

import glob
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


class InputError(ValueError):
    """Bad input: the message starts with file:line (or file:row)."""


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    """Field of a JSON line, or column of a parquet file, that holds the document."""
    txt_per_line: bool = False
    """A .txt file holds one document per line instead of one per file."""


def expand(inputs: list[str]) -> list[Path]:
    """Files, directories (searched recursively) and globs, sorted, without duplicates."""
    out: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_dir():
            found = [f for f in sorted(p.rglob("*")) if f.is_file() and _supported(f)]
        elif p.is_file():
            if not _supported(p):
                raise InputError(f"{p}: unsupported file type (supported: {', '.join(SUFFIXES)})")
            found = [p]
        else:
            found = [
                Path(f) for f in sorted(glob.glob(spec, recursive=True)) if _supported(Path(f))
            ]
            if not found:
                raise InputError(f"{spec}: no such file, directory, or matching glob")
        out.extend(found)
    seen: set[Path] = set()
    return [f for f in out if not (f.resolve() in seen or seen.add(f.resolve()))]


def _supported(p: Path) -> bool:
    return p.name.endswith(SUFFIXES)


def read_documents(path: Path, opts: ReadOptions) -> Iterator[tuple[str, str]]:
    """Yields (location, text) for every document of `path`."""
    name = path.name
    try:
        if name.endswith(".parquet"):
            yield from _parquet(path, opts)
        elif name.endswith(".txt"):
            yield from _txt(path, opts)
        else:
            yield from _jsonl(path, opts)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from e


def _open_binary(path: Path) -> io.BufferedIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.name.endswith(".zst"):
        import zstandard  # only .zst inputs need it

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # type: ignore[return-value]
    return open(path, "rb")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: invalid UTF-8 at byte {e.start} of the line") from e


def _txt(path: Path, opts: ReadOptions) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:
        if opts.txt_per_line:
            for n, raw in enumerate(f, 1):
                yield f"{path}:{n}", _decode(raw.rstrip(b"\r\n"), f"{path}:{n}")
            return
        data = f.read()
    try:
        yield f"{path}:1", data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: invalid UTF-8 (byte offset {e.start})") from e


def _jsonl(path: Path, opts: ReadOptions) -> Iterator[tuple[str, str]]:
    with _open_binary(path) as f:
        stream = io.BufferedReader(f) if not isinstance(f, io.BufferedReader) else f
        for n, raw in enumerate(stream, 1):
            where = f"{path}:{n}"
            line = _decode(raw, where).strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from e
            if not isinstance(obj, dict) or opts.text_field not in obj:
                raise InputError(
                    f"{where}: no field {opts.text_field!r} (choose one with --text-field)"
                )
            text = obj[opts.text_field]
            if not isinstance(text, str):
                raise InputError(
                    f"{where}: field {opts.text_field!r} is {type(text).__name__}, not a string"
                )
            yield where, text


def _parquet(path: Path, opts: ReadOptions) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid
        raise InputError(f"{path}: not a readable parquet file: {e}") from e
    if opts.text_field not in pf.schema_arrow.names:
        raise InputError(
            f"{path}: no column {opts.text_field!r} (columns: {', '.join(pf.schema_arrow.names)}; "
            "choose one with --text-field)"
        )
    row = 0
    for batch in pf.iter_batches(columns=[opts.text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise InputError(
                    f"{path}:row {row}: column {opts.text_field!r} is {type(text).__name__}, not a string"
                )
            yield f"{path}:row {row}", text
