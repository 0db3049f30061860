"""pack-shards on many workers: tokens/s of 1, 2, 4, 8 Ray workers (each with the same
cores) packing parts and merging them, against one `pack-shards` process given the same cores
in total, on real text (Python sources of this machine's site-packages as JSONL files) with
the embedded default's tokenizer.json (a byte-level BPE trained by `tokenizers`).

    PYTHONPATH=$PWD python benchmarks/pack_parts.py [--workers 1,2,4,8] [--cores-per-worker 2] [--mb 400] [--cpus 0-15] [--repeat 3] [--results rows.json]

Each Ray worker is a task with --cores-per-worker CPUs (and as many tokenizer threads);
there are 4 tasks per worker so that an early finisher takes another part. Ray runs twice a
row: as a job starts (Ray starts its worker processes inside the timed span), and with its W
workers started first, untimed (what the hours of a long job see). Beside them, W
independent `pack-shards --task I --tasks W` processes (as a Slurm array runs them). A row
of W workers confines every process of each column to the same first W x k of the CPUs
(--cpus; on a VM whose CPUs may be hyperthreads, pick one CPU a core if the host's layout
is known). Wall time includes the merge. Linear is W times one pack-shards process on k
CPUs (the first row); the goal is Ray at >= 0.9 of it up to 8 workers. A table is printed
last.

    PYTHONPATH=$PWD python benchmarks/pack_parts.py --in-process 1,16 [--mb 40 --files 16]

instead packs the corpus as 1, then 16 parts one after the other in this one process, as
a Ray worker runs its tasks (no Ray), and prints each count's wall and CPU seconds, with the
process's warm encoder and with a new one per part: what a part costs beyond its tokens
(BENCHMARKS.md, "What a part costs")."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.harness import machine_line, markdown_row, markdown_table  # noqa: E402


def corpus(work: Path, mb: float, files: int) -> Path:
    """JSONL files of real text, about `mb` MB in all."""
    raw = work / "raw"
    if raw.exists():
        return raw
    raw.mkdir(parents=True)
    sources = sorted(
        p
        for p in Path(sysconfig.get_paths()["purelib"]).rglob("*.py")
        if 0 < p.stat().st_size < 500_000
    )
    outs = [open(raw / f"part-{i:03d}.jsonl", "w") for i in range(files)]
    total, i = 0, 0
    while (
        total < mb * 1e6
    ):  # round after round over the sources (a bigger corpus than the machine has)
        for p in sources:
            text = p.read_text(encoding="utf-8", errors="replace")
            outs[i % files].write(json.dumps({"text": text}) + "\n")
            total, i = total + len(text), i + 1
            if total >= mb * 1e6:
                break
    for f in outs:
        f.close()
    return raw


def tokens(dataset: Path) -> int:
    return json.loads((dataset / "manifest.json").read_text())["totals"]["tokens"]


def cpu_list(spec: str) -> list[int]:
    """CPUs as taskset lists them: "0-7,16-23" -> [0, ..., 7, 16, ..., 23]."""
    out: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def physical_cores(cpus: list[int]) -> str:
    """How the kernel places `cpus` on physical cores (sysfs topology): "16 CPUs on 8
    cores (2 threads a core)". On a VM this is the guest's view, which may hide how its
    CPUs sit on the host's cores."""
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(
                (
                    (topo / "physical_package_id").read_text().strip(),
                    (topo / "core_id").read_text().strip(),
                )
            )
        except OSError:
            return f"{len(cpus)} CPUs (no topology in sysfs)"
    return f"{len(cpus)} CPUs on {len(cores)} cores ({len(cpus) / len(cores):g} threads a core)"


def pinned(cpus: list[int]):
    """A preexec_fn that confines the child process to `cpus`."""
    return lambda: os.sched_setaffinity(0, cpus)


def parts_in_one_process(work: Path, raw: Path, tok: str, mb: float, counts: list[int]) -> int:
    """Each count of parts packed one after the other here, as one Ray worker packs its
    tasks: wall and CPU seconds (all threads of this process), with the process's warm
    encoder (as shipped) and with a cold one for every part (as before
    `pytrain.data.shards.warm_encoder`), side by side."""
    from pytrain.data import shards
    from pytrain.data.inputs import BadInputs, ReadOptions
    from pytrain.data.parts import pack_part

    print(f"\n{mb:.0f} MB of JSONL, {time.strftime('%Y-%m-%d')}\n")
    print(markdown_table(["parts", "encoder", "wall s", "CPU s", "cores busy"], []))
    for n in counts:
        for cold in (False, True):
            out = work / f"inproc-{n}"
            shutil.rmtree(out, ignore_errors=True)
            shards.warm_encoder.cache_clear()
            cpu0, t0 = time.process_time(), time.perf_counter()
            for i in range(n):
                if cold:
                    shards.warm_encoder.cache_clear()
                opts = shards.PackOptions(tokenizer=tok)
                pack_part([str(raw)], out, i, n, opts, ReadOptions(), BadInputs())
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            how = "new one per part" if cold else "warm (shipped)"
            print(
                markdown_row([n, how, f"{wall:.2f}", f"{cpu:.2f}", f"{cpu / wall:.2f}"]), flush=True
            )
    return 0


def ray_parts(out: Path, raw: Path, tok: str, w: int, k: int, mine: list[int],
              everyone: list[int], warm: bool) -> float:  # fmt: skip
    """Tokens/s of W Ray workers of k CPUs packing 4 W parts, then the merge, on a fresh
    local Ray confined to `mine`. With `warm`, W tasks of the same resources and
    environment (a second's sleep each, so that W workers start) run first, untimed."""
    import ray

    shutil.rmtree(out, ignore_errors=True)
    os.sched_setaffinity(0, mine)  # Ray's processes, started from here, inherit it
    ray.init(num_cpus=w * k, include_dashboard=False)
    try:
        options = {"num_cpus": k, "runtime_env": {"env_vars": {"RAYON_NUM_THREADS": str(k)}}}

        @ray.remote(**options)
        def task(i: int, n: int, out: Path) -> None:
            from pytrain.data.inputs import BadInputs, ReadOptions
            from pytrain.data.parts import pack_part
            from pytrain.data.shards import PackOptions

            pack_part([str(raw)], out, i, n, PackOptions(tokenizer=tok), ReadOptions(), BadInputs())

        @ray.remote(**options)
        def start() -> int:
            import pytrain.data.parts  # noqa: F401  (what a task imports first)

            time.sleep(1.0)
            return os.getpid()

        if warm and len(set(ray.get([start.remote() for _ in range(w)]))) != w:
            raise SystemExit(f"Ray started fewer than {w} workers")
        n = 4 * w
        t0 = time.perf_counter()
        ray.get([task.remote(i, n, out) for i in range(n)])
        from pytrain.data.parts import merge

        merge(out)
        return tokens(out) / (time.perf_counter() - t0)
    finally:
        ray.shutdown()
        os.sched_setaffinity(0, everyone)


def columns(work: Path, raw: Path, tok: str, w: int, k: int, mine: list[int],
            everyone: list[int]) -> tuple[float, float, float, float]:  # fmt: skip
    """One row's four figures in tokens/s, every column's processes confined to the same
    W x k CPUs `mine`: one pack-shards, Ray as a job starts, Ray with its workers
    started, W independent processes."""
    # One process with the same cores (pack-shards' reader thread and compression come out
    # of the same CPUs).
    out = work / f"single-{w}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytrain.pack_shards", str(raw), "-o", str(out), "--tokenizer", tok,
                    "--workers", str(w * k), "--no-progress"], check=True, capture_output=True,
                   preexec_fn=pinned(mine))  # fmt: skip
    single = tokens(out) / (time.perf_counter() - t0)
    # W Ray workers of k cores, 4 tasks each, then the merge: first as a job starts (Ray
    # starts its worker processes inside the timed span), then with the workers already
    # started, as the hours of a long job see them.
    cold = ray_parts(work / f"ray-{w}", raw, tok, w, k, mine, everyone, warm=False)
    parts = ray_parts(work / f"ray-warm-{w}", raw, tok, w, k, mine, everyone, warm=True)
    # The host's own ceiling: W independent pack-shards processes of k cores at once (as a
    # Slurm array runs them on one machine), one task each, then the merge. Per-core speed
    # that falls as more cores work (clock, memory) shows here as in every other column.
    out = work / f"array-{w}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "pytrain.pack_shards", str(raw), "-o", str(out),
                               "--tokenizer", tok, "--workers", str(k), "--no-progress",
                               "--task", str(i), "--tasks", str(w)], stdout=subprocess.DEVNULL,
                              preexec_fn=pinned(mine[i * k : (i + 1) * k]))
             for i in range(w)]  # fmt: skip
    if any(p.wait() for p in procs):
        raise SystemExit(f"a pack-shards task of {w} failed")
    subprocess.run([sys.executable, "-m", "pytrain.pack_shards", "merge", str(out)], check=True,
                   capture_output=True)  # fmt: skip
    array = tokens(out) / (time.perf_counter() - t0)
    return single, cold, parts, array


def earlier_rows(path: Path | None, setup: dict) -> dict[int, tuple]:
    """The rows of --results, by worker count, if it holds any (measured with the same CPUs,
    corpus and cores a worker: another setup stops the script)."""
    if path is None or not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved["setup"] != setup:
        raise SystemExit(
            f"{path} holds rows of another setup ({saved['setup']}, here {setup}): "
            "name another --results file"
        )
    return {row[0]: tuple(row) for row in saved["rows"]}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--cores-per-worker", type=int, default=2)
    p.add_argument("--mb", type=float, default=400.0)
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1,
                   help="run each row N times and report each column's median (the one-worker "
                   "row, which sets linear, wandered by 1.5x on a 64-CPU VM)")  # fmt: skip
    p.add_argument("--results", type=Path, default=None,
                   help="a JSON file of rows: each row is written there as it ends, rows already "
                   "there are not run again, and the table covers them all (a run longer than "
                   "a job's time limit goes as several jobs: --workers 1,2, then 4,8)")  # fmt: skip
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "pytrain-bench-parts")
    p.add_argument("--cpus", default=None,
                   help="the CPUs to use, as taskset lists them (e.g. 0-15 or 0,2,4); default: all this process may use")  # fmt: skip
    p.add_argument("--in-process", default=None,
                   help="part counts to pack one after the other in this process (e.g. 1,16), no Ray")  # fmt: skip
    args = p.parse_args()
    print(machine_line(), flush=True)
    from pytrain.data.corpus import build_default

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTRAIN_CACHE", str(work / "cache"))
    tok = str(build_default()[0].parent / "tokenizer.json")
    raw = corpus(work, args.mb, args.files)
    mb = sum(f.stat().st_size for f in raw.iterdir()) / 1e6
    if args.in_process:
        return parts_in_one_process(
            work, raw, tok, mb, [int(n) for n in args.in_process.split(",")]
        )
    k = args.cores_per_worker
    everyone = sorted(os.sched_getaffinity(0))
    cpus = cpu_list(args.cpus) if args.cpus else everyone
    setup = {"cores_per_worker": k, "cpus": cpus, "mb": round(mb), "files": args.files,
             "repeat": args.repeat}  # fmt: skip
    measured = earlier_rows(args.results, setup)
    rows = list(measured.values())
    for w in (int(x) for x in args.workers.split(",")):
        if w * k > len(cpus):
            raise SystemExit(f"{w} workers of {k} CPUs need {w * k} CPUs; --cpus gives {len(cpus)}")
        if w in measured:
            print(f"[{w} worker(s)] measured already ({args.results})", flush=True)
            continue
        # Every column of this row gets exactly the same W x k CPUs (each process confined to
        # them: pack-shards' reader thread and compression come out of the same CPUs).
        mine = cpus[: w * k]
        runs = [columns(work, raw, tok, w, k, mine, everyone) for _ in range(args.repeat)]
        single, cold, parts, array = (statistics.median(col) for col in zip(*runs, strict=True))
        rows.append((w, w * k, single, cold, parts, array))
        if args.results:  # kept as each row ends: a later call measures the rest
            args.results.write_text(json.dumps({"setup": setup, "rows": rows}))
        print(
            f"[{w} worker(s)] single {single / 1e6:.2f} M tokens/s, Ray {cold / 1e6:.2f} "
            f"(workers started: {parts / 1e6:.2f}), "
            f"{w} independent processes {array / 1e6:.2f}",
            flush=True,
        )
        if args.repeat > 1:  # each run's four figures, to show how far a column wanders
            print("  runs: " + "; ".join(" ".join(f"{x / 1e6:.2f}" for x in r) for r in runs))
    # Linear: W times what one pack-shards process packs on k CPUs (the first row, if it has
    # one worker). Not Ray's own first row: Ray's daemons share a row's CPUs, which costs
    # most where there are fewest, and would flatter Ray's scaling.
    rows.sort()
    one = rows[0][2] / rows[0][0]
    used = cpus[: rows[-1][1]]
    print(f"\npack-shards on Ray workers, {time.strftime('%Y-%m-%d')}, CPUs {','.join(map(str, used))} "
          f"({physical_cores(used)}), {mb:.0f} MB of JSONL in {args.files} files, {k} cores a worker"
          f"{f', the median of {args.repeat} runs a row' if args.repeat > 1 else ''}\n")  # fmt: skip
    headers = ["workers", "cores", "one pack-shards M tok/s", "Ray workers M tok/s (started: M tok/s)",
               "independent processes M tok/s", "Ray / one process", "Ray / linear (started)",
               "independent / linear", "Ray / independent (started)"]  # fmt: skip
    print(markdown_table(headers, [
        [w, cores, f"{single / 1e6:.2f}", f"{cold / 1e6:.2f} ({parts / 1e6:.2f})", f"{array / 1e6:.2f}",
         f"{cold / single:.2f}", f"{cold / (w * one):.2f} ({parts / (w * one):.2f})",
         f"{array / (w * one):.2f}", f"{cold / array:.2f} ({parts / array:.2f})"]
        for w, cores, single, cold, parts, array in rows]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
