"""Reading the documents of a packed dataset back (report, tools, tests): lengths, all
documents, or a bounded sample of whole frames. Reads through the extension; no torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pytrain import _loader


def doc_lengths(path: Path) -> np.ndarray:
    return np.frombuffer(_loader.Dataset(str(path)).doc_lengths(), dtype="<u4")


def read_all_documents(path: Path) -> list[np.ndarray]:
    """Every document of a dataset in file order (for tests and small tools)."""
    return sample_documents(path)


def sample_documents(path: Path, max_tokens: int | None = None) -> list[np.ndarray]:
    """Documents of a dataset, whole frames at a time: all of them, or frames spread
    evenly over the dataset until about `max_tokens` tokens (a bounded sample that costs
    the same on a 10 B-token dataset as on a small one)."""
    ds = _loader.Dataset(str(path))
    dtype = "<u2" if ds.dtype == "uint16" else "<u4"
    frames = range(ds.n_frames)
    if max_tokens is not None and ds.n_frames:
        per_frame = max(1, ds.n_tokens // ds.n_frames)
        want = min(ds.n_frames, max(1, -(-max_tokens // per_frame)))
        frames = np.linspace(0, ds.n_frames - 1, want).round().astype(int).tolist()
    out = []
    for f in frames:
        raw, lens = ds.read_frame(f)
        toks = np.frombuffer(raw, dtype=dtype)
        out.extend(np.split(toks, np.cumsum(lens)[:-1]))
    return out
