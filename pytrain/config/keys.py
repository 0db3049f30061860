"""The settings by dotted key ('optim.lr', 'data.mode'): the fields of TrainConfig and its
sections flattened, their base types, and reading and setting one by its key. Shared by
the flags, the TOML presets and the checks."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field


def not_a_flag(default=dataclasses.MISSING, **kw):
    """A loader setting the trainer sets itself (rank, world size, ...): no flag, no TOML key
    (flatten leaves it out)."""
    return field(default=default, metadata={"flag": False}, **kw)


def flatten(cls, prefix: str = "") -> list[tuple[str, dataclasses.Field, type]]:
    """(dotted key, field, type) of every setting of `cls` that has a flag, its sections'
    fields under their section's name."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if f.metadata.get("flag", True) is False:
            continue
        if dataclasses.is_dataclass(t):
            out += flatten(t, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, t))
    return out


def base_type(t):
    """bool | None -> (bool, True); list[int] -> (list, int)."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0], True
    if origin is list:
        return list, typing.get_args(t)[0]
    return t, False


def owner(cfg, key: str) -> tuple[object, str]:
    """The section a dotted key lives in, and its last part ('data.mode': cfg.data, 'mode')."""
    obj = cfg
    *path, last = key.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj, last


def set_key(cfg, key: str, value) -> None:
    """Sets the setting `key` of `cfg`; KeyError for a key it does not have."""
    obj, last = owner(cfg, key)
    if not hasattr(obj, last):
        raise KeyError(key)
    setattr(obj, last, value)
