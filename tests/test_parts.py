"""pack-shards on many machines (pytrain.data.parts): N tasks each pack a part, `merge` joins
them; the merged dataset holds exactly the documents and token ids of one `pack-shards` of
the same inputs, in the same order. Run through the CLI (a shell loop or a Slurm array runs
exactly these commands) and as Ray tasks on a local Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SLURM, stdlib_texts

from pytrain import _loader
from pytrain.data.parts import Unit, partition

PACK = [sys.executable, "-m", "pytrain.pack_shards"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """JSONL, a .txt and a parquet file of three row groups: ~40 documents of real text."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    d = tmp_path_factory.mktemp("corpus")
    texts = [t for t in stdlib_texts(3_000_000) if t.strip()][:40]
    assert len(texts) == 40
    for i in range(3):
        with open(d / f"a{i}.jsonl", "w") as f:
            for t in texts[i * 8 : i * 8 + 8]:
                f.write(json.dumps({"text": t}) + "\n")
    (d / "b.txt").write_text(texts[24])
    table = pa.table({"text": texts[25:40]})
    pq.write_table(table, d / "c.parquet", row_group_size=5)
    return d


def documents(path: Path) -> list[tuple[int, ...]]:
    """Every document's token ids, in the dataset's order."""
    ds = _loader.Dataset(str(path))
    dtype = np.uint16 if ds.dtype == "uint16" else np.uint32
    out = []
    for frame in range(ds.n_frames):
        data, lengths = ds.read_frame(frame)
        ids = np.frombuffer(data, dtype=dtype)
        for piece in np.split(ids, np.cumsum(lengths)[:-1]):
            out.append(tuple(int(x) for x in piece))
    return out


def pack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PACK, *args], capture_output=True, text=True, timeout=300)


def tasks_then_merge(corpus: Path, tok: Path, out: Path, n: int) -> None:
    for i in range(n):  # a shell loop; a Slurm array runs one of these per element
        r = pack(str(corpus), "-o", str(out), "--tokenizer", str(tok), "--task", str(i),
                 "--tasks", str(n), "--shard-mib", "0.05", "--frame-mib", "0.01")  # fmt: skip
        assert r.returncode == 0, r.stderr
    r = pack("merge", str(out))
    assert r.returncode == 0, r.stderr
    assert f"merged {n} part(s)" in r.stdout


@pytest.fixture(scope="module")
def single(corpus, bpe_tokenizer_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "ds"
    r = pack(str(corpus), "-o", str(out), "--tokenizer", str(bpe_tokenizer_file),
             "--shard-mib", "0.05", "--frame-mib", "0.01")  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("n", [1, 3, 7, pytest.param(40, marks=pytest.mark.slow)])
def test_merged_parts_equal_one_pack_of_the_same_inputs(
    corpus, bpe_tokenizer_file, single, tmp_path, n
):
    """Any task count, also more tasks than files (parquet row groups are cut; a task may get
    nothing): the same documents, ids and order as one process; the loader reads it."""
    out = tmp_path / "ds"
    tasks_then_merge(corpus, bpe_tokenizer_file, out, n)
    want = documents(single)
    assert len(want) == 40
    assert documents(out) == want
    assert pack("verify", str(out)).returncode == 0  # every shard's checksum, totals
    m = json.loads((out / "manifest.json").read_text())
    assert m["parts"] == n and all(s["file"].startswith("part-") for s in m["shards"])
    assert (out / "tokenizer.json").exists()


def test_a_finished_task_is_not_rewritten_and_a_missing_one_is_named(
    corpus, bpe_tokenizer_file, tmp_path
):
    out = tmp_path / "ds"
    tasks_then_merge(corpus, bpe_tokenizer_file, out, 3)
    part1 = out / "part-00001-of-00003"
    before = {p.name: p.stat().st_mtime_ns for p in part1.iterdir()}
    r = pack(str(corpus), "-o", str(out), "--tokenizer", str(bpe_tokenizer_file), "--task", "1",
             "--tasks", "3", "--shard-mib", "0.05", "--frame-mib", "0.01")  # fmt: skip
    assert r.returncode == 0 and "complete already" in r.stdout, r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in part1.iterdir()} == before
    (out / "part-00002-of-00003" / "manifest.json").unlink()  # a task that died before its end
    r = pack("merge", str(out))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"pack-shards: error: {out}: 1 of 3 part(s) missing or unfinished (part-00002-of-00003); "
        "run those tasks (--task I --tasks 3), then merge again"
    ]


def test_parts_made_with_another_tokenizer_are_refused(corpus, bpe_tokenizer_file, tmp_path):
    out = tmp_path / "ds"
    for i, tok in enumerate([str(bpe_tokenizer_file), "byte"]):
        r = pack(str(corpus), "-o", str(out), "--tokenizer", tok, "--task", str(i), "--tasks", "2")
        assert r.returncode == 0, r.stderr
    r = pack("merge", str(out))
    assert (
        r.returncode == 1
        and "made with another tokenizer" in r.stderr
        and "part-00001-of-00002" in r.stderr
    )
    assert not (out / "manifest.json").exists()  # nothing a reader could take for a dataset


def test_merge_of_a_missing_directory_or_one_without_parts_is_one_line(tmp_path):
    r = pack("merge", str(tmp_path / "nowhere"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"pack-shards: error: {tmp_path / 'nowhere'}: no such directory"
    ]
    r = pack("merge", str(tmp_path))
    assert r.returncode == 1 and "no part-<i>-of-<n> directories" in r.stderr, r.stderr


def test_bad_task_arguments_are_one_line():
    r = pack("x.txt", "-o", "out", "--task", "3", "--tasks", "3")
    assert r.returncode != 0 and "--task 3 is not one of the 3 tasks" in r.stderr
    r = pack("x.txt", "-o", "out", "--task", "1")
    assert r.returncode == 2 and "--task I and --tasks N come together" in r.stderr


def test_the_partition_is_contiguous_complete_and_balanced():
    items = [
        Unit(Path(f"f{i}"), None, size)
        for i, size in enumerate([5, 1, 1, 1, 9, 3, 3, 3, 2, 2] * 10)
    ]
    for n in (1, 2, 3, 8, 150):
        runs = partition(items, n)
        assert len(runs) == n
        assert [u for run in runs for u in run] == items  # contiguous, in order, each once
        sizes = [sum(u.size for u in run) for run in runs]
        if n <= 8:
            assert max(sizes) - min(sizes) <= 2 * 9  # within two of the largest item
    assert partition(items, 3) == partition(list(items), 3)  # a pure function


def test_parts_packed_in_one_process_share_one_warm_encoder(
    corpus, bpe_tokenizer_file, single, tmp_path
):
    """A process that packs several parts (as a Ray worker runs its tasks) builds the
    tokenizer's encoder once and keeps its cache warm across them; the ids are the same."""
    from pytrain.data import shards
    from pytrain.data.inputs import BadInputs, ReadOptions
    from pytrain.data.parts import merge, pack_part

    out = tmp_path / "ds"
    opts = shards.PackOptions(tokenizer=str(bpe_tokenizer_file), shard_mib=0.05, frame_mib=0.01)
    shards.warm_encoder.cache_clear()
    for i in range(3):
        pack_part([str(corpus)], out, i, 3, opts, ReadOptions(), BadInputs())
    info = shards.warm_encoder.cache_info()
    assert (info.misses, info.hits) == (1, 2), info
    merge(out)
    assert documents(out) == documents(single)


@pytest.mark.slow  # starts a Ray cluster
def test_ray_tasks_on_a_local_cluster_pack_the_parts(corpus, bpe_tokenizer_file, single, tmp_path):
    """The same parts as Ray tasks (`ray.init(num_cpus=2)`), each calling pack_part."""
    ray = pytest.importorskip("ray")
    from pytrain.data.inputs import BadInputs, ReadOptions
    from pytrain.data.parts import merge, pack_part
    from pytrain.data.shards import PackOptions

    out = tmp_path / "ds"
    opts = PackOptions(tokenizer=str(bpe_tokenizer_file), shard_mib=0.05, frame_mib=0.01)

    @ray.remote(num_cpus=1, runtime_env={"env_vars": {"RAYON_NUM_THREADS": "1"}})  # as README
    def task(i: int, n: int) -> int:
        report = pack_part([str(corpus)], out, i, n, opts, ReadOptions(), BadInputs())
        return report.documents if report else 0

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        counts = ray.get([task.remote(i, 4) for i in range(4)])
    finally:
        ray.shutdown()
    assert sum(counts) == 40
    merge(out)
    assert documents(out) == documents(single)


@SLURM
def test_a_slurm_array_as_the_readme_runs_it_equals_one_pack_and_reruns_a_failed_element(
    corpus, bpe_tokenizer_file, single, tmp_path
):
    """README's Slurm array on a real Slurm: an array of `--task $SLURM_ARRAY_TASK_ID` elements,
    the merge as a job that depends on them (afterok). Element 1 fails on its first run (as a
    preempted or crashed task would), so the merge never runs and is cancelled; element 1 is
    rerun alone, the finished parts are not rewritten, and the merge then gives one pack's
    documents."""
    n, out = 3, tmp_path / "web"
    pack_cmd = (f"{sys.executable} -m pytrain.pack_shards {corpus} -o {out} --tokenizer "
                f"{bpe_tokenizer_file} --task $SLURM_ARRAY_TASK_ID --tasks {n} "
                "--shard-mib 0.05 --frame-mib 0.01")  # fmt: skip
    fail_once = 'if [ "$SLURM_ARRAY_TASK_ID" = 1 ] && [ ! -e failed-once ]; then touch failed-once; exit 1; fi; '
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def sbatch(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=600)  # fmt: skip

    first = sbatch(
        "--wait", f"--array=0-{n - 1}", "--cpus-per-task=1", "--wrap", fail_once + pack_cmd
    )
    assert first.returncode != 0  # one element failed: the array's state is FAILED
    jid = first.stdout.strip().split(";")[0]
    merge = sbatch("--wait", f"--dependency=afterok:{jid}", "--kill-on-invalid-dep=yes", "--wrap",
                   f"{sys.executable} -m pytrain.pack_shards merge {out}")  # fmt: skip
    # The merge never ran: Slurm cancelled it (sbatch --wait exits 0 for a cancelled job).
    state = subprocess.run(["scontrol", "show", "job", merge.stdout.strip()], capture_output=True,
                           text=True, timeout=30).stdout  # fmt: skip
    assert "JobState=CANCELLED" in state and "DependencyNeverSatisfied" in state, state
    assert not (out / "manifest.json").exists()

    def finished_parts() -> dict[int, int]:  # elements 0 and 2: their manifests' write times
        return {i: (out / f"part-{i:05d}-of-{n:05d}" / "manifest.json").stat().st_mtime_ns
                for i in (0, 2)}  # fmt: skip

    done = finished_parts()

    again = sbatch("--wait", "--array=1", "--cpus-per-task=1", "--wrap", fail_once + pack_cmd)
    assert again.returncode == 0, again.stderr
    merge = sbatch("--wait", "--wrap", f"{sys.executable} -m pytrain.pack_shards merge {out}")
    assert merge.returncode == 0, merge.stderr
    assert finished_parts() == done
    assert documents(out) == documents(single)
