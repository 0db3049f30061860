"""Model options that change numerics, checked on CPU."""

import pytest
import torch

from pytrain.model.gpt import GPT, ModelConfig


def test_residual_stream_dtype_follows_the_config():
    """residual='compute' carries the stream between blocks in the autocast dtype;
    'fp32' keeps it in fp32. The losses agree to bf16 accuracy."""
    losses = {}
    for choice in ("fp32", "compute"):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=200, n_layer=2, n_head=2, d_model=32, residual=choice)
        m = GPT(cfg).train()
        seen = []
        m.blocks[0].register_forward_hook(lambda mod, args, out, seen=seen: seen.append(out.dtype))
        ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses[choice] = float(
                m.loss_sum(ids, ids, None, torch.ones_like(ids, dtype=torch.bool), None)
            )
        assert seen == [torch.bfloat16 if choice == "compute" else torch.float32]
    assert losses["compute"] == pytest.approx(losses["fp32"], rel=2e-2)


@pytest.mark.parametrize("field,value", [("residual", "bf16"), ("fused_ce", "yes")])
def test_bad_numerics_options_are_refused_when_the_model_is_built(field, value):
    cfg = ModelConfig(vocab_size=200, n_layer=1, n_head=2, d_model=32, **{field: value})
    with pytest.raises(ValueError, match=field):
        GPT(cfg)


def test_fa4_install_hint_only_where_fa4_would_run_but_is_missing(monkeypatch):
    from pytrain.model import flash4

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cap, imports, want in (((9, 0), False, True), ((10, 0), False, True),
                               ((9, 0), True, False), ((8, 0), False, False)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0, c=cap: c)
        monkeypatch.setattr(flash4, "_imports", lambda v=imports: v)
        hint = flash4.install_hint(0)
        assert bool(hint) == want, (cap, imports)
        assert flash4.available(0) == (imports and cap[0] in (9, 10))
        if want:
            assert "pip install '.[fa4]'" in hint
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flash4.install_hint(0) == "" and not flash4.available(0)
