"""A trained model from where a run left it: a run directory (its newest valid
checkpoint), a checkpoint file, or a Hugging Face directory (written by pytrain.export, or
a Llama checkpoint from elsewhere: config.json and safetensors, one file or sharded); with
the training configuration and the dataset's tokenizer when there are any."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pytrain.config import REMOTE_SCHEMES, ConfigError, DataConfig, missing_model
from pytrain.model import families
from pytrain.model.config import ModelConfig
from pytrain.model.gpt import GPT
from pytrain.model.hf import NotExportable, strip_prefixes

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
"""A Hugging Face directory's weights: one file, or the index of its shards."""


@dataclass
class Loaded:
    gpt: GPT
    config: dict | None
    """The training configuration (TrainConfig as a dict); None for a Hugging Face dir."""
    tokenizer: Path | None
    """tokenizer.json of the training data (or of the exported directory)."""
    eos_id: int | None
    step: int | None
    source: Path


def load(path: str | Path, device: str | torch.device = "cpu") -> Loaded:
    if missing := missing_model(path):
        raise ConfigError(missing)
    p = Path(path)
    if (p / "config.json").is_file():
        return _load_hf(p, device)
    if p.is_dir() and not (p / "state.pt").is_file():  # a run directory (not one checkpoint's)
        from pytrain.train.checkpoint import load_latest

        found = load_latest(p)
        if found is None:
            raise ConfigError(f"{path}: no checkpoint (ckpt-*.pt) and no exported model in it")
        state, p = found
    elif p.is_file() or (p / "state.pt").is_file():  # a file, or a sharded checkpoint's directory
        from pytrain.train.checkpoint import UnsafeCheckpoint, read

        try:
            state = read(p)
        except UnsafeCheckpoint:
            raise
        except Exception as e:
            raise ConfigError(f"{path}: not a checkpoint ({type(e).__name__}: {e})") from None
    else:
        raise ConfigError(f"{path}: neither a file nor a directory")
    if (
        not isinstance(state, dict)
        or not ("model" in state or "sharded" in state)
        or "config" not in state
    ):
        raise ConfigError(f"{path}: not a pytrain checkpoint (no model and config in it)")
    cfg = ModelConfig.from_saved(state["config"]["model"])
    gpt = families.of(cfg).empty(cfg)  # every weight is loaded over it
    if "sharded" in state:  # an FSDP2 run's checkpoint: its shards, read whole here
        from pytrain.train.sharded_checkpoint import load_model

        load_model(state["sharded"], gpt)
    else:
        gpt.load_state_dict(strip_prefixes(state["model"]))
    data = dataset_of(state["config"]["data"])
    eos = None
    if data is not None:  # its manifest only: a remote dataset is not opened shard by shard
        from pytrain.data.shards import read_manifest

        eos = read_manifest(data).get("tokenizer", {}).get("eos_id")
    # The copy the trainer keeps in the run directory (p: the checkpoint, a file or a
    # directory), there even where the dataset is in object storage or gone; else, for a
    # run from before that copy, the local dataset's own.
    kept = [
        p.parent / "tokenizer.json",
        *([data / "tokenizer.json"] if isinstance(data, Path) else []),
    ]
    tok = next((t for t in kept if t.is_file()), None)
    return Loaded(gpt.to(device).eval(), state["config"], tok, eos, state.get("step"), p)


def dataset_of(data: dict) -> Path | str | None:
    """The (first) training dataset of a saved [data] section, if it is still there (an
    object-storage URL is returned as it is, unchecked)."""
    d = DataConfig.from_saved(data)
    path = d.mixture()[0] if d.mix else {"": d.path}
    first = next(iter(path.values()), "")
    if first.startswith(REMOTE_SCHEMES):
        return first
    return Path(first) if first and (Path(first) / "manifest.json").is_file() else None


def hf_weights(p: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor) of a Hugging Face directory. Only safetensors: a
    pytorch_model.bin is a pickle, which can run code as it loads."""
    from safetensors.torch import load_file

    config = json.loads((p / "config.json").read_text())
    if (p / SAFETENSORS[0]).is_file():
        return config, load_file(str(p / SAFETENSORS[0]))
    if not (p / SAFETENSORS[1]).is_file():
        raise ConfigError(
            f"{p}: no {' or '.join(SAFETENSORS)} beside config.json (weights are read from "
            "safetensors only; a .bin file is a pickle, which can run code)"
        )
    shards = sorted(set(json.loads((p / SAFETENSORS[1]).read_text())["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for name in shards:
        if not (p / name).is_file():
            raise ConfigError(f"{p}: {name}, a shard its {SAFETENSORS[1]} names, is missing")
        weights.update(load_file(str(p / name)))
    return config, weights


def hf_model(p: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """(ModelConfig, our state dict, config.json) of a Hugging Face directory; a class or
    setting our GPT does not compute, or a missing tensor, is a ConfigError naming it."""
    config, weights = hf_weights(p)
    try:
        cfg, state = families.from_hf(config, weights)
    except NotExportable as e:
        raise ConfigError(f"{p}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"{p}: no tensor or setting {e} in it") from None
    return cfg, state, config


def _load_hf(p: Path, device) -> Loaded:
    cfg, state, config = hf_model(p)
    gpt = families.of(cfg).empty(cfg)  # every weight is loaded over it
    gpt.load_state_dict(state)
    tok = p / "tokenizer.json"
    return Loaded(gpt.to(device).eval(), None, tok if tok.is_file() else None,
                  config.get("eos_token_id"), None, p)  # fmt: skip
