"""Which of this machine's CPUs share a physical core, found by timing rather than read from
sysfs: a VM's topology is the guest's view (often "1 thread a core") and says nothing about
how its CPUs sit on the host's cores. Two CPUs of one core (hyperthreads) slow each other
down when both work; two cores barely do.

    python benchmarks/cpu_pairs.py [--cpus 0-15] [--seconds 0.3] [--threshold 1.4]

First the same loop on 1, 2, 4, ... of the CPUs at once (how many CPUs' worth of work the
machine gives; a cgroup quota or shared cores show here), and the cgroup's quota if any.
Then for each CPU, a busy loop is timed alone and then beside each candidate until a sibling
is found (slowdown above --threshold, each time the least of three tries), where the first
CPU's row shows one sibling; where it shows several, the timings are the host's noise
(seen on a 64-CPU VM: 0.69x-2.26x) and no pairs are searched. Prints the pairs
and two `--cpus` lists for benchmarks/pack_parts.py: siblings next to each other (a row
of W workers of 2 CPUs gets W whole cores), and one CPU a core (no two share one; on a big
host, 16 of them make the "16-core host" of the benchmark). BENCHMARKS.md ("pack-shards")
says why the scaling figures need it."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import machine_line  # noqa: E402
from benchmarks.pack_parts import cpu_list  # noqa: E402


def _spin(n: int) -> int:
    """Integer work in the interpreter: what a core's two threads would share."""
    x = 0
    for i in range(n):
        x = (x * 31 + i) & 0xFFFF
    return x


def _timed(cpu: int, n: int, start: mp.synchronize.Barrier, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {cpu})
    start.wait()
    t0 = time.perf_counter()
    _spin(n)
    out.put((cpu, time.perf_counter() - t0))


def run_on(cpus: list[int], n: int, tries: int = 3) -> dict[int, float]:
    """Seconds the same work takes on each of `cpus`, all started at once; each CPU's least
    of `tries` (a VM's timings wander, here by up to 1.4x from one run to the next)."""
    ctx = mp.get_context("fork")
    best: dict[int, float] = {}
    for _ in range(tries):
        start, out = ctx.Barrier(len(cpus)), ctx.Queue()
        procs = [ctx.Process(target=_timed, args=(c, n, start, out)) for c in cpus]
        for p in procs:
            p.start()
        for _ in procs:
            try:  # a child that died (killed, out of memory) must not hang the rest
                c, t = out.get(timeout=120)
            except queue.Empty:
                raise SystemExit(
                    f"a timing process on CPUs {cpus} gave no result in 120 s"
                ) from None
            best[c] = min(t, best.get(c, t))
        for p in procs:
            p.join()
    return best


def slow_neighbours(row: dict[int, float], threshold: float) -> int:
    """How many CPUs slow one CPU above `threshold` in its row (its slowdown beside each)."""
    return sum(s > threshold for s in row.values())


def sibling_row(row: dict[int, float], threshold: float) -> str:
    """What one CPU's slowdowns beside every other CPU say of the layout: 'one' where exactly
    one CPU slows it above `threshold` (a hyperthread has one sibling, so the pair search is
    worth its time), 'none' where none does, 'noise' where several do: the host's own
    timing noise or contention, not siblings, and a search would try all n^2/2 pairs (on a
    64-CPU host, about 2,000 pairs of three timed tries each)."""
    over = slow_neighbours(row, threshold)
    return "none" if over == 0 else "one" if over == 1 else "noise"


def pairs(
    cpus: list[int], slowdown: Callable[[int, int], float], threshold: float
) -> tuple[list[tuple[int, int, float]], list[int]]:
    """Sibling pairs (a, b, slowdown) and the CPUs left without one. Each CPU is tried
    against the ones after it until one slows it by more than `threshold`: hyperthreads
    come in pairs, so the first such CPU is its sibling. The last pair's distance in the
    list is tried first: hosts number siblings regularly (n and n + 1, or n and n + cores),
    so a 64-CPU host takes about 64 tries instead of about 1,000."""
    at = {c: i for i, c in enumerate(cpus)}
    left, found, alone = list(cpus), [], []
    step = 0  # the last pair's distance in the list (0: none yet)
    while left:
        a = left.pop(0)
        first = [cpus[at[a] + step]] if step and at[a] + step < len(cpus) else []
        first = [c for c in first if c in left]
        for b in first + [c for c in left if c not in first]:
            s = slowdown(a, b)
            if s > threshold:
                found.append((a, b, s))
                left.remove(b)
                step = at[b] - at[a]
                break
        else:
            alone.append(a)
    return found, alone


def ordered(found: list[tuple[int, int, float]], alone: list[int]) -> list[int]:
    """A --cpus order with each pair's two CPUs next to each other, the unpaired after."""
    return [c for a, b, _ in found for c in (a, b)] + alone


def one_per_core(found: list[tuple[int, int, float]], alone: list[int]) -> list[int]:
    """A --cpus list with one CPU of each core: no two of them share one."""
    return [a for a, _, _ in found] + alone


def cpu_quota() -> str:
    """The cgroup's CPU limit, where there is one: a container may see 16 CPUs and be
    allowed the time of fewer."""
    for path, fmt in (
        ("/sys/fs/cgroup/cpu.max", "v2"),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "v1"),
    ):
        try:
            text = Path(path).read_text().split()
        except OSError:
            continue
        if fmt == "v2" and text[0] != "max":
            return f"cgroup v2 cpu.max: {int(text[0]) / int(text[1]):.1f} CPUs"
        if fmt == "v1" and int(text[0]) > 0:
            period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
            return f"cgroup v1 quota: {int(text[0]) / period:.1f} CPUs"
    return "no cgroup CPU quota"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", default=None, help="as taskset lists them; default: all this process may use")  # fmt: skip
    p.add_argument("--seconds", type=float, default=0.3, help="the busy loop's time alone")
    p.add_argument(
        "--threshold",
        type=float,
        default=1.4,
        help="slowdown that marks siblings (hyperthreads: 1.5-1.9x)",
    )
    args = p.parse_args()
    usable = sorted(os.sched_getaffinity(0))
    try:
        cpus = list(dict.fromkeys(cpu_list(args.cpus))) if args.cpus else usable
    except ValueError:
        raise SystemExit(
            f"--cpus {args.cpus!r}: expected CPUs as taskset lists them, e.g. 0-15"
        ) from None
    if unknown := sorted(set(cpus) - set(usable)):
        shown = ",".join(map(str, unknown[:8])) + (
            f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        )
        raise SystemExit(f"--cpus: CPU {shown} not among the {len(usable)} this process may use")
    print(machine_line(), flush=True)
    n = 200_000
    while (t := run_on(cpus[:1], n, 1)[cpus[0]]) < args.seconds / 4:  # calibrated on one CPU
        n *= 4
    n = int(n * args.seconds / t)
    alone = {c: run_on([c], n)[c] for c in cpus}

    measured: dict[frozenset, float] = {}  # each pair timed once: the row and the pairing agree

    def slowdown(a: int, b: int) -> float:
        if (key := frozenset((a, b))) not in measured:
            both = run_on([a, b], n)
            measured[key] = max(both[a] / alone[a], both[b] / alone[b])
        return measured[key]

    print(f"{len(cpus)} CPUs, a busy loop of {args.seconds} s alone on each "
          f"({min(alone.values()):.3f}-{max(alone.values()):.3f} s); {cpu_quota()}")  # fmt: skip
    # The machine's own ceiling: the loop on the first k CPUs at once, each against its time alone.
    for k in sorted({*(1 << i for i in range(len(cpus).bit_length())), len(cpus)}):
        at_once = run_on(cpus[:k], n)
        mean = sum(at_once[c] / alone[c] for c in at_once) / k
        print(f"  {k} at once: each took {mean:.2f}x its time alone ({k / mean:.1f} CPUs' worth)")
    first = {b: slowdown(cpus[0], b) for b in cpus[1:]}  # the whole row, to read the layout
    print(f"CPU {cpus[0]} beside each other CPU, time against alone: "
          + ", ".join(f"{b}: {s:.2f}x" for b, s in first.items()))  # fmt: skip
    if (row := sibling_row(first, args.threshold)) == "one":
        found, single = pairs(cpus, slowdown, args.threshold)
    else:  # hosts give all their CPUs a sibling or none: the O(n^2) search is not worth it
        over = slow_neighbours(first, args.threshold)
        print(
            f"  CPU {cpus[0]} has no sibling: no hyperthreads assumed, the others not tried"
            if row == "none"
            else f"  CPU {cpus[0]} is slowed above {args.threshold}x beside {over} CPUs, not "
            "one sibling: the host's noise, no pairs searched"
        )
        found, single = [], cpus
    for a, b, s in found:
        print(f"  CPUs {a} and {b} share a core: {s:.2f}x the time alone beside each other")
    if single:
        print(f"  no sibling found (slowdown <= {args.threshold}x): {','.join(map(str, single))}")
    print(
        f"{len(found)} pairs; siblings adjacent: --cpus {','.join(map(str, ordered(found, single)))}"
    )
    print(
        f"one CPU a core ({len(found) + len(single)}): --cpus {','.join(map(str, one_per_core(found, single)))}"
    )


if __name__ == "__main__":
    main()
