"""Run by tests/test_sharded_checkpoint.py under torchrun (gloo, --fsdp): the CLI, with
every shard file of the checkpoint at step 4 failing with ENOSPC on write, as a full disk
fails it."""

import errno
import os
import sys
from contextlib import contextmanager

from torch.distributed.checkpoint import filesystem

from pytrain.train import distributed
from pytrain.train.cli import main

real = filesystem.FileSystem.create_stream


class _Full:
    """A real file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def write(self, b):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.f, name)


@contextmanager
def create_stream(self, path, mode):
    with real(self, path, mode) as stream:
        full = "ckpt-00000004" in str(path) and str(path).endswith(".distcp") and "w" in mode
        yield _Full(stream) if full else stream


filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
distributed.exit_process(main(sys.argv[1:]))
