"""benchmarks/float8_quality.py: the decision rule fixed before float8's paired runs, and a
pair of the same settings run through the script on a CPU ending at ratio 1 exactly."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, load_script

f8 = load_script("benchmarks/float8_quality.py", "float8_quality")


def test_float8_is_within_one_percent_only_where_every_seed_pair_holds():
    bf16 = {10: 5.0, 20: 4.0}
    assert f8.decide([(bf16, {10: 5.2, 20: 4.03}), (bf16, {10: 5.0, 20: 3.97})]).startswith(
        "within"
    )
    assert f8.decide([(bf16, {10: 5.0, 20: 4.0}), (bf16, {10: 5.0, 20: 4.05})]).startswith("NOT")
    assert f8.decide([(bf16, {10: 5.0, 20: 4.0})]).startswith("undecided: 1 seed(s)")


def test_where_the_losses_part_is_the_first_evaluation_they_stay_apart_from():
    bf16 = {10: 5.0, 20: 4.0, 30: 3.0, 40: 2.0}
    assert f8.parting(bf16, {10: 5.2, 20: 4.0, 30: 3.1, 40: 2.1}) == 30
    assert f8.parting(bf16, {10: 5.2, 20: 4.0, 30: 3.0, 40: 2.0}) is None  # back within
    assert f8.parting(bf16, {10: 5.2, 20: 4.1, 30: 3.1, 40: 2.1}) == 10


@pytest.mark.slow
def test_a_pair_of_the_same_settings_ends_at_ratio_one(tmp_path, small_corpus):
    """Both sides bf16 throughout on the CPU: the pairing (seed, weights, batches, held-out
    batches) is exact, so the two runs' losses are the same, bit for bit; one seed paired
    decides nothing."""
    work = tmp_path / "w"
    work.mkdir()
    (work / "train").symlink_to(small_corpus[0])
    (work / "val").symlink_to(small_corpus[1])
    for side in ("bf16", "float8"):
        cmd = [sys.executable, "benchmarks/float8_quality.py", "run", "--work", str(work),
               "--preset", "cpu-default", "--seed", "1", "--side", side,
               "--float8-flags", "--model.float8 off --model.float8_head off",
               "--steps", "20", "--flags", "--model.n_layer 2 --data.batch_size 4 "
               "--data.seq_len 64 --optim.tokens_per_step 512 --data.frames_per_block 2 --eval_batches 2"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    results = {p.stem: json.loads(p.read_text()) for p in (work / "results").glob("*.json")}
    assert sorted(results) == ["cpu-default-1-bf16", "cpu-default-1-float8"]
    a, b = results["cpu-default-1-bf16"], results["cpu-default-1-float8"]
    assert len(a["val"]) == 10 and a["val"] == b["val"]
    assert "--model.float8_head off" in a["command"] and "--seed 1 " in b["command"]
    r = subprocess.run([sys.executable, "benchmarks/float8_quality.py", "report", "--work", str(work)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "| 1 | 20 |" in r.stdout and "| 1.0000 | yes | - |" in r.stdout, r.stdout
    assert "cpu-default: undecided: 1 seed(s) paired, the rule asks two at least" in r.stdout
