"""benchmarks/scaling_gpu.py: a failed job's row names the trainer's reason."""

from conftest import load_script

scaling = load_script("benchmarks/scaling_gpu.py", "scaling_bench")


def test_a_failed_row_names_the_trainers_line_not_torchruns_banner():
    stderr = (
        "W1127 some warning\n"
        "pytrain.train: error: out of memory on cuda:1 at step 1 (78.1 GiB reserved)\n"
        "[rank1]: exitcode  : 5\n"
        "============================================================\n"
    )
    assert scaling.failure_line(stderr).startswith("pytrain.train: error: out of memory")
    assert scaling.failure_line("a\nTraceback ...\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert scaling.failure_line("") == "?"
