"""The training loop: data from TokenLoader (no torch DataLoader), AMP, compile with
fallback, activation checkpointing, per-token gradient accumulation, guards against
NaN and loss spikes, atomic checkpoints with exact resume, TensorBoard."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pytrain import checkpoint, compile_policy, distributed, flash4, optim
from pytrain.config import ConfigError, TrainConfig, to_dict
from pytrain.data import DeviceBatch, DeviceFeed, HostBatch, TokenLoader
from pytrain.guard import PendingStep, StepGuard, StepResult
from pytrain.master_adamw import MasterAdamW
from pytrain.metrics import RunLog, StepLog, flops_per_token, loader_cpu_seconds, peak_flops
from pytrain.model import GPT
from pytrain.precision import choose_precision
from pytrain.profiling import StepProfiler


def dataset_dir(path: str, flag: str) -> Path:
    """`path` if it is a dataset made by pack-shards, else a ConfigError naming it."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory")
    if not (p / "manifest.json").is_file():
        raise ConfigError(
            f"{flag} {path}: not a dataset made by pack-shards (no manifest.json in it)"
        )
    return p


class LossModule(nn.Module):
    """What is compiled and wrapped: GPT plus the summed, masked loss."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, targets, position_ids, loss_mask, mask):
        return self.gpt.loss_sum(input_ids, targets, position_ids, loss_mask, mask)


def checkpoint_every(spec: str) -> int:
    if spec == "off":
        return 0
    if spec == "full":
        return 1
    if spec.startswith("every-") and spec[6:].isdigit() and int(spec[6:]) > 0:
        return int(spec[6:])
    raise ValueError(f"activation_checkpointing {spec!r} is not off, full or every-N")


class Trainer:
    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg = cfg
        self.dist, self.device = distributed.init(cfg.device)
        self.say = log if self.dist.is_main else (lambda *a, **k: None)
        self.run_dir = Path(cfg.out_dir) / cfg.name
        # The same seed on every rank until the model is built: FSDP2 keeps each rank's own
        # shard of its own initialisation (DDP broadcasts rank 0's), so the ranks must
        # initialise identically. Per-rank seeds come after (see below).
        self._seed(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # TF32 on Ampere and later
            torch.backends.cudnn.allow_tf32 = True
        self.precision = choose_precision(cfg.precision, self.device)
        self.train_path, self.val_path = self._datasets()
        self.loader = self._loader(self.train_path)
        vocab = self.loader.dataset.vocab_size or 0  # from the manifest, via the extension
        if cfg.model.vocab_size < vocab:
            cfg.model.vocab_size = vocab
        cfg.model.max_seq_len = max(
            cfg.model.max_seq_len, cfg.data.seq_len, max(cfg.data.bucket_lengths)
        )
        self.gpt = GPT(cfg.model).to(self.device)
        ckpt_every = checkpoint_every(cfg.activation_checkpointing)
        self.gpt.set_activation_checkpointing(ckpt_every)
        self.loss_module = LossModule(self.gpt)
        self.module = distributed.wrap(self.loss_module, self.dist, self.device, cfg.fsdp)
        self.sharded = cfg.fsdp and self.dist.enabled  # FSDP2: ranks hold shards of each parameter
        self._seed(cfg.seed + self.dist.rank)
        self.master = optim.use_master_weights(
            cfg.optim.master_weights,
            self.device,
            self.precision.dtype,
            one_process=not self.dist.enabled,
        )
        self.optimizer = optim.make_optimizer(self.gpt, cfg.optim, self.device, self.master)
        self.guard = StepGuard(
            cfg.optim.spike_factor, cfg.optim.max_bad_steps, cfg.optim.warmup_steps
        )
        decision = compile_policy.decide(
            cfg.compile.mode,
            cfg.compile.enabled,
            self.device,
            ckpt_every > 0,
            cfg.data.mode == "bucket",
            self.dist.enabled,
        )
        self.compile_mode = decision.mode
        self.compile_reason = decision.reason
        self.step = 0
        self.tokens_seen = 0
        self.expected_graphs = -1  # graphs compiled by the warm-up
        self.fallbacks: list[str] = []
        # (step, mode): raise a compile-like failure there (tests and the compile matrix).
        self.inject_compile_failure: tuple[int, str] | None = None
        if cfg.compile.inject_failure_at >= 0:
            self.inject_compile_failure = (cfg.compile.inject_failure_at, decision.mode)
        self._resume()
        self.attention = self.gpt.attention_backend(
            self.device, compiled=self.compile_mode != "eager"
        )
        # Micro-batches on the device, with document segments only where the attention
        # reads them (FA4); the feed owns copies, prefetch and slot release.
        self.segments = self.attention == "fa4"
        self.feed = DeviceFeed(self.loader, self.device, self.segments)
        if cfg.compile.coordinate_descent and self.compile_mode != "eager":
            import torch._inductor.config as inductor_config

            inductor_config.coordinate_descent_tuning = True
            self.compile_reason += "; coordinate-descent tuning on"
        if cfg.compile.inductor and self.compile_mode != "eager":
            applied = compile_policy.set_inductor_options(cfg.compile.inductor)
            self.compile_reason += f"; Inductor options {', '.join(applied)}"
        self.compiled = compile_policy.compile_model(self.module, self.compile_mode)
        # Evaluation runs compiled too (uncompiled FlexAttention materialises the scores),
        # without CUDA graphs (a few batches now and then), through the unwrapped module
        # where the parameters are whole (DDP's forward would sync buffers across ranks).
        self.eval_module = self.module if self.sharded else self.loss_module
        self.eval_mode = "default" if self.compile_mode == "reduce-overhead" else self.compile_mode
        self.eval_compiled = compile_policy.compile_model(self.eval_module, self.eval_mode)
        if self.val_path is not None and self.compile_mode != "eager":
            # Training and evaluation graphs of every batch shape share one Dynamo cache.
            compile_policy.ensure_graph_room(2 * len(self.loader.config.batch_shapes()))
        self.say(f"compile: {self.compile_mode} ({self.compile_reason})")
        self.log = RunLog(self.run_dir, self.dist.is_main, cfg.tensorboard)
        self.profiler = StepProfiler(
            cfg.profile_steps if self.dist.is_main else "", self.run_dir / "profile", self.device
        )
        self.flops_token = flops_per_token(
            self.gpt.num_params(),
            cfg.model.n_layer,
            cfg.model.n_head,
            cfg.model.d_model // cfg.model.n_head,
            cfg.data.seq_len,
        )
        self.steplog = StepLog(
            self.log,
            self.say,
            flops_token=self.flops_token,
            peak=peak_flops(self.device),
            world_size=self.dist.world_size,
            log_every=cfg.log_every,
            progress=cfg.progress and self.dist.is_main,
            device=self.device,
        )

    # ---- set-up -------------------------------------------------------------------------
    @staticmethod
    def _seed(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _datasets(self) -> tuple[Path, Path | None]:
        d = self.cfg.data
        if d.path:
            return dataset_dir(d.path, "--data.path"), (
                dataset_dir(d.val_path, "--data.val_path") if d.val_path else None
            )
        from pytrain.corpus import build_default

        if self.dist.is_main:
            paths = build_default(vocab_size=self.cfg.model.vocab_size, log=self.say)
        distributed.barrier(self.dist)
        if not self.dist.is_main:
            paths = build_default(vocab_size=self.cfg.model.vocab_size, log=self.say)
        return paths

    def _loader(self, path: Path, eval_mode: bool = False) -> TokenLoader:
        """The training loader (this rank's part of an endless shuffled stream), or for
        evaluation the validation set in its stored order, once, the same on every rank."""
        d = self.cfg.data
        if eval_mode:
            return TokenLoader(path, d, shuffle=False, num_epochs=1, threads=1, slots=2)
        return TokenLoader(path, d, rank=self.dist.rank, world_size=self.dist.world_size)

    # ---- checkpoints ----------------------------------------------------------------------
    def _state(self) -> dict:
        per_rank = distributed.gather_objects(
            {
                "loader": self.feed.state_dict(),
                "rng": checkpoint.rng_state(),
            },
            self.dist,
        )
        model, optim = distributed.model_optim_state(self.gpt, self.optimizer, self.sharded)
        if self.master:  # the fp32 weights, not their bf16 copies
            model = self._masters.master_state(self.gpt)
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "model": model,
            "optimizer": optim,
            "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None,
            "guard": self.guard.state_dict(),
            "compile_mode": self.compile_mode,
            "fallbacks": self.fallbacks,
            "ranks": per_rank,
            "world_size": self.dist.world_size,
            "config": to_dict(self.cfg),
        }

    def save_checkpoint(self) -> None:
        state = self._state()
        if self.dist.is_main:
            path = checkpoint.save(self.run_dir, self.step, state, self.cfg.keep_ckpts)
            self.log.text(f"checkpoint {path}")
        distributed.barrier(self.dist)

    def _resume(self) -> None:
        if not self.cfg.resume:
            return
        found = checkpoint.load_latest(self.run_dir)
        if found is None:
            return
        state, path = found
        saved_master = "exp_avg_sq" in state["optimizer"]  # MasterAdamW's flat state
        if saved_master != self.master:
            raise checkpoint.CheckpointMismatch(
                f"{path} was saved with optim.master_weights {'on' if saved_master else 'off'}; "
                f"resume it with --optim.master_weights {'on' if saved_master else 'off'}"
            )
        distributed.load_model_optim_state(
            self.gpt, self.optimizer, state["model"], state["optimizer"], self.sharded
        )
        if self.master:
            self._masters.load_masters(self.gpt, state["model"])
        if self.precision.scaler and state["scaler"]:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.guard.load_state_dict(state["guard"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.fallbacks = list(state["fallbacks"])
        if compile_policy.LEVELS.index(state["compile_mode"]) > compile_policy.LEVELS.index(
            self.compile_mode
        ):
            # A level that failed before is not retried.
            self.compile_mode = state["compile_mode"]
            self.compile_reason = (
                "a previous run fell back to it after a failure (see fallbacks in the log)"
            )
        ranks = state["ranks"]
        mine = ranks[self.dist.rank] if len(ranks) == self.dist.world_size else ranks[0]
        self.loader.load_state_dict(mine["loader"])  # before the feed exists: nothing ahead
        checkpoint.set_rng_state(mine["rng"])
        self.say(f"resumed from {path} at step {self.step}")

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
        mask = self._mask(b, self.compile_mode != "eager")
        with self.precision.autocast(self.device):
            if self.inject_compile_failure == (self.step, self.compile_mode):
                raise compile_policy.InjectedCompileFailure(
                    f"injected failure at step {self.step} ({self.compile_mode})"
                )
            return self.compiled(b.input_ids, b.targets, b.position_ids, b.loss_mask, mask)

    def _forward_backward(self, batches: list[DeviceBatch], denom: float) -> torch.Tensor:
        """Accumulates gradients of sum(loss) / (loss tokens of the whole step). DDP
        averages gradients over ranks, so each rank's loss is scaled by the world size.
        The summed loss stays on the device until the end: one sync per step, not per
        micro-batch."""
        total = torch.zeros((), device=self.device)
        scale = self.dist.world_size / denom
        for i, b in enumerate(batches):
            with distributed.no_sync(self.module, last_micro_step=i == len(batches) - 1):
                loss_sum = self._micro_loss(b)
                loss = loss_sum * scale
                (self.precision.scaler.scale(loss) if self.precision.scaler else loss).backward()
            if self.master and len(batches) > 1:
                self._masters.accumulate()  # into fp32, not into the bf16 .grad
            total += loss_sum.detach().float()
        return total

    def _zero_grads(self, keep: bool) -> None:
        """Clears the gradients before a step's backward passes. Under CUDA graphs with
        gradient accumulation they are kept as zeroed tensors instead of dropped: a
        backward graph's output installed as `.grad` would be overwritten by the next
        micro-batch's replay (pytorch/pytorch#169545: an error, or in some versions
        silently wrong gradients); into an existing `.grad` the output is added at once."""
        if self.master or not (keep and self.compile_mode == "reduce-overhead"):
            # MasterAdamW consumes each micro-batch's gradients as they come.
            self.optimizer.zero_grad(set_to_none=True)
            return
        params = [p for p in self.gpt.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch._foreach_zero_([p.grad for p in params if p.grad is not None])

    def _backward_with_fallback(
        self, batches: list[DeviceBatch], denom: float = 1.0, prefetch=None
    ) -> tuple[torch.Tensor, list[str]]:
        """Forward and backward of `batches`; a compile failure drops one compile level
        and reruns them from zeroed gradients. Returns the summed loss (on the device) and
        the fallbacks."""
        fallbacks = []
        while True:
            self._zero_grads(keep=len(batches) > 1)
            try:
                loss_sum = self._forward_backward(batches, denom)
                if prefetch:
                    prefetch()  # host work overlaps the kernels just queued
                break
            except Exception as e:
                if (
                    not (self.cfg.compile.guard and compile_policy.is_compile_failure(e))
                    or self.compile_mode == "eager"
                ):
                    raise
                old, self.compile_mode = (
                    self.compile_mode,
                    compile_policy.next_level(self.compile_mode),
                )
                note = f"step {self.step}: {old} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); falling back to {self.compile_mode}"
                self.say(f"compile fallback: {note}")
                fallbacks.append(note)
                self.fallbacks.append(note)
                self.compiled = compile_policy.compile_model(self.module, self.compile_mode)
        return loss_sum, fallbacks

    def train_step(self, batches: list[DeviceBatch], prefetch=None) -> PendingStep:
        """One optimizer step over `batches`, queued without waiting for the device (except
        with fp16's GradScaler, or a sharded or unfused optimizer): the guard decides on the
        device and the fused AdamW skips a bad step itself. `settle` reads the result."""
        local_tokens = sum(
            b.loss_tokens if b.loss_tokens >= 0 else int(b.loss_mask.sum()) for b in batches
        )
        denom = max(distributed.all_sum(local_tokens, self.dist, self.device), 1.0)
        loss_sum, fallbacks = self._backward_with_fallback(batches, denom, prefetch)
        loss = distributed.all_sum_tensor(loss_sum, self.dist) / denom
        for g in self.optimizer.param_groups:
            g["lr"] = optim.lr_at(self.step, self.cfg.optim, self.cfg.max_steps)
        grad_norm, bad, ema_before = self._clip_and_step(loss)
        # Gradients are cleared when the next step starts (_zero_grads), not here: under
        # CUDA graphs with accumulation they are kept, and reused, from step to step.
        tokens = sum(b.input_ids.numel() for b in batches) * self.dist.world_size
        values = torch.stack([t.detach().float() for t in (loss, grad_norm, bad, ema_before)])
        ready = None
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            values = host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return PendingStep(values, ready, int(denom), tokens, fallbacks)

    def _clip_and_step(self, loss: torch.Tensor):
        """The gradient norm, the guard's decision (skip, running mean before), and the
        clipped update or its skip. With a fused AdamW (CUDA, unsharded, no GradScaler)
        clipping happens inside the optimizer (pytrain.optim) and nothing waits."""
        max_norm = self.cfg.optim.grad_clip
        fold = self.optimizer.defaults.get("fused") and not (self.sharded or self.precision.scaler)
        if fold:
            grad_norm = optim.grad_norm(self.optimizer)
        else:
            if self.precision.scaler:
                self.precision.scaler.unscale_(self._torch_optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.gpt.parameters(), max_norm or float("inf")
            )
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
                grad_norm = grad_norm.full_tensor()
        bad, ema_before = self.guard.check(self.step, loss, grad_norm)
        if fold:
            optim.fused_step(self.optimizer, bad, grad_norm, max_norm)
        elif self.precision.scaler:
            bad = self._scaler_step(bad, loss, grad_norm)
        elif not bool(bad):
            self.optimizer.step()
        return grad_norm, bad, ema_before

    @property
    def _masters(self) -> MasterAdamW:
        """The optimizer, when it keeps fp32 master weights (`self.master`)."""
        assert isinstance(self.optimizer, MasterAdamW)
        return self.optimizer

    @property
    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, on the paths only torch's AdamW takes (fused step, GradScaler)."""
        assert isinstance(self.optimizer, torch.optim.Optimizer)
        return self.optimizer

    def _scaler_step(self, bad, loss, grad_norm) -> torch.Tensor:
        """fp16: the GradScaler skips steps with inf/NaN gradients itself (and lowers its
        scale), so an overflow is not a bad step; a bad loss or a spike still is."""
        scaler = self.precision.scaler
        assert scaler is not None  # fp16 only
        finite_grads = math.isfinite(float(grad_norm))
        if not bool(bad) or not finite_grads:
            scaler.step(self._torch_optimizer)
        scaler.update()
        if not finite_grads and math.isfinite(float(loss)):
            return torch.zeros_like(bad)
        return bad

    def settle(self, p: PendingStep) -> StepResult:
        """Reads a queued step's values (one transfer) and does the guard's bookkeeping;
        raises TrainingStopped after too many bad steps in a row."""
        if p.ready is not None:
            p.ready.synchronize()
        loss, norm, bad, ema = p.values.tolist()
        reason = self.guard.record(bool(bad), loss, norm, ema)
        return StepResult(loss, norm, p.loss_tokens, p.tokens, reason, p.fallbacks)

    # ---- compile warm-up ------------------------------------------------------------------
    def warm_up_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, seq_len) the loader can produce: one in pack mode, one per bucket."""
        return self.loader.config.batch_shapes()

    def warm_up(self) -> None:
        """Compiles every shape on every rank before the timed loop (so no rank races ahead
        into a collective while another compiles), on synthetic ids from a private
        generator: no loader batch, no global RNG draw, no optimizer step is spent."""
        if self.compile_mode == "eager":
            return
        cache = self.run_dir / "compile-artifacts.bin"
        loaded = compile_policy.load_cache_artifacts(cache)
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)  # private: the global RNG is not drawn from
        for rows, seq in self.warm_up_shapes():
            # Built like a loader batch (slot-shaped host tensors, the same copy path), so
            # the compiled graphs see the same dtypes, shapes and strides as training.
            host = HostBatch.synthetic(rows, seq, self.cfg.model.vocab_size, g)
            b = host.to(self.device, self.segments)
            self.train_step_dry(b)
            if self.val_path is not None:
                self._eval_graphs_for(b)
        distributed.barrier(self.dist)
        self.expected_graphs = compile_policy.compiled_graphs()
        if self.dist.is_main and not loaded:
            compile_policy.save_cache_artifacts(cache)
        self.say(
            f"compile warm-up: {len(self.warm_up_shapes())} shape(s) in {time.perf_counter() - t0:.1f}s"
            + (" (cache artifacts loaded)" if loaded else "")
        )

    def train_step_dry(self, b: DeviceBatch) -> None:
        """Forward and backward through the compiled module with the fallback in force,
        then the gradients are dropped."""
        saved, self.inject_compile_failure = self.inject_compile_failure, None
        try:
            self._backward_with_fallback([b])
        finally:
            self.inject_compile_failure = saved
            self.optimizer.zero_grad(set_to_none=True)

    # ---- evaluation and the loop ----------------------------------------------------------
    @torch.no_grad()
    def _eval_loss(self, b: DeviceBatch) -> torch.Tensor:
        """Summed loss of one batch in evaluation mode (no dropout, no activation
        checkpointing, the plain output layer), through the compiled evaluation module with
        the training's attention; a compile failure drops the evaluation one level."""
        mask = self._mask(b, self.eval_mode != "eager")
        while True:
            try:
                with self.precision.autocast(self.device):
                    return self.eval_compiled(
                        b.input_ids, b.targets, b.position_ids, b.loss_mask, mask
                    ).float()
            except Exception as e:
                if (
                    not (self.cfg.compile.guard and compile_policy.is_compile_failure(e))
                    or self.eval_mode == "eager"
                ):
                    raise
                old, self.eval_mode = self.eval_mode, compile_policy.next_level(self.eval_mode)
                self.say(
                    f"compile fallback (evaluation): {old} failed ({type(e).__name__}); using {self.eval_mode}"
                )
                self.eval_compiled = compile_policy.compile_model(self.eval_module, self.eval_mode)

    def _eval_graphs_for(self, b: DeviceBatch) -> None:
        """Compiles the evaluation graph of `b`'s shape (warm-up)."""
        self.gpt.eval()
        try:
            self._eval_loss(b)
        finally:
            self.gpt.train()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss per loss token over the first `eval_batches` batches of the validation
        set (the same batches every time). Every rank reads them in the same order and
        evaluates every world_size-th one; the result is the token-weighted mean over all
        ranks. The feed releases every slot it took, also when it stops early."""
        if self.val_path is None:
            return None
        world, rank = self.dist.world_size, self.dist.rank
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count, seen, last = 0, 0, None
        self.gpt.eval()
        try:
            with DeviceFeed(
                self._loader(self.val_path, eval_mode=True), self.device, self.segments
            ) as feed:
                for i, b in enumerate(feed):
                    if i >= self.cfg.eval_batches:
                        break
                    seen, last = i + 1, b
                    if i % world == rank:
                        total += self._eval_loss(b)
                        count += b.loss_tokens
                # FSDP2 gathers parameters in every forward, so every rank runs as many
                # forwards as the busiest one; a spare one counts for nothing.
                if self.sharded and last is not None and seen % world and rank >= seen % world:
                    self._eval_loss(last)
        finally:
            self.gpt.train()
        sums = torch.stack(
            [total, torch.tensor(float(count), dtype=torch.float64, device=self.device)]
        )
        sums = distributed.all_sum_tensor(sums, self.dist)
        loss, tokens = sums.tolist()
        return loss / tokens if tokens else None

    def fit(self) -> dict:
        cfg = self.cfg
        self.gpt.train()
        self.steplog.open_bar(cfg.max_steps, self.step)
        history: list[float] = []
        val = None
        t_start = time.perf_counter()
        cpu_start = loader_cpu_seconds()
        first_step = self.step
        self.warm_up()
        # No device sync inside a step: step k is queued, then step k-1's values are read
        # (the device finished them while step k was being queued) and logged. Step time
        # is the period between successive reads: in steady state, the device's.
        pending: tuple[PendingStep, float, int] | None = None  # (step, data wait, number)
        t_mark = time.perf_counter()

        def settle_pending() -> None:
            nonlocal pending, t_mark
            if pending is None:
                return
            (p, wait, number), pending = pending, None
            r = self.settle(p)
            now = time.perf_counter()
            dt, t_mark = now - t_mark, now
            history.append(r.loss)
            self.steplog.step(
                r, number, dt, wait, optim.lr_at(number - 1, cfg.optim, cfg.max_steps), self.guard.skipped,
                len(self.fallbacks),
            )  # fmt: skip

        while self.step < cfg.max_steps:
            if cfg.halt_after and self.step - first_step >= cfg.halt_after:
                break
            batches, wait = self.feed.take(cfg.optim.grad_accum)
            self.profiler.before_step(self.step)
            p = self.train_step(batches, prefetch=self._prefetch_next)
            self.tokens_seen += p.tokens
            self.step += 1
            settle_pending()
            pending = (p, wait, self.step)
            self.profiler.after_step(self.step)
            if self.profiler.summary is not None:
                self.say(f"profile of steps {cfg.profile_steps}: {self.profiler.out}/summary.md")
                self.profiler.summary = None
                t_mark = time.perf_counter()  # writing the trace is not step time
            eval_due = cfg.eval_every and self.step % cfg.eval_every == 0
            ckpt_due = cfg.ckpt_every and self.step % cfg.ckpt_every == 0
            time_up = cfg.time_limit_s and time.perf_counter() - t_start > cfg.time_limit_s
            if eval_due or ckpt_due or time_up:
                settle_pending()  # logs, guard counts and checkpoints up to this step
            if eval_due:
                val = self.evaluate()
                self.steplog.eval(self.step, val)
                t_mark = time.perf_counter()  # evaluation is not step time
            if ckpt_due:
                self.save_checkpoint()
                t_mark = time.perf_counter()
            if time_up:
                self.say(f"time limit of {cfg.time_limit_s:.0f}s reached at step {self.step}")
                break
        settle_pending()
        self.steplog.close_bar()
        cpu_end = loader_cpu_seconds()
        if cpu_start is not None and cpu_end is not None:
            wall = time.perf_counter() - t_start
            self.log.text(
                f"loader threads CPU: {cpu_end - cpu_start:.2f}s over {wall:.2f}s of training = {(cpu_end - cpu_start) / wall:.3f} cores"
            )
        if not (cfg.eval_every and self.step % cfg.eval_every == 0):
            val = self.evaluate()
            self.steplog.eval(self.step, val)
        if not (cfg.ckpt_every and self.step % cfg.ckpt_every == 0):
            self.save_checkpoint()
        graphs = compile_policy.compiled_graphs() if self.compile_mode != "eager" else 0
        if not self.dist.enabled and 0 <= self.expected_graphs < graphs:
            self.say(
                f"warning: {graphs - self.expected_graphs} recompile(s) after warm-up ({graphs} graphs, warm-up made "
                f"{self.expected_graphs}); shapes or guards changed during training (see TORCH_LOGS=recompiles)"
            )
        self.log.text(
            f"compiled graphs: {graphs}; compile mode at the end: {self.compile_mode}; fallbacks: {len(self.fallbacks)}"
        )
        return {
            "losses": history,
            "val_loss": val,
            "step": self.step,
            "fallbacks": self.fallbacks,
            "skipped": self.guard.skipped,
            "graphs": graphs,
        }

    def close(self) -> None:
        self.feed.close()
        self.log.close()
        distributed.shutdown(self.dist)
