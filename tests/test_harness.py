"""benchmarks/harness.py: why a launched run failed, in one line (kill_tree is tested
through scripts/gpu_acceptance.py's run, tests/test_acceptance_rows.py)."""

from conftest import load_script

harness = load_script("benchmarks/harness.py", "harness")


def test_a_failed_run_is_named_by_the_trainers_line_not_torchruns_report():
    stderr = (
        "W1127 some warning\n"
        "pytrain.train: error: out of memory on cuda:1 at step 1 (78.1 GiB reserved)\n"
        "[rank1]: exitcode  : 5\n"
        "============================================================\n"
    )
    assert harness.failure_line(stderr).startswith("pytrain.train: error: out of memory")
    assert harness.failure_line("a\nTraceback ...\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert harness.failure_line("") == "?"
