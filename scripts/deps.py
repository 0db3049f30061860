"""Prints the dependencies listed in pyproject.toml, for `make setup`.

python scripts/deps.py runtime dev   ->  one requirement per word, shell-quoted
"""

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
groups = sys.argv[1:] or ["runtime"]
reqs = []
for g in groups:
    reqs += project["dependencies"] if g == "runtime" else project["optional-dependencies"][g]
print("\n".join(reqs))
