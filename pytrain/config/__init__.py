"""Training configuration: dataclasses, TOML presets (configs/*.toml) and command-line
overrides generated from the dataclasses.

Every field is a flag: `--optim.lr 3e-4`, `--model.n_layer 12`, `--data.seq_len 1024`,
`--max_steps 500`. Booleans take `--compile` / `--no-compile` (argparse's
BooleanOptionalAction) or an explicit `--compile=false`; a value that is not a boolean
word is an error, never silently True. This package imports no torch, so the entry point
can set environment guards before torch is first imported.

    errors    ConfigError: a setting the user gave is wrong (one line, no traceback)
    data      LoaderConfig, DataConfig (the [data] section), dataset locations
    sections  TrainConfig and its [optim], [compile], [ft], [eval] sections ([model]: pytrain.model.config)
    keys      the settings by dotted key ('optim.lr'): flattened, read and set
    presets   apply_toml: a TOML preset onto a TrainConfig
    flags     the command line: build_parser, parse_args, boolean words
    checks    words, forms and ranges checked up front; settings read into values

Users import every name from here (`from pytrain.config import TrainConfig`)."""

from __future__ import annotations

from pytrain.config.checks import (
    BOUNDS,
    CHOICES,
    COMPILE_LEVELS,
    FORMS,
    SELECTIVE,
    check_choices,
    checkpoint_every,
    derive_grad_accum,
    inductor_options,
    profile_window,
)
from pytrain.config.data import (
    REMOTE_SCHEMES,
    DataConfig,
    LoaderConfig,
    dataset_dir,
    location,
    location_name,
    missing_model,
)
from pytrain.config.errors import ConfigError
from pytrain.config.flags import (
    ALIASES,
    FALSE_WORDS,
    TRUE_WORDS,
    build_parser,
    flag_value,
    parse_args,
    parse_bool,
)
from pytrain.config.presets import apply_toml
from pytrain.config.sections import (
    CompileConfig,
    EvalConfig,
    FtConfig,
    OptimConfig,
    TrainConfig,
    to_dict,
)

__all__ = [
    "ALIASES",
    "BOUNDS",
    "CHOICES",
    "COMPILE_LEVELS",
    "FALSE_WORDS",
    "FORMS",
    "REMOTE_SCHEMES",
    "SELECTIVE",
    "TRUE_WORDS",
    "CompileConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FtConfig",
    "LoaderConfig",
    "OptimConfig",
    "TrainConfig",
    "apply_toml",
    "build_parser",
    "check_choices",
    "checkpoint_every",
    "dataset_dir",
    "derive_grad_accum",
    "flag_value",
    "inductor_options",
    "location",
    "location_name",
    "missing_model",
    "parse_args",
    "parse_bool",
    "profile_window",
    "to_dict",
]
