"""The embedded default dataset: Python's standard library sources, on every machine.

Built once into the cache directory ($PYTRAIN_CACHE, else ~/.cache/pytrain) as
`stdlib-bpe<V>/{train,val}/` with a BPE tokenizer trained on the training files. Files are
split into train and validation by a hash of their path (about 5% held out), so the split
does not depend on the machine's file order."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from pytrain.data.shards import PackOptions, pack
from pytrain.data.tokenizer import train_bpe

VAL_PERCENT = 5
MAX_FILE_BYTES = 400_000


def cache_dir() -> Path:
    return Path(os.environ.get("PYTRAIN_CACHE", Path.home() / ".cache" / "pytrain"))


def stdlib_files(max_bytes: int) -> list[Path]:
    """Standard library .py files (tests and vendored packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "/test" in rel or rel.startswith("test") or "idle_test" in rel:
            continue
        size = p.stat().st_size
        if size == 0 or size > MAX_FILE_BYTES:
            continue
        files.append(p)
        total += size
        if total >= max_bytes:
            break
    return files


def is_val(path: Path) -> bool:
    return int(hashlib.sha256(path.name.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def _docs(files: list[Path]) -> Iterator[tuple[str, str]]:
    for p in files:
        yield str(p), p.read_text(encoding="utf-8", errors="replace")


def build_default(
    vocab_size: int = 4096, max_bytes: int | None = None, log=print
) -> tuple[Path, Path]:
    """Returns (train, val) dataset directories, building them if they are missing.
    $PYTRAIN_DEFAULT_MAX_BYTES caps the text used (the tests use a small slice)."""
    if max_bytes is None:
        max_bytes = int(os.environ.get("PYTRAIN_DEFAULT_MAX_BYTES", 24_000_000))
    suffix = "" if max_bytes == 24_000_000 else f"-{max_bytes}"
    root = cache_dir() / f"stdlib-bpe{vocab_size}{suffix}"
    train, val = root / "train", root / "val"
    if (train / "manifest.json").exists() and (val / "manifest.json").exists():
        return train, val
    files = stdlib_files(max_bytes)
    train_files = [p for p in files if not is_val(p)]
    val_files = [p for p in files if is_val(p)]
    log(f"building the embedded default dataset in {root} ({len(files)} stdlib files, once)")
    root.mkdir(parents=True, exist_ok=True)
    tok = train_bpe((t for _, t in _docs(train_files)), vocab_size)
    tok_path = root / "tokenizer.json"
    tok.save(str(tok_path))
    opts = PackOptions(tokenizer=str(tok_path), frame_mib=0.5, shard_mib=8)
    for out, fs in ((train, train_files), (val, val_files)):
        r = pack(_docs(fs), out, opts, overwrite=True)
        log(f"  {out.name}: {r.documents:,} documents, {r.tokens:,} tokens")
    return train, val
