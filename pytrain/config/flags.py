"""The command line: one flag per setting, generated from the dataclasses (their field
docstrings are the help), boolean words, and parse_args (defaults, then the --config
preset, then the flags, then the checks)."""

from __future__ import annotations

import argparse
import ast
import inspect
from pathlib import Path

from pytrain.config.checks import check_choices
from pytrain.config.data import DataConfig
from pytrain.config.keys import base_type, flatten, set_key
from pytrain.config.presets import apply_toml
from pytrain.config.sections import CompileConfig, EvalConfig, FtConfig, OptimConfig, TrainConfig
from pytrain.model.config import ModelConfig

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in TRUE_WORDS:
        return True
    if t in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a boolean (use one of: {', '.join(sorted(TRUE_WORDS | FALSE_WORDS))})"
    )


def flag_value(v) -> str:
    """A value as its command-line flag takes it: lists space-separated, booleans as words."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return " ".join(str(x) for x in v)
    return str(v)


def _field_docs(cls) -> dict[str, str]:
    """The docstrings under a dataclass's fields (and its bases'), for --help."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for a, b in zip(body, body[1:], strict=False):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(a.target, ast.Name)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)
            ):
                docs[a.target.id] = " ".join(b.value.value.split())
    return docs


ALIASES = {"compile": "compile.enabled"}
"""Short flags for common settings: `--compile` / `--no-compile`."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pytrain.train",
        description="Train a GPT on token shards. Without arguments: the embedded default, on CPU or GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--config", type=Path, default=None, help="TOML preset (configs/*.toml); flags override it"
    )
    docs: dict[str, str] = {}
    for section in (TrainConfig, DataConfig, OptimConfig, CompileConfig, FtConfig, EvalConfig,
                    ModelConfig):  # fmt: skip
        prefix = "" if section is TrainConfig else f"{section.__name__[:-6].lower()}."
        docs |= {prefix + k: v for k, v in _field_docs(section).items()}
    for key, _, t in flatten(TrainConfig):
        base, extra = base_type(t)
        doc = docs.get(key, "")
        # argparse formats help with %: a docstring's own "%" would read as a format
        help_text = (doc or " ").replace("%", "%%")
        kw: dict = {"dest": key, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            names = [f"--{key}"] + [f"--{a}" for a, k in ALIASES.items() if k == key]
            p.add_argument(*names, action=_BoolAction, **kw)
        elif base is list:
            p.add_argument(f"--{key}", type=extra, nargs="+", **kw)
        else:
            p.add_argument(f"--{key}", type=base, **kw)
    return p


class _BoolAction(argparse.BooleanOptionalAction):
    """`--flag`, `--no-flag`, or `--flag=VALUE` with VALUE a boolean word (else an error)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, **kw)
        self.nargs = "?"

    def __call__(self, parser, namespace, values, option_string=None):
        if values is not None:
            if option_string.startswith("--no-"):
                parser.error(f"{option_string} takes no value")
            try:
                setattr(namespace, self.dest, parse_bool(values))
            except argparse.ArgumentTypeError as e:
                parser.error(f"argument {option_string}: {e}")
            return
        super().__call__(parser, namespace, None, option_string)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The defaults, the --config preset over them, the flags over that; then checked."""
    args = vars(build_parser().parse_args(argv))
    cfg = TrainConfig()
    preset = args.pop("config", None)
    if preset is not None:
        apply_toml(cfg, preset)
    for key, value in args.items():
        set_key(cfg, key, value)
    check_choices(cfg)
    return cfg
