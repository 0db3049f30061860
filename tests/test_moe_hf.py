"""The mixture of experts in Hugging Face terms (pytrain.model.hf_moe): a Qwen3MoeForCausalLM
that transformers made and saved reads into MoEGPT with equal logits, a MoEGPT written as
config.json + safetensors loads in transformers with equal logits and parameters, what
Qwen3-MoE does not compute is refused by name, and Qwen3-30B-A3B's published config.json
reads as a model of its 30.5B parameters. CPU, fp32, tiny shapes (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pytrain.model.config import ModelConfig
from pytrain.model.hf import LOGITS_TOLERANCE, NotExportable
from pytrain.model.hf_moe import check_bias, config_from_hf, from_hf, hf_config, to_hf
from pytrain.model.load import hf_weights, load
from pytrain.model.moe import MoEGPT

PRESET = Path(__file__).resolve().parent.parent / "configs" / "qwen3-moe-30b-a3b.toml"

# Qwen3-30B-A3B's config.json as Qwen published it (the keys that shape the model).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "vocab_size": 151936, "rope_theta": 1000000.0, "rope_scaling": None,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
    "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False,
    "sliding_window": None, "output_router_logits": False,
}  # fmt: skip


def tiny(**kw) -> ModelConfig:
    """A MoEGPT Qwen3MoeForCausalLM computes: 4 query heads of 16 over 2 KV heads, 8 experts
    of 32, top 2; mlp_ratio 3 gives the dense blocks a width of 128."""
    base = dict(family="moe", vocab_size=128, n_layer=3, n_head=4, n_kv_head=2, d_model=64,
                mlp="swiglu", mlp_ratio=3.0, tie_embeddings=False, qk_norm=True, experts=8,
                top_k=2, expert_hidden=32, dense_layers=1, balance_rate=0.0, aux_loss=1e-3,
                max_seq_len=128, rope_base=10000.0)  # fmt: skip
    return ModelConfig(**{**base, **kw})


@torch.no_grad()
def scramble(model: torch.nn.Module) -> None:
    """Weights further from the usual init: norm weights away from 1 (so that each norm's
    place counts) and larger router weights (top-2 choices far from ties)."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.copy_(1 + 0.3 * torch.randn_like(p))
        elif "router" in name or "mlp.gate." in name:
            p.normal_(std=0.5)
        else:
            p.normal_(std=0.1)


def ids(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1))


# Qwen3-30B-A3B's shape (mlp_only_layers [], norm_topk_prob true, untied), and the other
# branches: a dense first block, raw top-k softmax weights, tied embeddings, MHA.
VARIANTS = {
    "qwen3": dict(dense_layers=0),
    "dense first, no top-k norm, tied, mha": dict(
        dense_layers=1, norm_topk=False, tie_embeddings=True, n_kv_head=0
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_qwen3_moe_saved_by_transformers_reads_with_equal_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    cfg = tiny(**VARIANTS[variant])
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=cfg.kv_heads,
        head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=cfg.norm_topk,
        mlp_only_layers=list(range(cfg.dense_layers)), tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=128, router_aux_loss_coef=1e-3,
    )  # fmt: skip
    theirs = transformers.Qwen3MoeForCausalLM(config).eval()
    scramble(theirs)
    theirs.save_pretrained(tmp_path)
    config_json, weights = hf_weights(tmp_path)
    # save_pretrained writes the experts one tensor each (the Hub's layout), not fused.
    moe = f"model.layers.{cfg.dense_layers}.mlp."
    assert moe + "experts.7.gate_proj.weight" in weights and moe + "gate.weight" in weights
    assert not any(k.endswith("gate_up_proj") for k in weights)

    got, state = from_hf(config_json, weights)
    assert got.architecture() == cfg.architecture()
    assert (got.balance_rate, got.aux_loss) == (0.0, 1e-3)
    ours = MoEGPT.empty(got)
    ours.load_state_dict(state)
    ours.eval()
    x = ids()
    with torch.no_grad():
        diff = (theirs(x).logits - ours(x)).abs().max().item()
    assert diff < LOGITS_TOLERANCE, diff
    # The way pytrain reads a directory (pytrain.model.families: the class names the family).
    loaded = load(tmp_path).gpt
    assert type(loaded) is MoEGPT
    with torch.no_grad():
        assert torch.equal(loaded(x), ours(x))
    # The fused form (transformers' in-memory names) reads to the same state.
    _, fused = from_hf(config_json, theirs.state_dict())
    assert fused.keys() == state.keys()
    assert all(torch.equal(fused[k], state[k]) for k in state)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_moegpt_written_as_qwen3_moe_loads_in_transformers_with_equal_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    cfg = tiny(**VARIANTS[variant])
    torch.manual_seed(0)
    ours = MoEGPT(cfg).eval()
    scramble(ours)
    weights = to_hf(cfg, ours.state_dict())
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(cfg, ours.vocab, eos_id=0, bos_id=None)
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    theirs.eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    assert not any(info.values()), info  # no key missing, unexpected or mismatched
    x = ids()
    with torch.no_grad():
        diff = (theirs(x).logits - ours(x)).abs().max().item()
    assert diff < LOGITS_TOLERANCE, diff
    counts = [sum(p.numel() for p in m.parameters()) for m in (ours, theirs)]
    assert counts[0] == counts[1], counts
    # Ours is what save_pretrained writes, tensor for tensor.
    theirs.save_pretrained(tmp_path / "again")
    _, again = hf_weights(tmp_path / "again")
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    # And reads back as the same model.
    back, state = from_hf(json.loads((tmp_path / "config.json").read_text()), weights)
    assert back.architecture() == cfg.architecture()
    reread = MoEGPT.empty(back)
    reread.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(reread.eval()(x), ours(x))


def test_what_qwen3_moe_does_not_compute_is_refused_by_name():
    cfg = tiny()
    state = MoEGPT(cfg).state_dict()
    check_bias(state)  # all zero: fine
    state["blocks.2.mlp.expert_bias"] = torch.tensor([0.0, 1e-3, 0, 0, 0, 0, 0, 0])
    for refuse in (check_bias, lambda s: to_hf(cfg, s)):
        with pytest.raises(NotExportable, match=r"blocks\.2\.mlp\.expert_bias is nonzero.*"
                           r"balance_rate 0"):  # fmt: skip
            refuse(state)
    for key, value in [("shared_experts", 1), ("router_score", "sigmoid"), ("route_scale", 2.5),
                       ("qk_norm", False), ("rope_scaling", "llama3")]:  # fmt: skip
        with pytest.raises(NotExportable, match=f"^model.{key} "):
            hf_config(tiny(**{key: value}), 128, None, None)
    good = hf_config(cfg, 128, None, None)
    assert config_from_hf(good).architecture() == cfg.architecture()
    for key, value in [("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                       ("attention_bias", True), ("vocab_size", 130),
                       ("hidden_act", "gelu"), ("use_sliding_window", True)]:  # fmt: skip
        with pytest.raises(NotExportable, match=f"Qwen3MoeForCausalLM with {key} "):
            config_from_hf({**good, key: value})
    with pytest.raises(NotExportable, match="^LlamaForCausalLM is not"):
        config_from_hf({**good, "architectures": ["LlamaForCausalLM"]})


def test_qwen3_30b_a3b_config_reads_as_a_model_of_its_parameters():
    """Qwen3-30B-A3B's published config.json, read by config_from_hf, builds a MoEGPT of
    the parameters transformers' Qwen3MoeForCausalLM has for it (both on the meta device:
    shapes only), 30,532,122,624; and it is the preset's architecture where that exists."""
    transformers = pytest.importorskip("transformers")
    cfg = config_from_hf(QWEN3_30B_A3B)
    with torch.device("meta"):
        theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_30B_A3B))
        ours = MoEGPT(cfg)
    counts = [sum(p.numel() for p in m.parameters()) for m in (ours, theirs)]
    assert counts == [30_532_122_624] * 2
    if PRESET.is_file():
        from pytrain.config import parse_args

        preset = parse_args(["--config", str(PRESET)]).model
        preset.vocab_size = cfg.vocab_size  # the preset takes the dataset's
        assert preset.architecture() == cfg.architecture()
