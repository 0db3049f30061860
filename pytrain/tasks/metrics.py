"""A task's accuracies from its options' log-likelihoods, as lm-evaluation-harness computes
them for its multiple_choice and loglikelihood tasks, and the CORE-style mean of them.

- acc: the option of the highest log-likelihood is the gold one (the first of equal ones,
  as numpy.argmax picks); for language modelling, the continuation is the greedy one.
- acc_norm: the same, each log-likelihood divided by its choice's length in characters;
  acc_bytes: by its length in UTF-8 bytes. The choices are the continuations as the file
  holds them (without the delimiter), or, for a schema item, its contexts: what
  lm-evaluation-harness's multiple-input tasks divide by.
- CORE (as DCLM's and nanochat's): each task's accuracy centred on chance,
  (acc - chance) / (1 - chance), then their mean."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pytrain.tasks.items import Task
from pytrain.tasks.requests import Request


@dataclass
class TaskResult:
    name: str
    kind: str
    items: int
    acc: float
    acc_norm: float | None
    acc_bytes: float | None
    chance: float
    metric: str
    """The accuracy CORE takes (TaskSpec.metric)."""
    truncated: int = 0
    """Requests whose context was cut from the left to fit the model's window."""
    loglik: list[float] = field(default_factory=list, repr=False)
    """Each request's log-likelihood, in request order."""

    @property
    def centered(self) -> float:
        value = getattr(self, self.metric)
        return (value - self.chance) / (1 - self.chance)

    def scalars(self) -> dict[str, float]:
        """What TensorBoard, W&B and MLflow get, under tasks/NAME/."""
        out = {"acc": self.acc, "acc_norm": self.acc_norm, "acc_bytes": self.acc_bytes,
               "centered": self.centered}  # fmt: skip
        return {f"tasks/{self.name}/{k}": v for k, v in out.items() if v is not None}

    def line(self) -> str:
        cells = [f"acc {self.acc:.4f}"]
        if self.acc_norm is not None:
            cells.append(f"acc_norm {self.acc_norm:.4f}")
        if self.acc_bytes is not None:
            cells.append(f"acc_bytes {self.acc_bytes:.4f}")
        cut = f", {self.truncated} truncated" if self.truncated else ""
        return f"{self.name}: {' '.join(cells)} ({self.items} items{cut})"


def task_result(
    task: Task, reqs: list[Request], loglik: list[float], greedy: list[bool], truncated: int
) -> TaskResult:
    """The accuracies of `task`'s items scored in `reqs` (requests() order)."""
    s = task.spec
    by_item: dict[int, list[int]] = {}
    for k, r in enumerate(reqs):
        by_item.setdefault(r.item, []).append(k)
    hits = np.zeros((len(by_item), 3))
    chance = []
    for row, (i, ks) in enumerate(by_item.items()):
        item = task.items[i]
        ll = np.array([loglik[k] for k in ks])
        if s.kind == "language_modeling":
            hits[row, 0] = float(all(greedy[k] for k in ks))
            chance.append(0.0)
            continue
        chars = np.array([float(len(c)) for c in item.choices])
        utf8 = np.array([float(len(c.encode("utf-8"))) for c in item.choices])
        preds = (np.argmax(ll), np.argmax(ll / chars), np.argmax(ll / utf8))
        hits[row] = [float(p == item.gold) for p in preds]
        chance.append(1 / item.options)
    mean = hits.mean(axis=0) if len(hits) else np.zeros(3)
    lm = s.kind == "language_modeling"
    return TaskResult(
        s.name, s.kind, len(by_item), float(mean[0]),
        None if lm else float(mean[1]), None if lm else float(mean[2]),
        s.chance if s.chance is not None else float(np.mean(chance)) if chance else 0.0,
        "acc" if lm else s.metric, truncated, list(loglik),
    )  # fmt: skip


def core(results: list[TaskResult]) -> float | None:
    """The mean of the tasks' accuracies centred on chance; None without tasks."""
    return sum(r.centered for r in results) / len(results) if results else None
