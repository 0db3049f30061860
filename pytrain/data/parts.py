"""pack-shards on many machines: the inputs split into N parts packed by N independent tasks
(any engine runs them: Ray tasks, a Slurm array, a shell loop), then joined by `merge`.

The partition is a pure function of the inputs and N: the inputs in pack-shards' order
(files sorted, a parquet file split by row group), cut into N contiguous runs of about equal
bytes. Task i packs run i into `OUT/part-<i>-of-<N>/`, a complete dataset of its own (shards,
tokenizer, a manifest saying which task it is and what it read), written atomically as every
dataset is; a task that died is rerun alone, and a finished part is not rewritten. `merge`
writes one manifest over every part's shards (no shard is copied or renamed), last, so that a
reader never sees half a dataset. Because the runs are contiguous and in order, the merged
dataset holds the documents and token ids of a single `pack-shards` of the same inputs, in
the same order (tests/test_parts.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from pytrain import _loader
from pytrain.data.inputs import (
    BadInputs,
    InputError,
    ReadOptions,
    expand,
    parquet_row_groups,
    read_documents,
)
from pytrain.data.shards import MANIFEST, PackOptions, PackReport, pack, read_manifest

PART = re.compile(r"part-(\d{5})-of-(\d{5})")


class PartError(ValueError):
    """Parts that cannot be merged, or a part directory that holds another task's work."""


@dataclass(frozen=True)
class Unit:
    """What one task reads whole: a file, or one row group of a parquet file."""

    path: Path
    row_group: int | None
    size: int

    @property
    def name(self) -> str:
        return (
            str(self.path) if self.row_group is None else f"{self.path}#row_group={self.row_group}"
        )


def units(inputs: list[str]) -> list[Unit]:
    """The inputs as pack-shards reads them, in its order, cut where tasks may cut them."""
    out: list[Unit] = []
    for path in expand(inputs):
        if path.name.endswith(".parquet"):
            out += [Unit(path, i, size) for i, size in enumerate(parquet_row_groups(path))]
        else:
            out.append(Unit(path, None, path.stat().st_size))
    return out


def partition(items: list[Unit], tasks: int) -> list[list[Unit]]:
    """`tasks` contiguous runs of `items` of about equal size: an item goes to the task whose
    share of the total holds the item's middle byte."""
    total = sum(u.size for u in items) or 1
    runs: list[list[Unit]] = [[] for _ in range(tasks)]
    before = 0
    for u in items:
        middle = before + u.size / 2
        runs[min(tasks - 1, int(middle * tasks / total))].append(u)
        before += u.size
    return runs


def part_dir(out: Path, task: int, tasks: int) -> Path:
    return Path(out) / f"part-{task:05d}-of-{tasks:05d}"


def pack_part(inputs: list[str], out: Path, task: int, tasks: int, opts: PackOptions,
              read: ReadOptions, bad: BadInputs, **pack_kw) -> PackReport | None:  # fmt: skip
    """Task `task` of `tasks`: packs its run of the inputs into its part directory. None if
    that part is already complete (a rerun of a finished task writes nothing)."""
    if not 0 <= task < tasks:
        raise PartError(f"--task {task} is not one of the {tasks} tasks (0 to {tasks - 1})")
    mine = partition(units(inputs), tasks)[task]
    plan = {"task": task, "tasks": tasks, "units": [u.name for u in mine]}
    where = part_dir(out, task, tasks)
    if (where / MANIFEST).exists():
        if read_manifest(where).get("part") == plan:
            return None
        raise PartError(
            f"{where} holds a part of other inputs (its manifest lists other files); "
            "remove it, or pack these inputs into another output directory"
        )
    docs = (doc for u in mine for doc in read_documents(u.path, read, bad, u.row_group))
    return pack(docs, where, opts, bad=bad, part=plan, overwrite=True, **pack_kw)


def merge(out: Path) -> dict:
    """Writes OUT/manifest.json over every part's shards; returns it. Refuses, naming what,
    a missing task and parts made with another tokenizer, format, dtype or arguments."""
    out = Path(out)
    if not out.is_dir():  # a mistyped path: say so, not that it holds no parts
        raise PartError(f"{out}: no such directory")
    found = {}
    for d in sorted(out.glob("part-*-of-*")):
        if (name := PART.fullmatch(d.name)) and d.is_dir():
            found[d] = (int(name.group(1)), int(name.group(2)))
    if not found:
        raise PartError(
            f"{out}: no part-<i>-of-<n> directories (pack them with --task I --tasks N)"
        )
    counts = {n for _, n in found.values()}
    if len(counts) > 1:
        raise PartError(f"{out}: parts of {' and '.join(map(str, sorted(counts)))} tasks are mixed")
    tasks = counts.pop()
    missing = [i for i in range(tasks) if not (part_dir(out, i, tasks) / MANIFEST).exists()]
    if missing:
        names = ", ".join(part_dir(out, i, tasks).name for i in missing[:10])
        raise PartError(
            f"{out}: {len(missing)} of {tasks} part(s) missing or unfinished ({names}); "
            f"run those tasks (--task I --tasks {tasks}), then merge again"
        )
    manifests = [read_manifest(part_dir(out, i, tasks)) for i in range(tasks)]
    first = manifests[0]
    for i, m in enumerate(manifests):
        where = part_dir(out, i, tasks)
        if m.get("format_version") != _loader.FORMAT_VERSION:
            raise PartError(f"{where}: format version {m.get('format_version')}, this pack-shards "
                            f"writes {_loader.FORMAT_VERSION}; repack that part")  # fmt: skip
        for key, what in (
            ("tokenizer", "tokenizer"),
            ("dtype", "token dtype"),
            ("args", "arguments"),
        ):
            if _same_everywhere(m.get(key)) != _same_everywhere(first.get(key)):
                raise PartError(
                    f"{where}: made with another {what} than {part_dir(out, 0, tasks).name} "
                    f"({key} differs); every task must run the same pack-shards command"
                )
        if (m.get("part") or {}).get("task") != i:
            raise PartError(f"{where}: its manifest does not say it is task {i} of {tasks}")
    shards = [{**s, "file": f"{part_dir(out, i, tasks).name}/{s['file']}"}
              for i, m in enumerate(manifests) for s in m["shards"]]  # fmt: skip
    if not shards:
        raise PartError(f"{out}: no part holds a document")
    fields = {
        "dtype": first["dtype"],
        "tokenizer": first["tokenizer"],
        "totals": {
            k: sum(m["totals"].get(k, 0) for m in manifests)
            for k in ("skipped_empty", "input_bytes")
        },  # fmt: skip
        "shards": shards,
        "args": first["args"],
        "created_by": "pytrain pack-shards merge",
        "parts": tasks,
    }
    bads = [m["bad_input"] for m in manifests if "bad_input" in m]
    if bads:
        listed = [x for b in bads for x in b["listed"]]
        fields["bad_input"] = {
            "policy": bads[0]["policy"], "skipped": sum(b["skipped"] for b in bads),
            "listed": listed[:1000], "listed_all": all(b["listed_all"] for b in bads) and len(listed) <= 1000,
        }  # fmt: skip
    tokenizer = part_dir(out, 0, tasks) / "tokenizer.json"
    if tokenizer.exists():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    # The manifest last, renamed into place: the directory is a dataset only once it is whole.
    tmp = out / f".merge-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _loader.write_manifest(str(tmp), json.dumps(fields))
        os.replace(tmp / MANIFEST, out / MANIFEST)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return read_manifest(out)


def _same_everywhere(section):
    """A manifest section without what may differ between machines: where the tokenizer file
    was (its content is compared by its sha256)."""
    if not isinstance(section, dict):
        return section
    return {k: v for k, v in section.items() if k not in ("name", "tokenizer")}


__all__ = [
    "InputError",
    "PartError",
    "Unit",
    "merge",
    "pack_part",
    "part_dir",
    "partition",
    "units",
]
