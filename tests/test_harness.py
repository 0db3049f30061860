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


def test_a_failed_torchrun_is_named_by_its_first_ranks_exception():
    """torchrun's report ends in a row of '=' and names ChildFailedError: the line that says
    why is the first rank's exception above it."""
    stderr = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "quack/gemm_runtime/identity.py", line 117, in semantic_value_key\n'
        "[rank1]:     raise TypeError(\n"
        "[rank1]: TypeError: epilogue fn depends on <ContextVar name='_LOC_TRANSFORMS'>\n"
        "[rank0]: RuntimeError: a later rank's\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================================\n"
        "pytrain.train FAILED\n"
        "============================================================\n"
    )
    assert harness.failure_line(stderr) == (
        "TypeError: epilogue fn depends on <ContextVar name='_LOC_TRANSFORMS'>"
    )
    assert harness.failure_line("x.py:3: UserWarning: Error-free\nstopped\n") == "stopped"
