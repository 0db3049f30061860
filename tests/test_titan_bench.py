"""benchmarks/titan.py: the ways ours runs (--ours-ac, --ours-variant), each a row of its own."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # titan.py imports benchmarks.harness
spec = importlib.util.spec_from_file_location("titan_bench", ROOT / "benchmarks/titan.py")
assert spec is not None and spec.loader is not None
titan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(titan)


def test_ours_runs_once_per_policy_and_named_variant():
    assert titan.ours_variants("", []) == [(None, [])]  # the preset as it is
    got = titan.ours_variants(
        "selective, every-2", ["fp32 moments=", "bf16 moments=--optim.state_dtype bf16"]
    )
    assert got == [
        ("selective", ["--activation_checkpointing", "selective"]),
        ("every-2", ["--activation_checkpointing", "every-2"]),
        ("fp32 moments", []),
        ("bf16 moments", ["--optim.state_dtype", "bf16"]),
    ]
    for bad in ("no flags", "=--fsdp"):
        with pytest.raises(ValueError, match="expected NAME=FLAGS"):
            titan.ours_variants("", [bad])
