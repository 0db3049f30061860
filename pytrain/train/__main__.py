"""`python -m pytrain.train`: see pytrain/train/cli.py."""

import sys

from pytrain.train.cli import main

sys.exit(main())
