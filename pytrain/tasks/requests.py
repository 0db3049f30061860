"""Items as what a model scores: one (context, continuation) pair for each option, the
few-shot examples before the context, the continuation after the task's delimiter (as
lm-evaluation-harness builds its loglikelihood requests)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pytrain.tasks.items import Item, Task


@dataclass(frozen=True)
class Request:
    context: str
    continuation: str
    item: int
    """The item's index in its task."""


def example(item: Item, delimiter: str) -> str:
    """An item as a solved example: its gold option's context, delimiter, continuation."""
    ctx, cont = item.option(item.gold)
    return ctx + delimiter + cont


def fewshot_prefix(task: Task, index: int) -> str:
    """The examples before item `index`'s context: `shots` items of the pool drawn with a
    generator seeded by fewshot_seed and the item's line (so an item's examples do not
    depend on which other items are scored), never the item itself."""
    s = task.spec
    if not s.shots:
        return ""
    item = task.items[index]
    rng = random.Random(s.fewshot_seed * 1_000_003 + item.line)
    pool = task.pool if s.fewshot_from else [x for x in task.pool if x.line != item.line]
    shots = rng.sample(pool, s.shots)
    return s.fewshot_sep.join(example(x, s.delimiter) for x in shots) + s.fewshot_sep


def requests(task: Task, limit: int = 0) -> list[Request]:
    """Every option of the first `limit` items (0: all), in order."""
    out = []
    items = task.items[:limit] if limit else task.items
    for i, item in enumerate(items):
        prefix = fewshot_prefix(task, i)
        for k in range(item.options):
            ctx, cont = item.option(k)
            out.append(Request(prefix + ctx, task.spec.delimiter + cont, i))
    return out
