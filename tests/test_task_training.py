"""Downstream tasks in the training loop (`--eval.tasks`, pytrain.train.downstream) and on
the command line (`python -m pytrain.eval --tasks`): scored at the evaluation steps and at
the end with the model as it trains (the end's scores equal the saved checkpoint's, scored
afterwards), logged to train.log and TensorBoard; a bad task file is one line, exit 2,
before anything is built."""

from __future__ import annotations

import json

import pytest
from conftest import stdlib_texts

from pytrain.config import ConfigError, parse_args
from pytrain.data.shards import PackOptions, pack
from pytrain.eval import main as eval_main
from pytrain.eval import score_tasks
from pytrain.tasks.scoring import Continuations
from pytrain.train.cli import main as train_main
from pytrain.train.trainer import Trainer

ITEMS = [
    {"context": "import os\nimport", "choices": [" sys", " os", " ñ"], "gold": 0},
    {"context": "def main(", "choices": ["self):", "):"], "gold": 1},
    {"context": "for i in ", "choices": ["range(10):", "x:"], "gold": 0},
    {"context": "return ", "choices": ["None", "€"], "gold": 0},
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, bpe_tokenizer_file):
    d = tmp_path_factory.mktemp("tasktrain")
    opts = PackOptions(tokenizer=str(bpe_tokenizer_file), frame_mib=0.05, shard_mib=0.2)
    pack(((f"t{i}", t) for i, t in enumerate(stdlib_texts(100_000))), d / "train", opts)
    tasks = d / "tasks"
    tasks.mkdir()
    (tasks / "code.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ITEMS))
    lm = [{"context": "import", "continuation": "os"}, {"context": "def f(x", "continuation": "):"}]
    (tasks / "words.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lm))
    return d


def args(d, tmp_path, *extra: str) -> list[str]:
    return [
        "--data.path", str(d / "train"), "--out_dir", str(tmp_path), "--name", "run",
        "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "32",
        "--data.seq_len", "64", "--data.bucket_lengths", "64", "--data.batch_size", "4",
        "--max_steps", "6", "--eval_every", "3", "--ckpt_every", "0", "--samples", "0",
        "--no-progress", "--optim.lr", "3e-3", *extra,
    ]  # fmt: skip


def test_tasks_scored_in_the_loop_equal_the_checkpoint_s_afterwards(dataset, tmp_path):
    t = Trainer(parse_args(args(dataset, tmp_path, "--eval.tasks", str(dataset / "tasks"))))
    t.fit()
    t.close()
    log = (tmp_path / "run" / "train.log").read_text()
    for step in (3, 6):  # the evaluation steps; 6 is also the end: scored once
        assert log.count(f"step {step} tasks: core ") == 1, log
        assert f"step {step} code: acc " in log and f"step {step} words: acc " in log
    assert "step 1 tasks" not in log
    end = t.tasks.last
    assert [r.name for r in end.tasks] == ["code", "words"] and end.tasks[1].acc_norm is None
    assert set(end.scalars()) >= {"tasks/core", "tasks/code/acc_norm", "tasks/words/acc"}
    later = score_tasks(str(tmp_path / "run"), [str(dataset / "tasks")])
    for a, b in zip(end.tasks, later.tasks, strict=True):
        assert a.loglik == pytest.approx(b.loglik, abs=1e-5)
        assert (a.acc, a.acc_norm, a.acc_bytes) == (b.acc, b.acc_norm, b.acc_bytes)
    assert end.core == later.core
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "run" / "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("tasks/core")] == [3, 6]


def test_tasks_every_and_limit(dataset, tmp_path):
    extra = ["--eval.tasks", str(dataset / "tasks" / "code.jsonl"), "--eval.tasks_every", "4",
             "--eval.tasks_limit", "2", "--no-tensorboard", "--max_steps", "5"]  # fmt: skip
    t = Trainer(parse_args(args(dataset, tmp_path, *extra)))
    t.fit()
    t.close()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 4 tasks: core" in log and "step 5 tasks: core" in log  # every 4, and the end
    assert "step 3 tasks" not in log
    assert t.tasks.last.tasks[0].items == 2
    # The scoring runs the model the evaluation runs, eagerly as it does on the CPU (where
    # the run compiles, it is compiled at the evaluation's level: trainer-side, not here).
    assert isinstance(t.tasks.forward, Continuations) and not t.tasks.compiled
    assert t.tasks.forward.gpt is t.compiler.eval_module.gpt and t.compiler.eager


def test_a_bad_task_file_is_one_line_exit_2_before_anything_runs(dataset, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ITEMS[0]) + "\n" + json.dumps({**ITEMS[1], "gold": 7}) + "\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:2: gold 7 is out of range for 2 options$"):
        parse_args(args(dataset, tmp_path, "--eval.tasks", str(bad)))
    assert train_main(args(dataset, tmp_path, "--eval.tasks", str(bad))) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pytrain.train: error: {bad}:2: gold 7 is out of range for 2 options"
    assert not (tmp_path / "run").exists()
    assert eval_main([str(dataset / "train"), "--tasks", str(bad)]) == 2  # a dataset, not a model
    assert eval_main([str(tmp_path), "--tasks", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("pytrain.eval: error: ") for e in err)
    with pytest.raises(ConfigError, match="eval.tasks_every is -1"):
        parse_args(args(dataset, tmp_path, "--eval.tasks_every", "-1"))
