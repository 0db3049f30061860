"""`python -m pytrain.train`: see pytrain/train/cli.py."""

import sys

from pytrain.train.cli import main

code = main()
from pytrain.train import distributed  # noqa: E402  (after main: torch loads behind its guards)

if distributed.from_env().enabled:
    distributed.exit_process(code)
sys.exit(code)
