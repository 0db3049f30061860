"""The shape of the code base, checked: imports run one way (no cycle among pytrain's
modules), the trainer stays a loop, and nothing committed names a path of the machine it
was written on."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_graph() -> dict[str, set[str]]:
    mods = {}
    for p in (ROOT / "pytrain").rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {}
    for name, p in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):  # TYPE_CHECKING and local imports too
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name and d != "pytrain"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d not in state and (found := visit(d, [*path, d])):
                return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n, [n])):
            return found
    return None


def test_no_import_cycle_among_pytrain_modules():
    assert _cycle(_module_graph()) is None, " -> ".join(_cycle(_module_graph()) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it finds one


def test_the_trainer_stays_a_loop():
    lines = len((ROOT / "pytrain/train/trainer.py").read_text().splitlines())
    assert lines <= 450, (
        f"pytrain/train/trainer.py has {lines} lines: move what is not the loop out"
    )


MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home/\w+)/")


def test_nothing_committed_names_a_path_of_this_machine():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    hits = []
    for name in files.split():
        if Path(name).suffix in {".md", ".py", ".toml", ".rs", ".yml", ".yaml", ".txt", ".sbatch"}:
            for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
                if MACHINE_PATH.search(line):
                    hits.append(f"{name}:{i}: {line.strip()[:120]}")
    assert not hits, "name files relative to the repository:\n" + "\n".join(hits)
    # The pattern finds one (built from parts, so this file names none itself).
    absolute, relative = "/".join(["see ", "work", ".device"]), "/".join(["a", "work", "b"])
    assert MACHINE_PATH.search(absolute) and not MACHINE_PATH.search(relative)
