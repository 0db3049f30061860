"""benchmarks/titan.py: the ways ours runs (--ours-ac, --ours-variant), each a row of its own."""

import pytest
from conftest import load_script

titan = load_script("benchmarks/titan.py", "titan_bench")


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
