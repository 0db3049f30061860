"""Reading raw documents for pack-shards: .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet.
Every document comes with where it came from ("file:line" or "file:row"), and every
error names the file and the line or row. A real corpus has bad files: `BadInputs`
decides whether a bad document stops packing (the default) or is left out and listed."""

from __future__ import annotations

import glob
import gzip
import io
import json
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


class InputError(ValueError):
    """Bad input: the message starts with file:line (or file:row)."""


BAD_INPUT_POLICIES = ("stop", "skip")


@dataclass
class BadInputs:
    """What to do with bad input: "stop" raises the error (file:line), "skip" leaves the
    document (or the unreadable rest of a file) out and records it here."""

    policy: str = "stop"
    count: int = 0
    listed: list[str] = field(default_factory=list)
    max_listed: int = 1000

    def __post_init__(self):
        if self.policy not in BAD_INPUT_POLICIES:
            raise ValueError(f"--on-bad-input {self.policy!r} is not one of {BAD_INPUT_POLICIES}")

    def __call__(self, err: InputError) -> None:
        if self.policy == "stop":
            raise err
        self.count += 1
        if len(self.listed) < self.max_listed:
            self.listed.append(str(err))

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "skipped": self.count,
            "listed": self.listed,
            "listed_all": self.count == len(self.listed),
        }

    def summary(self) -> str:
        if not self.count:
            return "no bad input"
        first = "; ".join(self.listed[:3])
        more = f" (+{self.count - 3} more)" if self.count > 3 else ""
        return (
            f"skipped {self.count:,} bad input(s), listed in manifest.json bad_input: {first}{more}"
        )


def optional(module: str, extra: str, what: str):
    """Imports an optional dependency, or raises an InputError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise InputError(
            f"{what} needs {module}: pip install {module} (or the extra: pytrain[{extra}])"
        ) from e


def _stop(err: InputError) -> None:
    raise err


def _decompress_errors() -> tuple[type[BaseException], ...]:
    """Errors of a damaged compressed stream (gzip's EOFError/zlib.error, zstandard's own)."""
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    zstd = sys.modules.get("zstandard")
    if zstd is not None:
        errors.append(zstd.ZstdError)
    return tuple(errors)


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
    unique: dict[Path, Path] = {}
    for f in out:
        unique.setdefault(f.resolve(), f)
    return list(unique.values())


def _supported(p: Path) -> bool:
    return p.name.endswith(SUFFIXES)


def read_documents(
    path: Path, opts: ReadOptions, bad: BadInputs | None = None, row_group: int | None = None
) -> Iterator[tuple[str, str]]:
    """Yields (location, text) for every document of `path` (of one parquet row group, with
    its rows numbered as in the whole file). A bad document goes to `bad` (raises by
    default); a file that cannot be read on (damaged compression, I/O error) goes to `bad`
    once, after the documents read before the damage."""
    on_bad = bad if bad is not None else _stop
    name = path.name
    try:
        if name.endswith(".parquet"):
            yield from _parquet(path, opts, on_bad, row_group)
        elif name.endswith(".txt"):
            yield from _txt(path, opts, on_bad)
        else:
            yield from _jsonl(path, opts, on_bad)
    except InputError as e:
        on_bad(e)  # a whole-file error (not a parquet file, no such column, ...)
    except _decompress_errors() as e:
        reason = getattr(e, "strerror", None) or e
        on_bad(InputError(f"{path}: cannot read: {reason}"))


def _open_binary(path: Path) -> io.BufferedIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        zstandard = optional("zstandard", "zstd", f"{path}: reading .zst")
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _txt(path: Path, opts: ReadOptions, on_bad) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:
        if opts.txt_per_line:
            offset = 0
            for n, raw in enumerate(f, 1):
                where = f"{path}:{n}"
                try:
                    text = raw.rstrip(b"\r\n").decode("utf-8")
                except UnicodeDecodeError as e:
                    on_bad(InputError(f"{where}: invalid UTF-8 (byte offset {offset + e.start})"))
                else:
                    yield where, text
                offset += len(raw)
            return
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        on_bad(InputError(f"{path}:{line}: invalid UTF-8 (byte offset {e.start})"))
        return
    yield f"{path}:1", text


def _jsonl(path: Path, opts: ReadOptions, on_bad) -> Iterator[tuple[str, str]]:
    offset_kind = "decompressed byte offset" if path.suffix in (".gz", ".zst") else "byte offset"
    with _open_binary(path) as f:
        stream = io.BufferedReader(f) if not isinstance(f, io.BufferedReader) else f
        offset = 0
        for n, raw in enumerate(stream, 1):
            where = f"{path}:{n}"
            at = offset
            offset += len(raw)
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                on_bad(InputError(f"{where}: invalid UTF-8 ({offset_kind} {at + e.start})"))
                continue
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                on_bad(InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})"))
                continue
            if not isinstance(obj, dict) or opts.text_field not in obj:
                on_bad(
                    InputError(
                        f"{where}: no field {opts.text_field!r} (choose one with --text-field)"
                    )
                )
                continue
            text = obj[opts.text_field]
            if not isinstance(text, str):
                on_bad(
                    InputError(
                        f"{where}: field {opts.text_field!r} is {type(text).__name__}, not a string"
                    )
                )
                continue
            yield where, text


PARQUET_BATCH_ROWS = 1024
"""Rows converted to Python at a time; pyarrow decodes one row group's column at a time."""


def parquet_row_groups(path: Path) -> list[int]:
    """The uncompressed bytes of each row group of a parquet file (pack-shards' tasks
    split parquet inputs by row group)."""
    pf = _parquet_file(path)
    return [pf.metadata.row_group(i).total_byte_size for i in range(pf.metadata.num_row_groups)]


def _parquet_file(path: Path):
    optional("pyarrow", "parquet", f"{path}: reading .parquet")
    import pyarrow.parquet as pq

    try:
        # No pre-buffering: read the text column of one row group at a time, so memory
        # is bounded by a row group, not by the file (FineWeb files are 1-2 GB).
        return pq.ParquetFile(path, pre_buffer=False)
    except Exception as e:  # pyarrow raises its own ArrowInvalid
        raise InputError(f"{path}: not a readable parquet file: {e}") from e


def _parquet(
    path: Path, opts: ReadOptions, on_bad, row_group: int | None = None
) -> Iterator[tuple[str, str]]:
    pf = _parquet_file(path)
    if opts.text_field not in pf.schema_arrow.names:
        raise InputError(
            f"{path}: no column {opts.text_field!r} (columns: {', '.join(pf.schema_arrow.names)}; "
            "choose one with --text-field)"
        )
    row, groups = 0, None
    if row_group is not None:
        row = sum(pf.metadata.row_group(i).num_rows for i in range(row_group))
        groups = [row_group]
    for batch in pf.iter_batches(
        batch_size=PARQUET_BATCH_ROWS,
        row_groups=groups,
        columns=[opts.text_field],
        use_threads=False,
    ):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                on_bad(
                    InputError(
                        f"{path}:row {row}: column {opts.text_field!r} is {type(text).__name__}, not a string"
                    )
                )
                continue
            yield f"{path}:row {row}", text
