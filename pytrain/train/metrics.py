"""Logging: TensorBoard scalars, a plain text log line every N steps, and MFU.

MFU = achieved FLOP/s / peak FLOP/s, with FLOPs per token = 6 N + 12 L H Q T
(N non-embedding parameters a token's forward multiplies by, L layers, H heads, Q head size,
T sequence length: the PaLM appendix B formula that nanoGPT uses; the model family's,
pytrain.model.families). Peak is the dense bf16 tensor-core rate of
the GPU (table below); MFU is not reported where the peak is unknown (e.g. CPU)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from pytrain.config import TrainConfig
from pytrain.config.errors import first_line
from pytrain.data.batch import FeedTime
from pytrain.train import trackers
from pytrain.train.trackers import Tracker

PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10": 125e12,
    "4090": 165e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class RunLog:
    """TensorBoard writer (rank 0) plus a text log file runs/<name>/train.log, and the
    trackers that get the same scalars (pytrain.train.trackers: W&B, MLflow)."""

    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool, trackers: Sequence[Tracker] = ()
    ):
        self.enabled = enabled
        self.tb = None
        self.file = None
        self.trackers = list(trackers)
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "train.log", "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    @classmethod
    def of(cls, cfg: TrainConfig, run_dir: Path, enabled: bool, resumed: bool) -> RunLog:
        """The run's logs as `cfg` asks (rank 0: `enabled`); `resumed`: its trackers go on in
        the tracked runs the run directory names."""
        tracked = trackers.open_trackers(cfg, run_dir, enabled, resumed)
        return cls(run_dir, enabled, cfg.tensorboard, tracked)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        """Logs every value that is not None (a figure this run cannot measure)."""
        known = {k: v for k, v in values.items() if v is not None}
        if self.tb is not None:
            for k, v in known.items():
                self.tb.add_scalar(k, v, step)
        for t in list(self.trackers):
            try:
                t.scalars(step, known)
            except Exception as e:  # its server or its disk: the run goes on without it
                self._drop(t, f"logging failed at step {step}", e)

    def _drop(self, tracker: Tracker, what: str, e: Exception) -> None:
        self.trackers.remove(tracker)
        line = f"{tracker.name}: {what} ({first_line(e)}); the run goes on without it"
        print(line, file=sys.stderr, flush=True)
        self.text(line)

    def text(self, line: str) -> None:
        if self.file is not None:
            self.file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
            self.file.flush()

    def close(self, status: str = trackers.FAILED) -> None:
        """`status`: how the run ended (trackers.FINISHED, KILLED, FAILED)."""
        for t in list(self.trackers):
            try:
                t.close(status)
            except Exception as e:
                self._drop(t, "closing its run failed", e)
        self.trackers = []
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.file is not None:
            self.file.close()
            self.file = None


def log_mixture(log: RunLog, step: int, names: list[str], loader_state: dict) -> None:
    """A mixture's tokens (all ranks) and epoch per source, from the loader's state."""
    values: dict[str, float | None] = {}
    for name, p in zip(names, loader_state["sources"], strict=True):
        values[f"data/tokens/{name}"] = float(p["tokens"])
        values[f"data/epoch/{name}"] = float(p["epoch"])
    log.scalars(step, values)


def loader_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process's loader threads (named "ptl-*"), from
    /proc (Linux); None elsewhere."""
    import os

    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("ptl-"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    except OSError:
        return None
    return total


class CpuClock:
    """CPU time of the loader threads and of the whole process over the training loop. The
    loader's own share comes from /proc's per-thread times; where a sandbox reports none
    (gVisor reports 0), the process's time (main thread included) is the bound to read."""

    def __init__(self):
        self.wall, self.process, self.loader = (
            time.perf_counter(), time.process_time(), loader_cpu_seconds()
        )  # fmt: skip

    def line(self) -> str:
        wall = time.perf_counter() - self.wall
        process = time.process_time() - self.process
        loader, now = None, loader_cpu_seconds()
        if self.loader is not None and now is not None:
            loader = now - self.loader
        text = (
            f"loader threads CPU: {loader:.2f}s" if loader is not None else "loader threads CPU: ?"
        )
        return (
            f"{text} over {wall:.2f}s of training = {(loader or 0.0) / wall:.3f} cores; "
            f"process CPU {process:.2f}s = {process / wall:.3f} cores"
        )


class StepClock:
    """Where each training step begins and ends, to time steps without waiting for the
    device: a mark is the host's time and, on a GPU, an event queued on the current stream
    (timed by the device when it gets there). A step's time is from its mark to the next
    step's mark (the period: in steady state the device's, idle gaps included), or, where
    the step is read at once (before an evaluation, a checkpoint, the end), to a mark
    queued after its work. Host times alone misread those: where queuing a step waits for
    the device (FSDP2's step reads the guard's verdict), a step read at once after the
    previous one looked 17 ms long and the next one twice its length."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> tuple[float, torch.cuda.Event | None]:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    @staticmethod
    def seconds(start, end) -> float:
        """Seconds from mark `start` to mark `end` (waiting for the device to reach `end`)."""
        if start[1] is not None and end[1] is not None:
            end[1].synchronize()
            return start[1].elapsed_time(end[1]) / 1e3
        return end[0] - start[0]


STEP_LINE = re.compile(r"\bstep (\d+) (loss .*)$", re.M)


def read_step_lines(text: str) -> list[dict[str, float]]:
    """train.log's step lines, as `StepLog.step` writes them, for the scripts and tests that
    read them back: {"step": n, "loss": ..., "lr": ..., "grad_norm": ..., "tok/s": ...,
    "step_ms": ..., "data_wait_ms": ..., "feed_ms": ..., "mfu": a fraction, "reserved_gib":
    ..., "allocated_gib": ...}; a field a line does not have (mfu, the GiB off a GPU) is
    absent. "loss" is the exact value (the line's `loss_exact`) where the line has it, else
    the 4 decimals shown. Evaluation and skip lines are not step lines."""
    rows = []
    for number, rest in STEP_LINE.findall(text):
        words = rest.split()
        row: dict[str, float] = {"step": int(number)}
        for key, value in zip(words[::2], words[1::2], strict=False):
            v = float(value.rstrip("%").replace(",", ""))
            row[key] = v / 100 if value.endswith("%") else v
        if "loss_exact" in row:
            row["loss"] = row.pop("loss_exact")
        rows.append(row)
    return rows


def expert_layers_line(number: int, stats: dict[str, float]) -> str:
    """train.log's line of each MoE layer's load at a log step (GPT.routing_stats' per-layer
    keys): `layer:max/mean:unused` for each, in layer order."""
    layers = sorted(int(k.rsplit("/", 1)[1]) for k in stats if k.startswith("moe/unused_experts/"))
    cells = (f"{i}:{stats[f'moe/load_max_over_mean/{i}']:.2f}:{stats[f'moe/unused_experts/{i}']:.0f}"
             for i in layers)  # fmt: skip
    return f"step {number} expert load by layer (layer:max/mean:unused) " + " ".join(cells)


class StepLog:
    """What the loop writes per step and per evaluation: TensorBoard scalars, a text line
    every `log_every` steps (and the first), the progress bar, and console lines for
    evaluations and skipped steps."""

    def __init__(
        self,
        log: RunLog,
        say: Callable[[str], None],
        *,
        flops_token: float,
        peak: float | None,
        world_size: int,
        log_every: int,
        progress: bool,
        device: torch.device,
        stats: Callable[[torch.Tensor], dict[str, float]] = lambda window: {},
    ):
        """`stats`: the model's scalars at each log step (GPT.routing_stats: a mixture of
        experts' loads) from the sum of the logged steps' `routing` since the last line,
        read there only: no host sync in the steps between."""
        self.log, self.say = log, say
        self.stats = stats
        self.flops_token, self.peak, self.world_size = flops_token, peak, world_size
        self.log_every, self.progress, self.device = log_every, progress, device
        self.bar = None
        self._layers_line = ""
        # Tokens, seconds and steps since the last text line, and the sum of their routing.
        self._window: tuple[int, float, int] = (0, 0.0, 0)
        self._routing: torch.Tensor | None = None

    def open_bar(self, total: int, initial: int) -> None:
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc="train", file=sys.stderr, dynamic_ncols=True
            )

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def step(
        self, r, number: int, dt: float, fed: FeedTime, lr: float, skipped: int, fallbacks: int
    ) -> None:
        """Logs the step (a `guard.StepResult`) that completed step count `number`, which
        took `dt` seconds (StepClock). Tokens/s, step time and MFU are averaged over the
        steps since the last text line. `fed`: the step's own data time, not averaged:
        data_wait_ms, blocked on the loader (the end line's "data wait" is the run's sum of
        it), and feed_ms, all host time getting the batches (the wait included)."""
        tokens, seconds, steps = self._window
        tokens, seconds, steps = tokens + r.tokens, seconds + dt, steps + 1
        self._window = (tokens, seconds, steps)
        if r.routing is not None:  # a device add, read at the log line
            self._routing = r.routing if self._routing is None else self._routing + r.routing
        tok_s = tokens / seconds
        dt = seconds / steps
        mfu = tok_s * self.flops_token / (self.peak * self.world_size) if self.peak else None
        values: dict[str, float | None] = {
            "train/loss": r.loss,
            "train/lr": lr,
            "train/grad_norm": r.grad_norm,
            "perf/tokens_per_s": tok_s,
            "perf/step_ms": dt * 1e3,
            "perf/data_wait_ms": fed.wait_s * 1e3,
            "perf/feed_ms": fed.host_s * 1e3,
            "perf/mfu": mfu,
            "train/skipped_steps": skipped,
            "compile/fallbacks": fallbacks,
        }
        if self.device.type == "cuda":
            values["perf/gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
        self.log.scalars(number, values)
        if r.skipped:
            self.say(f"step {number}: skipped ({r.skipped})")
            self.log.text(f"step {number} skipped: {r.skipped}")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{r.loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        if number % self.log_every == 0 or number == 1:
            # loss_exact: the loss as repr writes it (float() gives back the same bits), so
            # that a resumed run and an uninterrupted one compare bit for bit.
            line = (
                f"step {number} loss {r.loss:.4f} lr {lr:.2e} grad_norm {r.grad_norm:.3f} "
                f"tok/s {tok_s:,.0f} step_ms {dt * 1e3:.1f} data_wait_ms {fed.wait_s * 1e3:.2f} "
                f"feed_ms {fed.host_s * 1e3:.2f}"
                + (f" mfu {mfu:.1%}" if mfu else "")
                + f" loss_exact {r.loss!r}"
            )
            stats = self.stats(self._routing) if self._routing is not None else {}
            if stats:  # the worst layer's here, each layer's on a line below
                self.log.scalars(number, stats)
                line += (
                    f" expert_load_max_over_mean {stats['moe/load_max_over_mean']:.2f}"
                    f" unused_experts {stats['moe/unused_experts']:.0f}"
                )
                self._layers_line = expert_layers_line(number, stats)
            if self.device.type == "cuda":
                # Peaks so far: what the caching allocator holds (what must fit), and what
                # tensors held; the difference is memory the allocator could not reuse.
                line += (
                    f" reserved_gib {torch.cuda.max_memory_reserved(self.device) / 2**30:.2f}"
                    f" allocated_gib {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f}"
                )
            self.log.text(line)
            if self._layers_line:
                self.log.text(self._layers_line)
                self._layers_line = ""
            self._window, self._routing = (0, 0.0, 0), None

    def eval(self, step: int, val: float | None) -> None:
        if val is None:
            return
        self.log.scalars(step, {"val/loss": val})
        self.log.text(f"step {step} val_loss {val:.4f}")
        self.say(f"step {step}: val loss {val:.4f}")
