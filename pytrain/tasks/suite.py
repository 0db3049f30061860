"""A set of tasks ready to score: read and tokenized once (the trainer scores the same
requests at every evaluation), scored together in packed rows, results per task and CORE."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pytrain.tasks import metrics, scoring
from pytrain.tasks.items import Task, TaskError
from pytrain.tasks.requests import Request, requests


def tokenizer_encode(source: str | Path | bytes) -> scoring.Encode:
    """A tokenizer.json's (a path, or its bytes) encoding of a text, nothing cut or padded:
    with its template's tokens, if it has any, unless `special` is False (as
    lm-evaluation-harness's Hugging Face model encodes)."""
    from tokenizers import Tokenizer

    if isinstance(source, bytes):
        tok = Tokenizer.from_str(source.decode())
    else:
        tok = Tokenizer.from_file(str(source))
    tok.no_truncation()
    tok.no_padding()
    return lambda text, special=True: tok.encode(text, add_special_tokens=special).ids


@dataclass
class Results:
    tasks: list[metrics.TaskResult]
    core: float | None
    seconds: float
    rows: int
    tokens: int
    mine: int = 0
    """Rows this rank scored (under torchrun, its share of `rows`)."""

    def scalars(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"tasks/core": self.core}
        for r in self.tasks:
            out |= r.scalars()
        return out

    def lines(self) -> list[str]:
        core = f"core {self.core:.4f}" if self.core is not None else "core -"
        return [f"tasks: {core} ({self.seconds:.1f}s, {self.rows} rows)"] + [
            "  " + r.line() for r in self.tasks
        ]

    def to_json(self) -> dict:
        return {
            "core": self.core,
            "seconds": self.seconds,
            "tasks": {
                r.name: {
                    "kind": r.kind,
                    "items": r.items,
                    "acc": r.acc,
                    "acc_norm": r.acc_norm,
                    "acc_bytes": r.acc_bytes,
                    "centered": r.centered,
                    "chance": r.chance,
                    "core_metric": r.metric,
                    "truncated": r.truncated,
                }  # fmt: skip
                for r in self.tasks
            },
        }


class TaskSuite:
    """Tasks tokenized for a model's window. `limit`: the first N items of each task."""

    def __init__(
        self,
        tasks: list[Task],
        encode: scoring.Encode,
        prefix_id: int,
        window: int,
        limit: int = 0,
    ):
        self.tasks, self.window = tasks, window
        self.requests: list[list[Request]] = [requests(t, limit) for t in tasks]
        flat = [r for rs in self.requests for r in rs]
        self.segments = scoring.segments(flat, encode, prefix_id, window)

    @classmethod
    def for_model(cls, tasks: list[Task], tokenizer: str | Path | bytes | None, prefix_id: int | None,
                  window: int, limit: int = 0) -> TaskSuite:  # fmt: skip
        """`tasks` for a model with `tokenizer` (its tokenizer.json) and end-of-text id."""
        if tokenizer is None:
            raise TaskError("scoring tasks needs the model's tokenizer.json, and it has none")
        if prefix_id is None:
            raise TaskError("scoring tasks needs the model's end-of-text token id, and it has none")
        return cls(tasks, tokenizer_encode(tokenizer), prefix_id, window, limit)

    def score(self, gpt, device: torch.device, *, row_tokens: int = 512, **options) -> Results:
        """Every task's results, in rows of `row_tokens`; `options` are scoring.score's
        (batch_rows, packed, autocast, share, all_sum, forward, fixed_shapes, lockstep)."""
        import time

        t0 = time.perf_counter()
        # Rows of row_tokens (the longest request's length where that is more): the mask's
        # attention is dense on the CPU and under SDPA, so a row of the whole window would
        # cost its square for items a tenth of its length.
        longest = max((len(s.inputs) for s in self.segments), default=1)
        row_len = max(longest, min(row_tokens, self.window))
        s = scoring.score(gpt, self.segments, row_len=row_len, device=device, **options)
        out, at = [], 0
        for task, reqs in zip(self.tasks, self.requests, strict=True):
            end = at + len(reqs)
            cut = sum(seg.truncated for seg in self.segments[at:end])
            out.append(metrics.task_result(task, reqs, s.loglik[at:end], s.greedy[at:end], cut))
            at = end
        return Results(out, metrics.core(out), time.perf_counter() - t0, s.rows, s.tokens, s.mine)
