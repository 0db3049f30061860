"""Shared fixtures: real text from Python's standard library, synthetic datasets whose
token ids say which document and position they came from, and the repository's scripts
(benchmarks/, scripts/) loaded as modules."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from pytrain.data.shards import PackOptions, document_batches, write_dataset
from pytrain.data.tokenizer import TokenizerInfo, train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])

# Under pytest-xdist (`make test`) several workers share the cores: one torch thread each, and
# in the processes the tests start, which inherit it (torch's default, a thread per core in
# every process, puts several times more threads than cores to work).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The trainer's signing key (pytrain.train.signing) in a folder of this test run, not in the
# user's ~/.config: the tests and the processes they start share it.
os.environ.setdefault("PYTRAIN_CONFIG_DIR", tempfile.mkdtemp(prefix="pytrain-test-config-"))


def _free_ports():
    """A fresh port per torchrun or TCPStore: below the OS's ephemeral range (where a client
    connection could take a port between our check and torchrun's bind), skipping ports in
    use. Each pytest-xdist worker takes its own slice of the range, so that two workers never
    hand out one port, from a PID-dependent start within it so that concurrent test runs
    rarely meet."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = 12000 // workers
    low = 20000 + worker * size
    start = low + os.getpid() % (size // 10) * 10
    for port in [*range(start, low + size), *range(low, start)]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        yield port


PORTS = _free_ports()
"""Ports for the tests' torchrun agents and stores: `next(PORTS)`."""


def _slurm_up() -> bool:
    """A Slurm controller answers and has a node to run on (else the Slurm tests skip)."""
    if not all(shutil.which(b) for b in ("sbatch", "sinfo", "scontrol")):
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:  # a controller that does not answer
        return False
    return r.returncode == 0 and any(s in r.stdout for s in ("idle", "mix"))


SLURM = pytest.mark.skipif(not _slurm_up(), reason="needs a running Slurm (sbatch, sinfo, scontrol, an idle node; scripts/local_slurm.sh starts one)")  # fmt: skip
"""Marks a test that submits real Slurm jobs."""


def slurm_job_state(job: str) -> str:
    """A job's JobState as scontrol shows it ("GONE" once Slurm has forgotten the job)."""
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    m = re.search(r"JobState=(\S+)", r.stdout)
    return m.group(1) if m else "GONE"


def stdlib_texts(max_bytes: int) -> list[str]:
    """Sources of the standard library in sorted order, up to `max_bytes` of text."""
    out, total = [], 0
    for p in sorted(STDLIB.glob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return out


@pytest.fixture(scope="session")
def bpe_tokenizer_file(tmp_path_factory) -> Path:
    tok = train_bpe(stdlib_texts(400_000), vocab_size=1000)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def traceable_docs(lengths) -> list[np.ndarray]:
    """Document i holds tokens i * 10_000 + k for k in 0..len: every token is unique."""
    return [np.arange(len_, dtype=np.uint32) + i * 10_000 for i, len_ in enumerate(lengths)]


def write_synthetic(
    out: Path,
    docs: list[np.ndarray],
    frame_bytes: int = 4096,
    dtype: str = "uint32",
    vocab: int = 1 << 31,
) -> Path:
    """Writes `docs` as a dataset (no tokenizer involved), several frames per shard."""
    info = TokenizerInfo(
        name="synthetic", sha256="0" * 64, vocab_size=vocab, eos_id=None, bos_id=None
    )
    opts = PackOptions(
        tokenizer="synthetic",
        dtype=dtype,
        frame_mib=frame_bytes / (1 << 20),
        shard_mib=frame_bytes * 6 / (1 << 20),
    )
    write_dataset(document_batches(docs, per=50), out, info, dtype, opts)
    return out


@pytest.fixture
def synthetic_dataset(tmp_path) -> tuple[Path, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.0, 1.0, size=600).astype(int), 1, 2000)
    docs = traceable_docs(lengths)
    return write_synthetic(tmp_path / "ds", docs), docs


def learnable_docs(n: int, vocab: int = 256, seed: int = 0) -> list[np.ndarray]:
    """Documents a small model can learn: each counts upward by a per-document step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start, step, length = rng.integers(0, vocab), rng.integers(1, 4), rng.integers(20, 300)
        out.append(((start + step * np.arange(length)) % vocab).astype(np.uint32))
    return out


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(train, val) datasets with vocabulary 256, several frames each."""
    d = tmp_path_factory.mktemp("small")
    train = write_synthetic(
        d / "train", learnable_docs(800, seed=1), frame_bytes=8192, dtype="uint16", vocab=256
    )
    val = write_synthetic(
        d / "val", learnable_docs(100, seed=2), frame_bytes=8192, dtype="uint16", vocab=256
    )
    return train, val


ROOT = Path(__file__).resolve().parent.parent


def load_script(path: str, name: str) -> ModuleType:
    """The script at `path` (from the repository root) as module `name`: scripts are
    programs, not a package. Registered in sys.modules, where a dataclass of the script looks
    its module up; the root goes on sys.path, as the scripts import benchmarks.harness."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def losses_by_step(log: str) -> dict[int, float]:
    """The loss of each step line of a train.log's text (pytrain.train.metrics.read_step_lines),
    by step; a step logged twice (a resumed run) keeps its last line."""
    from pytrain.train.metrics import read_step_lines  # imports torch: only where used

    return {int(row["step"]): row["loss"] for row in read_step_lines(log)}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first (each in the order found): run in parallel, the short ones then
    fill the workers' ends, where a long test started last would run on alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
