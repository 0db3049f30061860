"""Reading a TokenLoader for a while, timed: the tokens of its batches (rows x seq_len),
the wall time and this process's CPU time. Used by the S3 and scaling benchmarks."""

from __future__ import annotations

import time


def read_for(loader, seconds: float) -> tuple[int, float, float]:
    """(tokens, wall seconds, process CPU seconds) of the batches read in `seconds`,
    counted after the loader's first batch (its start-up is not throughput)."""
    next(loader).release()
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        b = next(loader)
        tokens += b.tokens.shape[0] * (b.tokens.shape[1] - 1)
        b.release()
    return tokens, time.perf_counter() - t0, time.process_time() - c0
