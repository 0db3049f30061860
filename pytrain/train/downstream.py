"""Downstream tasks scored as the model trains (`--eval.tasks`, pytrain.tasks): at each
evaluation step, or every `--eval.tasks_every` steps, and at the run's end. The tasks are
read and tokenized once, with the training dataset's tokenizer, and scored with the model's
own weights in evaluation mode, in the run's precision, through the module the evaluation
runs (pytrain.tasks.scoring.Continuations over it), compiled where the run compiles, its
rows padded to a few fixed widths so that each width compiles once. Under
torchrun each rank scores its share of the rows and one all-reduce gathers them; under
FSDP2 the root's weights (embedding, output layer) are gathered for the scoring, each
block's by its own unit in each forward, so every rank runs as many forwards as the
busiest (a spare one on a one-token row whose scores are dropped).
Results go where the validation loss goes: train.log, TensorBoard, W&B and MLflow
(`tasks/NAME/acc`, `tasks/core`), and the end's report."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from pytrain.config import ConfigError
from pytrain.tasks.items import read_tasks
from pytrain.tasks.scoring import Continuations
from pytrain.tasks.suite import Results, TaskSuite
from pytrain.train import compile_policy, distributed


@contextmanager
def root_gathered(root):
    """FSDP2's root unit (`root`; None: nothing sharded) with its own weights whole: those
    outside the blocks' units, which its forward would gather and the scoring calls
    without it (GPT.hidden, GPT.head); sharded again after."""
    if root is None:
        yield
        return
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


class TaskScores:
    """What the loop calls at each step: scores the tasks where they are due."""

    def __init__(self, trainer, suite: TaskSuite | None):
        self.trainer, self.suite = trainer, suite
        self.every = trainer.cfg.eval.tasks_every
        self.last: Results | None = None
        self.scored_at = -1
        self.forward: torch.nn.Module | None
        self.forward, self.compiled = self._forward(trainer) if suite else (None, False)

    @staticmethod
    def _forward(trainer) -> tuple[torch.nn.Module, bool]:
        """(the scoring forward, whether compiled): the model the evaluation runs, compiled
        at the evaluation's level where the run compiles and its weights are whole (under
        FSDP2 it runs eagerly, its blocks' units gathering their weights)."""
        c = trainer.compiler
        module = Continuations(c.eval_module.gpt if not trainer.sharded else trainer.gpt)
        if c.eager or trainer.sharded:
            return module, False
        return compile_policy.compile_model(module, c.eval_mode), True

    @classmethod
    def of(cls, trainer) -> TaskScores:
        """The run's tasks (none without --eval.tasks): read and tokenized here, so that a
        bad file or a dataset without a tokenizer ends the run before its first step."""
        e = trainer.cfg.eval
        if not e.tasks:
            return cls(trainer, None)
        from pytrain import _loader

        tokenizer = _loader.read_file(str(trainer.train_path), "tokenizer.json")
        if tokenizer is None:
            raise ConfigError(
                f"--eval.tasks needs the training dataset's tokenizer.json ({trainer.train_path} "
                "has none: packed with the byte tokenizer, or imported ids)"
            )
        from pytrain.data.shards import read_manifest

        # An empty context's token, as lm-evaluation-harness takes it: BOS, else EOS.
        bos = read_manifest(trainer.train_path).get("tokenizer", {}).get("bos_id")
        prefix = bos if bos is not None else trainer.loader.dataset.eos_id
        suite = TaskSuite.for_model(read_tasks(e.tasks), tokenizer, prefix,
                                    trainer.gpt.cfg.max_seq_len, e.tasks_limit)  # fmt: skip
        return cls(trainer, suite)

    def _score(self) -> Results:
        t = self.trainer
        assert self.suite is not None, "scored only where tasks are given"
        with root_gathered(t.module if t.sharded else None):
            return self.suite.score(
                t.gpt, t.device, batch_rows=t.cfg.data.batch_size, row_tokens=t.cfg.data.seq_len,
                autocast=lambda: t.precision.autocast(t.device), share=(t.dist.rank, t.dist.world_size),
                all_sum=lambda x: distributed.all_sum_tensor(x, t.dist), forward=self.forward,
                fixed_shapes=self.compiled, lockstep=t.sharded,
                # Packed on a GPU: 4x the items/s of one request a row at llama-350m on an H100
                # (BENCHMARKS.md); on a CPU, where the mask's attention is dense, one a row.
                packed=t.device.type == "cuda",
            )  # fmt: skip

    def at(self, step: int, eval_due: bool, end: bool = False) -> Results | None:
        """Scores the tasks at `step` where they are due: at the run's `end`, at a multiple
        of tasks_every, or, where that is 0, at an evaluation step; once a step."""
        due = end or (step % self.every == 0 if self.every else eval_due)
        if self.suite is None or not due or step == self.scored_at:
            return None
        t = self.trainer
        graphs = compile_policy.compiled_graphs()
        try:
            r = self._score()
        except Exception as e:  # a compile failure: scored eagerly from here on
            if not (self.compiled and compile_policy.is_compile_failure(e)):
                raise
            t.say(f"compile fallback (tasks): {compile_policy.failure_line(e)}; scoring eagerly")
            self.forward, self.compiled = Continuations(t.gpt), False
            r = self._score()
        if self.compiled and t.compiler.expected_graphs >= 0:
            # The tasks' graphs (one a row width, compiled at the first scoring: the same
            # rows every time) are not training's recompiles.
            t.compiler.expected_graphs += compile_policy.compiled_graphs() - graphs
        self.last, self.scored_at = r, step
        t.log.scalars(step, r.scalars())
        for line in r.lines():
            t.log.text(f"step {step} {line.strip()}")
        t.say(f"step {step}: " + "  ".join([r.lines()[0], *(x.line() for x in r.tasks)]))
        return r
