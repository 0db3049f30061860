"""Type stubs for the Rust extension `pytrain._loader` (built by maturin from rust_loader/)."""

from typing import Any, final

from typing_extensions import Self

from pytrain.config import LoaderConfig

__all__ = [
    "FORMAT_VERSION", "LoaderError", "CorruptShardError", "ManifestError", "StateError", "RemoteError",
    "ShardWriter", "Encoder", "Dataset", "Loader", "ReadyBatch", "write_synthetic",
    "write_manifest", "read_file", "upload_dataset",
]  # fmt: skip

FORMAT_VERSION: int

class LoaderError(Exception):
    """Base class of the loader's errors."""

class CorruptShardError(LoaderError):
    """A shard's bytes disagree with its checksums or index (names shard and frame)."""

class ManifestError(LoaderError):
    """manifest.json is missing fields, malformed, or disagrees with the shards."""

class StateError(LoaderError):
    """A saved loader state does not fit this dataset or configuration."""

class RemoteError(LoaderError):
    """An object in object storage could not be read (after the store's retries), or is not there."""

@final
class ShardWriter:
    def __new__(cls, path: str, dtype: str, frame_bytes: int = ..., level: int = ...) -> Self: ...
    def add_documents(self, tokens: bytes, lengths: bytes) -> None:
        """tokens: little-endian uint32 ids of all documents back to back; lengths: uint32."""
    @property
    def bytes_written(self) -> int: ...
    @property
    def documents(self) -> int: ...
    def finish(self) -> dict[str, Any]:
        """Writes index and footer; returns documents, tokens, frames, bytes, xxh3_64."""

@final
class Encoder:
    def __new__(
        cls, tokenizer_json: str, eos: int | None = None, bos: int | None = None
    ) -> Self: ...
    def encode(self, texts: list[str]) -> tuple[bytes, bytes, int, int]:
        """(ids, lengths, empty, text_bytes): little-endian uint32 ids back to back (with
        eos/bos), their lengths, how many texts encoded to no tokens (left out), and the
        UTF-8 bytes of all texts."""

@final
class Dataset:
    def __new__(cls, path: str, cache_dir: str | None = None, cache_gb: float = 0.0) -> Self:
        """`cache_dir`, `cache_gb`: a bounded local cache of a remote dataset's frames."""
    @property
    def n_docs(self) -> int: ...
    @property
    def n_tokens(self) -> int: ...
    @property
    def n_frames(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def manifest_hash(self) -> str: ...
    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size recorded in the manifest."""
    @property
    def eos_id(self) -> int | None:
        """The end-of-document id pack-shards added, if any."""
    def doc_lengths(self) -> bytes: ...
    def verify(self) -> None: ...
    def frame_location(self, frame: int) -> tuple[str, int, int, int]:
        """(shard file, byte offset, compressed length, tokens) of a global frame."""
    def read_frame(self, frame: int) -> tuple[bytes, list[int]]:
        """Decoded tokens (dataset dtype, little-endian) and document lengths of a frame."""

@final
class ReadyBatch:
    """A batch the loader has filled (fields as named; read-only)."""

    @property
    def slot(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def width(self) -> int:
        """Tokens per row (sequence length + 1)."""
    @property
    def epoch(self) -> int: ...
    @property
    def doc_tokens(self) -> int: ...
    @property
    def pad_tokens(self) -> int: ...
    @property
    def pieces(self) -> int: ...
    @property
    def source_tokens(self) -> list[int]:
        """Documents' tokens in the batch by source."""

@final
class Loader:
    def __new__(
        cls,
        datasets: list[Dataset],
        slots: list[tuple[Any, Any]],
        config: LoaderConfig,
        *,
        schedule: list[tuple[int, list[float]]] | None = None,
        state: dict[str, Any] | None = None,
    ) -> Self:
        """`config`: pytrain.config.LoaderConfig, read by attribute name. `datasets`: one,
        or a mixture's sources; `schedule`: (first global item, weight per source) per stage."""
    def shutdown(self) -> None:
        """Stops the threads and waits for them, without the GIL."""
    def next(self) -> ReadyBatch | None:
        """The next filled slot, or None after the last epoch. Slots are (tokens, doc_ids)
        CPU tensors: tokens of the dataset's width (uint16 or int32), doc_ids int32."""
    def release(self, slot: int) -> None: ...
    def state(self) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def blocks_per_epoch(self) -> list[int]: ...

def read_file(location: str, name: str) -> bytes | None:
    """File `name` of the dataset directory `location` (a local path or an s3:// URL), or
    None where it has none."""

def upload_dataset(path: str, location: str) -> None:
    """Uploads the dataset directory `path` to the object-storage directory `location`,
    the manifest last."""

def write_manifest(path: str, fields: str) -> None:
    """Writes manifest.json (the format's one writer: format, version, totals set there)."""

def write_synthetic(
    path: str,
    documents: int,
    *,
    mu: float = ...,
    sigma: float = ...,
    max_len: int = ...,
    vocab: int = ...,
    traceable: bool = ...,
    frame_bytes: int = ...,
    docs_per_shard: int = ...,
    seed: int = ...,
    level: int = ...,
) -> int:
    """Writes a synthetic dataset (log-normal lengths, Zipf ids); returns its token count."""
