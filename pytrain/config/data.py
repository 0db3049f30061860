"""Training configuration: dataclasses, TOML presets (configs/*.toml) and command-line
overrides generated from the dataclasses.

Every field is a flag: `--optim.lr 3e-4`, `--model.n_layer 12`, `--data.seq_len 1024`,
`--max_steps 500`. Booleans take `--compile` / `--no-compile` (argparse's
BooleanOptionalAction) or an explicit `--compile=false`; a value that is not a boolean
word is an error, never silently True. This module imports no torch, so the entry point
can set environment guards before torch is first imported."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]

from pytrain.model.config import ModelConfig

COMPILE_LEVELS = ("reduce-overhead", "max-autotune-no-cudagraphs", "default", "eager")
"""torch.compile's modes, most ambitious first: the fallback ladder of
pytrain.train.compile_policy."""
CHOICES = {
    "precision": ("auto", "bf16", "fp16", "fp32"),
    "compile.mode": ("auto", *COMPILE_LEVELS),
    "data.mode": ("pack", "bucket"),
    "data.strategy": ("best_fit", "concat"),
    "optim.schedule": ("cosine", "linear", "constant", "wsd"),
    "optim.master_weights": ("auto", "on", "off"),
    "optim.state_dtype": ("fp32", "bf16"),
}
"""The training settings that take one of a few words (the model's: ModelConfig.check)."""

FORMS = {
    "device": (r"auto|cpu|mps|cuda|cuda:\d+", "auto, cpu, cuda, cuda:N or mps"),
}
"""The training settings written in a small form: the pattern, and the form in words."""

BOUNDS = {
    "data.seq_len": (1, None),
    "data.batch_size": (1, None),
    "optim.warmup_steps": (0, None),
    "optim.min_lr_ratio": (0, 1),
    "optim.grad_clip": (0, None),
    "optim.weight_decay": (0, None),
    "keep_ckpts": (0, None),
    "eval_every": (0, None),
    "ckpt_every": (0, None),
    "log_every": (1, None),
}
"""Numbers with a range (inclusive; None: open), checked where the command line is read.
Positive-only ones (learning rates, betas below 1) are checked in check_choices."""

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting the user gave is wrong (unknown key, bad value, missing file or dataset):
    the command line prints it as one line, without a traceback."""


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


def _not_a_flag(default=dataclasses.MISSING, **kw):
    """A loader setting the trainer sets itself (rank, world size, ...): no flag, no TOML key."""
    return field(default=default, metadata={"flag": False}, **kw)


@dataclass
class LoaderConfig:
    """How batches are cut: the one definition of the loader's settings and their
    defaults (`TokenLoader`, the Rust loader and the trainer's `[data]` section all read
    this). Everything but `threads`, `prefetch_blocks`, `slots`, `pin_memory` and the cache
    changes the batches and is checked against a saved state."""

    mode: str = "pack"
    """'pack': rows of seq_len+1 tokens filled with whole documents (cut only when longer
    than a row). 'bucket': one document per row, rows grouped by length bucket."""
    seq_len: int = 256
    batch_size: int = 16
    """Rows per micro-batch (pack mode)."""
    strategy: str = "best_fit"
    """Packing: 'best_fit' (best-fit decreasing) or 'concat' (concatenate and split)."""
    bucket_lengths: list[int] = field(default_factory=lambda: [64, 128, 256])
    token_budget: int = 4096
    """Bucket mode: tokens per batch; a batch of bucket L has token_budget // L rows."""
    seed: int = 1234
    shuffle: bool = True
    frames_per_block: int = 4
    """Frames whose documents are shuffled and packed together (memory ~ 2 MiB each)."""
    threads: int = 2
    prefetch_blocks: int = 0
    """Blocks decoded ahead; 0 means 2 per thread."""
    slots: int = 4
    """Batches buffered ahead of the consumer."""
    cache_dir: str = ""
    """A dataset in object storage (s3://): keep the frames it reads under this directory
    (one subdirectory per dataset, by its manifest's hash), so later epochs, restarts and
    the node's other ranks read them from local disk. Empty: no cache."""
    cache_gb: float = 20.0
    """The cache's bound in GB (per process); least recently used frames go first."""
    skip_corrupt: bool = False
    """Leave out frames that fail their checksum (counted in stats()["frames_skipped"])
    instead of raising CorruptShardError."""
    num_epochs: int | None = _not_a_flag(None)
    """Stop after this many epochs; None streams epoch after epoch."""
    pin_memory: bool | None = _not_a_flag(None)
    """None: pin when CUDA is available."""
    rank: int = _not_a_flag(0)
    world_size: int = _not_a_flag(1)

    def batch_settings(self) -> dict:
        """The settings that decide the stream of rows (or bucket batches), by name: what a
        saved loader state is checked against (the Rust loader's fingerprint of the same
        fields). Not batch_size in pack mode: a state is a row boundary, and any number
        of rows a batch continues from it, as any world size does."""
        common = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "frames_per_block": self.frames_per_block,
        }
        if self.mode == "pack":
            return {"mode": "pack", "seq_len": self.seq_len, "strategy": self.strategy,
                    **common}  # fmt: skip
        return {"mode": self.mode, "token_budget": self.token_budget,
                "bucket_lengths": list(self.bucket_lengths), **common}  # fmt: skip

    def batch_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, seq_len) a batch can have: one in pack mode, one per bucket (a
        batch of bucket L has max(1, token_budget // L) rows of L + 1 tokens)."""
        if self.mode == "pack":
            return [(self.batch_size, self.seq_len)]
        return [(max(1, self.token_budget // n), n) for n in sorted(self.bucket_lengths)]


@dataclass
class DataConfig(LoaderConfig):
    """The trainer's `[data]` section: the datasets, and the loader settings."""

    path: str = ""
    """Training dataset directory; empty builds (once) and uses the embedded default."""
    val_path: str = ""
    """Validation dataset directory (the embedded default has its own held-out split)."""
    mix: list[str] = field(default_factory=list)
    """A mixture instead of `path`: NAME=PATH:WEIGHT per source, weights = shares of tokens
    (TOML: a [data.mix.NAME] table with path and weight)."""
    stages: list[str] = field(default_factory=list)
    """Mixture weights from a step on: STEP:NAME=W,NAME=W (sources left out get 0)."""
    val_mix: list[str] = field(default_factory=list)
    """Validation sets by source, NAME=PATH: a loss per source, and their token-weighted mean
    (TOML: a [data.val_mix] table of NAME = PATH)."""

    @classmethod
    def from_saved(cls, data: dict) -> DataConfig:
        """A [data] section as a checkpoint saved it (keys this version lacks are dropped)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def mixture(self) -> tuple[dict[str, str], dict[str, float]]:
        """(paths, weights) by source name from `mix`."""
        paths, weights = {}, {}
        for item in self.mix:
            name, eq, rest = item.partition("=")
            path, colon, w = rest.rpartition(":")
            try:
                weight = float(w)
            except ValueError:
                weight = -1.0
            if not (eq and colon and name and path) or weight < 0 or name in paths:
                raise ConfigError(
                    f"--data.mix {item!r}: expected NAME=PATH:WEIGHT (a non-negative weight, each name once)"
                )
            paths[name], weights[name] = path, weight
        return paths, weights

    def stage_list(self) -> list[tuple[int, dict[str, float]]]:
        """(step, weights) per entry of `stages`, in step order."""
        out = []
        for item in self.stages:
            step, colon, rest = item.partition(":")
            try:
                pairs = [p.split("=") for p in rest.split(",")]
                out.append((int(step), {n.strip(): float(w) for n, w in pairs}))
            except ValueError:
                raise ConfigError(
                    f"--data.stages {item!r}: expected STEP:NAME=WEIGHT,NAME=WEIGHT"
                ) from None
        return sorted(out, key=lambda s: s[0])

    def val_sources(self) -> dict[str, str]:
        """Validation sets by name: `val_mix`, else `val_path` alone (named 'val')."""
        out = {}
        for item in self.val_mix:
            name, eq, path = item.partition("=")
            if not (eq and name and path) or name in out:
                raise ConfigError(f"--data.val_mix {item!r}: expected NAME=PATH, each name once")
            out[name] = path
        if not out and self.val_path:
            out["val"] = self.val_path
        return out


REMOTE_SCHEMES = ("s3://", "s3a://")
"""Datasets read from object storage by the extension (rust_loader/storage.rs)."""


def location(p: str | Path) -> str | Path:
    """A local dataset directory as a Path; an object-storage URL as the string it is (a
    Path would fold its '//')."""
    return p if isinstance(p, str) and p.startswith(REMOTE_SCHEMES) else Path(p)


def location_name(p: str | Path) -> str:
    """The last component of a directory or URL: a single source's name."""
    return str(p).rstrip("/").rsplit("/", 1)[-1]


def dataset_dir(path: str, flag: str) -> Path | str:
    """`path` if it is a dataset made by pack-shards, else a ConfigError naming it. An
    object-storage URL (s3://) is kept as given; opening it checks it (one line naming the
    object that cannot be read)."""
    if path.startswith(REMOTE_SCHEMES):
        return path
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory")
    if not (p / "manifest.json").is_file():
        raise ConfigError(
            f"{flag} {path}: not a dataset made by pack-shards (no manifest.json in it)"
        )
    return p


@dataclass
class OptimConfig:
    name: str = "adamw"
    """'adamw', or 'muon': Muon for the 2-D weights of the transformer blocks, AdamW for
    the embedding, output layer, norms and biases (pytrain/optim/muon.py)."""
    lr: float = 2e-3
    """Peak learning rate (AdamW's; with optim.name=muon, that of the AdamW groups)."""
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"
    """After warm-up: 'cosine', 'linear' or 'constant'; or 'wsd' (warm-up-stable-decay:
    constant, then linear to lr x min_lr_ratio over the last decay_frac of max_steps)."""
    decay_frac: float = 0.2
    """optim.schedule=wsd: the share of max_steps that decays (0 < decay_frac <= 1)."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank; 0: derived from tokens_per_step at the
    run's world size (one preset then makes the same optimizer step on 1 GPU or 64)."""
    tokens_per_step: int = 0
    """With grad_accum = 0: tokens per optimizer step over all ranks. Each rank runs
    tokens_per_step / (data.batch_size x data.seq_len x ranks) micro-batches, rounded to
    the nearest whole number (at least 1; the start line says the step it gives)."""
    master_weights: str = "auto"
    """Keep the parameters in bf16 and their fp32 copies in the optimizer
    (pytrain.optim.master_adamw): 'auto' (on for bf16 on CUDA in one process), 'on', 'off'
    (fp32 parameters under autocast)."""
    state_dtype: str = "fp32"
    """AdamW's two moments with master weights: 'fp32', or 'bf16' (4 bytes a parameter
    less: 12.8 GB at 3.2B; the update still computes in fp32; DeepSeek-V3 keeps them so).
    Needs master weights (optim.master_weights; not FSDP2 or Muon)."""
    muon_lr: float = 0.02
    """optim.name=muon: peak learning rate of the Muon group (same schedule as optim.lr)."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    """optim.name=muon: decoupled weight decay of the Muon group (per step: lr x this)."""
    spike_factor: float = 4.0
    """Skip a step whose loss exceeds this multiple of the running mean (0 disables)."""
    max_bad_steps: int = 10
    """Stop after this many skipped steps in a row."""


@dataclass
class CompileConfig:
    enabled: bool | None = None
    """None: on for CUDA, off for CPU."""
    mode: str = "auto"
    """'auto', 'eager', 'default', 'reduce-overhead', 'max-autotune-no-cudagraphs'."""
    safe_env: bool = True
    """Set Inductor/Triton environment guards before torch is imported (see docs/COMPILE.md)."""
    cache_dir: str = ""
    """Persistent Inductor cache (TORCHINDUCTOR_CACHE_DIR); empty: under runs/<name>/."""
    guard: bool = True
    """Avoid known-bad combinations up front and fall back at run time. Off shows torch's
    native behaviour (scripts/compile_matrix.py compares the two)."""
    coordinate_descent: bool = False
    """Inductor's coordinate-descent tuning of the kernels it generates (block sizes):
    a longer first compile for sometimes faster steps. Set in code, so it overrides the
    safe_env guard that turns it off; off by default."""
    inductor: str = ""
    """Inductor config overrides set in code before compiling, 'name=value' comma-separated
    with Python literals (e.g. 'triton.enable_pdl=True'); a name this torch does not have
    is skipped with a note in the compile line."""
    inject_failure_at: int = -1
    """Testing knob: raise a compile-like failure at this step (>= 0) to exercise the fallback."""


@dataclass
class TrainConfig:
    name: str = "default"
    out_dir: str = "runs"
    device: str = "auto"
    """'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N' (or 'mps', untested)."""
    precision: str = "auto"
    """'auto' (bf16 on GPUs that have it, else fp16 on CUDA, fp32 on CPU), 'bf16', 'fp16', 'fp32'."""
    max_steps: int = 120
    halt_after: int = 0
    """Checkpoint and exit after this many steps in this process (0: run to max_steps);
    for time-sliced clusters and preemption tests. The schedule still uses max_steps."""
    time_limit_s: float = 0.0
    """Stop (and checkpoint) after this many seconds of training; 0: no limit."""
    eval_every: int = 60
    eval_batches: int = 10
    log_every: int = 10
    ckpt_every: int = 60
    keep_ckpts: int = 3
    """The newest checkpoints kept in the run directory; 0 keeps every one."""
    ckpt_async: bool = True
    """Write checkpoints on a background thread from a snapshot of the step (pinned host
    copies); off: the loop waits for the file."""
    resume: bool = True
    """Resume from the latest valid checkpoint in runs/<name>/ if there is one."""
    init_from: str = ""
    """Start a new run from these weights (continued pretraining): a Hugging Face directory
    (LlamaForCausalLM, e.g. Meta's Llama 3.2, or ArceeForCausalLM; config.json and
    safetensors, one file or sharded), or a pytrain run directory or checkpoint. The model's
    shape comes from it (the preset's speed settings stay); optimizer and schedule start
    fresh. A run that resumes from its own checkpoint continues from that instead."""
    activation_checkpointing: str = "off"
    """'off', 'full', or 'every-N' (every N-th block)."""
    fsdp: bool | None = None
    """Under torchrun: shard parameters, gradients and optimizer state with FSDP2 (--fsdp),
    replicate the model on every rank (--no-fsdp), or unset (auto): FSDP2 where the training
    state would take over a quarter of one GPU's memory (pytrain.train.parallel)."""
    dist_timeout_s: float = 120.0
    """Under torchrun, how long a collective waits for the other ranks once training runs
    (after the compile warm-up): a rank that died or hangs ends the job within this, not
    after NCCL's 10 minutes. Longer than any step and than rank 0's synchronous checkpoint
    write (docs/TRAINER.md, Distributed)."""
    dist_init_timeout_s: float = 900.0
    """The same during set-up, resume and the compile warm-up (a cold compile of a large
    model takes minutes, and the ranks meet at its end)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (for exact-resume checks)."""
    seed: int = 1337
    samples: int = 3
    """Text samples generated at the end."""
    sample_tokens: int = 80
    progress: bool = True
    tensorboard: bool = True
    profile_steps: str = ""
    """'A:B' records steps A..B-1 with torch.profiler: runs/<name>/profile/ gets a Chrome
    trace and a table of kernel times per step (pytrain/train/profiling.py). Empty: off."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)


def _field_docs(cls) -> dict[str, str]:
    """The docstrings under a dataclass's fields (and its bases'), for --help."""
    import ast
    import inspect

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


def _flatten(cls, prefix: str = "") -> list[tuple[str, dataclasses.Field, type]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if f.metadata.get("flag", True) is False:
            continue
        if dataclasses.is_dataclass(t):
            out += _flatten(t, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, t))
    return out


def _base_type(t):
    """bool | None -> (bool, True); list[int] -> (list, int)."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0], True
    if origin is list:
        return list, typing.get_args(t)[0]
    return t, False


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
    for section in (TrainConfig, DataConfig, OptimConfig, CompileConfig, ModelConfig):
        prefix = "" if section is TrainConfig else f"{section.__name__[:-6].lower()}."
        docs |= {prefix + k: v for k, v in _field_docs(section).items()}
    for key, _, t in _flatten(TrainConfig):
        base, extra = _base_type(t)
        doc = docs.get(key, "")
        kw: dict = {"dest": key, "default": argparse.SUPPRESS, "help": doc or " "}
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


def _owner(cfg, key: str) -> tuple[object, str]:
    """The section a dotted key lives in, and its last part ('data.mode': cfg.data, 'mode')."""
    obj = cfg
    *path, last = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


def _set(cfg, key: str, value) -> None:
    obj, last = _owner(cfg, key)
    if not hasattr(obj, last):
        raise KeyError(key)
    setattr(obj, last, value)


def apply_toml(cfg: TrainConfig, path: Path) -> None:
    """Sets every key of a TOML file ([model], [data], ... tables map to the sections)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    known = {k: t for k, _, t in _flatten(TrainConfig)}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = prefix + k
            if key == "data.mix" and isinstance(v, dict):  # [data.mix.NAME] path, weight
                v = [f"{n}={t.get('path', '')}:{t.get('weight', '')}" for n, t in v.items()]
            if key == "data.val_mix" and isinstance(v, dict):  # [data.val_mix] NAME = PATH
                v = [f"{n}={p}" for n, p in v.items()]
            if isinstance(v, dict):
                walk(v, key + ".")
                continue
            if key not in known:
                raise ConfigError(
                    f"{path}: unknown setting {key!r} (python -m pytrain.train --help lists them)"
                )
            base, _ = _base_type(known[key])
            if base is bool and not isinstance(v, bool):
                raise ConfigError(f"{path}: {key} must be true or false, not {v!r}")
            _set(cfg, key, float(v) if base is float and isinstance(v, int) else v)

    walk(data, "")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    cfg = TrainConfig()
    preset = args.pop("config", None)
    if preset is not None:
        apply_toml(cfg, preset)
    for key, value in args.items():
        _set(cfg, key, value)
    check_choices(cfg)
    return cfg


def derive_grad_accum(cfg: TrainConfig, world_size: int) -> str | None:
    """Sets optim.grad_accum from optim.tokens_per_step where it is 0 (derived); returns a
    line saying what it chose, or None where grad_accum was given."""
    o, d = cfg.optim, cfg.data
    if o.grad_accum > 0:
        return None
    if o.grad_accum < 0 or o.tokens_per_step <= 0:
        raise ConfigError(
            f"optim.grad_accum is {o.grad_accum}: set it to a number of micro-batches, or to 0 "
            f"with optim.tokens_per_step > 0 (it is {o.tokens_per_step})"
        )
    per_micro_step = d.batch_size * d.seq_len * world_size
    o.grad_accum = max(1, round(o.tokens_per_step / per_micro_step))
    step = o.grad_accum * per_micro_step
    exact = (
        "" if step == o.tokens_per_step else f" (optim.tokens_per_step asks {o.tokens_per_step:,})"
    )
    return (
        f"gradient accumulation: {o.grad_accum} micro-batches of {d.batch_size}x{d.seq_len} per rank "
        f"x {world_size} rank(s) = {step:,} tokens per optimizer step{exact}"
    )


def check_choices(cfg: TrainConfig) -> None:
    """ConfigError naming the first setting that is not one of its words or forms, before
    anything is built or written."""
    for key, words in CHOICES.items():
        value = getattr(*_owner(cfg, key))
        if value not in words:
            raise ConfigError(f"{key} is {value!r}; expected one of {', '.join(words)}")
    for key, (pattern, form) in FORMS.items():
        value = getattr(*_owner(cfg, key))
        if not re.fullmatch(pattern, value):
            raise ConfigError(f"{key} is {value!r}; expected {form}")
    for key, (low, high) in BOUNDS.items():
        value = getattr(*_owner(cfg, key))
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"between {low} and {high}"
            raise ConfigError(f"{key} is {value}; expected a number {span}")
    o = cfg.optim
    for key, value in (("optim.lr", o.lr), ("optim.muon_lr", o.muon_lr)):
        if not value > 0:
            raise ConfigError(f"{key} is {value}; expected a learning rate above 0")
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key} is {value}; expected 0 <= it < 1")
    d = cfg.data
    if d.stages:
        stages = d.stage_list()  # its own form first
        if not d.mix:
            raise ConfigError(
                "--data.stages sets a mixture's weights from a step on: it needs --data.mix"
            )
        names = d.mixture()[0]
        for step, weights in stages:
            if unknown := sorted(set(weights) - set(names)):
                raise ConfigError(
                    f"--data.stages at step {step}: no source {', '.join(map(repr, unknown))} "
                    f"in --data.mix ({', '.join(names)})"
                )
    inductor_options(cfg.compile.inductor)
    profile_window(cfg.profile_steps)
    checkpoint_every(cfg.activation_checkpointing)
    if not 0 < cfg.optim.decay_frac <= 1:
        raise ConfigError(f"optim.decay_frac is {cfg.optim.decay_frac}; expected 0 < it <= 1")
    try:
        cfg.model.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def checkpoint_every(spec: str) -> int:
    """activation_checkpointing as the blocks' stride: 'off' 0, 'full' 1, 'every-N' N;
    ConfigError for anything else."""
    if spec in ("off", "full"):
        return int(spec == "full")
    if spec.startswith("every-") and spec[6:].isdigit() and int(spec[6:]) > 0:
        return int(spec[6:])
    raise ConfigError(
        f"activation_checkpointing is {spec!r}; expected off, full or every-N (N >= 1)"
    )


def profile_window(spec: str) -> tuple[int, int] | None:
    """--profile_steps 'A:B' as (A, B), None where it is empty; ConfigError unless
    0 <= A < B."""
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"profile_steps {spec!r} is not 'A:B' (two step numbers)") from None
    if not 0 <= a < b:
        raise ConfigError(f"profile_steps {spec!r}: need 0 <= A < B")
    return a, b


def inductor_options(spec: str) -> list[tuple[str, object]]:
    """compile.inductor's 'name=value,...' as (name, value) pairs (values are Python
    literals); ConfigError for an item that is not name=value or a value that is not a
    literal. Whether this torch has each name is decided where they are set
    (compile_policy.set_inductor_options)."""
    out = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"compile.inductor: {item!r} is not name=value")
        try:
            out.append((name.strip(), ast.literal_eval(raw.strip())))
        except (ValueError, SyntaxError):
            raise ConfigError(
                f"compile.inductor: value of {name.strip()!r} is not a literal: {raw.strip()!r}"
            ) from None
    return out


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
