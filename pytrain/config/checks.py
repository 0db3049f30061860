"""The settings checked before anything is built or written: words against their choices,
small forms, ranges (check_choices); the settings read into values (activation
checkpointing's stride, the profiler's window, Inductor's options), and grad_accum derived
at the run's world size. Each wrong setting is a ConfigError that names it."""

from __future__ import annotations

import ast
import re

from pytrain.config.errors import ConfigError
from pytrain.config.keys import owner
from pytrain.config.sections import TrainConfig

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
    "fsdp_reduce_dtype": ("fp32", "bf16"),
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
    "fsdp_shard_size": (0, None),
    "ep": (1, None),
    "ac_lean_blocks": (0, None),
    "ft.group": (0, None),
    "ft.groups": (1, None),
    "ft.min_replicas": (1, None),
    "eval.tasks_every": (0, None),
    "eval.tasks_limit": (0, None),
}
"""Numbers with a range (inclusive; None: open), checked where the command line is read.
Positive-only ones (learning rates, betas below 1) are checked in check_choices."""


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
        value = getattr(*owner(cfg, key))
        if value not in words:
            raise ConfigError(f"{key} is {value!r}; expected one of {', '.join(words)}")
    for key, (pattern, form) in FORMS.items():
        value = getattr(*owner(cfg, key))
        if not re.fullmatch(pattern, value):
            raise ConfigError(f"{key} is {value!r}; expected {form}")
    for key, (low, high) in BOUNDS.items():
        value = getattr(*owner(cfg, key))
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
    if cfg.fsdp_shard_size and cfg.fsdp is not True:
        raise ConfigError(
            f"fsdp_shard_size {cfg.fsdp_shard_size} sets FSDP2's shard groups: it needs --fsdp "
            "(or fsdp_shard_size 0)"
        )
    inductor_options(cfg.compile.inductor)
    if profile_window(cfg.profile_steps) is None and cfg.profile_memory:
        raise ConfigError("--profile_memory records the steps of --profile_steps A:B: set both")
    checkpoint_every(cfg.activation_checkpointing)
    if cfg.ac_lean_blocks and cfg.activation_checkpointing != SELECTIVE:
        raise ConfigError(
            f"ac_lean_blocks {cfg.ac_lean_blocks} makes blocks of '{SELECTIVE}' checkpointing "
            f"leaner: it needs --activation_checkpointing {SELECTIVE} (now "
            f"{cfg.activation_checkpointing})"
        )
    if not 0 < cfg.optim.decay_frac <= 1:
        raise ConfigError(f"optim.decay_frac is {cfg.optim.decay_frac}; expected 0 < it <= 1")
    try:
        cfg.model.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_expert_parallel(cfg)
    check_replica_groups(cfg)
    if cfg.eval.tasks:  # every file read: a bad line is said before anything is built
        from pytrain.tasks.items import read_tasks

        read_tasks(cfg.eval.tasks)


def check_replica_groups(cfg: TrainConfig) -> None:
    """The [ft] settings' needs that they alone decide (torchrun and torchft are checked
    where the group starts: pytrain.train.replica_groups)."""
    ft = cfg.ft
    if not ft.lighthouse:
        return
    if not re.fullmatch(r"https?://[^\s/]+:\d+", ft.lighthouse):
        raise ConfigError(
            f"ft.lighthouse is {ft.lighthouse!r}; expected http://HOST:PORT (the address "
            "torchft_lighthouse listens on, its --bind port)"
        )
    if ft.group >= ft.groups:
        raise ConfigError(
            f"ft.group {ft.group} is not one of ft.groups {ft.groups}: number the replica "
            f"groups 0 to {ft.groups - 1}"
        )
    if ft.min_replicas > ft.groups:
        raise ConfigError(
            f"ft.min_replicas {ft.min_replicas} is more than ft.groups {ft.groups}: no step "
            "could ever commit"
        )
    for key, value in (
        ("ft.timeout_s", ft.timeout_s),
        ("ft.quorum_timeout_s", ft.quorum_timeout_s),
    ):
        if not value > 0:
            raise ConfigError(f"{key} is {value}; expected a number of seconds above 0")
    if cfg.data.mode != "pack":
        raise ConfigError(
            "ft.lighthouse splits each step's rows of the global order over the replica "
            f"groups: it needs data.mode pack (not {cfg.data.mode}, whose batches' rows vary)"
        )


def check_expert_parallel(cfg: TrainConfig) -> None:
    """--ep's needs that the settings alone decide (the world's size is checked where it is
    known: pytrain.train.parallel.choose)."""
    ep, m = cfg.ep, cfg.model
    if ep == 1:
        return
    if m.family != "moe":
        raise ConfigError(
            f"ep {ep} splits a mixture of experts' routed experts over ranks: it needs "
            f"--model.family moe (this model's family is {m.family})"
        )
    if m.experts % ep:
        raise ConfigError(
            f"ep {ep} does not divide model.experts {m.experts}: each rank of an expert group "
            "holds experts / ep of them"
        )
    if cfg.fsdp is False:
        raise ConfigError(
            f"ep {ep} needs FSDP2, which shards the rest of the model and each expert's slice: "
            "drop --no-fsdp (fsdp auto takes FSDP2 where ep is above 1)"
        )


SELECTIVE = "selective"
"""activation_checkpointing's per-op policy: every block recomputed in the backward, its
attention and matmul outputs kept from the forward (pytrain.model.selective_ac)."""


def checkpoint_every(spec: str) -> int:
    """activation_checkpointing as the blocks' stride: 'off' 0, 'full' and 'selective' 1
    (every block; SELECTIVE says what the latter keeps), 'every-N' N; ConfigError for
    anything else."""
    if spec in ("off", "full", SELECTIVE):
        return int(spec != "off")
    if spec.startswith("every-") and spec[6:].isdigit() and int(spec[6:]) > 0:
        return int(spec[6:])
    raise ConfigError(
        f"activation_checkpointing is {spec!r}; expected off, full, {SELECTIVE} or every-N (N >= 1)"
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
