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
