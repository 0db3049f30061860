"""benchmarks/: the reproducible benchmarks whose figures BENCHMARKS.md cites, each a script
run from the repository root (`python benchmarks/NAME.py --help` says what it measures and
how). This module is what they share: the line naming the machine a run measured (every
benchmark prints it first), the median of a run's steady steps, Markdown tables, train.log's
step lines, a run's peak GPU memory, real text to tokenize, a timed read of a loader, the
line that says why a launched run failed, and the end of a launched job with all its
processes.
It imports no torch until a function needs it (read_steps); machine_line asks a child
process."""

from __future__ import annotations

import os
import platform
import re
import shutil
import site
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

# torch's versions and GPUs, asked of a child Python: the benchmark's own process stays as it
# was (no torch, no CUDA context), since a child's peak RSS starts at its parent's size and
# several benchmarks measure their children's.
_TORCH = """
import torch
props = map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))
print(torch.__version__, torch.version.cuda or "-")
print(", ".join(f"{p.name} ({p.total_memory / 2**30:.1f} GiB)" for p in props))
"""


def _nvidia_smi_gpus() -> str:
    """The GPUs as nvidia-smi names them (model, memory, power limit), alike ones counted
    once; empty where there is no nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    query = "--query-gpu=name,memory.total,power.limit"
    r = subprocess.run([smi, query, "--format=csv,noheader,nounits"],
                       capture_output=True, text=True) if smi else None  # fmt: skip
    gpus = []
    for line in r.stdout.strip().splitlines() if r and r.returncode == 0 else []:
        name, mib, watts = (x.strip() for x in line.split(","))
        power = f", {float(watts):.0f} W" if watts.replace(".", "").isdigit() else ""
        gpus.append(f"{name} ({float(mib) / 1024:.1f} GiB{power})")
    return ", ".join(f"{gpus.count(g)}x {g}" for g in dict.fromkeys(gpus))


def _cpus() -> str:
    """The CPU model (/proc/cpuinfo, where there is one) and how many CPUs this process may
    use, out of the machine's."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = " " + line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable, total = len(os.sched_getaffinity(0)), os.cpu_count() or 0
    return f"{usable} CPUs{model}" + (f" (of {total})" if usable != total else "")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process of a benchmark: this one's, with the repository
    first on PYTHONPATH (kept after it: where a host's extra packages were put there, such
    as torchft or torchao installed into a folder of their own) and `extra` added."""
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def machine_line() -> str:
    """What a benchmark measured on, in one line: GPUs (model, memory, power limit), CPUs,
    torch and the CUDA it was built with, Python."""
    r = subprocess.run([sys.executable, "-c", _TORCH], capture_output=True, text=True)
    lines = r.stdout.splitlines() if r.returncode == 0 else []
    version, cuda = lines[0].split() if lines else ("not importable", "-")
    gpus = _nvidia_smi_gpus() or (lines[1] if len(lines) > 1 else "") or "no GPU"
    cuda = f"CUDA {cuda}" if cuda != "-" else "no CUDA"
    return (f"machine: {gpus}; {_cpus()}; torch {version}, {cuda}; "
            f"Python {platform.python_version()}")  # fmt: skip


def median_steady(rows: Iterable[Mapping[str, float]], key: str, skip: int) -> float | None:
    """The median of `key` over the steps after `skip` (the warm-up: compile, the allocator,
    the loader's first blocks) of step rows {"step": n, key: value, ...}, as `read_steps`
    gives them; None where no steady step has `key` (a run cut short, mfu off a GPU)."""
    values = [row[key] for row in rows if row["step"] > skip and key in row]
    return statistics.median(values) if values else None


def markdown_row(cells: Sequence[object]) -> str:
    """One line of a Markdown table (cells as str() gives them): what a benchmark prints as
    each row is measured, under `markdown_table(headers, [])`."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table: the header, its rule and a line for each row."""
    return "\n".join(markdown_row(line) for line in [headers, ["---"] * len(headers), *rows])


def bar_chart(bars: int):
    """(figure, axes) of matplotlib, without a display, sized for `bars` horizontal bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(8, 0.6 * bars + 1.5))


def line_chart():
    """(figure, axes) of matplotlib, without a display, for a few curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def save_chart(fig, ax, title: str, path: Path) -> None:
    """Titles a chart of `bar_chart` or `line_chart`, writes it to `path` (PNG) and says where."""
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def read_steps(log: Path) -> list[dict[str, float]]:
    """The step lines of a run's train.log (pytrain.train.metrics.read_step_lines, the one
    reader of their format); none where the run left no log."""
    from pytrain.train.metrics import read_step_lines  # imports torch: only where used

    return read_step_lines(log.read_text()) if log.exists() else []


# The end of the trainer's last line on a GPU (pytrain/train/report.py, final_report):
# "... peak GPU memory 17.8 GB (19.25 GiB reserved)".
def python_sources(max_bytes: int) -> Iterator[tuple[str, str]]:
    """Real text present on every machine that ran `make setup`: (path, text) of the Python
    sources of the standard library (tests included), then of the installed packages
    (torch, numpy, ...), in sorted order, until `max_bytes` of text."""
    roots = [Path(sysconfig.get_paths()["stdlib"])] + [Path(p) for p in site.getsitepackages()]
    seen, total = set(), 0
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            if p in seen or "site-packages" in p.relative_to(root).as_posix() and root == roots[0]:
                continue
            seen.add(p)
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            yield str(p), text
            total += len(text.encode())
            if total >= max_bytes:
                return


def paired_runs_parser(doc: str, mb: int):
    """The argument parser that the paired-run studies (float8_quality, moe_vs_dense) share:
    prepare, plan, run, report; --work, and prepare's --tokenizer and --mb (default `mb`)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("what", choices=["prepare", "plan", "run", "report"])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--mb", type=int, default=mb, help="prepare: MB of Python sources at most")
    return p


def pack_python_text(work: Path, tokenizer: Path | None, mb: int) -> None:
    """`python_sources` up to `mb` MB, every 20th file held out, packed by pack-shards with
    `tokenizer` (default: the embedded default's BPE) as work/train and work/val."""
    import json

    if tokenizer is None:
        from pytrain.data.corpus import build_default

        tokenizer = build_default()[0].parent / "tokenizer.json"
    work.mkdir(parents=True, exist_ok=True)
    files = {s: open(work / f"{s}.jsonl", "w") for s in ("train", "val")}  # noqa: SIM115
    for n, (_, text) in enumerate(python_sources(mb << 20)):
        files["val" if n % 20 == 19 else "train"].write(json.dumps({"text": text}) + "\n")
    for f in files.values():
        f.close()
    root = Path(__file__).resolve().parent.parent
    for split in files:
        cmd = [sys.executable, "-m", "pytrain.pack_shards", str(work / f"{split}.jsonl"),
               "-o", str(work / split), "--tokenizer", str(tokenizer), "--overwrite",
               "--no-progress"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=root)
        (work / f"{split}.jsonl").unlink()


def read_for(loader, seconds: float) -> tuple[int, float, float]:
    """(tokens, wall seconds, process CPU seconds) of a TokenLoader's batches (rows x
    seq_len) read for `seconds`, counted after its first batch (its start-up is not
    throughput)."""
    next(loader).release()
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        b = next(loader)
        tokens += b.tokens.shape[0] * (b.tokens.shape[1] - 1)
        b.release()
    return tokens, time.perf_counter() - t0, time.process_time() - c0


EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception)\b.*)$")
"""The last line of a Python traceback, as a rank prints it under torchrun (`[rank1]: `)."""


def failure_line(output: str) -> str:
    """Why a launched run failed, in one line: the trainer's own (out of memory, a bad flag)
    where a rank printed one; else the first rank's exception (not the ChildFailedError
    report torchrun prints after it, which ends in a row of '='); else the last line."""
    lines = output.strip().splitlines() or ["?"]
    if own := next((x for x in lines if x.startswith("pytrain.train: ")), None):
        return own[:200]
    raised = [m.group(1) for x in lines if (m := EXCEPTION_LINE.match(x))]
    return next((x for x in raised if "ChildFailedError" not in x), lines[-1])[:200]


def children(pid: int) -> list[int]:
    """The processes `pid` started and that still run (torchrun's agent: its ranks), from
    /proc (Linux); [] once `pid` is gone."""
    try:
        return sorted(int(x) for t in Path(f"/proc/{pid}/task").iterdir()
                      for x in (t / "children").read_text().split())  # fmt: skip
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents first."""
    if not Path(f"/proc/{pid}").exists():
        return []
    return [pid] + [d for kid in children(pid) for d in _tree(kid)]


def _running(pid: int) -> bool:
    """Whether `pid` still runs: a killed process not yet reaped is a zombie ("Z") and holds
    no memory any more, GPU memory included."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_tree(pid: int, wait_s: float = 120.0) -> None:
    """SIGKILL to `pid` and all its descendants, then waits (up to `wait_s`) until none runs.
    torchrun starts each rank in a process group of its own, which a signal to the agent's
    group does not reach: a rank left so trains on, holding its GPU's memory, and writes its
    end's checkpoint while the next job starts. The whole tree is listed first and the parents
    killed first, so an agent cannot start a rank again, nor a rank lose its parent (and so
    its place in the tree) before it is listed."""
    import signal

    tree = _tree(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while any(map(_running, tree)) and time.monotonic() < deadline:
        time.sleep(0.1)
