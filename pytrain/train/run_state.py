"""A run's state in its checkpoints: what a checkpoint of the trainer holds (`collect`; a
rank's own part, `local_state`), writing it (`save`, synchronously or in the background),
and continuing a run from the newest one (`resume`, through `restore`), refusing with one
line a checkpoint this run cannot continue."""

from __future__ import annotations

import time

from pytrain.config import DataConfig, to_dict
from pytrain.model.config import ModelConfig
from pytrain.train import checkpoint, disk, distributed, sharded_checkpoint


def collect(t, tensors: bool = True) -> dict:
    """The state of Trainer `t` at a step boundary (every rank calls this: it gathers);
    without the model's and optimizer's tensors for a sharded checkpoint (each rank writes
    its own shards of those, pytrain.train.sharded_checkpoint)."""
    per_rank = distributed.gather_objects({"rng": checkpoint.rng_state()}, t.dist)
    return {
        **local_state(t, tensors),
        "ranks": per_rank,
        "world_size": t.dist.world_size,
        "config": to_dict(t.cfg),
    }


def local_state(t, tensors: bool = True) -> dict:
    """What this rank holds of Trainer `t`'s state at a step boundary, read without a
    collective (a healing peer's copy is read on torchft's thread: pytrain.train.replica_groups)."""
    weights: dict = {}
    if tensors:
        model, optim = t.gpt.state_dict(), t.optimizer.state_dict()
        if t.master:  # the fp32 weights, not their bf16 copies
            model = t.opt_step.masters.master_state(t.gpt)
        weights = {"model": model, "optimizer": optim}
    return {
        "step": t.step,
        "tokens_seen": t.tokens_seen,
        **weights,
        "master_weights": t.master,
        "scaler": t.precision.scaler.state_dict() if t.precision.scaler else None,
        "guard": t.guard.state_dict(),
        **t.compiler.state_dict(),
        # One loader state for the run: at a step boundary it is the same on every
        # rank and does not depend on the world size.
        "loader": t.feed.state_dict(),
    }


def writer(t) -> checkpoint.BackgroundWrite:
    """Trainer `t`'s background checkpoint writer: a sharded one under FSDP2, whose saves
    the optimizer's updates wait for on the device, and whose host memory is made ahead
    (ckpt_async; a run that writes in the loop needs none)."""
    if not t.sharded:
        return checkpoint.AsyncWriter()
    if not t.cfg.ckpt_async:
        return sharded_checkpoint.ShardedWriter()
    w = sharded_checkpoint.ShardedWriter(t.gpt, t.optimizer)
    t.opt_step.before_update = w.before_update
    return w


def save(t) -> None:
    """Saves Trainer `t`'s state at this step: in the background (ckpt_async; the loop goes
    on once the snapshot's copies are queued), or written here before returning. A
    synchronous write that fails for space raises disk.DiskFull on every rank."""
    t0 = time.perf_counter()
    if t.sharded:  # FSDP2: every rank writes its own shards (a collective)
        args = (t.run_dir, t.step, t.gpt, t.optimizer, collect(t, tensors=False), t.dist.is_main,
                lambda: distributed.barrier(t.dist))  # fmt: skip
        if t.cfg.ckpt_async:
            path = t.ckpt_writer.submit(*args, keep=t.cfg.keep_ckpts)
        else:
            path = sharded_checkpoint.save(*args)
            if t.dist.is_main:
                checkpoint.prune(t.run_dir, t.cfg.keep_ckpts)
        if t.dist.is_main:
            how = "sharded, written in the background" if t.cfg.ckpt_async else "sharded"
            # Where the wait went, on this rank (ShardedWriter.phases): state dict,
            # barrier, waiting for the host memory, queuing the copies into it.
            phases = t.ckpt_writer.phases if t.cfg.ckpt_async else {}
            parts = "".join(f", {k} {v:.3f}s" for k, v in phases.items())
            t.log.text(
                f"checkpoint {path} ({how}; the loop waited {time.perf_counter() - t0:.3f}s{parts})"
            )
        return
    state = collect(t)
    full: disk.DiskFull | None = None
    if t.dist.is_main:
        path = checkpoint.ckpt_path(t.run_dir, t.step)
        if t.cfg.ckpt_async:
            t.ckpt_writer.submit(t.run_dir, t.step, state, t.cfg.keep_ckpts)
        else:
            try:
                checkpoint.save(t.run_dir, t.step, state, t.cfg.keep_ckpts)
            except disk.DiskFull as e:
                full = e
        if full is None:
            how = "written in the background" if t.cfg.ckpt_async else "written"
            t.log.text(
                f"checkpoint {path} ({how}; the loop waited {time.perf_counter() - t0:.3f}s)"
            )
    if not t.cfg.ckpt_async:  # the ranks learn together whether it was written
        if distributed.all_sum(1 if full else 0, t.dist, t.device) > 0:
            raise full or disk.DiskFull("rank 0 could not write the checkpoint (it says why)")


def resume(t) -> None:
    """Continues Trainer `t` from its run directory's newest checkpoint, if any."""
    if not t.cfg.resume:
        return
    t0 = time.perf_counter()
    found = checkpoint.load_latest(t.run_dir)
    if found is None:
        return
    state, path = found
    saved = state["config"]
    on_off = {True: "on", False: "off"}
    # The optimizer state belongs to its optimizer (MasterAdamW keeps flat fp32 state).
    checkpoint.refuse_changed(
        path,
        "optim",
        {"name": saved["optim"].get("name", "adamw"),
         "master_weights": on_off[state.get("master_weights", "exp_avg_sq" in state.get("optimizer", {}))]},
        {"name": t.cfg.optim.name, "master_weights": on_off[t.master]},
        "its optimizer state belongs to that optimizer",
    )  # fmt: skip
    # Named here, before load_state_dict's list of tensor shapes (or a model with the
    # same shapes computing another function, for n_head or rope_base).
    checkpoint.refuse_changed(path, "model", ModelConfig.from_saved(saved["model"]).architecture(),
                              t.cfg.model.architecture(), "its weights belong to that model")  # fmt: skip
    # Named here, before the Rust loader's check refuses the state with no names.
    checkpoint.refuse_changed(path, "data", DataConfig.from_saved(saved["data"]).batch_settings(),
                              t.cfg.data.batch_settings(),
                              "its loader position belongs to those batches")  # fmt: skip
    saved_by_ddp = any(isinstance(k, int) for k in state.get("optimizer", {}).get("state", {}))
    if t.sharded and saved_by_ddp:  # its optimizer state is keyed by parameter index
        raise checkpoint.CheckpointMismatch(
            f"{path} was saved by a run without --fsdp (its optimizer state is keyed by "
            "parameter index): resume it without --fsdp, or train a new run under another --name"
        )
    restore(t, state)
    ranks, world = state["ranks"], t.dist.world_size
    same_world = len(ranks) == world
    # Checkpoints before the global order kept one loader state per rank.
    loader = state.get("loader") or ranks[t.dist.rank if same_world else 0]["loader"]
    t.loader.load_state_dict(loader)  # before the feed exists: nothing ahead
    if same_world:
        checkpoint.set_rng_state(ranks[t.dist.rank]["rng"])
    else:  # dropout streams of a new layout: seeded, not restored
        t._seed(t.cfg.seed + t.dist.rank + 1_000_003 * t.step)
        t.say(
            f"resuming a run saved on {len(ranks)} rank(s) on {world}: the loader continues "
            "its global order, each document once"
        )
    if (
        rows := saved["data"].get("batch_size")
    ) != t.cfg.data.batch_size and t.cfg.data.mode == "pack":
        t.say(
            f"resuming a run saved with {rows}-row micro-batches with {t.cfg.data.batch_size}-row "
            "ones: the loader continues from the same row, each document once"
        )
    # How long the state took to read (an 8B's 64 GB: the disk's share of a restart).
    t.say(f"resumed from {path} at step {t.step} (read in {time.perf_counter() - t0:.1f}s)")


def restore(t, state: dict, weights: bool = True) -> None:
    """Loads into Trainer `t` what `local_state` read (or a checkpoint holds): weights and
    optimizer (unless `weights` is off: the caller put them in), scaler, guard, step and
    compile mode; the loader and the RNG are the caller's, which knows whose they were."""
    if weights and "sharded" in state:  # each rank reads the chunks of its own layout
        sharded_checkpoint.load(state["sharded"], t.gpt, t.optimizer, state["param_groups"])
    elif weights:
        distributed.load_model_optim_state(
            t.gpt, t.optimizer, state["model"], state["optimizer"], t.sharded
        )
    if weights and t.master:
        t.opt_step.masters.load_masters(t.gpt, state["model"])
    if t.precision.scaler and state["scaler"]:
        t.precision.scaler.load_state_dict(state["scaler"])
    t.guard.load_state_dict(state["guard"])
    t.step, t.tokens_seen = state["step"], state["tokens_seen"]
    t.compiler.load_state_dict(state)
