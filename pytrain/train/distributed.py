"""torchrun support: process group set-up, the device of this rank, and small collectives
(the wrappers that share the model are pytrain.train.parallel's)."""

from __future__ import annotations

import atexit
import faulthandler
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

TOKEN_KEY = "pytrain/attempt-store"
"""The agents' store's entry where rank 0 leaves its own store's port and token."""


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False
    """Started by torchrun (or another launcher that sets its variables)."""
    local_world_size: int = 0
    """Ranks on this rank's node (torchrun's LOCAL_WORLD_SIZE); 0: not said (one node)."""

    @property
    def enabled(self) -> bool:
        """A process group and DDP/FSDP2 wrapping: with several ranks, and under torchrun
        with one (the multi-GPU code path on one GPU, as a launch script runs it)."""
        return self.world_size > 1 or self.launched

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def per_node(self) -> int:
        """Ranks a node: LOCAL_WORLD_SIZE where the launcher says it, else all of them."""
        return self.local_world_size or self.world_size


def from_env() -> DistInfo:
    """This process's place as torchrun's environment gives it."""
    return DistInfo(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
        launched="TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 0)),
    )


def init(device_pref: str, timeout_s: float = 900.0) -> tuple[DistInfo, torch.device]:
    """Reads torchrun's environment; NCCL on CUDA, gloo on CPU; collectives time out after
    `timeout_s` (set_timeout shortens it once training runs)."""
    info = from_env()
    device = resolve_device(device_pref, info)
    if device.type == "cuda":
        check_gpu(info, device)
        torch.cuda.set_device(device)
    if info.enabled and not dist.is_initialized():
        # Python tracebacks of every thread if this rank dies of a signal (a SIGABRT from a
        # collective library), so a failed rank says where it was; torchrun shows stderr.
        faulthandler.enable(all_threads=True)
        # DDP imports torch.distributed.nn.functional on first use; imported after the
        # group exists, its functions' `group=group.WORLD` defaults hold the default group
        # for the life of the process, and destroy_process_group() leaves its threads
        # running into interpreter exit. Imported first, those defaults are None.
        import torch.distributed.nn.functional as _  # noqa: F401

        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            device_id=device if device.type == "cuda" else None,
            store=_attempt_store(info, timeout_s),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    return info, device


def resolve_device(device_pref: str, info: DistInfo) -> torch.device:
    """The device `--device` names for this rank (auto: its local GPU where there is one)."""
    if device_pref == "auto":
        return torch.device(f"cuda:{info.local_rank}" if torch.cuda.is_available() else "cpu")
    if device_pref == "cuda":
        return torch.device(f"cuda:{info.local_rank}")
    return torch.device(device_pref)


def check_gpu(info: DistInfo, device: torch.device) -> None:
    """One line, not CUDA's "invalid device ordinal" traceback, where torchrun started more
    ranks on this host than it has GPUs (each rank takes the GPU of its local rank)."""
    from pytrain.config import ConfigError

    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(
            f"rank {info.rank} (local rank {info.local_rank}) wants GPU {device.index}, but this host "
            f"has {count} GPU(s) visible: start at most {count} rank(s) a node (torchrun "
            "--nproc_per_node), or train on the CPU with --device cpu"
        )


def _attempt_store(info: DistInfo, timeout_s: float) -> dist.Store:
    """The rendezvous store of this attempt of the job, which no earlier attempt wrote to.

    Under torchrun the agents' store outlives a restart (`--max-restarts`; the static
    rendezvous's, and c10d's, whose rank-0 agent keeps its store server from round to
    round): restarted ranks reading it would find the dead ranks' addresses (gloo:
    "connectFullMesh failed ... Connection refused"). A prefix per restart count does not
    do across nodes: each agent counts its own restarts, and an agent that restarts its
    workers because another node's failed does not count it, so two nodes' ranks may
    disagree on the attempt (seen with two agents of two ranks each). So rank 0 starts a
    store of its own on a free port and leaves its address and a fresh token in the agents'
    store; the other ranks read that entry until they reach a live store holding the same
    token (an entry of an earlier attempt names the store of a rank 0 that is gone: the
    agents stop every worker before the next attempt starts). Without an agent's store,
    rank 0 serves at MASTER_ADDR:MASTER_PORT, a new store every attempt."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.TCPStore(host, port, info.world_size, is_master=info.rank == 0, timeout=timeout)
    agents = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if info.rank == 0:
        ours = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        ours.set(TOKEN_KEY, token)
        agents.set(TOKEN_KEY, f"{ours.port} {token}")
        return ours
    deadline = time.monotonic() + timeout_s
    while True:
        at, token = agents.get(TOKEN_KEY).decode().split()  # waits for rank 0's first entry
        try:
            # A plain connection first: an earlier attempt's address refuses it at once,
            # where a store client would retry (and log each retry) until its timeout.
            socket.create_connection((host, int(at)), timeout=timeout_s).close()
            ours = dist.TCPStore(host, int(at), is_master=False, timeout=timedelta(seconds=10))
            if ours.get(TOKEN_KEY).decode() == token:
                ours.set_timeout(timeout)
                return ours
        except (OSError, RuntimeError):  # refused, or another store: an earlier attempt's
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {info.rank}: no store of this attempt's rank 0 within {timeout_s:.0f} s "
                f"(its entry in torchrun's store at {host}:{port} names {at})"
            )
        time.sleep(0.2)


def set_timeout(info: DistInfo, timeout_s: float) -> str | None:
    """How long collectives wait from now on (torchtitan does the same after its first
    step: a long timeout for set-up and compile, a short one for training). Returns a
    warning where the backend cannot change it (the set-up timeout then stays)."""
    if not (info.enabled and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    # Public from torch 2.12 (set_timeout); torch 2.11 has the private name only.
    set_pg = getattr(dist, "set_timeout", None) or getattr(
        distributed_c10d, "_set_pg_timeout", None
    )
    try:
        if set_pg is None:
            raise NotImplementedError("no set_timeout in this torch")
        set_pg(timedelta(seconds=timeout_s), None)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"warning: collectives keep the set-up timeout (--dist_init_timeout_s): {e}"
    return None


def all_sum(x: float | int, info: DistInfo, device: torch.device) -> float:
    return all_sums([x], info, device)[0]


def all_sums(xs: list, info: DistInfo, device: torch.device) -> list[float]:
    """Sums of host numbers over ranks, in one collective (one host sync)."""
    if not info.enabled:
        return [float(x) for x in xs]
    t = torch.tensor([float(x) for x in xs], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_sum_tensor(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of a device tensor over ranks, left on the device (no host sync)."""
    if not info.enabled:
        return t
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def gather_objects(obj, info: DistInfo) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo, model: torch.nn.Module | None = None) -> None:
    """Ends the process group: every rank first reaches this point (no rank closes its
    connections while another still runs a collective), then the group is destroyed and,
    under DDP, released by the wrapper, so its threads (gloo's or NCCL's) are joined here
    while the interpreter is whole rather than during its teardown. The wrapper cannot
    train after this."""
    if not (info.enabled and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(model, DDP):
        # The reducer and its logger hold the group in C++ as long as they live.
        for name in ("reducer", "logger", "process_group"):
            if hasattr(model, name):
                delattr(model, name)


def exit_process(code: int) -> NoReturn:
    """Ends a process that ran a process group, after its work is written and closed
    (Trainer.close), without Python's interpreter teardown. Collective libraries leave C++
    threads behind (FSDP2's sharded parameters keep their group alive; autograd's device
    threads), and one that touches a Python object while the interpreter is finalizing is
    ended by Python through a noexcept frame: "terminate called without an active
    exception", SIGABRT, and torchrun reports a finished run as failed (seen on a gloo rank
    in CI; pytorch/pytorch#190489). The atexit handlers still run first, while Python is
    whole, and the standard streams are flushed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def load_model_optim_state(
    model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict, sharded: bool
) -> None:
    """Loads whole state dicts (a single-file checkpoint: of a DDP or one-process run, or of
    an FSDP2 run before its checkpoints were sharded); under FSDP2 each rank keeps its own
    shards of them."""
    if not sharded:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )
