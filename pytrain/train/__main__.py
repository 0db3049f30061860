"""`python -m pytrain.train`: see pytrain/train/cli.py."""

import sys

from pytrain.train.cli import main

code = main()
# A run that loaded torch ends through pytrain.train.distributed (a process group's C++
# threads must not meet the interpreter's teardown). One that ended at its configuration (a
# user error: one line, exit 2) never loaded torch and ran no process group: loading torch
# here only to learn that would hold its exit two seconds.
if "torch" in sys.modules:
    from pytrain.train import distributed

    if distributed.from_env().enabled:
        distributed.exit_process(code)
sys.exit(code)
