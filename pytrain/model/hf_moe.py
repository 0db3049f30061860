"""The mixture-of-experts model in Hugging Face terms, as pytrain.model.hf is for the dense
one: which transformers class computes what a MoEGPT (model.family "moe") computes, and the
weights renamed both ways. No transformers import here (the trainer never needs it).

    family="moe" -> Qwen3MoeForCausalLM  (Llama's blocks with an RMSNorm over each query and
                                          key head before RoPE; each MoE block's MLP a
                                          softmax router over SwiGLU experts, top_k of them
                                          per token; the first blocks may be dense)

What Qwen3-MoE does not compute is refused by name: shared experts, sigmoid scores,
a route scale, attention without the q/k norms, RoPE scaling, and a nonzero auxiliary-loss-
free bias (it changes which experts are chosen; Qwen3 balances with an aux loss instead).

Experts are written as `save_pretrained` of transformers 5 writes them: one tensor per
expert and projection (`mlp.experts.{j}.gate_proj.weight`, `up_proj`, `down_proj`), the
Hub's Qwen3-30B-A3B layout, which transformers fuses into `experts.gate_up_proj` and
`experts.down_proj` as it loads. `from_hf` reads either form."""

from __future__ import annotations

import torch

from pytrain.model.config import ModelConfig
from pytrain.model.hf import NotExportable, head_size_of, refuse_unsupported, shared_to_hf

ARCHITECTURES = {"moe": ("qwen3_moe", "Qwen3MoeForCausalLM")}
"""model.family -> (model_type, the transformers class), as pytrain.model.hf's."""
CLASSES = tuple(arch for _, arch in ARCHITECTURES.values())
"""The transformers classes from_hf reads (pytrain.model.families looks a directory up)."""


def refusal(cfg: ModelConfig) -> str | None:
    """Why Qwen3MoeForCausalLM does not compute `cfg`'s model, in one line; None if it does."""
    if cfg.family != "moe":
        return f"model.family {cfg.family!r}: pytrain.model.hf exports dense models"
    arch = ARCHITECTURES["moe"][1]
    unsupported = {
        "shared_experts": (cfg.shared_experts, 0),
        "router_score": (cfg.router_score, "softmax"),
        "route_scale": (cfg.route_scale, 1.0),
        "qk_norm": (cfg.qk_norm, True),
        "rope_scaling": (cfg.rope_scaling, "none"),
        "mlp": (cfg.mlp, "swiglu"),
    }
    for key, (ours, theirs) in unsupported.items():
        if ours != theirs:
            return f"model.{key} {ours!r}: {arch} computes only {key} {theirs!r}"
    return None


def hf_config(cfg: ModelConfig, vocab: int, eos_id: int | None, bos_id: int | None) -> dict:
    """config.json's contents for `cfg` (a MoEGPT with `vocab` output rows)."""
    if why := refusal(cfg):
        raise NotExportable(why)
    model_type, arch = ARCHITECTURES["moe"]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,  # the dense blocks' SwiGLU width
        "moe_intermediate_size": cfg.expert_width,
        "num_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.dense_layers)),  # Qwen3's word for dense blocks
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": rope,
        "rope_scaling": None,  # transformers 4's key
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        # The balancing loss's weight, for whoever trains on from there (Qwen3 balances
        # with it); the logits do not depend on it.
        "router_aux_loss_coef": cfg.aux_loss,
        "output_router_logits": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def check_bias(state: dict[str, torch.Tensor]) -> None:
    """NotExportable if an auxiliary-loss-free bias (model.balance_rate) has moved: it is
    added to the router's scores to choose experts, so without it Qwen3 would choose others."""
    for key, bias in state.items():
        if key.endswith("mlp.expert_bias") and bias.count_nonzero():
            raise NotExportable(
                f"{key} is nonzero: the auxiliary-loss-free bias changes which experts are "
                f"chosen and {ARCHITECTURES['moe'][1]} has no such bias (train with "
                "model.balance_rate 0 and an aux loss, as Qwen3 does, to export it)"
            )


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MoEGPT's state dict -> Qwen3MoeForCausalLM's, per-expert as save_pretrained writes
    it (fp32, contiguous)."""
    check_bias(state)
    out = shared_to_hf(cfg, state)  # qk_norm: hf_config refuses a model without it
    for i in range(cfg.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        if not cfg.is_moe_block(i):  # up = [gate (through SiLU); up]
            gate, up = state[p + "mlp.up.weight"].chunk(2)
            out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
            out[q + "mlp.down_proj.weight"] = state[p + "mlp.down.weight"]
            continue
        out[q + "mlp.gate.weight"] = state[p + "mlp.router.weight"]
        ups, downs = state[p + "mlp.experts.up"], state[p + "mlp.experts.down"]
        for j in range(cfg.experts):
            e = f"{q}mlp.experts.{j}."
            out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = ups[j].chunk(2)
            out[e + "down_proj.weight"] = downs[j]
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def config_from_hf(config: dict) -> ModelConfig:
    """A Qwen3MoeForCausalLM config.json -> ModelConfig; NotExportable names the first
    setting MoEGPT does not compute."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch != ARCHITECTURES["moe"][1]:
        raise NotExportable(f"{arch} is not a class pytrain reads as a mixture of experts "
                            f"({ARCHITECTURES['moe'][1]})")  # fmt: skip
    d, n_head = config["hidden_size"], config["num_attention_heads"]
    n_layer = config["num_hidden_layers"]
    kv = config.get("num_key_value_heads") or n_head
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    dense = config.get("mlp_only_layers") or []
    unsupported = {
        "attention_bias": (config.get("attention_bias", False), False),
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope_type": (rope.get("rope_type", rope.get("type", "default")), "default"),
        "use_sliding_window": (config.get("use_sliding_window", False), False),
        # Qwen3's rule: block i is dense if it is in mlp_only_layers or (i + 1) is not a
        # multiple of decoder_sparse_step; ours: the first dense_layers blocks are.
        "decoder_sparse_step": (config.get("decoder_sparse_step", 1), 1),
        "mlp_only_layers": (dense, list(range(len(dense)))),
    }
    refuse_unsupported(arch, config, unsupported, "MoEGPT")
    cfg = ModelConfig(
        family="moe", vocab_size=config["vocab_size"], n_layer=n_layer, n_head=n_head,
        n_kv_head=0 if kv == n_head else kv, d_model=d, mlp="swiglu",
        head_size=head_size_of(config),  # Qwen3-30B-A3B's: 32 heads of 128 over 2048
        tie_embeddings=config.get("tie_word_embeddings", False),  # Qwen3MoeConfig's default
        rope_base=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_seq_len=config["max_position_embeddings"], norm_eps=config.get("rms_norm_eps", 1e-6),
        qk_norm=True,
        # transformers writes num_experts as num_local_experts (its attribute_map)
        experts=config["num_experts"] if "num_experts" in config else config["num_local_experts"],
        top_k=config["num_experts_per_tok"], expert_hidden=config["moe_intermediate_size"],
        shared_experts=0, dense_layers=len(dense), router_score="softmax",
        norm_topk=config.get("norm_topk_prob", False),  # Qwen3MoeConfig's default
        route_scale=1.0,
        # Qwen3 balances with the global aux loss, not a bias.
        balance_rate=0.0, aux_loss=config.get("router_aux_loss_coef", 0.001),
    )  # fmt: skip
    cfg.mlp_ratio = config["intermediate_size"] / d / (2 / 3)
    # Only dense blocks use intermediate_size: without them any width reads (and is
    # written back as mlp_hidden, which computes the same).
    if dense and cfg.mlp_hidden != config["intermediate_size"]:
        raise NotExportable(
            f"{arch} with intermediate_size {config['intermediate_size']}: pytrain's MLP widths "
            "are multiples of 64"
        )
    return cfg


def from_hf(config: dict, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict]:
    """A Qwen3MoeForCausalLM directory's config.json and weights -> (ModelConfig, state
    dict), its experts one tensor per expert (the Hub's, save_pretrained's) or fused
    (transformers' in-memory `experts.gate_up_proj` / `experts.down_proj`)."""
    cfg = config_from_hf(config)
    if "tie_word_embeddings" not in config:  # the weights tell
        cfg.tie_embeddings = "lm_head.weight" not in weights
    state = {
        "embed.weight": weights["model.embed_tokens.weight"],
        "norm.weight": weights["model.norm.weight"],
    }
    state["head.weight"] = weights.get("lm_head.weight", state["embed.weight"])
    for i in range(cfg.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        qkv = [weights[q + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        state[p + "attn.qkv.weight"] = torch.cat(qkv)
        state[p + "attn.proj.weight"] = weights[q + "self_attn.o_proj.weight"]
        state[p + "attn.q_norm.weight"] = weights[q + "self_attn.q_norm.weight"]
        state[p + "attn.k_norm.weight"] = weights[q + "self_attn.k_norm.weight"]
        state[p + "norm1.weight"] = weights[q + "input_layernorm.weight"]
        state[p + "norm2.weight"] = weights[q + "post_attention_layernorm.weight"]
        if not cfg.is_moe_block(i):
            parts = [weights[q + "mlp.gate_proj.weight"], weights[q + "mlp.up_proj.weight"]]
            state[p + "mlp.up.weight"] = torch.cat(parts)
            state[p + "mlp.down.weight"] = weights[q + "mlp.down_proj.weight"]
            continue
        state[p + "mlp.router.weight"] = weights[q + "mlp.gate.weight"]
        state[p + "mlp.expert_bias"] = torch.zeros(cfg.experts, dtype=torch.float32)
        if q + "mlp.experts.gate_up_proj" in weights:  # fused: [E, 2h, d] gate rows first
            state[p + "mlp.experts.up"] = weights[q + "mlp.experts.gate_up_proj"]
            state[p + "mlp.experts.down"] = weights[q + "mlp.experts.down_proj"]
            continue
        e = [f"{q}mlp.experts.{j}." for j in range(cfg.experts)]
        ups = [
            torch.cat([weights[x + "gate_proj.weight"], weights[x + "up_proj.weight"]]) for x in e
        ]
        state[p + "mlp.experts.up"] = torch.stack(ups)
        state[p + "mlp.experts.down"] = torch.stack([weights[x + "down_proj.weight"] for x in e])
    return cfg, state
