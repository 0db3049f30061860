"""A replica group's rank for tests/test_replica_groups.py: `python -m pytrain.train ARGS`,
where each step that a smaller quorum than ft.groups trains is held to PACE seconds of wall
time (a sleep: no work, no CPU). On real hardware a step takes longer than a restart's
seconds of imports; the tests' steps take milliseconds, so without it the survivors would
finish the run before a restarted group came back to heal.

With DIE_AT=STEP in its environment, the rank SIGKILLs itself where it would join the
all-reduce between groups of its first step from STEP on that every group of ft.groups
trains: the other groups of that quorum are then inside the all-reduce, waiting on it. It
writes the time it dies (time.time()) to the file DIED names, first.

With DIE_AFTER=STEP, it SIGKILLs itself once it has committed its first step from STEP on
(counted from 1) that every group of ft.groups trained, before the next step asks for its
quorum: between two steps, nothing of its in flight.

With WAIT_FOR=FILE and WAIT_AT=STEP, a smaller quorum's steps from STEP on wait until FILE
exists (a group that must not end the job before a late one has started).

With HELD=FILE and GO=FILE in its environment, the rank holds as its group starts to build,
after the check that the job has not ended and before its manager exists: it writes HELD,
then waits until GO exists.

    torchrun ... tests/replica_group_worker.py PACE ARGS..."""

from __future__ import annotations

import os
import signal
import sys
import time

from pytrain.train import distributed, replica_groups
from pytrain.train.cli import main

PACE = float(sys.argv[1])
DIE_AT = int(os.environ.get("DIE_AT", "-1"))
DIE_AFTER = int(os.environ.get("DIE_AFTER", "-1"))
GROUPS = int([b for a, b in zip(sys.argv, sys.argv[1:], strict=False) if a == "--ft.groups"][-1])
attempt = replica_groups.ReplicaGroupTrainer.train_step
build = replica_groups.ReplicaGroupTrainer._build
sum_over_groups = replica_groups.sum_over_groups


def paced(self, batches, prefetch=None):
    t0 = time.perf_counter()
    p = attempt(self, batches, prefetch)
    if 0 <= DIE_AFTER <= self.step + 1 and self.manager.num_participants() == GROUPS:
        died()  # committed a step of every group: dead before the next one begins
    if self.manager.num_participants() < self.cfg.ft.groups:
        if "WAIT_FOR" in os.environ and self.step >= int(os.environ["WAIT_AT"]):
            while not os.path.exists(os.environ["WAIT_FOR"]):
                time.sleep(0.05)
        time.sleep(max(0.0, PACE - (time.perf_counter() - t0)))
    return p


def died():
    with open(os.environ["DIED"], "w") as f:
        f.write(f"{time.time()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def dying(manager, *args, **kwargs):
    if 0 <= DIE_AT <= manager.current_step() and manager.num_participants() == GROUPS:
        died()
    return sum_over_groups(manager, *args, **kwargs)


def held(self):
    if "HELD" in os.environ:
        with open(os.environ["HELD"], "w") as f:
            f.write(f"{time.time()}\n")
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.05)
    return build(self)


replica_groups.ReplicaGroupTrainer._build = held  # type: ignore[method-assign]
replica_groups.ReplicaGroupTrainer.train_step = paced  # type: ignore[method-assign]
replica_groups.sum_over_groups = dying
distributed.exit_process(main(sys.argv[2:]))
