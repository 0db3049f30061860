"""The training loop: data from TokenLoader (no torch DataLoader), AMP, compile with
fallback, activation checkpointing, per-token gradient accumulation, guards against
NaN and loss spikes, atomic checkpoints with exact resume, TensorBoard (W&B, MLflow)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy as np
import torch

from pytrain.config import TrainConfig, checkpoint_every, derive_grad_accum
from pytrain.data.batch import DeviceBatch, DeviceFeed, FeedTime, HostBatch
from pytrain.model import families, flash4, float8, fused_gelu, quack_swiglu
from pytrain.model.gpt import LossModule
from pytrain.optim.build import build_optimizer, keeps_masters
from pytrain.optim.schedule import lr_at
from pytrain.optim.step import OptimizerStep
from pytrain.train import (
    compile_cache,
    compile_policy,
    disk,
    distributed,
    downstream,
    initial_weights,
    parallel,
    run_lock,
    run_state,
    sharded_checkpoint,
    sources,
)
from pytrain.train.evaluation import Evaluator
from pytrain.train.guard import PendingStep, StepGuard, StepResult
from pytrain.train.metrics import CpuClock, RunLog, StepClock, StepLog, log_mixture, peak_flops
from pytrain.train.precision import choose_precision
from pytrain.train.profiling import StepProfiler
from pytrain.train.stopping import StopSignals


class Trainer:
    """The training loop and what it steps: model, optimizer step, compiled modules, data
    feed, evaluation, checkpoints and logs. Each part lives in its own module; this one
    builds them and runs `fit`."""

    def __init__(self, cfg: TrainConfig, log=print, stop: StopSignals | None = None):
        self.cfg = cfg
        self.stop = stop or StopSignals()  # the CLI's, installed since it started
        self.dist, self.device = distributed.init(cfg.device, cfg.dist_init_timeout_s)
        self.say = log if self.dist.is_main else (lambda *a, **k: None)
        self.run_dir = Path(cfg.out_dir) / cfg.name
        self.run_lock = run_lock.take(self.run_dir, self.dist, self.device)
        try:  # a run that fails to start leaves its directory to the next one
            sharded_checkpoint.remove_unfinished(self.run_dir, self.dist.is_main)
            self._build()
        except BaseException:
            self.run_lock.release()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        # The same seed on every rank until the model is built: FSDP2 keeps each rank's own
        # shard of its own initialisation (DDP broadcasts rank 0's), so the ranks must
        # initialise identically. Per-rank seeds come after the model.
        self._set_up_torch(cfg.seed)
        self.precision = choose_precision(cfg.precision, self.device)
        self.sources = sources.resolve(cfg.data)
        if accum := derive_grad_accum(cfg, self.dist.world_size):
            self.say(accum)
        self.train_path, self.val_path = self.sources.train_path, self.sources.val_path
        self.loader = sources.train_loader(cfg.data, self.sources, cfg.optim.grad_accum, self.dist)
        sources.check_same_data(self.loader, self.sources, self.dist)
        self._build_model()
        self._seed(cfg.seed + self.dist.rank)
        self._build_optimizer()
        self.compiler = self._compiler()
        self.step = self.tokens_seen = 0
        self.ckpt_writer = run_state.writer(self)
        run_state.resume(self)
        per_ckpt = disk.checkpoint_estimate(self.gpt, self.optimizer, self.master)
        if self.dist.is_main and (note := disk.space_note(self.run_dir, per_ckpt, cfg.keep_ckpts)):
            self.say(note)
        self.attention = self.gpt.attention_backend(self.device, compiled=not self.compiler.eager)
        # Micro-batches on the device, with document segments only where the attention
        # reads them (FA4); the feed owns copies, prefetch and slot release.
        self.segments = self.attention == "fa4"
        # Whether the MLPs' GELU (SwiGLU: quack) runs inside their matmuls, and why not
        # where `auto` asked for it and it does not (the start lines say so).
        dtype = self.precision.dtype or torch.float32
        self.fused_gelu = fused_gelu.used(self.gpt.cfg, self.device, dtype)
        self.fused_gelu_missing = fused_gelu.why_not(self.gpt.cfg, self.device, dtype)
        self.quack_mlp = quack_swiglu.check(self.gpt.cfg, self.device, dtype)
        self.feed = DeviceFeed(self.loader, self.device, self.segments)
        self.evaluator = self._evaluator()
        shapes = len(self.loader.config.batch_shapes())
        c = cfg.compile
        self.compiler.start(c.coordinate_descent, c.inductor, shapes * (2 if self.val_path else 1))
        self._build_logs()
        self.tasks = downstream.TaskScores.of(self)  # --eval.tasks: read and tokenized once

    # ---- set-up -------------------------------------------------------------------------
    def _set_up_torch(self, seed: int) -> None:
        self._seed(seed)
        if self.cfg.deterministic:  # cuBLAS is deterministic only with a fixed workspace
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        if self.device.type == "cuda":  # TF32 on Ampere and later
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    def _build_model(self) -> None:
        cfg = self.cfg
        vocab = self.loader.dataset.vocab_size or 0  # from the manifest, via the extension
        self.gpt = initial_weights.build(cfg, vocab, self.say, self.device)
        self.ckpt_every = checkpoint_every(cfg.activation_checkpointing)
        self.gpt.set_activation_checkpointing(cfg.activation_checkpointing, cfg.ac_lean_blocks)
        self.loss_module = LossModule(self.gpt)
        masters = keeps_masters(cfg.optim, self.device, self.precision.dtype, sharded=False)
        state = parallel.state_bytes(self.gpt, masters, cfg.optim.state_dtype)
        self.plan = parallel.choose(cfg, self.dist, self.device, state, masters)
        if cfg.model.float8 != "off":  # after the plan: FSDP2 all-gathers in float8
            n = float8.convert(self.gpt, cfg.model.float8, self.device, self.plan.sharded)
            self.say(f"float8 ({cfg.model.float8}, torchao): {n} linear layers of the blocks")
        self.module = parallel.wrap(self.loss_module, self.plan, self.device, self.precision.dtype)
        self.sharded = self.plan.sharded  # FSDP2: ranks hold shards of each parameter

    def _build_optimizer(self) -> None:
        o = self.cfg.optim
        self.optimizer, self.master = build_optimizer(
            self.gpt, o, self.device, self.precision.dtype,
            sharded=self.sharded, fp16_scaler=self.precision.scaler is not None,
        )  # fmt: skip
        replicas = self.dist.world_size if self.plan.kind == "replicas" else 0
        self.opt_step = OptimizerStep(
            self.optimizer, self.gpt, self.precision.scaler, o.grad_clip, replicas
        )
        self.guard = StepGuard(o.spike_factor, o.max_bad_steps, o.warmup_steps)

    def _compiler(self) -> compile_policy.CompiledModel:
        c = self.cfg.compile
        decision = compile_policy.decide(
            c.mode, c.enabled, self.device, self.ckpt_every > 0, self.cfg.data.mode == "bucket", self.plan.kind == "ddp",
            fsdp2=self.sharded)  # fmt: skip
        # Evaluation goes through the unwrapped module where the parameters are whole (DDP's
        # forward would sync buffers across ranks).
        eval_module = self.module if self.sharded else self.loss_module
        compiler = compile_policy.CompiledModel(
            self.module, eval_module, decision, c.guard, self.say
        )
        if c.inject_failure_at >= 0:
            compiler.inject_failure = (c.inject_failure_at, decision.mode)
        return compiler

    def _evaluator(self) -> Evaluator | None:
        if not self.sources.val:
            return None
        return Evaluator(
            self.sources.val, self.cfg.data, self.gpt, self.compiler, self.precision, self.dist,
            self.device, self._mask, self.segments, self.sharded, self.cfg.eval_batches,
        )  # fmt: skip

    def _build_logs(self) -> None:
        cfg, m = self.cfg, self.cfg.model
        # After resume: a resumed run goes on in the tracked runs (W&B, MLflow) it began.
        self.log = RunLog.of(cfg, self.run_dir, self.dist.is_main, resumed=self.step > 0)
        self.profiler = StepProfiler(
            cfg.profile_steps if self.dist.is_main else "", self.run_dir / "profile", self.device,
            memory=cfg.profile_memory,
        )  # fmt: skip
        self.flops_token = families.of(m).flops_per_token(self.gpt, cfg.data.seq_len)
        self.steplog = StepLog(
            self.log, self.say, flops_token=self.flops_token, peak=peak_flops(self.device),
            world_size=self.dist.world_size, log_every=cfg.log_every,
            progress=cfg.progress and self.dist.is_main, device=self.device,
            stats=self.gpt.routing_stats,
        )  # fmt: skip

    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # ---- checkpoints (written by pytrain.train.run_state.save) -------------------------
    def finish_checkpoints(self) -> None:
        """Waits for a checkpoint being written (and raises its error, if any)."""
        self.ckpt_writer.wait()
        distributed.barrier(self.dist)

    # ---- one optimizer step ---------------------------------------------------------------
    def _prefetch_next(self) -> None:
        """Fetches the next step's micro-batches while this step's kernels run (the feed
        keeps the loader state of this step for a checkpoint)."""
        if self.step + 1 < self.cfg.max_steps:
            self.feed.prefetch(self.cfg.optim.grad_accum)

    def _mask(self, b: DeviceBatch, compiled: bool):
        """The attention mask of `b` for the model (see GPT.make_mask)."""
        mask = self.gpt.make_mask(b.doc_ids, self.attention, b.cu_seqlens)
        if isinstance(mask, flash4.Segments) and compiled:
            # The number of segments varies by batch: one graph for all of them.
            torch._dynamo.mark_dynamic(mask.cu_seqlens, 0)
        return mask

    def _micro_loss(self, b: DeviceBatch) -> torch.Tensor:
        mask = self._mask(b, not self.compiler.eager)
        with self.precision.autocast(self.device):
            args = (b.input_ids, b.targets, b.position_ids, b.loss_mask, mask)
            return self.compiler.forward(self.step, *args)

    def _forward_backward(self, batches: list[DeviceBatch], denom: float) -> torch.Tensor:
        """Accumulates gradients of sum(loss) / (loss tokens of the whole step). DDP
        averages gradients over ranks, so each rank's loss is scaled by the world size.
        The summed loss stays on the device until the end: one sync per step, not per
        micro-batch."""
        total = torch.zeros((), device=self.device)
        scale = self.dist.world_size / denom
        for i, b in enumerate(batches):
            with parallel.no_sync(self.module, self.plan, last_micro_step=i == len(batches) - 1):
                loss_sum = self._micro_loss(b)
                loss = loss_sum * scale
                (self.precision.scaler.scale(loss) if self.precision.scaler else loss).backward()
            self.opt_step.after_micro_batch(accumulating=len(batches) > 1)
            total += loss_sum.detach().float()
        return total

    def _backward_with_fallback(
        self, batches: list[DeviceBatch], denom: float = 1.0, prefetch=None
    ) -> tuple[torch.Tensor, list[str]]:
        """Forward and backward of `batches`; a compile failure drops one compile level
        and reruns them from zeroed gradients. Returns the summed loss (on the device) and
        the fallbacks."""
        fallbacks: list[str] = []
        while True:
            cuda_graphs = self.compiler.mode == "reduce-overhead"
            self.opt_step.zero_grads(keep=cuda_graphs and len(batches) > 1)
            try:
                loss_sum = self._forward_backward(batches, denom)
                if prefetch:
                    prefetch()  # host work overlaps the kernels just queued
                return loss_sum, fallbacks
            except Exception as e:  # re-raised unless a lower compile level avoids it
                fallbacks.append(self.compiler.fall_back(e, self.step))

    def train_step(self, batches: list[DeviceBatch], prefetch=None) -> PendingStep:
        """One optimizer step over `batches`, queued without waiting for the device (except
        with fp16's GradScaler, or a sharded or unfused optimizer): the guard decides on the
        device and the fused AdamW skips a bad step itself. `settle` reads the result."""
        local_tokens = sum(
            b.loss_tokens if b.loss_tokens >= 0 else int(b.loss_mask.sum()) for b in batches
        )
        # One sum for the loss tokens and the ranks asked to stop (pytrain.train.stopping).
        tokens_all, *votes = distributed.all_sums(
            [local_tokens, *self.stop.vote()], self.dist, self.device
        )
        denom = max(tokens_all, 1.0)
        loss_sum, fallbacks = self._backward_with_fallback(batches, denom, prefetch)
        loss = distributed.all_sum_tensor(loss_sum, self.dist) / denom
        tokens = sum(b.input_ids.numel() for b in batches) * self.dist.world_size
        return self.update(loss, int(denom), tokens, fallbacks, self.stop.agreed(*votes))

    def update(self, loss, loss_tokens: int, tokens: int, fallbacks, stop: bool) -> PendingStep:
        """The optimizer step after a step's backward, `loss` its mean over every rank (replica
        groups step here too, pytrain.train.replica_groups); the step's values are queued."""
        self.opt_step.set_lr(lr_at(self.step, self.cfg.optim, self.cfg.max_steps))
        grad_norm, bad, ema_before = self.opt_step.step(self.guard, self.step, loss)
        # Gradients are cleared when the next step starts (OptimizerStep.zero_grads), not here: under
        # CUDA graphs with accumulation they are kept, and reused, from step to step.
        values = torch.stack([t.detach().float() for t in (loss, grad_norm, bad, ema_before)])
        ready = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        routing = self.opt_step.routing
        return PendingStep(values, ready, loss_tokens, tokens, fallbacks, stop, routing=routing)

    def settle(self, p: PendingStep) -> StepResult:
        """Reads a queued step's values (one transfer) and does the guard's bookkeeping;
        raises TrainingStopped after too many bad steps in a row."""
        if p.ready is not None:
            p.ready.synchronize()
        loss, norm, bad, ema = p.values.tolist()
        reason = self.guard.record(bool(bad), loss, norm, ema)
        return StepResult(loss, norm, p.loss_tokens, p.tokens, reason, p.fallbacks, p.routing)

    # ---- compile warm-up ------------------------------------------------------------------
    def warm_up_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, seq_len) the loader can produce: one in pack mode, one per bucket."""
        return self.loader.config.batch_shapes()

    def warm_up(self) -> None:
        """Compiles every shape on every rank before the timed loop (so no rank races ahead
        into a collective while another compiles), on synthetic ids from a private
        generator: no loader batch, no global RNG draw, no optimizer step is spent."""
        if self.compiler.eager:
            return
        t0 = time.perf_counter()

        def compile_all() -> None:
            g = torch.Generator().manual_seed(0)  # private: the global RNG is not drawn from
            for rows, seq in self.warm_up_shapes():
                # Built like a loader batch (slot-shaped host tensors, the same copy path),
                # so the graphs see the same dtypes, shapes and strides as training.
                host = HostBatch.synthetic(rows, seq, self.cfg.model.vocab_size, g)
                b = host.to(self.device, self.segments)
                self.train_step_dry(b)
                if self.evaluator is not None:
                    self.evaluator.compile_for(b)
            distributed.barrier(self.dist)

        loaded = self.compiler.warm_up(
            self.run_dir / "compile-artifacts.bin", compile_all, self.dist.is_main
        )
        self.say(
            f"compile warm-up: {len(self.warm_up_shapes())} shape(s) in {time.perf_counter() - t0:.1f}s{loaded}"
        )
        self.log.text(f"compile seconds by phase:\n{compile_cache.phase_table()}")

    def train_step_dry(self, b: DeviceBatch) -> None:
        """Forward and backward through the compiled module with the fallback in force,
        then the gradients are dropped, and what its tokens routed (a resume stays exact)."""
        saved, self.compiler.inject_failure = self.compiler.inject_failure, None
        try:
            self._backward_with_fallback([b])
        finally:
            self.compiler.inject_failure = saved
            self.optimizer.zero_grad(set_to_none=True)
            self.gpt.discard_step()

    # ---- the loop ------------------------------------------------------------------------
    def evaluate(self) -> float | None:
        """Validation loss per loss token over every validation set (pytrain.train.evaluation),
        with a loss per set in the logs when there are several; None without any."""
        if self.evaluator is None:
            return None
        loss = self.evaluator()
        if len(self.sources.val) > 1:
            by = self.evaluator.by_source
            self.log.scalars(self.step, {f"val/{n}": v for n, v in by.items()})
            self.say("  ".join(f"val {n} {v:.4f}" for n, v in by.items() if v is not None))
        return loss

    def fit(self) -> dict:
        cfg = self.cfg
        self.gpt.train()
        self.steplog.open_bar(cfg.max_steps, self.step)
        history: list[float] = []
        val = None
        t_start = time.perf_counter()
        first_step = self.step
        self.stopped_by: str | None = None
        sums = lambda xs: distributed.all_sums(xs, self.dist, self.device)  # noqa: E731
        self.stop.install()  # (the CLI's are, since it started)
        self.stop.check_set_up(sums)  # asked to stop in set-up or resume: nothing to save
        self.warm_up()
        self.stop.check_set_up(sums, looping=True)  # ... or in the compile warm-up
        cpu = CpuClock()  # after the compile warm-up: the loop's CPU time
        if note := distributed.set_timeout(self.dist, cfg.dist_timeout_s):  # a dead peer ends it
            self.say(note)
        # No device sync inside a step: step k is queued, then step k-1's values are read
        # (the device finished them while step k was being queued) and logged, timed from
        # its start to step k's (StepClock).
        pending: tuple[PendingStep, FeedTime, int, tuple] | None = None  # step, feed, number, start
        clock = StepClock(self.device)

        def settle_pending(end: tuple | None = None) -> None:
            nonlocal pending
            if pending is None:
                return
            (p, fed, number, start), pending = pending, None
            end = end or clock.mark()  # read at once: to the end of its own work
            r = self.settle(p)
            dt = clock.seconds(start, end)
            history.append(r.loss)
            self.steplog.step(
                r, number, dt, fed, lr_at(number - 1, cfg.optim, cfg.max_steps), self.guard.skipped,
                len(self.compiler.fallbacks),
            )  # fmt: skip
            if len(self.loader.names) > 1 and number % cfg.log_every == 0:
                log_mixture(self.log, number, self.loader.names, self.feed.state_dict())

        while self.step < cfg.max_steps:
            if cfg.halt_after and self.step - first_step >= cfg.halt_after:
                break
            start = clock.mark()
            batches, fed = self.feed.take(cfg.optim.grad_accum)
            self.profiler.before_step(self.step)
            p = self.train_step(batches, prefetch=self._prefetch_next)
            self.tokens_seen += p.tokens
            self.step += 1
            settle_pending(end=start)
            pending = (p, fed, self.step, start)
            if self.profiler.ends_at(self.step):
                settle_pending()  # writing the trace is not step time
            if written := self.profiler.after_step(self.step):
                self.say(written)
            eval_due = cfg.eval_every and self.step % cfg.eval_every == 0
            ckpt_due = cfg.ckpt_every and self.step % cfg.ckpt_every == 0
            time_up = cfg.time_limit_s and time.perf_counter() - t_start > cfg.time_limit_s
            if eval_due or ckpt_due or time_up:
                settle_pending()  # logs, guard counts and checkpoints up to this step
            if eval_due:
                val = self.evaluate()
                self.steplog.eval(self.step, val)
            self.tasks.at(self.step, bool(eval_due))  # downstream tasks where due
            if ckpt_due:
                run_state.save(self)
            if time_up:
                self.say(f"time limit of {cfg.time_limit_s:.0f}s reached at step {self.step}")
                break
            if p.stop:  # every rank stops after this step (its checkpoint follows)
                self.stopped_by = self.stop.received
                break
        settle_pending()
        self.steplog.close_bar()
        self.log.text(cpu.line())
        if not self.stopped_by and not (cfg.eval_every and self.step % cfg.eval_every == 0):
            val = self.evaluate()
            self.steplog.eval(self.step, val)
        self.tasks.at(self.step, False, end=not self.stopped_by)
        if not (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
            run_state.save(self)
        self.finish_checkpoints()  # the run's last checkpoint is on disk when fit returns
        graphs, warning = self.compiler.summary(check_recompiles=not self.dist.enabled)
        if warning:
            self.say(warning)
        self.log.text(
            f"compiled graphs: {graphs}; compile mode at the end: {self.compiler.mode}; fallbacks: {len(self.compiler.fallbacks)}"
        )
        return {
            "losses": history,
            "val_loss": val,
            "step": self.step,
            "fallbacks": self.compiler.fallbacks,
            "skipped": self.guard.skipped,
            "graphs": graphs,
            "stopped_by": self.stopped_by,
        }

    def close(self, status: str = "FAILED") -> None:
        """`status`: how the run ended, for the trackers (pytrain.train.trackers)."""
        self.stop.restore()
        self.ckpt_writer.wait()
        self.feed.close()
        self.log.close(status)
        distributed.shutdown(self.dist, self.module)
        self.run_lock.release()
