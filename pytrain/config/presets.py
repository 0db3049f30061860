"""TOML presets (configs/*.toml): every key set on a TrainConfig, [model], [data], ...
tables mapping to its sections."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]

from pytrain.config.errors import ConfigError
from pytrain.config.keys import base_type, flatten, set_key
from pytrain.config.sections import TrainConfig


def apply_toml(cfg: TrainConfig, path: Path) -> None:
    """Sets every key of a TOML file ([model], [data], ... tables map to the sections)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    known = {k: t for k, _, t in flatten(TrainConfig)}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = prefix + k
            if key == "data.mix" and isinstance(v, dict):  # [data.mix.NAME] path, weight
                v = [f"{n}={t.get('path', '')}:{t.get('weight', '')}" for n, t in v.items()]
            if key == "data.val_mix" and isinstance(v, dict):  # [data.val_mix] NAME = PATH
                v = [f"{n}={p}" for n, p in v.items()]
            if isinstance(v, dict):
                walk(v, key + ".")
                continue
            if key not in known:
                raise ConfigError(
                    f"{path}: unknown setting {key!r} (python -m pytrain.train --help lists them)"
                )
            base, _ = base_type(known[key])
            if base is bool and not isinstance(v, bool):
                raise ConfigError(f"{path}: {key} must be true or false, not {v!r}")
            set_key(cfg, key, float(v) if base is float and isinstance(v, int) else v)

    walk(data, "")
