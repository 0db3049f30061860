"""The error of a setting the user gave: the command line prints it as one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting the user gave is wrong (unknown key, bad value, missing file or dataset):
    the command line prints it as one line, without a traceback."""
