"""What torchft and the libraries under it would print, kept off a replica group's terminal
(pytrain.train.replica_groups): the terminal gets one line for a step attempt that failed
and one for a heal, and the detail goes to the group's log file (LOG_NAME in its run
directory, one a rank): torchft's warnings and errors with their tracebacks, a failed
all-reduce's gloo error among them.

What is dropped: the heal's HTTP access line (torchft's checkpoint server, on http.server's
stderr), the UserWarning of torch's streaming load about the received bytes being
read-only (the state is copied into the trainer's own tensors), and the deprecation that
torchft's process groups set off in torch's C++ backend (`_set_sequence_number_for_group`,
a no-op now), which C++ prints once a process."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch.distributed as dist
from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo

LOG_NAME = "torchft.log"

warnings.filterwarnings(
    "ignore", message="The given buffer is not writable", category=UserWarning,
    module=r"torch\.distributed\._serialization",
)  # fmt: skip


def log_to(path: Path) -> logging.Handler:
    """torchft's Python loggers (warnings and errors, with their tracebacks) into `path`,
    not the terminal; `stop` takes the returned handler off again."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("torchft")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # INFO is a line a quorum and one a vote
    logger.propagate = False
    return handler


def stop(handler: logging.Handler) -> None:
    logging.getLogger("torchft").removeHandler(handler)
    handler.close()


def quiet_http(transport) -> None:
    """torchft's HTTP checkpoint server (`transport`, the Manager's) logs each request to
    its logger at INFO instead of the terminal."""
    server = getattr(transport, "_server", None)
    if server is not None:
        log = logging.getLogger("torchft.checkpointing.http_transport")
        server.RequestHandlerClass.log_message = lambda _, fmt, *args: log.info(fmt, *args)


_spent = False


def spend_sequence_warning() -> None:
    """Sets off torch's once-a-process warning that `_set_sequence_number_for_group` is
    deprecated on a backend of one rank of its own, stderr pointed at /dev/null meanwhile;
    torchft's process groups then call it without a word."""
    global _spent
    if _spent:
        return
    _spent = True
    backend = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    if not hasattr(backend, "_set_sequence_number_for_group"):
        return
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            backend._set_sequence_number_for_group()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class QuietGloo(ProcessGroupGloo):
    """torchft's gloo process group between groups, without the deprecation's line."""

    def _create_pg(self, store, rank: int, world_size: int):
        spend_sequence_warning()
        return super()._create_pg(store, rank, world_size)


class QuietBabyNCCL(ProcessGroupBabyNCCL):
    """torchft's NCCL process group between groups (in a subprocess of its own, made anew
    at each reconfiguration), without the deprecation's line, and shut down without the
    subprocess's tracebacks: it is killed before its pipes are closed (torchft closes them
    first, and the subprocess, reading from them, prints its EOFError on the terminal)."""

    @classmethod
    def _create_pg(cls, store, rank: int, world_size: int):
        spend_sequence_warning()
        return super()._create_pg(store, rank, world_size)

    def shutdown(self) -> None:
        if self._p is not None:
            self._p.kill()
            self._p.join()
        super().shutdown()
