"""The mixture of experts in Hugging Face terms (pytrain.model.hf_moe): a Qwen3MoeForCausalLM,
Glm4MoeForCausalLM or OlmoeForCausalLM that transformers made and saved reads into MoEGPT
with equal logits, a MoEGPT written as config.json + safetensors loads in transformers as
the class its routing names with equal logits and parameters, the balancing loss pooled as
transformers pools it, what each class does not compute is refused by name, and
Qwen3-30B-A3B's and OLMoE-1B-7B's published config.json read as models of their parameters.
CPU, fp32, tiny shapes (no download)."""

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
                aux_loss_scope="model", max_seq_len=128, rope_base=10000.0,
                router_score="softmax")  # fmt: skip
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


def test_what_qwen3_moe_does_not_compute_is_refused_by_name():
    cfg = tiny()
    state = MoEGPT(cfg).state_dict()
    check_bias(cfg, state)  # all zero: fine
    state["blocks.2.mlp.expert_bias"] = torch.tensor([0.0, 1e-3, 0, 0, 0, 0, 0, 0])
    for refuse in (lambda s: check_bias(cfg, s), lambda s: to_hf(cfg, s)):
        with pytest.raises(NotExportable, match=r"blocks\.2\.mlp\.expert_bias is nonzero.*"
                           r"router_score sigmoid.*balance_rate 0"):  # fmt: skip
            refuse(state)
    for key, value in [("shared_experts", 1), ("route_scale", 2.5), ("qk_norm", False),
                       ("rope_scaling", "llama3")]:  # fmt: skip
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


# ---- GLM-4.5's and OLMoE's classes: sigmoid routing with its bias, QK-norm over the whole
# projection --------------------------------------------------------------------------------

# allenai/OLMoE-1B-7B-0924's config.json as AI2 published it (the keys that shape the model).
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False,
    "attention_dropout": 0.0, "clip_qkv": None, "eos_token_id": 50279, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64,
    "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
    "output_router_logits": False, "pad_token_id": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False, "vocab_size": 50304,
}  # fmt: skip
OLMOE_PRESET = PRESET.parent / "olmoe-1b-7b.toml"


def qwen3_config(transformers, cfg: ModelConfig):
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=cfg.kv_heads,
        head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=cfg.norm_topk,
        mlp_only_layers=list(range(cfg.dense_layers)), tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=128, router_aux_loss_coef=1e-3,
    )  # fmt: skip


def glm4_config(transformers, cfg: ModelConfig):
    """The Glm4MoeConfig that computes `cfg` (tiny(): 3 layers, 8 experts of 32)."""
    return transformers.Glm4MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=cfg.kv_heads,
        head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=cfg.shared_experts,
        norm_topk_prob=cfg.norm_topk, routed_scaling_factor=cfg.route_scale, n_group=1,
        topk_group=1, first_k_dense_replace=cfg.dense_layers, use_qk_norm=cfg.qk_norm,
        partial_rotary_factor=1.0, tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=128, rms_norm_eps=cfg.norm_eps, attention_bias=False,
    )  # fmt: skip


def olmoe_config(transformers, cfg: ModelConfig):
    return transformers.OlmoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=cfg.kv_heads, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=cfg.norm_topk, tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=128, rms_norm_eps=cfg.norm_eps, router_aux_loss_coef=0.01,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


# Qwen3-30B-A3B's shape (mlp_only_layers [], norm_topk_prob true, untied), and the other
# branches: a dense first block, raw top-k softmax weights, tied embeddings, MHA. GLM-4.5's
# routing (sigmoid, the bias, normalised top-k times a scale, a shared expert, a dense first
# block), with and without QK-norm and shared experts; OLMoE's (raw softmax
# top-k, QK-norm over the projection, every block routed: no dense width, so mlp_ratio
# keeps its default), MHA and GQA.
DIALECTS = {
    "qwen3": (qwen3_config, "Qwen3MoeForCausalLM", dict(dense_layers=0)),
    "qwen3 dense first, no top-k norm, tied, mha": (qwen3_config, "Qwen3MoeForCausalLM", dict(
        dense_layers=1, norm_topk=False, tie_embeddings=True, n_kv_head=0)),
    "glm4": (glm4_config, "Glm4MoeForCausalLM", dict(
        router_score="sigmoid", balance_rate=1e-3, aux_loss=0.0, shared_experts=1,
        route_scale=2.5, dense_layers=1)),
    "glm4 no shared, no qk-norm, tied": (glm4_config, "Glm4MoeForCausalLM", dict(
        router_score="sigmoid", balance_rate=1e-3, aux_loss=0.0, shared_experts=0,
        qk_norm=False, norm_topk=False, dense_layers=0, tie_embeddings=True)),
    "olmoe": (olmoe_config, "OlmoeForCausalLM", dict(
        qk_norm_scope="projection", n_kv_head=0, dense_layers=0, norm_topk=False,
        aux_loss=0.01, aux_loss_scope="model", norm_eps=1e-5, mlp_ratio=4.0)),
    "olmoe gqa": (olmoe_config, "OlmoeForCausalLM", dict(
        qk_norm_scope="projection", dense_layers=0, norm_topk=True, aux_loss=0.01,
        aux_loss_scope="model", norm_eps=1e-5, mlp_ratio=4.0)),
}  # fmt: skip


@torch.no_grad()
def moved_bias(model: torch.nn.Module) -> None:
    """A balancing bias as training leaves it: large enough to change some choices."""
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias") or name.endswith("e_score_correction_bias"):
            buf.copy_(0.3 * torch.randn_like(buf))


@pytest.mark.parametrize("variant", list(DIALECTS))
def test_a_dialect_saved_by_transformers_reads_with_equal_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    make_config, arch, settings = DIALECTS[variant]
    cfg = tiny(**settings)
    torch.manual_seed(0)
    theirs = getattr(transformers, arch)(make_config(transformers, cfg)).eval()
    scramble(theirs)
    moved_bias(theirs)
    theirs.save_pretrained(tmp_path)
    config_json, weights = hf_weights(tmp_path)
    # save_pretrained writes the experts one tensor each (the Hub's layout), not fused.
    moe = f"model.layers.{cfg.dense_layers}.mlp."
    assert moe + "experts.7.gate_proj.weight" in weights and moe + "gate.weight" in weights
    assert not any(k.endswith("gate_up_proj") for k in weights)
    got, state = from_hf(config_json, weights)
    assert got.architecture() == cfg.architecture()
    balance = (got.balance_rate, got.aux_loss, got.aux_loss_scope)
    coef = 1e-3 if "qwen3" in variant else 0.01  # each class's router_aux_loss_coef
    assert balance == ((1e-3, 0.0, "layer") if "glm4" in variant else (0.0, coef, "model"))
    ours = MoEGPT.empty(got)
    ours.load_state_dict(state)
    x = ids()
    with torch.no_grad():
        diff = (theirs(x).logits - ours.eval()(x)).abs().max().item()
    assert diff < LOGITS_TOLERANCE, diff
    # The way pytrain reads a directory (pytrain.model.families: the class names the family).
    loaded = load(tmp_path).gpt
    assert type(loaded) is MoEGPT
    with torch.no_grad():
        assert torch.equal(loaded(x), ours(x))
    # The bias chose differently from the scores alone (else the test would not see it).
    if "glm4" in variant:
        layer = ours.moe_layers()[0]
        h = torch.randn(64, 64)
        _, scores, chosen, _ = layer.route(h)
        assert not torch.equal(chosen.sort(-1).values, scores.topk(2).indices.sort(-1).values)
    # The fused form (transformers' in-memory names) reads to the same state.
    _, fused = from_hf(config_json, theirs.state_dict())
    assert fused.keys() == state.keys()
    assert all(torch.equal(fused[k], state[k]) for k in state)


@pytest.mark.parametrize("variant", list(DIALECTS))
def test_a_dialect_written_by_us_loads_in_transformers_with_equal_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    _, arch, settings = DIALECTS[variant]
    cfg = tiny(**settings)
    torch.manual_seed(0)
    ours = MoEGPT(cfg).eval()
    scramble(ours)
    if "glm4" in variant:
        moved_bias(ours)  # exported as GLM's e_score_correction_bias
    weights = to_hf(cfg, ours.state_dict())
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(cfg, ours.vocab, eos_id=0, bos_id=None)
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True
    )
    assert type(theirs).__name__ == arch
    assert not any(info.values()), info  # no key missing, unexpected or mismatched
    x = ids()
    with torch.no_grad():
        diff = (theirs.eval()(x).logits - ours(x)).abs().max().item()
    assert diff < LOGITS_TOLERANCE, diff
    counts = [sum(p.numel() for p in m.parameters()) for m in (ours, theirs)]
    assert counts[0] == counts[1], counts
    theirs.save_pretrained(tmp_path / "again")
    _, again = hf_weights(tmp_path / "again")
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    back, state = from_hf(json.loads((tmp_path / "config.json").read_text()), weights)
    assert back.architecture() == cfg.architecture()
    reread = MoEGPT.empty(back)
    reread.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(reread.eval()(x), ours(x))


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"])
def test_the_pooled_balancing_loss_is_transformers_own(tmp_path, arch):
    """aux_loss_scope 'model' (what --init_from keeps of Qwen3-MoE and OLMoE): the loss's
    statistics pooled over the layers, equal to transformers' load_balancing_loss_func on
    the same weights and ids; the per-layer form is about layers times larger."""
    transformers = pytest.importorskip("transformers")
    olmoe = arch == "OlmoeForCausalLM"
    cfg = tiny(**(DIALECTS["olmoe"][2] if olmoe else dict(dense_layers=0, aux_loss=0.01,
                                                          aux_loss_scope="model")))  # fmt: skip
    config = (olmoe_config if olmoe else qwen3_config)(transformers, cfg)
    config.router_aux_loss_coef = 0.01
    config.output_router_logits = True
    torch.manual_seed(0)
    theirs = getattr(transformers, arch)(config)
    scramble(theirs)
    theirs.save_pretrained(tmp_path)
    got, state = from_hf(*hf_weights(tmp_path))
    assert got.aux_loss_scope == "model"
    ours = MoEGPT.empty(got)
    ours.load_state_dict(state)
    x = ids()
    with torch.no_grad():
        expected = theirs.eval()(x, labels=x).aux_loss.item() * 0.01
        pooled = ours.aux_objective(ours.train().trunk(x)[1]).item()
        got.aux_loss_scope = "layer"
        per_layer = ours.aux_objective(ours.trunk(x)[1]).item()
    assert pooled == pytest.approx(expected, rel=1e-5)
    assert per_layer / pooled > 2  # 3 MoE layers: 3 times where balanced, more where not


def test_what_each_dialect_does_not_compute_is_refused_by_name():
    olmoe = DIALECTS["olmoe"][2]
    cases = [
        (dict(**olmoe, shared_experts=1), "^model.shared_experts 1: OlmoeForCausalLM"),
        ({**olmoe, "dense_layers": 1}, "^model.dense_layers 1: OlmoeForCausalLM"),
        (dict(router_score="sigmoid", qk_norm_scope="projection"),
         "^model.qk_norm_scope 'projection': Glm4MoeForCausalLM"),
        (dict(router_score="sigmoid", experts=1, top_k=1), "^model.experts 1: Glm4Moe"),
    ]  # fmt: skip
    for settings, message in cases:
        with pytest.raises(NotExportable, match=message):
            hf_config(tiny(**settings), 128, None, None)
    glm = hf_config(tiny(**DIALECTS["glm4"][2]), 128, None, None)
    for key, value in [("n_group", 4), ("partial_rotary_factor", 0.5), ("attention_bias", True)]:
        with pytest.raises(NotExportable, match=f"Glm4MoeForCausalLM with {key} "):
            config_from_hf({**glm, key: value})
    # GLM's own default rotates half of each head: refused where the key is missing.
    no_factor = {k: v for k, v in glm.items() if k != "partial_rotary_factor"}
    no_factor["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(NotExportable, match="partial_rotary_factor 0.5"):
        config_from_hf(no_factor)
    with pytest.raises(NotExportable, match="OlmoeForCausalLM with clip_qkv 8"):
        config_from_hf({**OLMOE_1B_7B, "clip_qkv": 8.0})


def test_olmoe_1b_7b_config_reads_as_a_model_of_its_parameters():
    """OLMoE-1B-7B's published config.json builds a MoEGPT of the parameters transformers'
    OlmoeForCausalLM has for it, 6.92B, 1.28B of them active a token; it is the preset's
    architecture, and balances as the preset does."""
    transformers = pytest.importorskip("transformers")
    cfg = config_from_hf(OLMOE_1B_7B)
    with torch.device("meta"):
        theirs = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**OLMOE_1B_7B))
        ours = MoEGPT(cfg)
    counts = [sum(p.numel() for p in m.parameters()) for m in (ours, theirs)]
    assert counts[0] == counts[1], counts
    assert 6.9e9 < counts[0] < 6.95e9
    # Active as OLMoE counts them (1.3B), with the input embedding, which GPT.num_params
    # (and so MFU's count) leaves out: a lookup, not a multiply.
    active = ours.active_params() + ours.embed.weight.numel()
    assert 1.25e9 < active < 1.3e9, active
    from pytrain.config import parse_args

    preset = parse_args(["--config", str(OLMOE_PRESET)]).model
    assert preset.architecture() == cfg.architecture()
    assert (preset.aux_loss, preset.aux_loss_scope, preset.balance_rate) == (0.01, "model", 0.0)
