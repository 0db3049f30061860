"""Run by tests/test_sharded_checkpoint.py under torchrun (gloo, --fsdp): trains, then
writes its last checkpoint as FSDP2 runs did before checkpoints were sharded (one file of
whole tensors gathered on rank 0, `get_state_dict(full_state_dict=True)`) in place of the
sharded directory, so the test can check that such a file still resumes."""

import shutil
import sys

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from pytrain.config import parse_args
from pytrain.train import checkpoint, distributed, run_state
from pytrain.train.trainer import Trainer

t = Trainer(parse_args(sys.argv[1:]))
t.fit()
opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
model, optim = get_state_dict(t.gpt, t.optimizer, options=opts)  # every rank: it gathers
state = {**run_state.collect(t, tensors=False), "model": model, "optimizer": optim}
if t.dist.is_main:
    for sharded in checkpoint.list_checkpoints(t.run_dir):
        shutil.rmtree(sharded)
    checkpoint.save(t.run_dir, t.step, state, keep=3)
distributed.barrier(t.dist)
t.close()
distributed.exit_process(0)
