"""The task file format: one task a file, JSONL (or Parquet, the `parquet` extra), an item a
line (a row), and the task's settings in an optional header. docs/DOWNSTREAM.md describes it
for users; this module reads it and names the file and line of anything wrong.

Items, by the task's kind:

    multiple_choice    {"context": "...", "choices": ["...", "..."], "gold": 1}
    schema             {"contexts": ["...", "..."], "continuation": "...", "gold": 0}
    language_modeling  {"context": "...", "continuation": "..."}

A continuation follows its context after the task's `delimiter` (" " unless the header says
otherwise), as lm-evaluation-harness's `target_delimiter`. The header is a first line
{"task": {...}} in JSONL, the same JSON under the key `pytrain.task` of a Parquet file's
metadata; every key of it is optional (TaskSpec's fields). Without one, the kind is read off
the first item's keys and the name off the file's."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pytrain.config.errors import ConfigError

KINDS = ("multiple_choice", "schema", "language_modeling")
METRICS = ("acc", "acc_norm", "acc_bytes")
SUFFIXES = (".jsonl", ".parquet")
PARQUET_KEY = b"pytrain.task"
"""The Parquet metadata key that holds a task's header."""


HEADER_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "shots": ((int,), "whole number"),
    "fewshot_seed": ((int,), "whole number"),
    "chance": ((int, float), "number"),
}
"""The header keys that are not strings: their types, and the words that say them."""


class TaskError(ConfigError):
    """A task file, or a line of it, that cannot be read: one line naming the file and line."""


@dataclass(frozen=True)
class TaskSpec:
    """A task's settings: its file's header, with these defaults."""

    name: str = ""
    """How results are named (train.log, TensorBoard's `tasks/NAME/acc`); default the file's
    name without its suffix."""
    kind: str = ""
    """multiple_choice, schema or language_modeling; default read off the first item's keys."""
    shots: int = 0
    """Few-shot examples before each item's context."""
    fewshot_from: str = ""
    """A task file of the same kind the examples are drawn from (a path relative to this
    file's folder); default this file, never the item itself."""
    fewshot_seed: int = 1234
    """Seeds the draw: each item's examples depend on this and the item's line only."""
    fewshot_sep: str = "\n\n"
    """Between the examples, and between the last one and the item's context."""
    delimiter: str = " "
    """Between a context and its continuation (lm-evaluation-harness's target_delimiter)."""
    core_metric: str = ""
    """The accuracy this task brings to the CORE mean: acc, acc_norm or acc_bytes; default
    acc_norm for multiple choice, acc otherwise."""
    chance: float | None = None
    """The accuracy of a random guess, which CORE centres on; default the mean of 1 / the
    options of each item (0 for language modelling)."""

    @property
    def metric(self) -> str:
        return self.core_metric or ("acc_norm" if self.kind == "multiple_choice" else "acc")


@dataclass(frozen=True)
class Item:
    """One item in one shape for every kind: multiple choice has one context and several
    continuations, schema several contexts and one continuation, language modelling one
    of each. `gold` indexes the options (the longer of the two)."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int
    line: int
    """Its line in the file (its row, counted from 1, in Parquet)."""

    @property
    def options(self) -> int:
        return max(len(self.contexts), len(self.continuations))

    def option(self, i: int) -> tuple[str, str]:
        """(context, continuation) of option i."""
        ctx = self.contexts[i if len(self.contexts) > 1 else 0]
        return ctx, self.continuations[i if len(self.continuations) > 1 else 0]

    @property
    def choices(self) -> tuple[str, ...]:
        """What lm-evaluation-harness calls the choices, whose lengths acc_norm and acc_bytes
        divide by: the continuations, or a schema item's contexts."""
        return self.contexts if len(self.contexts) > 1 else self.continuations


@dataclass
class Task:
    spec: TaskSpec
    items: list[Item]
    path: Path
    pool: list[Item]
    """The items few-shot examples are drawn from (the task's own, or fewshot_from's)."""


def _header(raw, where: str) -> TaskSpec:
    if not isinstance(raw, dict):
        raise TaskError(f'{where}: the header\'s "task" is not an object')
    fields = {f.name: f for f in dataclasses.fields(TaskSpec)}
    for key, value in raw.items():
        if key not in fields:
            raise TaskError(f"{where}: unknown header key {key!r} (known: {', '.join(fields)})")
        want, word = HEADER_TYPES.get(key, ((str,), "string"))
        if isinstance(value, bool) or not isinstance(value, want):
            raise TaskError(f"{where}: header key {key!r} is {value!r}; expected a {word}")
    spec = TaskSpec(**raw)
    if spec.kind and spec.kind not in KINDS:
        raise TaskError(f"{where}: kind {spec.kind!r}; expected one of {', '.join(KINDS)}")
    if spec.core_metric and spec.core_metric not in METRICS:
        raise TaskError(
            f"{where}: core_metric {spec.core_metric!r}; expected one of {', '.join(METRICS)}"
        )
    if spec.shots < 0:
        raise TaskError(f"{where}: shots is {spec.shots}; expected 0 or more")
    if spec.chance is not None and not 0 <= spec.chance < 1:
        raise TaskError(f"{where}: chance is {spec.chance}; expected 0 <= it < 1")
    return spec


def kind_of(row: dict) -> str | None:
    """The kind an item's keys say, without a header."""
    if "choices" in row:
        return "multiple_choice"
    if "contexts" in row:
        return "schema"
    if "continuation" in row:
        return "language_modeling"
    return None


def _texts(row: dict, key: str, where: str, least: int) -> tuple[str, ...]:
    v = row.get(key)
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise TaskError(f"{where}: {key!r} is not a list of strings")
    if len(v) < least:
        raise TaskError(f"{where}: {key!r} has {len(v)} entries; expected {least} or more")
    for i, x in enumerate(v):
        if not x:
            raise TaskError(f"{where}: {key}[{i}] is empty")
    return tuple(v)


def _text(row: dict, key: str, where: str, empty: bool = False) -> str:
    v = row.get(key)
    if not isinstance(v, str):
        raise TaskError(f"{where}: {key!r} is missing or not a string")
    if not v and not empty:
        raise TaskError(f"{where}: {key!r} is empty")
    return v


def _gold(row: dict, options: int, where: str) -> int:
    g = row.get("gold")
    if isinstance(g, bool) or not isinstance(g, int):
        raise TaskError(f"{where}: 'gold' is {g!r}; expected the index of the right option")
    if not 0 <= g < options:
        raise TaskError(f"{where}: gold {g} is out of range for {options} options")
    return g


def parse_item(row, kind: str, line: int, where: str) -> Item:
    """An item of `kind` from a decoded line; TaskError naming `where` otherwise."""
    if not isinstance(row, dict):
        raise TaskError(f"{where}: not a JSON object")
    if kind == "multiple_choice":
        ctx = _text(row, "context", where, empty=True)
        choices = _texts(row, "choices", where, 2)
        return Item((ctx,), choices, _gold(row, len(choices), where), line)
    if kind == "schema":
        contexts = _texts(row, "contexts", where, 2)
        cont = _text(row, "continuation", where)
        return Item(contexts, (cont,), _gold(row, len(contexts), where), line)
    ctx = _text(row, "context", where, empty=True)
    return Item((ctx,), (_text(row, "continuation", where),), 0, line)


def _rows(path: Path) -> tuple[dict | None, list[tuple[int, object]]]:
    """(the header's "task" value or None, [(line, decoded item)]) of a task file."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise TaskError(
                f"{path}: reading Parquet needs pyarrow: pip install 'pytrain[parquet]'"
            ) from None
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow's own errors: not a Parquet file, truncated
            raise TaskError(f"{path}: not a readable Parquet file ({e})") from None
        meta = (table.schema.metadata or {}).get(PARQUET_KEY)
        try:
            header = json.loads(meta) if meta is not None else None
        except ValueError:
            raise TaskError(f"{path}: its metadata {PARQUET_KEY.decode()} is not JSON") from None
        return header, list(enumerate(table.to_pylist(), 1))
    header = None
    rows: list[tuple[int, object]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise TaskError(f"{path}:{n}: not a JSON line ({e})") from None
        if not rows and header is None and isinstance(row, dict) and list(row) == ["task"]:
            header = row["task"]
            continue
        rows.append((n, row))
    return header, rows


def _where(path: Path, line: int) -> str:
    return f"{path}: row {line}" if path.suffix == ".parquet" else f"{path}:{line}"


def read_items(path: Path) -> tuple[TaskSpec, list[Item]]:
    """A task file's settings (defaults filled in) and its items."""
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    raw, rows = _rows(path)
    spec = _header(raw, f"{path}: header") if raw is not None else TaskSpec()
    if not rows:
        raise TaskError(f"{path}: no items in it")
    kind = spec.kind or (kind_of(rows[0][1]) if isinstance(rows[0][1], dict) else None)
    if kind is None:
        raise TaskError(
            f"{_where(path, rows[0][0])}: cannot tell the task's kind: an item has 'choices' "
            "(multiple_choice), 'contexts' (schema) or 'continuation' (language_modeling)"
        )
    name = spec.name or path.name.removesuffix(path.suffix)
    spec = dataclasses.replace(spec, kind=kind, name=name)
    return spec, [parse_item(row, kind, n, _where(path, n)) for n, row in rows]


def read_task(path: str | Path) -> Task:
    """A task file with its few-shot pool; TaskError (one line) for anything wrong in it."""
    path = Path(path)
    spec, items = read_items(path)
    pool = items
    if spec.fewshot_from:
        source = path.parent / spec.fewshot_from
        pool_spec, pool = read_items(source)
        if pool_spec.kind != spec.kind:
            raise TaskError(
                f"{path}: fewshot_from {spec.fewshot_from} holds {pool_spec.kind} items, this "
                f"task {spec.kind} ones"
            )
    available = len(pool) - (0 if spec.fewshot_from else 1)
    if spec.shots > available:
        raise TaskError(
            f"{path}: shots {spec.shots}, but only {available} items to draw examples from"
        )
    return Task(spec, items, path, pool)


def task_files(paths: list[str]) -> list[Path]:
    """The task files `paths` name: files, or folders of them (their *.jsonl and *.parquet,
    less those another task of the folder names as its fewshot_from), in order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
            pools = {
                (p / s.fewshot_from).resolve()
                for s in (read_items(f)[0] for f in found)
                if s.fewshot_from
            }
            found = [f for f in found if f.resolve() not in pools]
            if not found:
                raise TaskError(f"{p}: no task files (*.jsonl, *.parquet) in it")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise TaskError(f"{p}: no such task file or folder")
    return out


def read_tasks(paths: list[str]) -> list[Task]:
    """Every task `paths` name (task_files); two of one name are refused."""
    tasks = [read_task(f) for f in task_files(paths)]
    seen: dict[str, Path] = {}
    for t in tasks:
        if t.spec.name in seen:
            raise TaskError(
                f"{t.path}: task name {t.spec.name!r} is also {seen[t.spec.name]}'s; name one "
                'of them in its header ({"task": {"name": ...}})'
            )
        seen[t.spec.name] = t.path
    return tasks
