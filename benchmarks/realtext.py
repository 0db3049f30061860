"""Real text present on every machine that ran `make setup`: Python sources of the standard
library (tests included) and then of the installed packages (torch, numpy, ...), in sorted
order, up to a byte budget. Used by the pack-shards and packing-quality benchmarks."""

from __future__ import annotations

import site
import sysconfig
from collections.abc import Iterator
from pathlib import Path


def python_sources(max_bytes: int) -> Iterator[tuple[str, str]]:
    roots = [Path(sysconfig.get_paths()["stdlib"])] + [Path(p) for p in site.getsitepackages()]
    seen, total = set(), 0
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            if p in seen or "site-packages" in p.relative_to(root).as_posix() and root == roots[0]:
                continue
            seen.add(p)
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield str(p), text
            total += len(text.encode())
            if total >= max_bytes:
                return
