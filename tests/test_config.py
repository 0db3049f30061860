"""Configuration: booleans are never silently truthy; presets and overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytrain.config import (
    ConfigError,
    TrainConfig,
    apply_toml,
    build_parser,
    derive_grad_accum,
    parse_args,
)

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize(
    "argv, want",
    [
        (["--compile"], True),
        (["--no-compile"], False),
        (["--compile=False"], False),
        (["--compile=false"], False),
        (["--compile=0"], False),
        (["--compile=True"], True),
        (["--compile.enabled=no"], False),
        ([], None),
    ],
)
def test_boolean_flags(argv, want):
    assert parse_args(argv).compile.enabled is want


@pytest.mark.parametrize("bad", ["--compile=Flase", "--compile=2", "--compile="])
def test_a_non_boolean_word_is_an_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([bad])
    assert e.value.code == 2
    assert "is not a boolean" in capsys.readouterr().err


def test_typed_overrides():
    c = parse_args(
        [
            "--optim.lr",
            "3e-4",
            "--model.n_layer",
            "6",
            "--data.bucket_lengths",
            "64",
            "128",
            "--no-progress",
        ]
    )
    assert (c.optim.lr, c.model.n_layer, c.data.bucket_lengths, c.progress) == (
        3e-4,
        6,
        [64, 128],
        False,
    )
    with pytest.raises(SystemExit):
        parse_args(["--model.n_layer", "six"])


@pytest.mark.parametrize("preset", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_presets_load_and_flags_override_them(preset):
    c = parse_args(["--config", str(preset), "--max_steps", "7"])
    assert c.max_steps == 7
    assert isinstance(c.model.n_layer, int) and c.model.d_model % c.model.n_head == 0


def test_toml_rejects_unknown_keys_and_non_boolean_values(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlrr = 1.0\n")
    with pytest.raises(ValueError, match="unknown setting 'optim.lrr'"):
        apply_toml(TrainConfig(), bad)
    bad.write_text('[compile]\nenabled = "False"\n')
    with pytest.raises(ValueError, match="must be true or false"):
        apply_toml(TrainConfig(), bad)


@pytest.mark.slow  # two processes importing torch
def test_env_guards_are_set_before_torch_is_imported(tmp_path):
    # The entry point parses flags and sets the guards without importing torch first.
    code = (
        "import sys, os\n"
        "from pytrain.config import parse_args\n"
        "from pytrain.train.env_guards import apply_safe_env\n"
        "cfg = parse_args([])\n"
        "assert 'torch' not in sys.modules, 'config imported torch'\n"
        "apply_safe_env(None)\n"
        "import torch._inductor.config as ic\n"
        "print(os.environ['TORCHINDUCTOR_MAX_AUTOTUNE'], os.environ['TORCH_COMPILE_DISABLE_CUDAGRAPHS'], ic.max_autotune, ic.coordinate_descent_tuning)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "False", "False"]
    # Asking for CUDA graphs by name leaves them on; autotuning stays off.
    code = code.replace("parse_args([])", "parse_args(['--compile.mode', 'reduce-overhead'])")
    code = code.replace(
        "apply_safe_env(None)", "apply_safe_env(None, cfg.compile.mode == 'reduce-overhead')"
    )
    code = code.replace(
        "os.environ['TORCH_COMPILE_DISABLE_CUDAGRAPHS']",
        "os.environ.get('TORCH_COMPILE_DISABLE_CUDAGRAPHS', '-')",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "-", "False", "False"]


def test_the_allocator_grows_segments_unless_the_user_configured_it(monkeypatch):
    from pytrain.train.env_guards import apply_allocator_env, expandable_in_force

    for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    assert not expandable_in_force()
    # A run that asks for CUDA graphs keeps torch's default allocator.
    assert apply_allocator_env(cudagraphs=True) == "" and not expandable_in_force()
    assert apply_allocator_env() == "expandable_segments:True"
    assert expandable_in_force()
    # A setting of the user's, under either name, is kept as it is.
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert apply_allocator_env() == "max_split_size_mb:512"
    assert "PYTORCH_ALLOC_CONF" not in os.environ and not expandable_in_force()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments:True")
    assert expandable_in_force()


def test_inductor_options_are_set_checked_and_skipped_when_unknown():
    import torch._inductor.config as inductor_config

    from pytrain.train.compile_policy import set_inductor_options

    before = inductor_config.triton.descriptive_names
    try:
        done = set_inductor_options("triton.descriptive_names='torch', no_such.option=1")
        assert inductor_config.triton.descriptive_names == "torch"
        assert done[0] == "triton.descriptive_names='torch'"
        assert "no_such.option (not an option of torch" in done[1]
    finally:
        inductor_config.triton.descriptive_names = before
    with pytest.raises(ValueError, match="is not name=value"):
        set_inductor_options("triton.descriptive_names")
    with pytest.raises(ValueError, match="not a literal"):
        set_inductor_options("triton.descriptive_names=torch")


def test_mixture_flags_toml_tables_and_help(tmp_path):
    cfg = parse_args(["--data.mix", "web=d/web:0.7", "code=d/code:0.3",
                      "--data.stages", "500:web=0.5,code=0.5", "--data.val_mix", "web=v/web"])  # fmt: skip
    assert cfg.data.mixture() == ({"web": "d/web", "code": "d/code"}, {"web": 0.7, "code": 0.3})
    assert cfg.data.stage_list() == [(500, {"web": 0.5, "code": 0.5})]
    assert cfg.data.val_sources() == {"web": "v/web"}
    toml = tmp_path / "mix.toml"
    toml.write_text(
        '[data.mix.web]\npath = "d/web"\nweight = 0.7\n[data.mix.code]\npath = "d/code"\nweight = 0.3\n'
        '[data.val_mix]\nweb = "v/web"\n[data]\nstages = ["500:web=0.5,code=0.5"]\n'
    )
    t = parse_args(["--config", str(toml)])
    assert t.data.mixture() == cfg.data.mixture() and t.data.val_sources() == {"web": "v/web"}
    for bad in (["web=d/web"], ["web=d/web:-1"], ["a=x:1", "a=y:1"]):
        with pytest.raises(ConfigError, match="NAME=PATH:WEIGHT"):
            parse_args(["--data.mix", *bad]).data.mixture()
    with pytest.raises(ConfigError, match="STEP:NAME=WEIGHT"):
        parse_args(["--data.stages", "x:web=1"]).data.stage_list()
    text = build_parser().format_help()
    assert "NAME=PATH:WEIGHT" in text and "STEP:NAME=W" in text
    # A docstring's "%" as written (argparse formats help with %).
    assert "about 0.7% of the tokens/s a block in bf16, 0.2% in float8" in " ".join(text.split())


@pytest.mark.parametrize("world, accum", [(1, 16), (2, 8), (8, 2), (16, 1), (32, 1), (3, 5)])
def test_the_gpt2_preset_makes_a_half_million_token_step_at_any_world_size(world, accum):
    c = parse_args(["--config", str(CONFIGS / "gpt2-124m.toml")])
    line = derive_grad_accum(c, world)
    assert c.optim.grad_accum == accum
    step = accum * 32 * 1024 * world
    assert f"= {step:,} tokens per optimizer step" in line
    assert ("asks 524,288" in line) == (step != 524288)


def test_a_given_grad_accum_wins_and_zero_needs_tokens_per_step():
    c = parse_args(["--config", str(CONFIGS / "gpt2-124m.toml"), "--optim.grad_accum", "2"])
    assert derive_grad_accum(c, 4) is None and c.optim.grad_accum == 2
    c = parse_args(["--optim.grad_accum", "0"])
    with pytest.raises(ConfigError, match="optim.tokens_per_step > 0"):
        derive_grad_accum(c, 1)
