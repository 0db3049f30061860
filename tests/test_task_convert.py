"""`pack-shards eval-tasks`: the public benchmarks, as small files in each layout users keep
them in (JSONL, Parquet, a `datasets` save_to_disk folder), into task files that read back
as the items lm-evaluation-harness's tasks of those names build."""

from __future__ import annotations

import json

import pytest

from pytrain.pack_shards import main as pack_shards
from pytrain.tasks.items import read_task
from pytrain.tasks.requests import requests

# One record of each, with the fields (and their types) of the Hugging Face copies.
RECORDS = {
    "hellaswag": {
        "ind": 4, "activity_label": "Removing ice from car",
        "ctx_a": "Then, the man writes over the snow covering the window of a car.",
        "ctx_b": "then", "ctx": "unused", "source_id": "x", "split": "val",
        "split_type": "indomain", "label": "3",
        "endings": [", the man adds wax [title] to it.", ", a person boards a ski lift.",
                    ", the man puts on a coat.", ", the man continues removing the snow."],
    },
    "arc_easy": {
        "id": "Mercury_7175875", "question": "Which effect is most likely?", "answerKey": "C",
        "choices": {"text": ["Density falls.", "Years lengthen.", "Days shorten.", "Nothing."],
                    "label": ["A", "B", "C", "D"]},
    },
    "piqa": {"goal": "When boiling butter, you can", "sol1": "Pour it onto a plate",
             "sol2": "Pour it into a jar", "label": 1},
    "winogrande": {"sentence": "Sarah was a better surgeon than Maria so _ got the hard cases.",
                   "option1": "Sarah", "option2": "Maria", "answer": "1"},
    "boolq": {"question": "is the sky blue", "passage": "The sky is blue by day.", "answer": True},
    "lambada": {"text": "She held the stone out to her friend Lucy"},
}  # fmt: skip

EXPECTED = {  # (kind, the gold request's context, its continuation, options)
    "hellaswag": ("multiple_choice", "Removing ice from car: Then, the man writes over the snow "
                  "covering the window of a car. Then", " , the man continues removing the snow.", 4),
    "arc_easy": ("multiple_choice", "Question: Which effect is most likely?\nAnswer:", " Days shorten.", 4),
    "piqa": ("multiple_choice", "Question: When boiling butter, you can\nAnswer:", " Pour it into a jar", 2),
    "winogrande": ("schema", "Sarah was a better surgeon than Maria so Sarah", " got the hard cases.", 2),
    "boolq": ("multiple_choice", "The sky is blue by day.\nQuestion: is the sky blue?\nAnswer:", " yes", 2),
    "lambada": ("language_modeling", "She held the stone out to her friend", " Lucy", 1),
}  # fmt: skip


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check(out, dataset):
    kind, context, continuation, options = EXPECTED[dataset]
    task = read_task(out)
    assert (task.spec.name, task.spec.kind) == (dataset, kind)
    item = task.items[0]
    gold = requests(task)[item.gold]
    assert (gold.context, gold.continuation, item.options) == (context, continuation, options)


@pytest.mark.parametrize("dataset", sorted(EXPECTED))
def test_each_dataset_from_jsonl(tmp_path, dataset, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [RECORDS[dataset]])
    out = tmp_path / "out.jsonl"
    assert pack_shards(["eval-tasks", dataset, str(src), "-o", str(out)]) == 0
    assert f"1 {dataset} items -> {out}" in capsys.readouterr().out
    check(out, dataset)


def test_arc_challenge_and_super_glue_boolq_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist([RECORDS["arc_easy"]]), tmp_path / "arc.parquet")
    out = tmp_path / "arc.parquet.out.jsonl"
    assert (
        pack_shards(["eval-tasks", "arc_challenge", str(tmp_path / "arc.parquet"), "-o", str(out)])
        == 0
    )
    assert read_task(out).spec.name == "arc_challenge" and read_task(out).items[0].gold == 2
    glue = {k: v for k, v in RECORDS["boolq"].items() if k != "answer"} | {"label": 1, "idx": 0}
    pq.write_table(pa.Table.from_pylist([glue]), tmp_path / "boolq.parquet")
    assert pack_shards(["eval-tasks", "boolq", str(tmp_path / "boolq.parquet"), "-o",
                        str(tmp_path / "bq.parquet")]) == 0  # fmt: skip
    check(tmp_path / "bq.parquet", "boolq")


def test_save_to_disk_folders_a_dataset_and_a_dataset_dict(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([RECORDS["hellaswag"]] * 3).save_to_disk(str(tmp_path / "hs"))
    assert (
        pack_shards(
            ["eval-tasks", "hellaswag", str(tmp_path / "hs"), "-o", str(tmp_path / "hs.jsonl")]
        )
        == 0
    )
    assert len(read_task(tmp_path / "hs.jsonl").items) == 3
    check(tmp_path / "hs.jsonl", "hellaswag")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list([RECORDS["winogrande"]] * 2),
                               "validation": datasets.Dataset.from_list([RECORDS["winogrande"]])})  # fmt: skip
    dd.save_to_disk(str(tmp_path / "wg"))
    args = ["eval-tasks", "winogrande", str(tmp_path / "wg"), "-o", str(tmp_path / "wg.jsonl")]
    assert pack_shards(args) == 1
    assert (
        "a DatasetDict of splits train, validation: pick one with --split"
        in capsys.readouterr().err
    )
    assert pack_shards([*args, "--split", "validation"]) == 0
    check(tmp_path / "wg.jsonl", "winogrande")


def test_a_bad_record_is_one_line_naming_it_and_nothing_is_written(tmp_path, capsys):
    good = RECORDS["hellaswag"]
    src = write_jsonl(tmp_path / "in.jsonl", [good, {**good, "label": ""}])  # a test split's
    out = tmp_path / "out.jsonl"
    assert pack_shards(["eval-tasks", "hellaswag", str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"pack-shards eval-tasks: error: {src}:2: not a hellaswag record (ValueError"
    )
    assert "\n" not in err and not out.exists()
    out.write_text("")
    assert pack_shards(["eval-tasks", "hellaswag", str(src), "-o", str(out)]) == 3
    assert (
        pack_shards(
            ["eval-tasks", "piqa", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "p.jsonl")]
        )
        == 2
    )
