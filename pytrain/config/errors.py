"""The error of a setting the user gave: the command line prints it as one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting the user gave is wrong (unknown key, bad value, missing file or dataset):
    the command line prints it as one line, without a traceback."""


def first_line(e: BaseException) -> str:
    """The first line of another library's error (many carry a traceback or a hint after it),
    for a line of our own that quotes it."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
