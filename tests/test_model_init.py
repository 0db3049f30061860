"""A fresh run's model: GPT.create builds on the meta device and initialises where the model
will live (GPT.init_weights). Checked on the CPU: every parameter and buffer is written,
with the intended distribution; a seed gives the same weights; nothing is allocated before
the model is placed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pytrain.model.gpt import GPT, ModelConfig, RMSNorm

# Llama 3's RoPE scaling and grouped-query attention, so that every kind of table and
# projection is made; the residual projections' std (0.02 / sqrt(2 * 3) = 0.0082) is far
# from 0.02.
KW = dict(vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, d_model=64, max_seq_len=128,
          rope_scaling="llama3", rope_factor=8.0, rope_original_len=32)  # fmt: skip


def intended_std(name: str, n_layer: int) -> float:
    return 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "down.weight")) else 0.02


@pytest.mark.parametrize("tie", [False, True])
def test_create_initialises_every_parameter_and_buffer_as_intended(tie):
    cfg = ModelConfig(tie_embeddings=tie, **KW)
    torch.manual_seed(0)
    made = GPT.create(cfg, "cpu")
    reference = GPT(cfg)
    buffers = dict(reference.named_buffers())
    assert buffers.keys() == {"rope_cos", "rope_sin"}
    for name, b in made.named_buffers():  # the RoPE tables, exactly
        assert torch.equal(b, buffers[name]), name
    assert (made.head.weight is made.embed.weight) == tie
    names = [n for n, _ in made.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()]
    norms = {f"{n}.weight" for n, m in made.named_modules() if isinstance(m, RMSNorm)}
    assert len(norms) == 2 * cfg.n_layer + 1
    for name, p in made.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
        if name in norms:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        # 4096 draws at the least: the sample std's relative error is 1/sqrt(2n), 1.1%.
        std = intended_std(name, cfg.n_layer)
        assert p.std().item() == pytest.approx(std, rel=0.05), name
        assert abs(p.mean().item()) < 0.1 * std, name


def test_init_weights_writes_every_parameter_and_buffer():
    """Whatever a tensor held before (here NaN), init_weights overwrites it: none is left
    to what the allocation happened to contain."""
    cfg = ModelConfig(**KW)
    gpt = GPT(cfg)
    tensors = dict(gpt.named_parameters()) | dict(gpt.named_buffers())
    with torch.no_grad():
        for t in tensors.values():
            t.fill_(float("nan"))
    gpt.init_weights()
    left = [name for name, t in tensors.items() if torch.isnan(t).any()]
    assert not left


def test_a_seed_gives_the_same_weights_and_another_seed_others():
    cfg = ModelConfig(**KW)

    def made(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return GPT.create(cfg, "cpu").state_dict()

    a, b, c = made(1), made(1), made(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    different = {k for k in a if not torch.equal(a[k], c[k])}
    norms = {k for k in a if k.split(".")[-2] in ("norm", "norm1", "norm2")}
    assert norms and different == a.keys() - norms  # every drawn weight; the norms are ones


def test_create_allocates_nothing_before_placing_the_model(monkeypatch):
    """The modules are made on the meta device: no memory, no CPU draws (nn.Linear's own
    kaiming init included) until to_empty gives them the device's memory."""
    cfg = ModelConfig(**KW)
    seen = []
    to_empty = nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        seen.append(all(t.is_meta for t in [*self.parameters(), *self.buffers()]))
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(nn.Module, "to_empty", spy)
    state = torch.get_rng_state()
    meta = GPT.create(cfg, "meta")
    assert seen == [True]
    assert all(p.is_meta for p in meta.parameters())
    assert torch.equal(torch.get_rng_state(), state)  # the CPU generator was not drawn from


@pytest.mark.parametrize("tie", [False, True])
def test_empty_draws_nothing_and_a_load_over_it_gives_the_models_logits(tie):
    """GPT.empty, what a checkpoint or an export is loaded over (pytrain.model.load): no
    random draws (an 8B's on the CPU took minutes of the export), the RoPE tables filled
    (no state holds them), and once the weights are loaded the logits are the model's."""
    cfg = ModelConfig(tie_embeddings=tie, **KW)
    torch.manual_seed(0)
    trained = GPT(cfg).eval()
    rng = torch.get_rng_state()
    empty = GPT.empty(cfg)
    assert torch.equal(torch.get_rng_state(), rng)
    assert (empty.head.weight is empty.embed.weight) == tie
    for name, b in empty.named_buffers():
        assert torch.equal(b, dict(trained.named_buffers())[name]), name
    empty.load_state_dict(trained.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(empty.eval()(ids), trained(ids))


def test_loading_a_run_initialises_nothing(tmp_path, monkeypatch):
    """pytrain.model.load (export, eval, sample) builds the model with GPT.empty: no
    initialisation that the load would overwrite; the loaded weights are the saved ones."""
    from pytrain.model.load import load

    cfg = ModelConfig(**KW)
    torch.manual_seed(0)
    trained = GPT(cfg)
    torch.save({"model": trained.state_dict(), "config": {"model": cfg.__dict__, "data": {}}},
               tmp_path / "ckpt.pt")  # fmt: skip
    # GPT() calls init_weights on the meta device too, where it writes nothing.
    monkeypatch.setattr(
        GPT, "init_weights", lambda self: self.rope_cos.is_meta or pytest.fail("initialised")
    )
    loaded = load(tmp_path / "ckpt.pt").gpt
    for (name, a), b in zip(
        loaded.state_dict().items(), trained.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
