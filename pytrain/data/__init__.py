"""Raw text to token shards (inputs, tokenizer, shards, corpus, pretokenized: what
`pack-shards` runs), and token shards to batches on the device (loader, batch).

`from pytrain.data import TokenLoader` is the loader's public name; it is resolved on
first use so that `pack-shards`, which never loads batches, does not import torch."""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "TokenLoader": "pytrain.data.loader",
    "HostBatch": "pytrain.data.batch",
    "DeviceBatch": "pytrain.data.batch",
    "DeviceFeed": "pytrain.data.batch",
    "position_ids": "pytrain.data.batch",
    "loss_mask": "pytrain.data.batch",
    "token_ids": "pytrain.data.batch",
    "cu_seqlens": "pytrain.data.batch",
    "LoaderConfig": "pytrain.config",
    "LoaderError": "pytrain._loader",
    "CorruptShardError": "pytrain._loader",
    "ManifestError": "pytrain._loader",
    "StateError": "pytrain._loader",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pytrain.data' has no attribute {name!r}")
