"""`pack-shards eval-tasks DATASET INPUT -o OUT`: a public benchmark, as users keep it
locally, into a task file (pytrain.tasks.items). Inputs: a Hugging Face `datasets` folder
written by save_to_disk (a split's folder, or a DatasetDict's with --split), a .jsonl file or
a .parquet file, with the fields the dataset's Hugging Face copy has. Each item is the one
lm-evaluation-harness's task of that name builds (its prompt, its choices, its gold index).

    hellaswag      Rowan/hellaswag            multiple_choice (acc_norm)
    arc_easy       allenai/ai2_arc ARC-Easy   multiple_choice
    arc_challenge  allenai/ai2_arc ARC-Challenge
    piqa           ybisk/piqa                 multiple_choice
    winogrande     allenai/winogrande         schema (the blank filled by each option)
    boolq          google/boolq, super_glue/boolq   multiple_choice (no / yes)
    lambada        EleutherAI/lambada_openai  language_modeling (the last word)"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pytrain.tasks.items import PARQUET_KEY, TaskError


class BadRecord(TaskError):
    """A record without the fields its dataset has."""


def _hellaswag_text(text: str) -> str:
    """lm-evaluation-harness's hellaswag preprocess: WikiHow's [title] markers and other
    bracketed tags out, double spaces once."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def hellaswag(r: dict) -> dict:
    ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
    return {"context": _hellaswag_text(r["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_text(e) for e in r["endings"]], "gold": int(r["label"])}  # fmt: skip


def arc(r: dict) -> dict:
    labels = list(r["choices"]["label"])
    return {"context": f"Question: {r['question']}\nAnswer:", "choices": list(r["choices"]["text"]),
            "gold": labels.index(r["answerKey"])}  # fmt: skip


def piqa(r: dict) -> dict:
    return {"context": f"Question: {r['goal']}\nAnswer:", "choices": [r["sol1"], r["sol2"]],
            "gold": int(r["label"])}  # fmt: skip


def winogrande(r: dict) -> dict:
    s = r["sentence"]
    blank = s.index("_")
    return {"contexts": [s[:blank] + r["option1"], s[:blank] + r["option2"]],
            "continuation": s[blank + 1 :].strip(), "gold": int(r["answer"]) - 1}  # fmt: skip


def boolq(r: dict) -> dict:
    answer = r["answer"] if "answer" in r else bool(r["label"])  # google/boolq, super_glue
    return {"context": f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:",
            "choices": ["no", "yes"], "gold": int(answer)}  # fmt: skip


def lambada(r: dict) -> dict:
    *words, last = r["text"].split(" ")
    return {"context": " ".join(words), "continuation": last}


DATASETS: dict[str, tuple[Callable[[dict], dict], dict]] = {
    "hellaswag": (hellaswag, {"kind": "multiple_choice"}),
    "arc_easy": (arc, {"kind": "multiple_choice"}),
    "arc_challenge": (arc, {"kind": "multiple_choice"}),
    "piqa": (piqa, {"kind": "multiple_choice"}),
    "winogrande": (winogrande, {"kind": "schema"}),
    "boolq": (boolq, {"kind": "multiple_choice", "core_metric": "acc"}),
    "lambada": (lambada, {"kind": "language_modeling"}),
}
"""Each dataset's item maker and the header its task file gets (the name is added)."""


def _arrow_files(folder: Path, split: str | None) -> list[Path]:
    """The .arrow files of a save_to_disk folder: a Dataset's, or a DatasetDict's split."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        if split is None or split not in splits:
            raise TaskError(f"{folder}: a DatasetDict of splits {', '.join(splits)}: pick one "
                            "with --split")  # fmt: skip
        folder = folder / split
    state = folder / "state.json"
    if not state.is_file():
        raise TaskError(f"{folder}: not a folder written by datasets' save_to_disk (no state.json)")
    return [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]


def records(path: Path, split: str | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) of every record of a save_to_disk folder, .jsonl or .parquet file."""
    if path.is_dir():
        import pyarrow as pa

        n = 0
        for f in _arrow_files(path, split):
            with pa.memory_map(str(f)) as source:
                for row in pa.ipc.open_stream(source).read_all().to_pylist():
                    n += 1
                    yield f"{path}: row {n}", row
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path}: row {n}", row
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    try:
                        yield f"{path}:{n}", json.loads(line)
                    except ValueError as e:
                        raise BadRecord(f"{path}:{n}: not a JSON line ({e})") from None
    else:
        raise TaskError(f"{path}: not a save_to_disk folder, .jsonl or .parquet file")


def convert(dataset: str, source: Path, out: Path, split: str | None = None,
            name: str = "") -> int:  # fmt: skip
    """Writes `source`'s records as the task file `out` (.jsonl or .parquet); the items
    written. A record the dataset's maker cannot read is a BadRecord naming it; nothing is
    written then."""
    make, header = DATASETS[dataset]
    items = []
    for where, r in records(source, split):
        try:
            items.append(make(r))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise BadRecord(f"{where}: not a {dataset} record ({type(e).__name__}: {e})") from None
    if not items:
        raise TaskError(f"{source}: no records in it")
    head = {"name": name or dataset, **header}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(items)
        pq.write_table(table.replace_schema_metadata({PARQUET_KEY: json.dumps(head).encode()}), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"task": head}) + "\n")
            for item in items:
                f.write(json.dumps(item, ensure_ascii=False) + "\n")
    tmp.replace(out)
    return len(items)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pack-shards eval-tasks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("dataset", choices=sorted(DATASETS), help="which benchmark INPUT holds")
    p.add_argument("input", type=Path, help="a save_to_disk folder, a .jsonl or a .parquet file")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="the task file to write: .jsonl, or .parquet (the parquet extra)")  # fmt: skip
    p.add_argument("--split", default=None, help="the split of a DatasetDict folder (validation)")
    p.add_argument("--name", default="", help="the task's name (default: DATASET)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    args = p.parse_args(argv)
    if args.output.suffix not in (".jsonl", ".parquet"):
        print(f"pack-shards eval-tasks: error: {args.output}: write .jsonl or .parquet",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.output.exists() and not args.overwrite:
        print(f"pack-shards eval-tasks: error: {args.output} exists (--overwrite replaces it)",
              file=sys.stderr)  # fmt: skip
        return 3
    if not args.input.exists():
        print(f"pack-shards eval-tasks: error: {args.input}: no such file or folder",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        n = convert(args.dataset, args.input, args.output, args.split, args.name)
    except TaskError as e:
        print(f"pack-shards eval-tasks: error: {e}", file=sys.stderr)
        return 1
    print(f"{n:,} {args.dataset} items -> {args.output}")
    return 0
