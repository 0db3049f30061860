"""Model options that change numerics, checked on CPU."""

import os

import pytest
import torch

from pytrain.model.gpt import GPT, ModelConfig


def test_residual_stream_dtype_follows_the_config():
    """residual='compute' carries the stream between blocks in the autocast dtype;
    'fp32' keeps it in fp32. The summed losses of the same weights on 512 tokens differ
    by 7.5e-6 of the loss (at init a loss near ln(vocab) moves little: with the residual
    in bf16, seeds 0-5 measured 1e-6 to 1.4e-5); the tolerance, 5e-5, fails for a
    defect as small as the embedding scaled by 1.01 (1.3e-3), the second block left out
    (5e-4 to 8e-4) or its attention weights scaled by 1.1 (2e-4 to 3e-4)."""
    losses = {}
    for choice in ("fp32", "compute"):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=200, n_layer=2, n_head=2, d_model=32, residual=choice)
        m = GPT(cfg).train()
        seen = []
        m.blocks[0].register_forward_hook(
            lambda mod, args, out, seen=seen: seen.append(out[0].dtype)
        )
        ids = torch.randint(0, 200, (8, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            losses[choice] = float(
                m.loss_sum(ids, ids, None, torch.ones_like(ids, dtype=torch.bool), None)
            )
        assert seen == [torch.bfloat16 if choice == "compute" else torch.float32]
    assert losses["compute"] == pytest.approx(losses["fp32"], rel=5e-5)


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


def _gqa_and_its_mha_twin(attention: str) -> tuple[GPT, GPT]:
    """A GQA model (4 query heads, 2 key/value heads) and a multi-head model whose key/value
    heads are the GQA model's, each repeated for the query heads it serves: both compute
    the same function."""
    torch.manual_seed(0)
    kw = dict(vocab_size=128, n_layer=2, n_head=4, d_model=64, attention=attention)
    gqa, mha = GPT(ModelConfig(n_kv_head=2, **kw)), GPT(ModelConfig(**kw))
    state = gqa.state_dict()
    D, H = 16, 4
    for i in range(2):
        w = state[f"blocks.{i}.attn.qkv.weight"]
        assert w.shape == ((H + 2 * 2) * D, 64)  # a smaller projection than MHA's 3 * 64
        q, k, v = w.split((H * D, 2 * D, 2 * D))
        k, v = (t.view(2, D, 64).repeat_interleave(2, dim=0).reshape(H * D, 64) for t in (k, v))
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat((q, k, v))
    mha.load_state_dict(state)
    return gqa.eval(), mha.eval()


@pytest.mark.parametrize("attention", ["sdpa_mask", "causal"])
def test_grouped_query_attention_equals_multi_head_attention_with_shared_heads(attention):
    gqa, mha = _gqa_and_its_mha_twin(attention)
    ids = torch.randint(0, 128, (2, 24))
    doc_ids = torch.cat([torch.zeros(2, 10), torch.ones(2, 14)], dim=1).long()
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    with torch.no_grad():
        mask_g = gqa.make_mask(doc_ids, "sdpa_mask") if attention == "sdpa_mask" else None
        mask_m = mha.make_mask(doc_ids, "sdpa_mask") if attention == "sdpa_mask" else None
        got = gqa(ids, pos if mask_g is not None else None, mask_g)
        want = mha(ids, pos if mask_m is not None else None, mask_m)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_of_a_gqa_model_holds_its_key_value_heads_only():
    from pytrain.model.gpt import KVCache

    gqa, mha = _gqa_and_its_mha_twin("sdpa_mask")
    ids = torch.randint(0, 128, (1, 8))
    assert (
        gqa.generate(ids, 6, temperature=0).tolist() == mha.generate(ids, 6, temperature=0).tolist()
    )
    cache = KVCache(16)
    with torch.no_grad():
        gqa.hidden(ids, None, None, caches=[cache, KVCache(16)])
    assert cache.k is not None and cache.k.shape == (1, 2, 16, 16)  # (B, n_kv_head, len, D)


def test_llama3_rope_scaling_equals_transformers_and_changes_only_long_wavelengths():
    from pytrain.model.gpt import llama3_scaled

    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    scaled = llama3_scaled(inv, factor=32.0, original_len=8192)
    wavelen = 2 * torch.pi / inv
    assert torch.equal(scaled[wavelen < 8192 / 4], inv[wavelen < 8192 / 4])  # short: kept
    torch.testing.assert_close(scaled[wavelen > 8192], inv[wavelen > 8192] / 32)  # long: / factor
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(
        head_dim=64, hidden_size=64 * 32, num_attention_heads=32, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(scaled, want.float())


@pytest.mark.parametrize("n_kv_head", [3, -1])
def test_a_kv_head_count_that_does_not_divide_the_query_heads_is_refused(n_kv_head):
    with pytest.raises(ValueError, match="model.n_kv_head"):
        ModelConfig(n_head=4, n_kv_head=n_kv_head).check()


def test_fa4_kernel_cache_goes_to_this_users_cache_directory(tmp_path, monkeypatch):
    """FA4's kernel cache (shared objects it loads) is turned on in a folder of this user's
    own cache directory (mode 0700), never FA4's default under /tmp; a folder the user
    names is kept; and where none can be made the cache stays off."""
    from pytrain.model import flash4

    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    flash4._enable_kernel_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(
        tmp_path / "cache" / "pytrain" / "flash-attn-4"
    )
    assert (tmp_path / "cache" / "pytrain").stat().st_mode & 0o777 == 0o700

    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "mine"))
    flash4._enable_kernel_cache()
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == str(tmp_path / "mine")

    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        monkeypatch.delenv(var)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # not a directory
    flash4._enable_kernel_cache()
    assert "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" not in os.environ
