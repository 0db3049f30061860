"""The loader's settings (LoaderConfig), the trainer's [data] section (DataConfig) and
where a dataset is: a local directory or an object-storage URL."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pytrain.config.errors import ConfigError
from pytrain.config.keys import not_a_flag


@dataclass
class LoaderConfig:
    """How batches are cut: the one definition of the loader's settings and their
    defaults (`TokenLoader`, the Rust loader and the trainer's `[data]` section all read
    this). Everything but `threads`, `prefetch_blocks`, `slots`, `pin_memory` and the cache
    changes the batches and is checked against a saved state."""

    mode: str = "pack"
    """'pack': rows of seq_len+1 tokens filled with whole documents (cut only when longer
    than a row). 'bucket': one document per row, rows grouped by length bucket."""
    seq_len: int = 256
    batch_size: int = 16
    """Rows per micro-batch (pack mode)."""
    strategy: str = "best_fit"
    """Packing: 'best_fit' (best-fit decreasing) or 'concat' (concatenate and split)."""
    bucket_lengths: list[int] = field(default_factory=lambda: [64, 128, 256])
    token_budget: int = 4096
    """Bucket mode: tokens per batch; a batch of bucket L has token_budget // L rows."""
    seed: int = 1234
    shuffle: bool = True
    frames_per_block: int = 4
    """Frames whose documents are shuffled and packed together (memory ~ 2 MiB each)."""
    threads: int = 2
    prefetch_blocks: int = 0
    """Blocks decoded ahead; 0 means 2 per thread."""
    slots: int = 4
    """Batches buffered ahead of the consumer."""
    cache_dir: str = ""
    """A dataset in object storage (s3://): keep the frames it reads under this directory
    (one subdirectory per dataset, by its manifest's hash), so later epochs, restarts and
    the node's other ranks read them from local disk. Empty: no cache."""
    cache_gb: float = 20.0
    """The cache's bound in GB (per process); least recently used frames go first."""
    skip_corrupt: bool = False
    """Leave out frames that fail their checksum (counted in stats()["frames_skipped"])
    instead of raising CorruptShardError."""
    num_epochs: int | None = not_a_flag(None)
    """Stop after this many epochs; None streams epoch after epoch."""
    pin_memory: bool | None = not_a_flag(None)
    """None: pin when CUDA is available."""
    rank: int = not_a_flag(0)
    world_size: int = not_a_flag(1)

    def batch_settings(self) -> dict:
        """The settings that decide the stream of rows (or bucket batches), by name: what a
        saved loader state is checked against (the Rust loader's fingerprint of the same
        fields). Not batch_size in pack mode: a state is a row boundary, and any number
        of rows a batch continues from it, as any world size does."""
        common = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "frames_per_block": self.frames_per_block,
        }
        if self.mode == "pack":
            return {"mode": "pack", "seq_len": self.seq_len, "strategy": self.strategy,
                    **common}  # fmt: skip
        return {"mode": self.mode, "token_budget": self.token_budget,
                "bucket_lengths": list(self.bucket_lengths), **common}  # fmt: skip

    def batch_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, seq_len) a batch can have: one in pack mode, one per bucket (a
        batch of bucket L has max(1, token_budget // L) rows of L + 1 tokens)."""
        if self.mode == "pack":
            return [(self.batch_size, self.seq_len)]
        return [(max(1, self.token_budget // n), n) for n in sorted(self.bucket_lengths)]


@dataclass
class DataConfig(LoaderConfig):
    """The trainer's `[data]` section: the datasets, and the loader settings."""

    path: str = ""
    """Training dataset directory; empty builds (once) and uses the embedded default."""
    val_path: str = ""
    """Validation dataset directory (the embedded default has its own held-out split)."""
    mix: list[str] = field(default_factory=list)
    """A mixture instead of `path`: NAME=PATH:WEIGHT per source, weights = shares of tokens
    (TOML: a [data.mix.NAME] table with path and weight)."""
    stages: list[str] = field(default_factory=list)
    """Mixture weights from a step on: STEP:NAME=W,NAME=W (sources left out get 0)."""
    val_mix: list[str] = field(default_factory=list)
    """Validation sets by source, NAME=PATH: a loss per source, and their token-weighted mean
    (TOML: a [data.val_mix] table of NAME = PATH)."""

    @classmethod
    def from_saved(cls, data: dict) -> DataConfig:
        """A [data] section as a checkpoint saved it (keys this version lacks are dropped)."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def mixture(self) -> tuple[dict[str, str], dict[str, float]]:
        """(paths, weights) by source name from `mix`."""
        paths, weights = {}, {}
        for item in self.mix:
            name, eq, rest = item.partition("=")
            path, colon, w = rest.rpartition(":")
            try:
                weight = float(w)
            except ValueError:
                weight = -1.0
            if not (eq and colon and name and path) or weight < 0 or name in paths:
                raise ConfigError(
                    f"--data.mix {item!r}: expected NAME=PATH:WEIGHT (a non-negative weight, each name once)"
                )
            paths[name], weights[name] = path, weight
        return paths, weights

    def stage_list(self) -> list[tuple[int, dict[str, float]]]:
        """(step, weights) per entry of `stages`, in step order."""
        out = []
        for item in self.stages:
            step, colon, rest = item.partition(":")
            try:
                pairs = [p.split("=") for p in rest.split(",")]
                out.append((int(step), {n.strip(): float(w) for n, w in pairs}))
            except ValueError:
                raise ConfigError(
                    f"--data.stages {item!r}: expected STEP:NAME=WEIGHT,NAME=WEIGHT"
                ) from None
        return sorted(out, key=lambda s: s[0])

    def val_sources(self) -> dict[str, str]:
        """Validation sets by name: `val_mix`, else `val_path` alone (named 'val')."""
        out = {}
        for item in self.val_mix:
            name, eq, path = item.partition("=")
            if not (eq and name and path) or name in out:
                raise ConfigError(f"--data.val_mix {item!r}: expected NAME=PATH, each name once")
            out[name] = path
        if not out and self.val_path:
            out["val"] = self.val_path
        return out


REMOTE_SCHEMES = ("s3://", "s3a://")
"""Datasets read from object storage by the extension (rust_loader/storage.rs)."""


def location(p: str | Path) -> str | Path:
    """A local dataset directory as a Path; an object-storage URL as the string it is (a
    Path would fold its '//')."""
    return p if isinstance(p, str) and p.startswith(REMOTE_SCHEMES) else Path(p)


def location_name(p: str | Path) -> str:
    """The last component of a directory or URL: a single source's name."""
    return str(p).rstrip("/").rsplit("/", 1)[-1]


def missing_model(path: str | Path) -> str:
    """Why `path`, given to eval, sample or export as a run directory, a checkpoint or an
    exported directory, cannot be one ('' where it exists). torch-free, so that a mistyped
    path's line comes before the seconds torch takes to load."""
    return "" if Path(path).exists() else f"{path}: no such file or directory"


def dataset_dir(path: str, flag: str) -> Path | str:
    """`path` if it is a dataset made by pack-shards, else a ConfigError naming it. An
    object-storage URL (s3://) is kept as given; opening it checks it (one line naming the
    object that cannot be read)."""
    if path.startswith(REMOTE_SCHEMES):
        return path
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory")
    if not (p / "manifest.json").is_file():
        raise ConfigError(
            f"{flag} {path}: not a dataset made by pack-shards (no manifest.json in it)"
        )
    return p
