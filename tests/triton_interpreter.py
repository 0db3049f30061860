"""Runs a check script under Triton's interpreter (TRITON_INTERPRET=1), so a Triton
kernel runs on the CPU. In a subprocess: Triton reads the variable when it is imported."""

import os
import subprocess
import sys

import pytest


def assert_passes_in_interpreter(script: str, done: str = "kernel ok") -> None:
    """Runs `script` with the interpreter on; it must exit 0 and print `done` at its end."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and done in r.stdout, r.stderr[-3000:]
