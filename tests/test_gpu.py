"""The device copy path on a real GPU: a batch copied from a pinned slot to CUDA (tokens and
doc ids only; the rest derived there) equals the same batch prepared on the CPU, and the
slot comes back once the copy is done. Skipped without CUDA; on the lent GPU machine,
where pytest may be missing, `python tests/test_gpu.py` runs the same checks."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pytrain import _loader
from pytrain.data import TokenLoader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_copy_equals_cpu_preparation(tmp_path: Path | None = None):
    tmp_path = tmp_path or Path(tempfile.mkdtemp())
    path = tmp_path / "ds"
    # Zipf ids over a 50,257 vocabulary: uint16 slots, ids above 32,767 included.
    _loader.write_synthetic(str(path), 3000, mu=5.0, sigma=1.0, vocab=50257, seed=1)
    loader = TokenLoader(path, seq_len=511, batch_size=4, slots=2, threads=2, pin_memory=True)
    assert loader._slots[0][0].is_pinned() and loader._slots[0][0].dtype == torch.uint16
    seen_high = False
    for _ in range(20):
        hb = next(loader)
        want = {
            "input_ids": hb.tokens[:, :-1].to(torch.int64),
            "targets": hb.tokens[:, 1:].to(torch.int64),
            "position_ids": hb.position_ids[:, :-1],
            "doc_ids": hb.doc_ids[:, :-1].clone(),
            "loss_mask": hb.loss_mask[:, :-1],
        }
        loss_tokens = hb.loss_tokens
        seen_high |= bool((want["input_ids"] > 32767).any())
        db = hb.to("cuda")
        torch.cuda.synchronize()
        for k, v in want.items():
            got = getattr(db, k).cpu()
            assert torch.equal(got.to(v.dtype), v), k
        assert db.loss_tokens == loss_tokens == int(db.loss_mask.sum())
        assert db.release_host(wait=True)
    assert seen_high


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    test_cuda_copy_equals_cpu_preparation()
    print("test_gpu: ok")
