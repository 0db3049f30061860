"""Muon (pytrain/optim/muon.py): its parameter groups, the compact update against
torch.optim.Muon, orthogonalisation, gradient accumulation, exact resume, refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from pytrain.config import ConfigError, OptimConfig
from pytrain.model.config import ModelConfig
from pytrain.model.gpt import GPT
from pytrain.optim import muon
from pytrain.optim.build import build_optimizer
from pytrain.train.trainer import Trainer
from tests.test_trainer import cat_rows, device_batches, small_cfg

CPU = torch.device("cpu")


def tiny_gpt(tie: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, vocab_size=96, tie_embeddings=tie))


@pytest.mark.parametrize("tie", [True, False])
def test_groups_muon_for_block_matrices_adamw_for_embedding_head_and_norms(tie):
    model = tiny_gpt(tie)
    opt = muon.MuonAdamW(model, OptimConfig(name="muon", lr=1e-3, muon_lr=0.02), CPU)
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for p in opt.muon.param_groups[0]["params"]}
    decay, no_decay = ({names[id(p)] for p in g["params"]} for g in opt.adamw.param_groups)
    assert on_muon and all(n.startswith("blocks.") and "norm" not in n for n in on_muon)
    assert all(model.get_parameter(n).dim() == 2 for n in on_muon)
    assert "embed.weight" in decay and ("head.weight" in decay) == (not tie)
    assert no_decay and all(model.get_parameter(n).dim() == 1 for n in no_decay)
    # Every trainable parameter exactly once.
    assert sorted(on_muon | decay | no_decay) == sorted(names.values())
    assert len(on_muon) + len(decay) + len(no_decay) == len(names)
    # Each group's own peak rate, kept as a ratio to optim.lr for the schedule.
    assert [g["lr_ratio"] for g in opt.param_groups] == [20.0, 1.0, 1.0]
    assert opt.muon.param_groups[0]["lr"] == 0.02 and opt.adamw.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_newton_schulz_orthogonalises(dtype):
    torch.manual_seed(0)
    for shape in [(48, 16), (16, 48), (32, 32)]:
        g = torch.randn(shape)
        o = muon.newton_schulz(g, dtype=dtype).float()
        assert o.shape == g.shape
        s = torch.linalg.svdvals(o)
        # The quintic's fixed band (not exactly 1: faster convergence at zero instead).
        assert s.min() > 0.5 and s.max() < 1.3, s
        # Same singular vectors: o ~ U V^T of g.
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        cos = torch.nn.functional.cosine_similarity(o.flatten(), (u @ vh).flatten(), dim=0)
        assert cos > 0.95


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_compact_muon_is_torch_muon():
    torch.manual_seed(0)
    ws = [torch.randn(24, 8), torch.randn(8, 40)]
    a = [torch.nn.Parameter(w.clone()) for w in ws]
    b = [torch.nn.Parameter(w.clone()) for w in ws]
    ta = torch.optim.Muon(a, lr=0.02, weight_decay=0.01, momentum=0.9)
    tb = muon.CompactMuon(b, lr=0.02, weight_decay=0.01, momentum=0.9)
    for _ in range(3):
        grads = [torch.randn_like(w) for w in ws]
        for p, q, g in zip(a, b, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ta.step()
        tb.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_compact_muon_is_used_where_torch_has_none(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    assert muon.muon_class() is muon.CompactMuon


def test_on_a_cpu_newton_schulz_runs_in_fp32():
    """A CPU without bf16 matrix units emulates bf16 matmuls (4x fp32's time); the update
    stays within bf16's rounding of torch's."""
    opt = muon.MuonAdamW(tiny_gpt(), OptimConfig(name="muon"), CPU)
    assert isinstance(opt.muon, muon.CompactMuon) and opt.muon.ns_dtype == torch.float32
    torch.manual_seed(0)
    g = torch.randn(64, 24)
    o32, o16 = (muon.newton_schulz(g, dtype=d).float() for d in (torch.float32, torch.bfloat16))
    assert not torch.equal(o32, o16)
    torch.testing.assert_close(o32, o16, rtol=0, atol=0.05)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_compact_and_torch_muon_load_each_others_state():
    """A checkpoint of a CPU run (CompactMuon) resumes on a GPU (torch.optim.Muon) and back:
    the same group settings, the same momentum, the same next step."""
    torch.manual_seed(0)
    ws, grads = [torch.randn(24, 8)], [[torch.randn(24, 8)] for _ in range(3)]

    def run(first, then) -> torch.Tensor:
        p = [torch.nn.Parameter(w.clone()) for w in ws]
        a = first(p, lr=0.02, weight_decay=0.01, momentum=0.9)
        for step_grads in grads[:2]:
            p[0].grad = step_grads[0].clone()
            a.step()
        b = then(p, lr=0.02, weight_decay=0.01, momentum=0.9)
        b.load_state_dict(copy.deepcopy(a.state_dict()))
        p[0].grad = grads[2][0].clone()
        b.step()
        return p[0].detach()

    want = run(muon.CompactMuon, muon.CompactMuon)
    torch.testing.assert_close(run(muon.CompactMuon, torch.optim.Muon), want, rtol=0, atol=0)
    torch.testing.assert_close(run(torch.optim.Muon, muon.CompactMuon), want, rtol=0, atol=0)


def test_trainer_muon_accumulation_equals_one_big_batch(small_corpus, tmp_path):
    """Two micro-batches with different loss-token counts step Muon and AdamW to the weights
    their concatenation gives (within the bf16 Newton-Schulz's rounding), and closer than a
    per-micro-batch mean does."""
    t = Trainer(small_cfg(small_corpus, tmp_path, "--optim.name", "muon"))
    assert isinstance(t.optimizer, muon.MuonAdamW)
    micro = device_batches(t, 2)
    micro[0].loss_mask[:, 16:] = False  # 1/4 of the tokens of the second micro-batch
    counts = [int(b.loss_mask.sum()) for b in micro]
    start = {k: v.clone() for k, v in t.gpt.state_dict().items()}
    fresh = copy.deepcopy(t.optimizer.state_dict())  # empty: no step taken yet

    def step(fill_grads) -> list[torch.Tensor]:
        t.gpt.load_state_dict(start)
        t.optimizer.load_state_dict(fresh)
        t.opt_step.zero_grads(keep=False)
        fill_grads()
        t.opt_step.set_lr(3e-3)
        t.optimizer.step()
        return [p.detach() - start[n] for n, p in t.gpt.named_parameters()]

    def per_micro_batch_mean():
        for b in micro:
            (t._micro_loss(b) / int(b.loss_mask.sum()) / len(micro)).backward()

    accum = step(lambda: t._forward_backward(micro, sum(counts)))
    big = step(lambda: t._forward_backward([cat_rows(micro)], sum(counts)))
    wrong = step(per_micro_batch_mean)

    def rel(a, b):
        return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True))

    assert rel(accum, big) < 0.02, rel(accum, big)
    assert rel(wrong, big) > 5 * max(rel(accum, big), 1e-3), (rel(wrong, big), rel(accum, big))
    t.close()


def test_trainer_muon_learns_and_resumes_exactly(small_corpus, tmp_path):
    args = ("--optim.name", "muon", "--optim.grad_accum", "2", "--optim.muon_lr", "0.02")
    full = Trainer(small_cfg(small_corpus, tmp_path / "a", *args))
    want = full.fit()["losses"]
    full.close()
    assert len(want) == 12 and want[-1] < want[0] - 0.5

    first = Trainer(small_cfg(small_corpus, tmp_path / "b", *args, "--halt_after", "5"))
    got = first.fit()["losses"]
    first.close()
    second = Trainer(small_cfg(small_corpus, tmp_path / "b", *args))
    assert second.step == 5
    got += second.fit()["losses"]
    second.close()
    assert got == want  # bit for bit: momentum buffers and AdamW moments restored

    with pytest.raises(ConfigError, match="saved with optim.name muon"):
        Trainer(small_cfg(small_corpus, tmp_path / "b", "--max_steps", "20"))


def test_muon_refusals():
    model = tiny_gpt()
    kw = {"sharded": False, "fp16_scaler": False}
    with pytest.raises(ConfigError, match="FSDP2"):
        build_optimizer(model, OptimConfig(name="muon"), CPU, None, **{**kw, "sharded": True})
    with pytest.raises(ConfigError, match="fp16"):
        build_optimizer(model, OptimConfig(name="muon"), CPU, None, **{**kw, "fp16_scaler": True})
    with pytest.raises(ConfigError, match="master_weights=on"):
        build_optimizer(model, OptimConfig(name="muon", master_weights="on"), CPU, None, **kw)
    with pytest.raises(ConfigError, match="expected one of adamw, muon"):
        build_optimizer(model, OptimConfig(name="sgd"), CPU, None, **kw)
    opt, master = build_optimizer(
        model, OptimConfig(name="muon"), torch.device("cuda"), torch.bfloat16, **kw
    )  # auto master weights: off with Muon
    assert isinstance(opt, muon.MuonAdamW) and not master
