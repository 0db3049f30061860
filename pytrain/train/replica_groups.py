"""Replica groups on torchft: data parallelism over groups that may fail, each group its own
torchrun job (one rank, replicas, DDP or any plan of pytrain.train.parallel within it).

torchft does the coordination; nothing here decides who is alive. Its Lighthouse (a process
of its own, `torchft_lighthouse`) forms each step's quorum of the groups that ask; its
Manager, in each group, sits between the backward and the optimizer step:

1. `start_quorum` before the step's rows are read. A group behind the quorum's furthest
   step (restarted, or late) heals there from a live peer over torchft's HTTP transport:
   weights, optimizer, loader position, step and RNG (pytrain.train.peer_state), not from
   disk.
2. The step's rows are cut by that quorum (pytrain.train.step_rows): the global batch stays
   the same while a group is missing, the others take more micro-batches.
3. The gradients (and the loss) are summed over the quorum's groups by torchft's all-reduce,
   and `should_commit` says whether the step counts: only then does the optimizer step and
   the order move on; otherwise the step's rows are given back and the step is tried again
   under the next quorum. A ledger line a step attempt (`ledger.jsonl` in the group's run
   directory) says which rows of the global order the group trained, and whether it counted.
4. Where the next quorum is the failed attempt's groups less some that died, the survivors
   keep that attempt's gradients and train only the dead groups' rows between them (_keep,
   pytrain.train.step_rows.Kept): after a kill, about a step over the quorum's size, not
   a whole step again.
5. A group that committed its last step trains the next one ahead of its quorum, cut as
   the last (_ahead): the quorum is asked for on another thread meanwhile, and its answer
   checked after the backward (_settle_ahead). The same groups: nothing was waited for. The
   same less some that died (the Lighthouse answered after their heartbeat timeout, time the
   step trained in): kept, as in 4. Else the step is cut anew and trained again.

Each group writes its own checkpoints under runs/NAME/groupN/."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from pytrain.config import ConfigError, TrainConfig, derive_grad_accum
from pytrain.config.errors import first_line
from pytrain.train import checkpoint, distributed, peer_state, run_state, sources
from pytrain.train.distributed import DistInfo
from pytrain.train.guard import PendingStep
from pytrain.train.step_rows import Kept, StepRows, lost_rows, runs
from pytrain.train.stopping import NothingToDo
from pytrain.train.trainer import Trainer

Cut = tuple[int, list[str], int]
"""How a quorum cut a step for this group: its place, the quorum's replica ids (its groups,
in place order), torchft's id of it."""


class HealFailed(RuntimeError):
    """A peer's state did not load into this group (a bug, or groups run with other
    settings: every group runs the same command but for --ft.group)."""


class NoQuorum(ConfigError):
    """No quorum of ft.min_replicas groups within ft.quorum_timeout_s (too few groups came,
    or the Lighthouse is down): this group stops at its last committed step, checkpointed."""


def job_done(run_dir: Path, max_steps: int) -> Path | None:
    """A checkpoint of the job's last step (`max_steps`), this group's own (`run_dir`) or a
    peer group's beside it (runs/NAME/groupN, where the groups share the output directory):
    the job ended, a group that starts now would wait for a quorum that never forms."""
    for d in [run_dir, *sorted(run_dir.parent.glob("group*"))]:
        for ckpt in checkpoint.list_checkpoints(d)[-1:]:
            if int(checkpoint.PATTERN.match(ckpt.name).group(1)) >= max_steps:  # type: ignore[union-attr]
                return ckpt
    return None


def trainer_class(cfg: TrainConfig) -> type[Trainer]:
    """The trainer for `cfg`: a replica group's where ft.lighthouse is set."""
    return ReplicaGroupTrainer if cfg.ft.lighthouse else Trainer


def import_torchft():
    """torchft (the ft extra), or one line that says how to install it."""
    try:
        import torchft
    except ImportError as e:
        raise ConfigError(
            f"ft.lighthouse needs torchft, which does not import here ({e}): pip install "
            "'pytrain[ft]' (make setup installs it)"
        ) from None
    return torchft


def group_store() -> tuple[str, int]:
    """(host, port) of this group's rendezvous store (this torchrun attempt's, see
    distributed._attempt_store), which torchft's Manager shares among the group's ranks and
    offers to the other groups for their all-reduce's rendezvous: under a loopback
    MASTER_ADDR (torchrun --standalone) the host's name, so that other nodes reach it."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # the default group's PrefixStores
        store = store.underlying_store
    host = os.environ.get("MASTER_ADDR", "localhost")
    if host in ("localhost", "127.0.0.1", "::1"):
        host = socket.gethostname()
    return host, store.port  # type: ignore[attr-defined]


TAG_BLOCKS = 7


def quorum_tag(group: int, groups: int, place: int, size: int, step: int,
               kept: Kept | None = None, kept_id: int = 0) -> torch.Tensor:  # fmt: skip
    """What a group adds to the step's all-reduce to say how it cut the step: at its own
    index (ft.group) of seven blocks of `groups` entries, a one, its place in the quorum, the
    quorum's size, the step, and where it keeps a failed attempt's work (Kept) its place in
    that attempt's quorum plus one, that quorum's size and torchft's id of it (else zeros).
    Summed, each group's entries stay apart, and quorum_mismatch reads every contributor's
    view back."""
    tag = torch.zeros(TAG_BLOCKS, groups)
    was = (kept.place + 1, kept.groups, kept_id % (1 << 24)) if kept is not None else (0, 0, 0)
    tag[:, group] = torch.tensor([1.0, place, size, step % (1 << 24), *was])  # exact in float32
    return tag.reshape(-1)


def quorum_mismatch(summed: torch.Tensor, groups: int, size: int, step: int) -> str | None:
    """Why the all-reduce's contributors did not train this group's step as one quorum of
    `size` groups at `step`, or None where they did: one process a group, `size` of them,
    each with this step and size, their places 0..size-1 (so their shares cut the step's rows
    once each). Every contributor reads the same sums, so a mismatch fails every group's
    vote, not only the one whose view differs. Where they keep a failed attempt's work, they
    all do, from one quorum of more groups (the same size), in places of it of their own."""
    one, place, n, at, was, before, kept_id = summed.reshape(TAG_BLOCKS, groups).round().long()
    if not bool(((one == 0) | (one == 1)).all()):
        return f"more than one process of group(s) {(one > 1).nonzero().flatten().tolist()}"
    members = one.nonzero().flatten()
    if len(members) != size:
        return f"the all-reduce summed {len(members)} group(s) of a quorum of {size}"
    if not (bool((n[members] == size).all()) and bool((at[members] == step % (1 << 24)).all())):
        return (
            f"groups {members.tolist()} were in quorums of {n[members].tolist()} groups at "
            f"steps {at[members].tolist()}, this group in one of {size} at step {step}"
        )
    if sorted(place[members].tolist()) != list(range(size)):
        return f"groups {members.tolist()} took the places {place[members].tolist()}"
    if len(old := set(zip(before[members].tolist(), kept_id[members].tolist(), strict=True))) != 1:
        return (
            f"groups {members.tolist()} kept the work of attempts under quorums of "
            f"{before[members].tolist()} groups of ids {kept_id[members].tolist()} (0: none)"
        )
    places = was[members] - 1
    if (n_old := old.pop()[0]) and not (
        n_old > size
        and len(set(places.tolist())) == size
        and bool(((places >= 0) & (places < n_old)).all())
    ):
        return (
            f"groups {members.tolist()} kept the work of the places {places.tolist()} of a "
            f"quorum of {n_old}"
        )
    return None


def sum_over_groups(manager, pg, tensors: list[torch.Tensor], loss: torch.Tensor,
                    tag: torch.Tensor, check, times: dict | None = None) -> torch.Tensor | None:  # fmt: skip
    """Sums `tensors` (in place), `loss` and `tag` (quorum_tag) over the groups of the step's
    quorum, in one all-reduce through torchft, then asks whether the step commits. Returns
    the summed loss, or None where it does not (an all-reduce that failed, a group that failed
    its vote, too few groups, or `check(summed tag)`'s mismatch): the tensors are then left
    as they were, to be dropped. `times` gets the milliseconds of the parts: copy_ms, the
    tensors' copy into the all-reduce's buffer (on a GPU timed by CUDA events, read once the
    vote has synchronized; the copy back out is as large); allreduce_ms, the all-reduce's
    wait; vote_ms, torchft's should_commit.

    An all-reduce that fails closes `pg` (the Manager's process group between groups) at
    once. A group that dies mid all-reduce is seen at once only by the groups that exchange
    data with it (gloo's ring: its neighbours); the others wait on a receive from a live
    group that has given up. torchft would close its connections only when the next quorum
    forms, and that quorum may need the waiting groups: everyone then waited ft.timeout_s.
    Closed now, the waiting groups' receives fail too, and every group asks for the next
    quorum within the Lighthouse's heartbeat timeout. The failed vote gives the next quorum
    a new id (torchft's Lighthouse re-forms on a commit failure), under which the process
    group is made again.

    The tag catches an all-reduce over groups that did not cut the step alike. torchft
    re-forms its all-reduce group only when the quorum's id changes, and a restarted
    Lighthouse counts ids from 1 again, so an all-reduce can mix quorums. Seen with torchft
    0.2.0: two groups committed a step of three without the third's rows; and, the Lighthouse
    restarted mid-step, a group of the old quorum of three summed with two of the new quorum
    of two (their shares overlapping) and committed alone. Such a step commits nowhere; the
    failed vote moves the Lighthouse to a new id, under which every group re-forms."""
    clock = _Clock(loss.device)
    flat = torch.cat([t.reshape(-1).float() for t in tensors]
                     + [loss.reshape(1).float(), tag.to(loss.device)])  # fmt: skip
    copied = clock.mark()
    manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
    summed = time.perf_counter()
    if manager.errored() is not None:
        close(pg)
    elif (why := check(flat[-tag.numel() :].cpu())) is not None:
        manager.report_error(RuntimeError(f"the step's all-reduce mixed quorums: {why}"))
    voting = time.perf_counter()
    commit = manager.should_commit()
    if times is not None:
        times["copy_ms"] = clock.ms(copied)
        times["allreduce_ms"] = (summed - clock.t0) * 1e3 - times["copy_ms"]
        times["vote_ms"] = (time.perf_counter() - voting) * 1e3
    if not commit:
        return None
    at = 0
    for t in tensors:
        t.copy_(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return flat[at]


class _Clock:
    """Milliseconds from its making to a mark: the host's clock, a GPU's events on CUDA."""

    def __init__(self, device: torch.device):
        self.t0 = time.perf_counter()
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return end

    def ms(self, mark) -> float:
        return self.start.elapsed_time(mark) if self.cuda else (mark - self.t0) * 1e3


def close(pg) -> None:
    """Closes torchft's process group `pg` and its connections to the other groups: gloo's
    sockets (ProcessGroupWrapper.abort), or the subprocess that holds NCCL's communicator
    (ProcessGroupBaby's). torchft's next reconfiguration makes it again."""
    from torchft.process_group import ProcessGroupBaby

    if isinstance(pg, ProcessGroupBaby):
        pg.shutdown()
    else:
        pg.abort()


class QuorumRecorder:
    """torchft's ManagerClient (a Manager's `_client`), keeping the last quorum it was
    given: its id and its members, for the ledger."""

    def __init__(self, client):
        self._client = client
        self.last = None

    def _quorum(self, *args, **kwargs):
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def id_and_members(self) -> tuple[int | None, list[int]]:
        """The last quorum's id and its groups (ft.group) by their place in it (torchft's
        replica ids are groupN:UUID)."""
        if self.last is None:
            return None, []
        ids = self.last.replica_ids
        return self.last.quorum_id, [int(r.split(":")[0].removeprefix("group")) for r in ids]


class ReplicaGroupTrainer(Trainer):
    """Trainer of one replica group (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, log=print, stop=None):
        self.torchft = import_torchft()
        env = distributed.from_env()
        if not env.launched:
            raise ConfigError(
                "ft.lighthouse: start each replica group with torchrun (torchrun "
                "--nproc_per_node N -m pytrain.train ... --ft.group K), one job a group"
            )
        # The global batch is the planned groups' (grad_accum derived over all their ranks).
        if (line := derive_grad_accum(cfg, cfg.ft.groups * env.world_size)) and env.is_main:
            log(line)
        cfg.name = f"{cfg.name}/group{cfg.ft.group}"
        if (done := job_done(Path(cfg.out_dir) / cfg.name, cfg.max_steps)) is not None:
            raise NothingToDo(
                f"the job is complete: {done} is at its last step (max_steps {cfg.max_steps}); "
                f"group {cfg.ft.group} has nothing to train and wrote nothing"
                if env.is_main
                else ""
            )
        super().__init__(cfg, log, stop)

    def _build(self) -> None:
        super()._build()
        cfg = self.cfg
        if self.dist.world_size == 1:  # (DDP wraps a lone torchrun rank; nothing to say of it)
            self.plan = dataclasses.replace(
                self.plan, line=f"data parallel: replica group {cfg.ft.group} of {cfg.ft.groups}, "
                "one rank; gradients summed over the step's quorum of groups by torchft",
            )  # fmt: skip
        self.rows = (
            cfg.data.batch_size * cfg.optim.grad_accum * self.dist.world_size * cfg.ft.groups
        )
        # Every rank reads the global order at world size 1 (the loader's state does not
        # depend on it); a mixture's stages then start at row step x rows.
        position = self.loader.state_dict()
        self.loader.close()
        batches = self.rows // cfg.data.batch_size
        self.loader = sources.train_loader(cfg.data, self.sources, batches, DistInfo())
        self.loader.load_state_dict(position)
        self.rows_feed = StepRows(
            self.loader, self.device, self.segments, self.rows, self.dist.rank,
            self.dist.world_size,
        )  # fmt: skip
        self.rows_feed.quorum = self._quorum
        # The loop reads it as it reads a DeviceFeed: take, prefetch, state_dict, close.
        self.feed = self.rows_feed  # type: ignore[assignment]
        from pytrain.train import ft_logs

        rank = self.dist.rank
        self.ft_log = self.run_dir / (ft_logs.LOG_NAME if rank == 0 else f"torchft-rank{rank}.log")
        self._ft_handler = ft_logs.log_to(self.ft_log)
        self.manager = self._manager()
        # One ledger a group, written by its rank 0: a line a step attempt.
        self.ledger = (self.run_dir / "ledger.jsonl").open("a") if self.dist.is_main else None
        self._healed: int | None = None  # the step of a heal just applied
        self._quorum_s = 0.0  # the last quorum's seconds
        self._committed = False  # whether this process committed a step
        # A failed attempt's work, until the next quorum says whether it is kept (_keep):
        # (the step, the quorum it was cut by, its loss).
        self._pending: tuple[int, Cut, torch.Tensor] | None = None
        self._kept: Kept | None = None  # what the open attempt keeps
        self._kept_from = (0, torch.zeros(()))  # its quorum's id, and its loss
        # The last committed step's quorum, the cut the next step trains while its quorum
        # forms (_ahead).
        self._last: Cut | None = None
        self._asked: Future | None = None  # that quorum, asked for on _pool's thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quorum")
        self._ahead_lock = threading.Lock()  # held while a step trains ahead of its quorum
        self._step_rng: dict | None = None  # the RNG at such a step's start, for a healing peer
        self.rows_feed.ahead = self._ahead

    def _manager(self):
        ft, tf = self.cfg.ft, self.torchft
        timeout = timedelta(seconds=ft.timeout_s)
        from pytrain.train import ft_logs

        cross = ft_logs.QuietBabyNCCL if self.device.type == "cuda" else ft_logs.QuietGloo
        host, port = group_store()
        self.cross_pg = cross(timeout=timeout)
        try:
            manager = tf.Manager(
                pg=self.cross_pg, load_state_dict=self._load_peer_state,
                state_dict=self._peer_state, min_replica_size=ft.min_replicas,
                # A quorum's heal is applied before the step's rows are cut: every group of
                # the quorum then trains its share (torchft's asynchronous quorum would leave
                # a healing group out of the step).
                use_async_quorum=False, timeout=timeout,
                quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=timeout,
                rank=self.dist.rank, world_size=self.dist.world_size, store_addr=host,
                store_port=port, lighthouse_addr=ft.lighthouse, replica_id=f"group{ft.group}",
                # Every group builds the same weights from the same seed (as FSDP2's ranks
                # do), so step 0 needs no transfer; a group behind heals at any step.
                init_sync=False,
                # A Lighthouse that is down is asked again about once a second until the
                # quorum's timeout: one restarted within it finds the groups waiting.
                quorum_retries=max(1, int(ft.quorum_timeout_s)),
            )  # fmt: skip
        except Exception as e:  # the Lighthouse is not there: torchft's RPC error
            raise NoQuorum(
                f"no Lighthouse at ft.lighthouse {ft.lighthouse}: {first_line(e)}"
            ) from None
        ft_logs.quiet_http(manager._checkpoint_transport)
        manager._client = self.quorums = QuorumRecorder(manager._client)
        # A group that resumed from its checkpoint starts its torchft step there.
        manager.load_state_dict({"step": self.step, "batches_committed": self.step * ft.groups})
        return manager

    # ---- healing: what a peer sends and what this group loads (pytrain.train.peer_state) ----
    def _peer_state(self) -> dict:
        # Read after a step that trains ahead of its quorum has run its backward, not during
        # it (torchft asks on its own thread; FSDP2's state dict would meet the forward's
        # gathered parameters); the weights and the optimizer are still the step's start's.
        with self._ahead_lock:
            state = peer_state.collect(self)
        if self._step_rng is not None:  # the forward may have drawn from it since
            state["rng"] = self._step_rng
        return state

    def _load_peer_state(self, state: dict) -> None:
        try:
            with self._ahead_lock:  # not into weights that a step ahead still trains with
                peer_state.load(self, state)
        except Exception as e:  # not the quorum's failure: said as it is
            raise HealFailed(f"group {self.cfg.ft.group} could not load a peer's state: {e}") from e
        self._healed = self.step

    # ---- a step ----------------------------------------------------------------------------
    def _quorum(self) -> tuple[int, int, Kept | None]:
        """(this group's place, the groups, what it keeps of the step's failed attempt) of the
        next step's quorum, healed where behind; NoQuorum, after a checkpoint, where none
        forms in time."""
        t0 = time.perf_counter()
        try:
            self.manager.start_quorum()
            place, groups = self.manager.participating_rank(), self.manager.num_participants()
        except HealFailed:
            raise
        except Exception as e:  # torchft's TimeoutError or RuntimeError from its RPCs
            self._stop_without_quorum(e)
        self._quorum_s = time.perf_counter() - t0
        if not self._committed and groups < self.cfg.ft.groups:
            self._stop_if_job_done()
        healed = self._said_heal()
        assert place is not None, "a synchronous quorum has every group in its step"
        return place, groups, self._keep(groups, healed)

    def _said_heal(self) -> bool:
        """Whether the quorum just formed healed this group (said in one line)."""
        if self._healed is None:
            return False
        self.say(f"healed from a peer at step {self._healed} in {self._quorum_s:.2f}s")
        self._healed = None
        return True

    def _keep(self, groups: int, healed: bool) -> Kept | None:
        """What the attempt under this quorum keeps of the step's last one, which failed
        (_survivors_keep), or None: that work is then dropped, the step cut anew and
        trained from zeroed gradients."""
        pending, self._pending, self._kept = self._pending, None, None
        if pending is None:
            return None
        step, was, loss = pending
        if step != self.step or (kept := self._survivors_keep(was, loss, groups, healed)) is None:
            self.gpt.discard_step()  # its rows are given back: so is what they routed
            return None
        return kept

    def _survivors_keep(
        self, was: Cut, loss: torch.Tensor, groups: int, healed: bool
    ) -> Kept | None:
        """Kept, where the quorum just formed (of `groups`) is the groups of `was` (the quorum
        that work was trained under) less some that died: the same processes (a restarted
        group is a new replica id), none healed (all at the step: a healed one was behind,
        or one of them committed it), and the dead groups' rows give each rank of each
        survivor one at least. Every group of the quorum decides alike from the same
        quorum. The work's loss and quorum go to _kept_from."""
        place, ids, quorum_id = was
        now = list(self.quorums.last.replica_ids)
        kept = Kept(place, len(ids), tuple(i for i, r in enumerate(ids) if r not in now))
        if (
            healed
            or not kept.lost
            or not set(now) <= set(ids)
            or len(lost_rows(self.rows, kept)) < groups * self.dist.world_size
        ):
            return None
        self._kept, self._kept_from = kept, (quorum_id, loss)
        return kept

    def _ahead(self) -> tuple[int, int] | None:
        """The cut a step trains while its quorum forms, the quorum asked for on another
        thread: the last step's, where this group committed it (the quorum's furthest step,
        so it heals from none) and no attempt failed since (a failed step waits for its
        quorum, _keep). The Lighthouse answers at once where every group of the last quorum
        asks again; where one died, after its heartbeat timeout, time in which the step
        trains: the survivors then keep it and train the dead group's rows between them
        (_settle_ahead)."""
        if self._last is None or self._pending is not None:
            return None
        if self.cfg.model.dropout:  # the forward draws from the RNG: a healing peer's is this
            self._step_rng = checkpoint.rng_state()
        self._asked = self._pool.submit(self._ask_quorum)
        place, ids, _ = self._last
        return place, len(ids)

    def _ask_quorum(self) -> None:
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self._quorum_s = time.perf_counter() - t0

    def _settle_ahead(
        self, denom: float, loss_sum: torch.Tensor, fallbacks: list[str]
    ) -> tuple[torch.Tensor, list[str]]:
        """The quorum that _ahead asked for, once the step trained ahead of it: the same
        groups in the same places, the step goes on; the same less some that died, this
        group keeps what it trained and trains its part of the dead groups' rows (Kept, as
        _keep); else (a group joined, this one healed) the step is cut by the quorum and
        trained again. Every group of the quorum decides alike from the same quorum."""
        asked, self._asked, self._step_rng = self._asked, None, None
        assert asked is not None and self._last is not None
        try:
            asked.result()
        except HealFailed:
            raise
        except Exception as e:  # torchft's TimeoutError or RuntimeError from its RPCs
            self._stop_without_quorum(e)
        healed = self._said_heal()
        place, groups = self.manager.participating_rank(), self.manager.num_participants()
        assert place is not None, "a synchronous quorum has every group in its step"
        if not healed and list(self.quorums.last.replica_ids) == self._last[1]:
            return loss_sum, fallbacks
        if (kept := self._survivors_keep(self._last, loss_sum, groups, healed)) is not None:
            return self._top_up(self.rows_feed.cut(place, groups, kept), denom)
        self.gpt.discard_step()  # what the step routed ahead of its quorum
        return self._backward_with_fallback(self.rows_feed.cut(place, groups, None), denom)

    def _stop_if_job_done(self) -> None:
        """NothingToDo where the peers ended the job while this group was being built: it
        passed the check in __init__ then, and would now train the job again from its own
        step, alone. Asked until this process's first commit (after it, the group steps with
        its quorum and ends with it); the quorum forms only after the Lighthouse waited
        its join timeout for the peers still heartbeating, time in which one that committed
        the last step writes its checkpoint. The group's ranks decide together (a shared
        filesystem may show the checkpoint to one rank first)."""
        cfg = self.cfg
        done = job_done(self.run_dir, cfg.max_steps)
        if distributed.all_sums([done is not None], self.dist, self.device)[0] == 0:
            return
        raise NothingToDo(
            f"the job is complete: {done or 'a peer'} is at its last step (max_steps "
            f"{cfg.max_steps}); group {cfg.ft.group} started as its peers ended and "
            "committed no step"
            if self.dist.is_main
            else ""
        )

    def _stop_without_quorum(self, e: Exception) -> NoReturn:
        ft = self.cfg.ft
        run_state.save(self)
        self.finish_checkpoints()
        raise NoQuorum(
            f"no quorum of ft.min_replicas {ft.min_replicas} replica group(s) at the Lighthouse "
            f"{ft.lighthouse} within ft.quorum_timeout_s {ft.quorum_timeout_s:g} (too few groups, "
            f"or the Lighthouse down: {first_line(e)}); group {ft.group} stopped at step "
            f"{self.step}, checkpoint in {self.run_dir}: run the same command to resume"
        )

    def train_step(self, batches, prefetch=None) -> PendingStep:
        """One committed step: attempts until torchft commits one, each under its own
        quorum, the rows of an attempt that does not commit given back."""
        while (p := self._attempt(batches)) is None:
            self.rows_feed.rewind()
            batches, _ = self.rows_feed.take()
        return p

    def _attempt(self, batches) -> PendingStep | None:
        # The stop votes within the group; the loss tokens over every group (every rank read
        # all of the step's rows).
        votes = distributed.all_sums(list(self.stop.vote()), self.dist, self.device)
        denom = max(self.rows_feed.loss_tokens, 1)
        if self._asked is not None:  # cut ahead of its quorum (_ahead)
            self._kept = None
            with self._ahead_lock:
                loss_sum, fallbacks = self._backward_with_fallback(batches, denom)
            loss_sum, fallbacks = self._settle_ahead(denom, loss_sum, fallbacks)
        elif self._kept is None:
            loss_sum, fallbacks = self._backward_with_fallback(batches, denom)
        else:
            loss_sum, fallbacks = self._top_up(batches, denom)
        kept = self._kept
        t0 = time.perf_counter()
        ft, place, size = (
            self.cfg.ft,
            self.manager.participating_rank(),
            self.manager.num_participants(),
        )
        tag = quorum_tag(ft.group, ft.groups, place, size, self.step, kept, self._kept_from[0])
        times = dict[str, float]()
        total = sum_over_groups(
            self.manager, self.cross_pg, self._grads() + self.gpt.step_sums(), loss_sum, tag,
            lambda summed: quorum_mismatch(summed, ft.groups, size, self.step), times,
        )  # fmt: skip
        self._write_ledger(total is not None, time.perf_counter() - t0, times)
        if total is None:
            self.say(f"step {self.step + 1} not committed under this quorum of {size} group(s): "
                     f"{self._why_not()}; tried again (detail in {self.ft_log})")  # fmt: skip
            self._last = None  # the next attempt waits for its quorum
            if kept is None and not fallbacks:  # kept or dropped at the next quorum (_keep)
                self._pending = (self.step, self._cut(place), loss_sum)
            else:
                self.gpt.discard_step()  # its rows are given back: so is what they routed
            return None
        self.rows_feed.commit()
        self._committed = True
        self._last = self._cut(place)
        loss = distributed.all_sum_tensor(total, self.dist) / denom
        tokens = self.rows * self.cfg.data.seq_len
        return self.update(loss, denom, tokens, fallbacks, self.stop.agreed(*votes))

    def _cut(self, place: int) -> Cut:
        """The quorum that cut this attempt, as _survivors_keep compares a later one with it."""
        quorum_id, _ = self.quorums.id_and_members()
        return place, list(self.quorums.last.replica_ids), quorum_id or 0

    def _top_up(self, batches, denom: float) -> tuple[torch.Tensor, list[str]]:
        """Forward and backward of this rank's part of the lost groups' rows (`batches`),
        added to the gradients (and a mixture's loads) that the failed attempt left: its
        loss plus theirs. A compile failure here drops a compile level, as
        _backward_with_fallback does, and fails the step's vote in every group (the kept
        gradients may hold part of the failed pass): the next attempt keeps nothing."""
        try:
            return self._kept_from[1] + self._forward_backward(batches, denom), []
        except Exception as e:  # re-raised unless a lower compile level avoids it
            fallback = self.compiler.fall_back(e, self.step)
            self.manager.report_error(
                RuntimeError(f"a compile fallback in a kept attempt: {fallback}")
            )
            return self._kept_from[1], [fallback]

    def _why_not(self) -> str:
        """Why the step's vote failed, in a few words: this rank's error (gloo's message
        without its source location and advice), or the vote's other causes."""
        if (e := self.manager.errored()) is not None:
            e = getattr(e, "original_exception", e)
            return re.sub(r"^\[[^\]]*\] ", "", first_line(e)).split(". ")[0]
        if self.manager.num_participants() < self.cfg.ft.min_replicas:
            return f"fewer groups than ft.min_replicas {self.cfg.ft.min_replicas}"
        return "another rank of this group failed its part"

    def _grads(self) -> list[torch.Tensor]:
        """This rank's gradients as the group reduced them (a shard's under FSDP2; the fp32
        sums under master weights), the same list in every group: a parameter without a
        gradient gets zeros."""
        if self.master:
            masters = self.opt_step.masters
            # One micro-batch left them in .grad (or a kept attempt's one: added to the sum).
            if masters.flat_grad is None or any(p.grad is not None for p in masters.params):
                masters.accumulate()
            assert masters.flat_grad is not None
            return [masters.flat_grad]
        out = []
        for p in self.gpt.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
        return out

    def _write_ledger(self, committed: bool, sync_s: float, times: dict) -> None:
        """A line of the group's ledger for this step attempt: the step's rows of the global
        order ([first, last]: a committed line says all of them were trained, as torchft's
        all-reduce completed only with every group's share in it), the quorum it was tried
        under (torchft's id, and its groups by their places), this group's share of the rows
        and its CRC-32, whether the step counted, and what torchft's part took: the quorum
        (a heal included), and the all-reduce with the commit vote (sync_ms), split into
        the gradients' copy into its buffer, the all-reduce and the vote (sum_over_groups)."""
        if self.ledger is None:
            return
        start = self.step * self.rows
        first, end = self.rows_feed.group_rows
        quorum, members = self.quorums.id_and_members()
        line = {
            "step": self.step, "committed": committed, "rows": [start, start + self.rows - 1],
            "group": self.cfg.ft.group, "place": self.manager.participating_rank(),
            "groups": self.manager.num_participants(), "quorum": quorum, "members": members,
            "share": [start + first, start + end - 1],
            "crc": self.rows_feed.group_crc(), "pid": os.getpid(), "time": time.time(),
            **self._kept_fields(start),
            "quorum_ms": round(self._quorum_s * 1e3, 2), "sync_ms": round(sync_s * 1e3, 2),
            **{k: round(v, 2) for k, v in times.items()},
        }  # fmt: skip
        self.ledger.write(json.dumps(line) + "\n")
        self.ledger.flush()

    def _kept_fields(self, start: int) -> dict:
        """The ledger's fields of an attempt that kept a failed one's work: that attempt's
        quorum (`kept_from`, torchft's id), and the rows of the lost groups that this group
        trained in this one (`extra`, [first, last] runs in the global order) with their
        CRC-32 (`extra_crc`); `share` and `crc` are then the kept attempt's share."""
        if self._kept is None or self.rows_feed.extra_rows is None:
            return {}
        extra = [[start + a, start + b] for a, b in runs(self.rows_feed.extra_rows)]
        return {"kept_from": self._kept_from[0], "extra": extra,
                "extra_crc": self.rows_feed.group_crc(extra=True)}  # fmt: skip

    def close(self, status: str = "FAILED") -> None:
        if self.ledger is not None:
            self.ledger.close()
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.manager.shutdown(wait=False)
        from pytrain.train import ft_logs

        ft_logs.stop(self._ft_handler)
        super().close(status)
