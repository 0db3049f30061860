"""Checkpoints of FSDP2 runs, sharded: every rank writes its own shards of the model and
optimizer state through `torch.distributed.checkpoint` (DCP), and no rank ever gathers the
whole state (a 1B-8B model's full state does not fit one rank's memory). Loading reshards:
a checkpoint saved by N ranks loads on M ranks, or in one process (pytrain.sample, eval,
export), because DCP reads each tensor's chunks into whatever layout the reader asks for.

A checkpoint is a directory `ckpt-<step>/`: DCP's files (`.metadata`, `__<rank>_<i>.distcp`)
holding tensors only, and `state.pt`, written by rank 0, holding everything else of the run
(step, loader position, RNG states per rank, configuration, the optimizer's param groups),
read like every checkpoint file with the weights-only unpickler. It is written under a
temporary name and renamed into place once complete, as single-file checkpoints are; with
ckpt_async (the default) in the background, as single-file checkpoints are (`ShardedWriter`).

Loading never runs code: DCP reads `.metadata` with Python's pickle, so `safe_reader` reads it
with an unpickler that rebuilds DCP's metadata classes, torch sizes, dtypes and layouts, and
paths, and refuses anything else; entries stored as pickled bytes (DCP's way for non-tensor
values, which these checkpoints never hold) are refused too."""

from __future__ import annotations

import functools
import math
import os
import pickle
import re
import shutil
import time
import warnings
import weakref
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from pytrain.config import ConfigError
from pytrain.train import checkpoint, disk

STATE = checkpoint.SHARDED_STATE
UNFINISHED = re.compile(r"^\.ckpt-\d{8}\.tmp$")
"""The temporary directory of a write (`_start`): `.ckpt-<step>.tmp`, renamed once complete."""
WRITER_THREADS = 4
"""DCP's writer threads, each writing a file of every rank's shards (`__<rank>_<i>.distcp`).
The GPT-2 preset's 1.64 GB of state saved in 1.91 s with 4 against 4.37 s with 1 (CPU box,
`python benchmarks/checkpoint.py --device cpu --saves 2`; BENCHMARKS.md); serializing
each tensor and writing it, one after another, was the time."""


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes and the few torch and pathlib types they hold; nothing else.
    Only classes defined in DCP's metadata module (dataclasses and enums, whose rebuilding
    runs no code of the file's choosing), never a function or a name those modules import."""

    def find_class(self, module: str, name: str):
        found = None
        if module == "torch.distributed.checkpoint.metadata":
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if not (isinstance(found, type) and found.__module__ == module):
                found = None
        elif (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            from torch.distributed.checkpoint.filesystem import _StorageInfo

            found = _StorageInfo
        elif module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            found = getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            found = torch.serialization._get_layout
        elif module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath"):
            found = getattr(__import__("pathlib"), name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found


def _dcp():
    """torch.distributed.checkpoint, imported where a sharded checkpoint is written or read:
    at import it costs a trainer process over half a second, which runs without FSDP2 never
    need."""
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _safe_reader_class() -> type:
    """DCP's file reader with `.metadata` read by _MetadataUnpickler (defined on first use,
    as DCP is imported then)."""

    class SafeReader(_dcp().FileSystemReader):  # type: ignore[misc]  # a base known at run time
        """DCP's file reader with `.metadata` read by _MetadataUnpickler."""

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise UnsafeShards(
                    f"{path}: refused to load: it holds {e}, which unpickling would call; a "
                    "pytrain checkpoint holds tensors and plain values only (nothing was run)"
                ) from None
            pickled = [
                k
                for k, v in metadata.state_dict_metadata.items()
                if isinstance(v, BytesStorageMetadata)
            ]
            if pickled:
                raise UnsafeShards(
                    f"{path}: refused to load: {pickled[0]} is stored as pickled bytes, which "
                    "loading would unpickle; a pytrain checkpoint holds tensors only there"
                )
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def safe_reader(path: Path):
    """A reader of the sharded checkpoint at `path` that never unpickles code."""
    return _safe_reader_class()(str(path))


class UnsafeShards(ConfigError):
    """A sharded checkpoint whose metadata would run code or unpickle objects."""


def _tensors_only(tree, where: str):
    """`tree` with every leaf a tensor, else a clear error (DCP would pickle the leaf)."""
    if isinstance(tree, dict):
        return {k: _tensors_only(v, f"{where}.{k}") for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return tree
    raise ValueError(f"{where} is a {type(tree).__name__}: sharded checkpoints hold tensors only")


def save(run_dir: Path, step: int, model, optimizer, rest: dict, is_main: bool, barrier,
         threads: int = WRITER_THREADS) -> Path:  # fmt: skip
    """Writes ckpt-<step>/ from every rank (a collective): each rank's shards of the model and
    the optimizer state, and rank 0's `rest` as state.pt. Returns the final path. `threads`:
    DCP's writer threads, a file each per rank (benchmarks/checkpoint.py compares 1)."""
    tensors, extra = _prepare(model, optimizer, rest)
    final, tmp = _start(run_dir, step, is_main, barrier)
    try:
        writer = _dcp().FileSystemWriter(str(tmp), sync_files=True, thread_count=threads)
        _dcp().save(tensors, storage_writer=writer)
        if is_main:
            _finish(run_dir, tmp, final, extra)
    except BaseException as e:
        raise _failed(e, tmp, final, is_main) from None
    barrier()
    return final


class HostCopies:
    """Host memory for one rank's checkpoint tensors, kept from save to save: one buffer,
    each tensor a view of it at an aligned offset, pinned on a GPU host by registering the
    buffer with CUDA. Not a pinned tensor each: torch's pinned allocator rounds every
    allocation up to a power of two, up to twice the memory (the 8B: 22 GB a rank)."""

    ALIGN = 4096
    """Bytes: every tensor starts on a page of its own (the buffer starts on a page too), so
    that the buffer can be registered with CUDA in pieces that meet at tensors' starts."""
    CHUNK = 1 << 30
    """Bytes a registration covers at most, unless one tensor alone is larger."""

    def __init__(self, layout: dict[tuple, tuple[int, torch.dtype, tuple]], pin: bool) -> None:
        self.layout = layout
        """Each tensor's (offset, dtype, shape), by its path in the state (`layout_of`)."""
        size = max(1, max((o + _nbytes(d, s) for o, d, s in layout.values()), default=0))
        raw = torch.empty(size + self.ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % self.ALIGN  # the allocator aligns to 64 bytes, not a page
        self.buffer = raw[skip : skip + size]
        self.pinned = False
        if pin:
            self.pinned = self._register()

    def _register(self) -> bool:
        """Pins the buffer by registering it with CUDA; False (and nothing registered) where
        CUDA refuses. Made in a background thread beside training: the pages are written
        first (the kernel zero-fills them outside CUDA's call), then registered in pieces
        of at most CHUNK bytes. Why: at 8B (22 GB a rank) the step during which one call
        registered the whole buffer took 12-26 s where 1.6 s is usual; the suspected cause
        is the call holding the driver while the loop's own CUDA calls wait (not yet
        measured with the pieces). Each tensor lies within one piece, so that every copy
        into it is a copy into one pinned range, and no two pieces share a page."""
        self.buffer.zero_()
        cudart = torch.cuda.cudart()
        base, done = self.buffer.data_ptr(), list[int]()
        for start, stop in self.pieces(self.layout, self.buffer.numel(), self.CHUNK):
            if int(cudart.cudaHostRegister(base + start, stop - start, 0)) != 0:
                for ptr in done:
                    cudart.cudaHostUnregister(ptr)
                return False
            done.append(base + start)
        # Unregistered before the memory is freed (the finalizer holds the buffer).
        weakref.finalize(self, _unregister, self.buffer, done)
        return True

    @staticmethod
    def pieces(layout: dict, size: int, chunk: int) -> list[tuple[int, int]]:
        """[start, stop) byte ranges that cover [0, size) in order, each at most `chunk`
        bytes unless one tensor alone is larger, meeting only at tensors' starts."""
        bounds, start = [], 0
        for offset, end in sorted((o, o + _nbytes(d, s)) for o, d, s in layout.values()):
            if end - start > chunk and offset > start:  # a new piece from this tensor on
                bounds.append((start, offset))
                start = offset
        return [(a, b) for a, b in [*bounds, (start, size)] if b > a]

    @classmethod
    def layout_of(cls, tensors: dict) -> dict[tuple, tuple[int, torch.dtype, tuple]]:
        """Where each of this rank's tensors of the state goes in the buffer."""
        layout, offset = {}, 0
        for path, t in _leaves(tensors):
            local = _local(t)
            layout[path] = (offset, local.dtype, tuple(local.shape))
            offset += -(-_nbytes(local.dtype, local.shape) // cls.ALIGN) * cls.ALIGN
        return layout

    def copy(self, tensors: dict) -> dict:
        """`tensors` with each replaced by its copy here (DTensors keep their placement, as
        DCP's own staging keeps it): queued on the current stream where the buffer is
        pinned and the tensor on a GPU, else done before returning."""
        out: dict = {}
        for path, t in _leaves(tensors):
            offset, dtype, shape = self.layout[path]
            local = _local(t).detach()
            host = self.buffer[offset : offset + _nbytes(dtype, shape)].view(dtype).view(shape)
            queued = self.pinned and local.is_cuda
            host.copy_(local, non_blocking=queued)
            if queued:  # a temporary of get_state_dict stays allocated until copied
                local.record_stream(torch.cuda.current_stream())
            if hasattr(t, "to_local"):
                from torch.distributed.tensor import DTensor

                # DTensor.from_local would move the host copy back to the mesh's device.
                host = DTensor(host, t._spec, requires_grad=False)
            node = out
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = host
        return out


def _unregister(buffer: torch.Tensor, pieces: list[int]) -> None:
    """Unregisters the pieces of `buffer` (their start addresses); the buffer is an argument
    only to be kept alive until then."""
    cudart = torch.cuda.cudart()
    for ptr in pieces:
        cudart.cudaHostUnregister(ptr)


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


def _leaves(tree: dict, path: tuple = ()):
    """(path, tensor) of every tensor of a nested dict of tensors, in order."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*path, k))
        else:
            yield (*path, k), v


def _local(t) -> torch.Tensor:
    """This rank's part of a tensor of the state (a DTensor's shard, or a plain tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


class ShardedWriter(checkpoint.BackgroundWrite):
    """Sharded checkpoints written in the background (ckpt_async, as single-file ones are).

    `submit` queues copies of this rank's shards into host memory (`HostCopies`, kept from
    save to save) on a stream of their own and returns; the training loop goes on, and
    the optimizer's next update waits on the device for the copies to have read the
    weights and moments it overwrites (`before_update`, the trainer's OptimizerStep calls
    it). A thread then writes the copies through DCP, whose collectives run on a gloo group
    of their own (never interleaved with training's), and rank 0 writes state.pt and
    renames the directory into place. DCP reports a failure of any rank to every rank, so
    `wait` (before the next save, at a stop, at the end) raises it on every rank alike.

    The host memory (the 8B: 22 GB a rank, pinned: tens of seconds to allocate) is made in
    the background once the optimizer has its state (`before_update`), long before the
    first save of a run that saves every few hundred steps."""

    def __init__(self, model=None, optimizer=None) -> None:
        super().__init__()
        self._state = (model, optimizer)  # whose host memory is made ahead (None: at a save)
        # The gloo group of DCP's collectives. Made here where the process group is up (every
        # rank makes its writer at the same point of its set-up), else at the first save,
        # which then waits for every rank to have reached it, in the loop's time.
        self._group: Any = _gloo_group()
        self._host: HostCopies | None = None
        self._making: checkpoint.BackgroundWrite | None = None  # making self._host ahead
        self._stream: Any = None  # the copies' CUDA stream
        self._copied: Any = None  # the event the next update waits for
        self.phases: dict[str, float] = {}
        """Seconds the last `submit` held the loop, by phase: `previous` (the write before
        it, and the gloo group where it was not made with the writer), `state_dict`
        (get_state_dict), `start` (a barrier, the temporary directory), `host_memory`
        (waiting for the host memory made ahead, or making it), `copy` (queuing the copies
        into it)."""

    def before_update(self) -> None:
        """Called before each optimizer update: the device waits for the last save's copies
        to be done reading the tensors the update overwrites (the loop does not wait); and
        once the optimizer has its state, the host memory of the saves is made in the
        background."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None
        model, optimizer = self._state
        if model is None or self._host is not None or self._making is not None:
            return
        if not getattr(optimizer, "state", None):
            return  # get_state_dict would make the state by an update of its own
        layout = HostCopies.layout_of(_prepare(model, optimizer, {})[0])

        def make() -> None:  # an error is raised in the training thread at the next save
            self._host = HostCopies(layout, pin=torch.cuda.is_available())

        self._making = checkpoint.BackgroundWrite()
        self._making.start(make, "ckpt-host-memory")

    def host_memory(self) -> HostCopies | None:
        """The host memory of the saves, waiting for it where it is being made ahead."""
        if self._making is not None:
            making, self._making = self._making, None
            making.wait()
        return self._host

    def copies_done(self) -> None:
        """Blocks until the last save's copies into host memory are done."""
        if self._copied is not None:
            self._copied.synchronize()

    def _host_for(self, tensors: dict) -> HostCopies:
        """The host memory made ahead, or made now where there is none or the state's
        layout changed."""
        self.host_memory()
        layout = HostCopies.layout_of(tensors)
        if self._host is None or self._host.layout != layout:
            self._host = None  # its memory is freed before the new one is taken
            self._host = HostCopies(layout, pin=torch.cuda.is_available())
        return self._host

    def submit(self, run_dir: Path, step: int, model, optimizer, rest: dict, is_main: bool,
               barrier, keep: int) -> Path:  # fmt: skip
        clock = [time.perf_counter()]  # the start, then each phase's end (self.phases)
        self.wait()  # one write at a time: the host memory is about to be reused
        if self._group is None:  # every rank saves at the same step: a collective is safe here
            self._group = _gloo_group()
        clock.append(time.perf_counter())
        tensors, extra = _prepare(model, optimizer, rest)
        clock.append(time.perf_counter())
        final, tmp = _start(run_dir, step, is_main, barrier)
        t0 = time.perf_counter()
        clock.append(t0)
        host = self._host_for(tensors)
        clock.append(time.perf_counter())
        copied = None
        if host.pinned:
            # On a stream of their own, after the work queued so far (the last update):
            # the next step's forward and backward run beside them.
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                staged = host.copy(tensors)
                copied = self._copied = torch.cuda.Event()
                copied.record()
        else:
            staged = host.copy(tensors)
        clock.append(time.perf_counter())
        names = ("previous", "state_dict", "start", "host_memory", "copy")
        self.phases = {n: b - a for n, (a, b) in zip(names, pairwise(clock), strict=True)}
        group = self._group

        def finish() -> None:
            try:
                if copied is not None:
                    copied.synchronize()
                writer = _dcp().FileSystemWriter(str(tmp), sync_files=True,
                                                 thread_count=WRITER_THREADS)  # fmt: skip
                _dcp().save(staged, storage_writer=writer, process_group=group)
                if is_main:
                    _finish(run_dir, tmp, final, extra)
                    checkpoint.prune(run_dir, keep)
            except BaseException as e:
                raise _failed(e, tmp, final, is_main) from None
            self.last = (final, time.perf_counter() - t0)

        self.start(finish, "dcp-writer")
        return final


def _gloo_group() -> Any:
    """A new gloo group of every rank (a collective: each rank calls it at the same point),
    or None where no process group is up."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member: never NON_GROUP_MEMBER
    # Every rank has finished connecting before any goes on: a rank that leaves set-up at
    # once after this (a user error every rank finds alike, found first by one) would
    # otherwise close its end under a rank still connecting, which dies with a traceback.
    dist.barrier(group=group)
    return group


def _prepare(model, optimizer, rest: dict) -> tuple[dict, dict]:
    """(the tensors DCP writes, what state.pt holds)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors = {"model": _tensors_only(model_sd, "model"),
               "optimizer": _tensors_only(optim_sd["state"], "optimizer.state")}  # fmt: skip
    return tensors, {**rest, "param_groups": optim_sd["param_groups"], "sharded": True}


def remove_unfinished(run_dir: Path, is_main: bool) -> None:
    """Removes the temporary directories of writes a killed run left in `run_dir` (rank 0,
    holding the run directory's lock: no write of another run can be under way there). Only
    directories named as `_start` names them: nothing else of the run directory."""
    if not is_main or not Path(run_dir).is_dir():
        return
    for p in Path(run_dir).iterdir():
        if UNFINISHED.match(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)  # one that stays is removed at its step's write


def _start(run_dir: Path, step: int, is_main: bool, barrier) -> tuple[Path, Path]:
    """(final path, an empty temporary directory that every rank sees)."""
    final = Path(run_dir) / f"ckpt-{step:08d}"
    tmp = final.with_name(f".{final.name}.tmp")  # UNFINISHED's name
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # an attempt that was killed
        tmp.mkdir(parents=True)
    barrier()
    return final, tmp


def _finish(run_dir: Path, tmp: Path, final: Path, extra: dict) -> None:
    """Rank 0, once every rank's shards and DCP's metadata are written: state.pt, then the
    directory renamed into place."""
    with open(tmp / STATE, "wb") as f:
        torch.save(extra, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    checkpoint.fsync_dir(Path(run_dir))


def _failed(e: BaseException, tmp: Path, final: Path, is_main: bool) -> BaseException:
    """The error to raise for a failed write: a full disk becomes disk.DiskFull (one line,
    exit 4), its temporary directory removed; anything else is raised as it is."""
    if (full := disk.full_disk_error(e)) is None:
        return e
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    return checkpoint.not_written(final, f"writing {full.filename or 'its shards'}")


def load(path: Path, model, optimizer, param_groups) -> None:
    """Loads a sharded checkpoint's model and optimizer state into `model` (FSDP2 or whole)
    and `optimizer`, each rank reading the chunks of its own shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # get_state_dict gives a fresh optimizer its state (zeros, by a step with zero
    # gradients), so every tensor the checkpoint holds has a place to be read into.
    reader = checked_reader(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    want: dict = {"model": model_sd, "optimizer": optim_sd["state"]}
    _dcp().load(want, storage_reader=reader)  # fills the tensors in place
    set_state_dict(
        model, optimizer, model_state_dict=model_sd,
        optim_state_dict={"state": want["optimizer"], "param_groups": param_groups},
    )  # fmt: skip


def checked_reader(path: Path):
    """Reads the metadata once here, so a refused one says so in its own line (inside
    dcp.load the reason would come wrapped in DCP's error)."""
    reader = safe_reader(path)
    reader.read_metadata()
    return reader


def load_model(path: Path, model: torch.nn.Module) -> None:
    """The model's weights only, in one process (sample, eval, export)."""
    reader = checked_reader(path)
    want = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that one process is assumed: it is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp().load(want, storage_reader=reader, no_dist=True)
    model.load_state_dict(want["model"])
