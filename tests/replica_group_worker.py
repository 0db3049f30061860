"""A replica group's rank for tests/test_replica_groups.py: `python -m pytrain.train ARGS`,
where each step that a smaller quorum than ft.groups trains is held to PACE seconds of wall
time (a sleep: no work, no CPU). On real hardware a step takes longer than a restart's
seconds of imports; the tests' steps take milliseconds, so without it the survivors would
finish the run before a restarted group came back to heal.

    torchrun ... tests/replica_group_worker.py PACE ARGS..."""

from __future__ import annotations

import sys
import time

from pytrain.train import distributed, replica_groups
from pytrain.train.cli import main

PACE = float(sys.argv[1])
attempt = replica_groups.ReplicaGroupTrainer.train_step


def paced(self, batches, prefetch=None):
    t0 = time.perf_counter()
    p = attempt(self, batches, prefetch)
    if self.manager.num_participants() < self.cfg.ft.groups:
        time.sleep(max(0.0, PACE - (time.perf_counter() - t0)))
    return p


replica_groups.ReplicaGroupTrainer.train_step = paced  # type: ignore[method-assign]
distributed.exit_process(main(sys.argv[2:]))
