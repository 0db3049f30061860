"""Which datasets a run reads: the training source (or a mixture's sources with their
weights) and the validation sets, by name, from the `[data]` section, each checked to be
a dataset; and the training loader over them."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from pytrain.config import ConfigError, DataConfig, dataset_dir, location_name
from pytrain.data.loader import TokenLoader
from pytrain.train import distributed
from pytrain.train.distributed import DistInfo


@dataclass
class Sources:
    train: dict[str, Path | str]
    val: dict[str, Path | str]
    weights: dict[str, float] | None = None
    """A mixture's shares of tokens; None for one dataset."""

    @property
    def train_path(self) -> Path | str:
        """The first training source (its tokenizer.json and prompts serve the report)."""
        return next(iter(self.train.values()))

    @property
    def val_path(self) -> Path | str | None:
        return next(iter(self.val.values()), None)


def resolve(d: DataConfig) -> Sources:
    if d.mix and d.path:
        raise ConfigError("set --data.path or --data.mix, not both")
    weights = None
    if d.mix:
        paths, weights = d.mixture()
        train = {n: dataset_dir(p, f"--data.mix {n}") for n, p in paths.items()}
    elif d.path:
        train = {location_name(d.path): dataset_dir(d.path, "--data.path")}
    else:
        raise ConfigError(
            "no training dataset: set --data.path or --data.mix (python -m pytrain.train builds the embedded default)"
        )

    def flag(name: str) -> str:
        return f"--data.val_mix {name}" if d.val_mix else "--data.val_path"

    val = {n: dataset_dir(p, flag(n)) for n, p in d.val_sources().items()}
    same_tokenizer(
        [(f"--data.mix {n}" if d.mix else "--data.path", p) for n, p in train.items()]
        + [(flag(n), p) for n, p in val.items()]
    )
    return Sources(train, val, weights)


def same_tokenizer(sets: list[tuple[str, Path | str]]) -> None:
    """Every dataset of `sets` ((flag, path) each) was packed with the first one's tokenizer,
    by its manifest's vocabulary and settings hash: a mixture's sources and the validation
    sets hold ids that must mean the same tokens (a validation set packed with another
    tokenizer gave a loss with no meaning). Raises ConfigError naming both otherwise."""
    from pytrain.data.shards import manifest_tokenizer

    def described(t: dict) -> str:
        return (f"{t.get('name')}: vocabulary {t.get('vocab_size')}, settings hash "
                f"{(t.get('sha256') or 'none')[:12]}")  # fmt: skip

    def key(t: dict) -> tuple:
        return t.get("vocab_size"), t.get("sha256")

    (flag0, path0), *rest = sets
    if (t0 := manifest_tokenizer(path0)) is None:
        return
    for flag, path in rest:
        if (t := manifest_tokenizer(path)) is not None and key(t) != key(t0):
            raise ConfigError(
                f"{flag} {path} was packed with another tokenizer than {flag0} {path0} "
                f"({described(t)}; against {described(t0)}): its ids would mean other "
                "tokens; pack it with the same tokenizer.json"
            )


def train_loader(d: DataConfig, s: Sources, grad_accum: int, dist: DistInfo) -> TokenLoader:
    """This rank's part of the endless shuffled stream; a mixture's stage at step S starts
    at global batch S x grad_accum x world size."""
    if s.weights is None:
        return TokenLoader(s.train_path, d, rank=dist.rank, world_size=dist.world_size)
    stages = [(step * grad_accum * dist.world_size, w) for step, w in d.stage_list()]
    try:
        return TokenLoader(
            s.train, d, weights=s.weights, stages=stages, rank=dist.rank, world_size=dist.world_size
        )
    except ValueError as e:  # sources the loader cannot mix (e.g. 2- and 4-byte tokens)
        raise ConfigError(f"--data.mix: {str(e).removeprefix('invalid argument: ')}") from None


def keep_tokenizer(run_dir: Path, train: Path | str) -> None:
    """Copies the training dataset's tokenizer.json into the run directory (where one is
    there): samples, `pytrain.sample` and export then need no access to the dataset, which
    may be in object storage or moved."""
    from pytrain import _loader

    data = _loader.read_file(str(train), "tokenizer.json")
    if data is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "tokenizer.json.tmp"
        tmp.write_bytes(data)
        tmp.replace(run_dir / "tokenizer.json")


def check_same_data(loader: TokenLoader, s: Sources, dist: DistInfo) -> None:
    """Every rank reads the same datasets: each node may have its own copy under its own
    path (a local disk per node), but their contents, by the manifests' hashes, must be
    one. Raises ConfigError on every rank, naming the first rank and path that differ
    from rank 0's."""
    if not dist.enabled:
        return
    hashes = [src["manifest_hash"] for src in loader.state_dict()["sources"]]
    mine = {"hashes": hashes, "paths": [str(p) for p in s.train.values()],
            "host": socket.gethostname()}  # fmt: skip
    ranks = distributed.gather_objects(mine, dist)
    for rank, theirs in enumerate(ranks):
        if theirs["hashes"] != ranks[0]["hashes"]:
            raise ConfigError(
                f"rank {rank} on {theirs['host']} reads {', '.join(theirs['paths'])}, whose "
                f"content (manifest hash {', '.join(theirs['hashes'])}) differs from rank 0's "
                f"{', '.join(ranks[0]['paths'])} on {ranks[0]['host']} "
                f"({', '.join(ranks[0]['hashes'])}): every node must read the same dataset"
            )
