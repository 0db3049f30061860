"""Run by tests/test_sharded_checkpoint.py under torchrun (gloo, --fsdp): the CLI, with every
shard file of the checkpoint at step 4 stalling in its fsync (DCP's writer syncs each file
it wrote), so that the test can kill the job while that checkpoint is being written."""

import os
import sys
import time

from pytrain.train import distributed
from pytrain.train.cli import main

real_fsync = os.fsync


def stalling_fsync(fd) -> None:
    if "/.ckpt-00000004.tmp/" in os.readlink(f"/proc/self/fd/{fd}"):
        time.sleep(3600)
    real_fsync(fd)


os.fsync = stalling_fsync
distributed.exit_process(main(sys.argv[1:]))
