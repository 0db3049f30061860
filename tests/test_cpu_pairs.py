"""benchmarks/cpu_pairs.py: hyperthread pairs from timings, and the --cpus order it prints."""

import os
import sys

from conftest import ROOT, load_script

cpu_pairs = load_script("benchmarks/cpu_pairs.py", "cpu_pairs")


def _host(sibling_of: dict[int, int], tried: list):
    """A slowdown as a host whose CPU c shares its core with sibling_of[c] would time it."""

    def slowdown(a: int, b: int) -> float:
        tried.append((a, b))
        return 1.6 if sibling_of.get(a) == b else 1.05

    return slowdown


def test_siblings_eight_apart_are_paired_and_put_next_to_each_other():
    cpus = list(range(16))
    sib = {c: (c + 8) % 16 for c in cpus}
    tried: list = []
    found, alone = cpu_pairs.pairs(cpus, _host(sib, tried), 1.25)
    assert [(a, b) for a, b, _ in found] == [(c, c + 8) for c in range(8)]
    assert alone == []
    order = cpu_pairs.ordered(found, alone)
    assert order[:4] == [0, 8, 1, 9] and sorted(order) == cpus
    # the first pair's distance is tried first for the others: 8 tries for CPU 0, then 1 each
    assert len(tried) == 8 + 7


def test_adjacent_siblings_and_cpus_without_one():
    cpus = [0, 1, 2, 3, 4]
    sib = {0: 1, 1: 0, 2: 3, 3: 2}  # CPU 4 has its core to itself
    found, alone = cpu_pairs.pairs(cpus, _host(sib, []), 1.25)
    assert [(a, b) for a, b, _ in found] == [(0, 1), (2, 3)]
    assert alone == [4]
    assert cpu_pairs.ordered(found, alone) == [0, 1, 2, 3, 4]


def test_no_pairs_below_the_threshold_keeps_the_input_order():
    cpus = [3, 1, 2]
    found, alone = cpu_pairs.pairs(cpus, lambda a, b: 1.2, 1.25)
    assert found == [] and cpu_pairs.ordered(found, alone) == [3, 1, 2]


def test_a_row_with_several_slow_neighbours_is_noise_not_a_sibling():
    """CPU 0 of the 64-CPU host: above 1.4x beside five CPUs, so no pair search (which would
    time every pair); one such CPU is a sibling, none is no hyperthreads."""
    row = {1: 1.59, 2: 1.12, 13: 2.26, 22: 1.58, 33: 1.45, 39: 1.74, 40: 1.05}
    assert cpu_pairs.sibling_row(row, 1.4) == "noise"
    assert cpu_pairs.sibling_row({1: 1.05, 8: 1.7, 9: 0.98}, 1.4) == "one"
    assert cpu_pairs.sibling_row({1: 1.05, 9: 0.98}, 1.4) == "none"


def test_the_busy_loop_runs_on_the_cpus_it_is_given():
    cpu = sorted(os.sched_getaffinity(0))[0]
    times = cpu_pairs.run_on([cpu], 20_000)
    assert list(times) == [cpu] and times[cpu] > 0


def test_cpus_this_process_may_not_use_end_in_one_line():
    import subprocess

    for spec, words in (("0-9999", "not among the"), ("a-b", "expected CPUs")):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks/cpu_pairs.py"), "--cpus", spec],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 1 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_one_cpu_a_core_takes_one_of_each_pair_and_the_unpaired():
    found = [(0, 8, 1.6), (1, 9, 1.7)]
    assert cpu_pairs.one_per_core(found, [5]) == [0, 1, 5]


def test_a_host_of_64_with_siblings_32_apart_takes_a_try_a_cpu():
    cpus = list(range(64))
    tried: list = []
    found, alone = cpu_pairs.pairs(cpus, _host({c: (c + 32) % 64 for c in cpus}, tried), 1.4)
    assert len(found) == 32 and alone == [] and len(tried) == 32 + 31


def test_an_irregular_layout_is_still_paired_by_scanning():
    cpus = [0, 1, 2, 3, 4, 5]
    sib = {0: 3, 3: 0, 1: 2, 2: 1, 4: 5, 5: 4}
    found, alone = cpu_pairs.pairs(cpus, _host(sib, []), 1.4)
    assert sorted((a, b) for a, b, _ in found) == [(0, 3), (1, 2), (4, 5)] and alone == []
