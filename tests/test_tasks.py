"""Downstream task files and their scoring (pytrain.tasks): the format's three kinds in JSONL
and Parquet, one line naming file and line for each bad input, few-shot draws, lm-evaluation-
harness's token split, packed rows scoring as one request a row does, the accuracies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytrain.model.config import ModelConfig
from pytrain.model.gpt import GPT
from pytrain.tasks import metrics, scoring
from pytrain.tasks.items import TaskError, read_task, read_tasks
from pytrain.tasks.requests import requests
from pytrain.tasks.suite import TaskSuite


def write_jsonl(path: Path, rows: list[dict], header: dict | None = None) -> Path:
    lines = ([json.dumps({"task": header})] if header is not None else []) + [
        json.dumps(r, ensure_ascii=False) for r in rows
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


MC = [
    {"context": "The sky is", "choices": ["blue", "green", "très loin"], "gold": 0},
    {"context": "Two plus two is ", "choices": ["four", "five"], "gold": 0},
    {"context": "Water is", "choices": ["dry", "wet", "日本語"], "gold": 1},
    {"context": "Cats say", "choices": ["woof", "meow"], "gold": 1},
]


def test_reads_each_kind_without_a_header(tmp_path):
    mc = read_task(write_jsonl(tmp_path / "mc.jsonl", MC))
    assert (mc.spec.kind, mc.spec.name, len(mc.items)) == ("multiple_choice", "mc", 4)
    assert mc.items[2].choices == ("dry", "wet", "日本語") and mc.items[2].gold == 1
    schema = read_task(write_jsonl(tmp_path / "wg.jsonl", [
        {"contexts": ["Anna gave Bob", "Bob gave Anna"], "continuation": "a book.", "gold": 1}]))  # fmt: skip
    assert schema.spec.kind == "schema" and schema.items[0].option(1) == (
        "Bob gave Anna",
        "a book.",
    )
    lm = read_task(write_jsonl(tmp_path / "lm.jsonl", [{"context": "a b", "continuation": "c"}]))
    assert lm.spec.kind == "language_modeling" and lm.spec.metric == "acc"
    assert mc.spec.metric == "acc_norm"


def test_header_sets_name_kind_and_few_shot(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", MC, {"name": "toy", "shots": 2, "fewshot_seed": 7,
                                                  "fewshot_sep": "\n", "delimiter": ": "})  # fmt: skip
    task = read_task(path)
    reqs = requests(task)
    assert task.spec.name == "toy" and len(reqs) == 10  # 3 + 2 + 3 + 2 options
    first = reqs[0].context
    assert first.endswith("\nThe sky is") and reqs[0].continuation == ": blue"
    assert "The sky is" not in first[: -len("The sky is")]  # never the item itself
    assert first.count("\n") == 2  # two examples, each followed by the separator
    assert requests(read_task(path))[0].context == first  # the same draw every time
    other = write_jsonl(tmp_path / "y.jsonl", MC, {"shots": 2, "fewshot_seed": 8})
    assert requests(read_task(other))[0].context != first.replace("\n", "\n\n")


def test_few_shot_from_a_named_file_and_a_folder_leaves_it_out(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"context": "Q", "choices": ["x", "y"], "gold": 1}])
    write_jsonl(tmp_path / "test.jsonl", MC[:2], {"shots": 1, "fewshot_from": "train.jsonl"})
    tasks = read_tasks([str(tmp_path)])
    assert [t.spec.name for t in tasks] == ["test"]
    assert requests(tasks[0])[0].context == "Q y\n\nThe sky is"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", ":2: not a JSON line"),
        ('{"context": "a", "choices": ["x", "y"], "gold": 2}', ":2: gold 2 is out of range for 2 options"),
        ('{"context": "a", "choices": ["x", ""], "gold": 0}', ":2: choices[1] is empty"),
        ('{"context": "a", "choices": ["x", "y"], "gold": "0"}', ":2: 'gold' is '0'; expected"),
        ('{"context": 3, "choices": ["x", "y"], "gold": 0}', ":2: 'context' is missing or not a string"),
        ('[1, 2]', ":2: not a JSON object"),
    ],
)  # fmt: skip
def test_bad_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MC[0]) + "\n" + line + "\n")
    with pytest.raises(TaskError) as e:
        read_task(path)
    assert str(e.value).startswith(f"{path}{message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_bad_header_and_names(tmp_path):
    with pytest.raises(TaskError, match="unknown header key 'shot'"):
        read_task(write_jsonl(tmp_path / "a.jsonl", MC, {"shot": 1}))
    with pytest.raises(TaskError, match="shots 9, but only 3 items"):
        read_task(write_jsonl(tmp_path / "b.jsonl", MC, {"shots": 9}))
    write_jsonl(tmp_path / "c.jsonl", MC, {"name": "same"})
    write_jsonl(tmp_path / "d.jsonl", MC, {"name": "same"})
    with pytest.raises(TaskError, match="task name 'same' is also"):
        read_tasks([str(tmp_path / "c.jsonl"), str(tmp_path / "d.jsonl")])
    with pytest.raises(TaskError, match="no such task file or folder"):
        read_tasks([str(tmp_path / "missing.jsonl")])


def test_parquet_with_its_header_in_the_metadata(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.Table.from_pylist(MC).replace_schema_metadata(
        {b"pytrain.task": json.dumps({"name": "pq", "delimiter": ""}).encode()}
    )
    pq.write_table(table, tmp_path / "t.parquet")
    task = read_task(tmp_path / "t.parquet")
    assert (task.spec.name, task.spec.delimiter, task.items[0].choices[2]) == (
        "pq",
        "",
        "très loin",
    )
    bad = pa.Table.from_pylist([{**MC[0], "gold": 5}])
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(TaskError, match=r"bad.parquet: row 1: gold 5 is out of range"):
        read_task(tmp_path / "bad.parquet")


def test_token_split_is_lm_evaluation_harness_s():
    def encode(s: str, special: bool = True) -> list[int]:  # merges " b" into one token
        return [ord(c) if c != "\x01" else 0 for c in s.replace(" b", "\x01")]

    # The context's trailing space moves to the continuation, and the continuation is the
    # tail of the whole string's encoding: " b" is one token there.
    assert scoring.encode_pair(encode, "a ", "bc", 99) == ([ord("a")], [0, ord("c")])
    assert scoring.encode_pair(encode, "", "bc", 99) == ([99], [ord("b"), ord("c")])
    # An empty context whose continuation starts with the prefix token: that token is it.
    assert scoring.encode_pair(encode, "", "cb", ord("c")) == ([ord("c")], [ord("b")])


def test_pack_rows_fills_rows_without_overflow():
    lengths = [5, 9, 3, 7, 2, 8, 1, 10]
    rows = scoring.pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(8))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert len(rows) == 5  # 45 tokens: at least 5 rows of 10


def tiny_gpt(window: int = 32) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, n_layer=2, n_head=2, d_model=32, max_seq_len=window)
    return GPT(cfg).eval()


def byte_encode(s: str, special: bool = True) -> list[int]:
    return [b % 128 for b in s.encode()]


def test_packed_rows_score_as_each_request_alone(tmp_path):
    gpt = tiny_gpt()
    path = write_jsonl(tmp_path / "mc.jsonl", MC)
    suite = TaskSuite(read_tasks([str(path)]), byte_encode, 0, window=32)
    packed = scoring.score(
        gpt, suite.segments, row_len=32, batch_rows=2, device=torch.device("cpu"), packed=True
    )
    alone = scoring.score(gpt, suite.segments, row_len=32, batch_rows=1,
                          device=torch.device("cpu"), packed=False)  # fmt: skip
    assert packed.rows < alone.rows == len(suite.segments)
    for seg, ll, g in zip(suite.segments, packed.loglik, packed.greedy, strict=True):
        ids = torch.tensor([seg.inputs])
        logp = torch.log_softmax(gpt(ids).float(), dim=-1)[0]
        k = len(seg.targets)
        want = sum(logp[len(seg.inputs) - k + j, t].item() for j, t in enumerate(seg.targets))
        assert ll == pytest.approx(want, abs=1e-5)
        greedy = all(
            logp[len(seg.inputs) - k + j].argmax().item() == t for j, t in enumerate(seg.targets)
        )
        assert g == greedy
    assert alone.loglik == pytest.approx(packed.loglik, abs=1e-5)


def test_a_context_longer_than_the_window_is_cut_from_the_left_and_counted(tmp_path):
    long = {"context": "x" * 50, "choices": ["ab", "cd"], "gold": 0}
    path = write_jsonl(tmp_path / "long.jsonl", [long, MC[0]])
    suite = TaskSuite(read_tasks([str(path)]), byte_encode, 0, window=24)
    assert [len(s.inputs) for s in suite.segments[:3]] == [24, 24, len("The sky is blue") - 1]
    assert suite.segments[0].targets == byte_encode(" ab")
    assert suite.segments[0].inputs[:-2] == byte_encode("x" * 22)
    r = suite.score(tiny_gpt(24), torch.device("cpu")).tasks[0]
    assert r.truncated == 2 and r.items == 2


def test_accuracies_as_lm_evaluation_harness_defines_them(tmp_path):
    # One item; "日本" has 2 characters and 6 bytes, "abcd" 4 and 4: the three rules disagree.
    task = read_task(write_jsonl(tmp_path / "t.jsonl", [
        {"context": "c", "choices": ["a", "日本", "abcd"], "gold": 1}]))  # fmt: skip
    reqs = requests(task)
    ll = [-1.0, -2.2, -4.0]  # acc: a; per char: -1, -1.1, -1 -> a; per byte: -1, -0.37, -1 -> 日本
    r = metrics.task_result(task, reqs, ll, [False] * 3, 0)
    assert (r.acc, r.acc_norm, r.acc_bytes) == (0.0, 0.0, 1.0)
    assert r.chance == pytest.approx(1 / 3) and r.centered == pytest.approx(-0.5)
    lm = read_task(write_jsonl(tmp_path / "lm.jsonl", [{"context": "a", "continuation": "b"}] * 2))
    r2 = metrics.task_result(lm, requests(lm), [-1.0, -1.0], [True, False], 0)
    assert (r2.acc, r2.acc_norm, r2.chance, r2.centered) == (0.5, None, 0.0, 0.5)
    assert metrics.core([r, r2]) == pytest.approx(0.0)


def test_compiled_scoring_of_fixed_widths_equals_eager_and_compiles_once_a_width(tmp_path):
    # What the trainer does where it compiles: rows padded to a few fixed widths (64 and
    # 128 here) and picks to the most of their width, so the four requests' four lengths
    # make two graphs, and scoring again makes none. Dynamo's tracing alone (backend "eager"):
    # Inductor's C++ compile would take a minute on a CPU. A 1-layer model: 6 s on 2 cores.
    from torch._dynamo.utils import counters

    items = [{"context": "x" * n + " is", "choices": ["a", "bcde"], "gold": 0} for n in (10, 70)]
    suite = TaskSuite(read_tasks([str(write_jsonl(tmp_path / "w.jsonl", items))]), byte_encode,
                      0, window=128)  # fmt: skip
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, n_layer=1, n_head=2, d_model=32, max_seq_len=128)
    gpt, cpu = GPT(cfg).eval(), torch.device("cpu")
    eager = scoring.score(gpt, suite.segments, row_len=128, batch_rows=1, device=cpu, packed=False)
    assert len({len(s.inputs) for s in suite.segments}) == 4
    compiled = torch.compile(scoring.Continuations(gpt), backend="eager", dynamic=False)
    graphs = []
    for _ in range(2):
        before = counters["stats"]["unique_graphs"]
        r = scoring.score(gpt, suite.segments, row_len=128, batch_rows=1, device=cpu,
                          packed=False, forward=compiled, fixed_shapes=True)  # fmt: skip
        graphs.append(counters["stats"]["unique_graphs"] - before)
        assert r.loglik == pytest.approx(eager.loglik, abs=1e-5) and r.greedy == eager.greedy
    assert graphs == [2, 0]
    assert (eager.tokens, r.tokens) == (
        sum(len(s.inputs) for s in suite.segments),
        2 * (64 + 128),
    )
