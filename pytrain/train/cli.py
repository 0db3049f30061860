"""`python -m pytrain.train`: train a GPT on token shards.

With no arguments it trains on the embedded default (Python's standard library, built
once into ~/.cache/pytrain), on the GPU if there is one, else on the CPU, for a few
minutes; then it evaluates, prints samples, and says where everything went.

    python -m pytrain.train --config configs/gpt2-124m.toml --data.path data/fineweb
    torchrun --nproc_per_node=8 -m pytrain.train --config configs/gpt2-124m.toml

This module imports no torch until the environment guards are in place."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytrain.train.stopping import StopSignals

START_LINE = re.compile(
    r"\| attention (?P<attention>\S+) \| output layer (?P<output_layer>\S+) "
    r"\| mlp (?P<mlp>[^|]+?) \|.*?\| batch (?P<batch>\S+) \|"
)
"""The start line's description of the step's kernels (what `auto` resolved to) and batch
(rows x tokens x micro-batches), as the benchmark scripts read it: the one definition of
its format besides the line itself."""


def read_start_line(out: str) -> dict[str, str] | None:
    """{attention, output_layer (fp8, or the precision's bf16/fp16/fp32), mlp ('gelu, fused' ...), batch} from a run's
    output, or None when it has no start line."""
    m = START_LINE.search(out)
    return m.groupdict() if m else None


def read_fallbacks(out: str) -> list[str]:
    """The compile fallbacks a run's output reports (compile_policy's 'compile fallback'
    lines, shortened): a run with any did not run as configured (e.g. CUDA graphs refused)."""
    return [x.strip()[:160] for x in out.splitlines() if x.startswith("compile fallback")]


PEAK_LINE = re.compile(r"peak GPU memory ([\d.]+) GB \(([\d.]+) GiB reserved\)")
"""The end line's peak memory (pytrain.train.report.final_report)."""


def read_peak_memory(out: str) -> tuple[float, float] | None:
    """(GB allocated, GiB reserved) at a run's peak, from its output's end line:
    torch.cuda.max_memory_allocated / 1e9 and max_memory_reserved / 2**30 of rank 0's GPU
    (the first such line); None where there is none (a CPU run, a run that failed)."""
    m = PEAK_LINE.search(out)
    return (float(m.group(1)), float(m.group(2))) if m else None


def apply_env_guards(cfg) -> None:
    """What `python -m pytrain.train` sets before torch is imported, unless
    --compile.safe_env is off: Inductor's environment guards (env_guards) and its cache
    directory. A benchmark that must import torch before the trainer (benchmarks/fit.py caps
    its GPU memory) calls this first and passes --no-compile.safe_env to the trainer.
    The allocator's expandable segments are set either way (env_guards.apply_allocator_env)."""
    from pytrain.train.env_guards import apply_allocator_env, apply_safe_env, run_inductor_cache

    apply_allocator_env(cudagraphs=cfg.compile.mode == "reduce-overhead")
    if not cfg.compile.safe_env:
        return

    cache = cfg.compile.cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not cache:  # the run's own, where this user's trainer made it (see there)
        cache, note = run_inductor_cache(Path(cfg.out_dir) / cfg.name)
        if note and os.environ.get("RANK", "0") == "0":  # said once under torchrun
            print(note)
    apply_safe_env(cache, cudagraphs=cfg.compile.mode == "reduce-overhead")


EXIT_OK = 0
EXIT_USER_ERROR = 2
"""A bad setting, a missing or damaged dataset, a checkpoint that does not fit or would
run code, a run directory in use by another run."""
EXIT_BAD_STEPS = 3
"""Too many bad (NaN or spiking) steps in a row: the guard stopped training."""
EXIT_DISK_FULL = 4
"""A checkpoint could not be written for space (its partial file removed, the previous
checkpoint intact)."""
EXIT_OUT_OF_MEMORY = 5
"""The GPU's (or the host's) memory ran out: the line names the settings that lower it."""
# Stopped by a signal after writing a checkpoint: 128 + the signal's number (SIGINT 130,
# SIGTERM 143, SIGUSR1 138; pytrain.train.stopping). A second SIGINT: 130, no checkpoint.
# Stopped by one during set-up, before the first step: the same codes, nothing to save.


def main(argv: list[str] | None = None) -> int:
    """Runs training and returns one of the exit codes above. A user error prints one
    line naming what is wrong, as does a full disk; anything else is a bug or a system
    failure and keeps its traceback."""
    from pytrain.train.stopping import NothingToDo, StoppedInSetUp, StopSignals, exit_code

    # First of all: a scheduler's SIGTERM during set-up (imports, resume, the compile
    # warm-up) ends the run with its line and exit code, not by the default action.
    stop = StopSignals()
    stop.install()
    from pytrain._loader import LoaderError
    from pytrain.config import ConfigError
    from pytrain.train.disk import DiskFull
    from pytrain.train.out_of_memory import OutOfMemory

    try:
        return _main(argv, stop)
    except StoppedInSetUp as e:
        print(f"pytrain.train: {e}", file=sys.stderr)
        return exit_code(e.signal)
    except NothingToDo as e:
        if str(e):
            print(f"pytrain.train: {e}")
        return EXIT_OK
    except (ConfigError, LoaderError) as e:
        print(f"pytrain.train: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OutOfMemory as e:
        print(f"pytrain.train: error: {e}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except DiskFull as e:
        print(f"pytrain.train: error: {e}", file=sys.stderr)
        return EXIT_DISK_FULL
    except OSError as e:  # any other write that ran out of space: train.log, TensorBoard
        from pytrain.train.disk import free_bytes, full_disk_error, human

        if (full := full_disk_error(e)) is None:
            raise
        where = (
            f"{full.filename} ({human(free_bytes(full.filename))} free there)"
            if full.filename
            else "a file of the run"
        )
        print(f"pytrain.train: error: no space left writing {where}; the newest checkpoint is "
              "intact: free some space and run the same command to resume", file=sys.stderr)  # fmt: skip
        return EXIT_DISK_FULL
    except KeyboardInterrupt:
        print(
            "pytrain.train: interrupted by SIGINT; the run directory keeps its newest "
            "complete checkpoint (run the same command to resume from it)",
            file=sys.stderr,
        )
        return 130
    finally:
        stop.restore()


def check_model_here(cfg) -> None:
    """ConfigError, one line, for a model setting this machine cannot run (quack's MLP, FA4
    attention, float8 experts), found from the device and precision alone, as the model's
    build would."""
    import torch

    from pytrain.config import ConfigError
    from pytrain.model import flash4, quack_swiglu
    from pytrain.train import distributed
    from pytrain.train.precision import choose_precision

    device = distributed.resolve_device(cfg.device, distributed.from_env())
    dtype = choose_precision(cfg.precision, device).dtype or torch.float32
    quack_swiglu.check(cfg.model, device, dtype)
    if cfg.model.family == "moe":
        from pytrain.model.moe import check_float8_experts

        check_float8_experts(cfg.model, device)
    if cfg.model.attention == "fa4" and not (
        device.type == "cuda" and flash4.available(device.index or 0)
    ):
        raise ConfigError(flash4.NEEDS)


def _main(argv: list[str] | None, stop: StopSignals) -> int:
    from pytrain.config import parse_args

    cfg = parse_args(argv)
    apply_env_guards(cfg)
    from pytrain.model import fused_swiglu, quack_swiglu
    from pytrain.train import trackers
    from pytrain.train.guard import TrainingStopped
    from pytrain.train.out_of_memory import explained
    from pytrain.train.replica_groups import trainer_class
    from pytrain.train.report import final_report
    from pytrain.train.stopping import NothingToDo, StoppedInSetUp

    t0 = time.perf_counter()
    check_model_here(cfg)  # before any data is touched: the embedded default takes minutes
    trackers.check_installed(cfg)
    if not cfg.data.path and not cfg.data.mix:  # a mixture names its own datasets
        use_default_dataset(cfg)
    with explained(cfg):
        trainer = trainer_class(cfg)(cfg, stop=stop)
    if trainer.dist.is_main:
        from pytrain.train.sources import keep_tokenizer

        keep_tokenizer(trainer.run_dir, trainer.train_path)
    mcfg = trainer.gpt.cfg
    fused = trainer.fused_gelu or fused_swiglu.used(mcfg, trainer.device)
    trainer.say(
        f"device {trainer.device} | precision {trainer.precision.name} | attention {trainer.attention} | "
        f"output layer {'fp8' if trainer.gpt.uses_float8_head(trainer.device) else trainer.precision.short} | "
        f"mlp {mcfg.mlp}{', quack' if trainer.quack_mlp else ', fused' if fused else ''} | "
        f"params {trainer.gpt.num_params() / 1e6:.2f}M | world {trainer.dist.world_size} | "
        f"batch {cfg.data.batch_size}x{cfg.data.seq_len}x{cfg.optim.grad_accum} | run dir {trainer.run_dir}"
    )
    if trainer.plan.line:
        trainer.say(trainer.plan.line)
    if cfg.model.attention == "auto" and trainer.device.type == "cuda":
        from pytrain.model import flash4

        if hint := flash4.install_hint(trainer.device.index or 0):
            trainer.say(hint)
    if why := trainer.fused_gelu_missing:
        trainer.say(f"model.fused_gelu auto: {why}; the MLP's GELU runs unfused")
    if why := quack_swiglu.auto_note(cfg.model, trainer.device):
        trainer.say(f"model.fused_swiglu auto: quack's MLP {why}; the SwiGLU runs as the Triton op")
    try:
        with explained(cfg, step=lambda: trainer.step + 1):
            result = trainer.fit()
    except TrainingStopped as e:
        trainer.say(f"training stopped: {e}")
        trainer.close()
        return EXIT_BAD_STEPS
    except StoppedInSetUp:  # said by main; the run directory is left as it was
        trainer.close()
        raise
    except NothingToDo:  # a replica group that found its job ended (said by main)
        trainer.close(trackers.FINISHED)
        raise
    if signal := result["stopped_by"]:
        from pytrain.train.checkpoint import list_checkpoints
        from pytrain.train.stopping import exit_code

        if trainer.dist.is_main:  # this step's checkpoint, a file or a sharded directory
            trainer.say(
                f"stopped at step {result['step']} by {signal}; checkpoint "
                f"{list_checkpoints(trainer.run_dir)[-1]}; run the same command to resume"
            )
        trainer.close(trackers.KILLED)
        return exit_code(signal)
    if trainer.dist.is_main:
        final_report(trainer, result, time.perf_counter() - t0)
    trainer.close(trackers.FINISHED)
    return EXIT_OK


def use_default_dataset(cfg) -> None:
    """Points cfg.data at the embedded default (Python's standard library, BPE-tokenized),
    building it once: rank 0 builds, the others wait and then find it built."""
    from pytrain.data.corpus import build_default
    from pytrain.train import distributed

    dist, _ = distributed.init(cfg.device, cfg.dist_init_timeout_s)
    say = print if dist.is_main else (lambda *a, **k: None)
    if dist.is_main:
        build_default(vocab_size=cfg.model.vocab_size, log=say)
    distributed.barrier(dist)
    train, val = build_default(vocab_size=cfg.model.vocab_size, log=say)
    cfg.data.path, cfg.data.val_path = str(train), str(val)


if __name__ == "__main__":
    sys.exit(main())
