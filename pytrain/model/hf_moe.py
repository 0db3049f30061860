"""The mixture-of-experts model in Hugging Face terms, as pytrain.model.hf is for the dense
one: which transformers class computes what a MoEGPT (model.family "moe") computes, and the
weights renamed both ways. No transformers import here (the trainer never needs it).

Three classes, each computing a part of what MoEGPT can, chosen by the model's router and
QK-norm (`dialect`):

    router_score "sigmoid"        -> Glm4MoeForCausalLM  (GLM-4.5, DeepSeek-V3's routing:
                                     sigmoid scores, the balancing bias as its
                                     e_score_correction_bias, routed_scaling_factor,
                                     shared experts, dense first blocks, optional
                                     per-head QK-norm, RoPE over the whole head)
    qk_norm_scope "projection"    -> OlmoeForCausalLM    (OLMoE: softmax scores, QK-norm
                                     over the whole query and key projections, every
                                     block routed)
    otherwise                     -> Qwen3MoeForCausalLM (softmax scores, per-head QK-norm,
                                     dense first blocks as mlp_only_layers)

What the chosen class does not compute is refused by name: for Qwen3 and OLMoE, shared
experts, a route scale, dense blocks (OLMoE), and a nonzero auxiliary-loss-free bias (it
changes which experts are chosen; both balance with an aux loss instead).

Experts are written as `save_pretrained` of transformers 5 writes them for all three: one
tensor per expert and projection (`mlp.experts.{j}.gate_proj.weight`, `up_proj`,
`down_proj`), the Hub's layout, which transformers fuses into `experts.gate_up_proj` and
`experts.down_proj` as it loads. `from_hf` reads either form.

Balancing. Qwen3-MoE and OLMoE as transformers trains them pool the balancing loss's
statistics over all MoE layers (model.aux_loss_scope "model"); a directory read here keeps
that form and its coefficient. GLM-4.5 balances with the bias (DeepSeek-V3), so a
Glm4MoeForCausalLM read here trains with balance_rate's default and no aux loss."""

from __future__ import annotations

import torch

from pytrain.model.config import ModelConfig
from pytrain.model.hf import NotExportable, head_size_of, refuse_unsupported, shared_to_hf

ARCHITECTURES = {
    "qwen3": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "glm4": ("glm4_moe", "Glm4MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
}
"""dialect -> (model_type, the transformers class)."""
CLASSES = tuple(arch for _, arch in ARCHITECTURES.values())
"""The transformers classes from_hf reads (pytrain.model.families looks a directory up)."""
DIALECTS = {arch: name for name, (_, arch) in ARCHITECTURES.items()}
DEFAULT_BALANCE_RATE = ModelConfig.balance_rate


def dialect(cfg: ModelConfig) -> str:
    """The transformers class that can compute `cfg`'s routing and attention (its key in
    ARCHITECTURES); `refusal` says what else it needs."""
    if cfg.router_score == "sigmoid":
        return "glm4"
    return "olmoe" if cfg.qk_norm and cfg.qk_norm_scope == "projection" else "qwen3"


def computes(name: str) -> dict[str, object]:
    """{setting: the value the dialect's class computes} for the settings it fixes."""
    fixed: dict[str, object] = {"rope_scaling": "none", "mlp": "swiglu"}
    if name == "glm4":
        # n_group 1, topk_group 1: its group-limited choice is plain top-k; qk_norm optional.
        return {**fixed, "router_score": "sigmoid", "qk_norm_scope": "head"}
    fixed.update(shared_experts=0, router_score="softmax", route_scale=1.0, qk_norm=True)
    if name == "olmoe":
        return {**fixed, "qk_norm_scope": "projection", "dense_layers": 0}
    return {**fixed, "qk_norm_scope": "head"}


def refusal(cfg: ModelConfig) -> str | None:
    """Why no transformers class computes `cfg`'s model, in one line; None if one does."""
    if cfg.family != "moe":
        return f"model.family {cfg.family!r}: pytrain.model.hf exports dense models"
    name = dialect(cfg)
    arch = ARCHITECTURES[name][1]
    for key, theirs in computes(name).items():
        if getattr(cfg, key) != theirs:
            return f"model.{key} {getattr(cfg, key)!r}: {arch} computes only {key} {theirs!r}"
    if name == "glm4" and cfg.experts < 2:  # its router takes the top 2 of a group
        return f"model.experts {cfg.experts}: {arch} routes over at least 2"
    return None


def hf_config(cfg: ModelConfig, vocab: int, eos_id: int | None, bos_id: int | None) -> dict:
    """config.json's contents for `cfg` (a MoEGPT with `vocab` output rows)."""
    if why := refusal(cfg):
        raise NotExportable(why)
    name = dialect(cfg)
    model_type, arch = ARCHITECTURES[name]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": rope,
        "rope_scaling": None,  # transformers 4's key
        "attention_bias": False,
        "attention_dropout": 0.0,
        "output_router_logits": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    if name == "glm4":
        rope["partial_rotary_factor"] = 1.0  # its default rotates half of each head
        return {
            **out,
            "intermediate_size": cfg.mlp_hidden,  # the dense blocks' SwiGLU width
            "moe_intermediate_size": cfg.expert_width,
            "n_routed_experts": cfg.experts,
            "n_shared_experts": cfg.shared_experts,
            "routed_scaling_factor": cfg.route_scale,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": cfg.dense_layers,
            "use_qk_norm": cfg.qk_norm,
            "partial_rotary_factor": 1.0,
            "num_nextn_predict_layers": 0,
            "pad_token_id": None,
        }
    # The balancing loss's weight, for whoever trains on from there (both balance with
    # it); the logits do not depend on it.
    out["router_aux_loss_coef"] = cfg.aux_loss
    out["num_experts"] = cfg.experts
    if name == "olmoe":
        return {**out, "intermediate_size": cfg.expert_width, "clip_qkv": None,
                "pad_token_id": None}  # fmt: skip
    return {
        **out,
        "intermediate_size": cfg.mlp_hidden,
        "moe_intermediate_size": cfg.expert_width,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.dense_layers)),  # Qwen3's word for dense blocks
        "use_sliding_window": False,
        "sliding_window": None,
    }


def check_bias(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """NotExportable if an auxiliary-loss-free bias (model.balance_rate) has moved in a
    model whose class has none: it is added to the router's scores to choose experts, so
    without it Qwen3 or OLMoE would choose others."""
    if dialect(cfg) == "glm4":
        return
    arch = ARCHITECTURES[dialect(cfg)][1]
    for key, bias in state.items():
        if key.endswith("mlp.expert_bias") and bias.count_nonzero():
            raise NotExportable(
                f"{key} is nonzero: the auxiliary-loss-free bias changes which experts are "
                f"chosen and {arch}, which computes softmax scores, has no such bias (train "
                "with model.router_score sigmoid, exported as Glm4MoeForCausalLM, or with "
                "model.balance_rate 0 and an aux loss)"
            )


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MoEGPT's state dict -> the dialect's class's, per-expert as save_pretrained writes
    it (fp32, contiguous)."""
    if why := refusal(cfg):
        raise NotExportable(why)
    check_bias(cfg, state)
    glm = dialect(cfg) == "glm4"
    out = shared_to_hf(cfg, state)
    for i in range(cfg.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        if not cfg.is_moe_block(i):
            out.update(swiglu_to_hf(state, p + "mlp.", q + "mlp."))
            continue
        out[q + "mlp.gate.weight"] = state[p + "mlp.router.weight"]
        if glm:
            out[q + "mlp.gate.e_score_correction_bias"] = state[p + "mlp.expert_bias"]
            out.update(swiglu_to_hf(state, p + "mlp.shared.", q + "mlp.shared_experts."))
        ups, downs = state[p + "mlp.experts.up"], state[p + "mlp.experts.down"]
        for j in range(cfg.experts):
            e = f"{q}mlp.experts.{j}."
            out[e + "gate_proj.weight"], out[e + "up_proj.weight"] = ups[j].chunk(2)
            out[e + "down_proj.weight"] = downs[j]
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def swiglu_to_hf(state: dict, ours: str, theirs: str) -> dict[str, torch.Tensor]:
    """One SwiGLU MLP (ours: up = [gate (through SiLU); up], down) in Llama's names. A
    model without shared experts has none: Glm4Moe's zero-wide one is then written empty."""
    if ours + "up.weight" not in state:
        d = state["norm.weight"].shape[0]
        empty = torch.zeros(0, d)
        return {theirs + "gate_proj.weight": empty, theirs + "up_proj.weight": empty,
                theirs + "down_proj.weight": torch.zeros(d, 0)}  # fmt: skip
    gate, up = state[ours + "up.weight"].chunk(2)
    return {theirs + "gate_proj.weight": gate, theirs + "up_proj.weight": up,
            theirs + "down_proj.weight": state[ours + "down.weight"]}  # fmt: skip


def swiglu_from_hf(weights: dict, theirs: str, ours: str) -> dict[str, torch.Tensor]:
    """swiglu_to_hf's inverse."""
    parts = [weights[theirs + "gate_proj.weight"], weights[theirs + "up_proj.weight"]]
    return {ours + "up.weight": torch.cat(parts), ours + "down.weight": weights[theirs + "down_proj.weight"]}  # fmt: skip


def config_from_hf(config: dict) -> ModelConfig:
    """A Qwen3MoeForCausalLM, Glm4MoeForCausalLM or OlmoeForCausalLM config.json ->
    ModelConfig; NotExportable names the first setting MoEGPT does not compute."""
    arch = (config.get("architectures") or ["?"])[0]
    name = DIALECTS.get(arch)
    if name is None:
        raise NotExportable(f"{arch} is not a class pytrain reads as a mixture of experts "
                            f"({', '.join(CLASSES)})")  # fmt: skip
    d, n_head = config["hidden_size"], config["num_attention_heads"]
    n_layer = config["num_hidden_layers"]
    kv = config.get("num_key_value_heads") or n_head
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    unsupported: dict[str, tuple[object, object]] = {
        "attention_bias": (config.get("attention_bias", False), False),
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "rope_type": (rope.get("rope_type", rope.get("type", "default")), "default"),
    }
    if name == "qwen3":
        dense = len(config.get("mlp_only_layers") or [])
        unsupported.update({
            "use_sliding_window": (config.get("use_sliding_window", False), False),
            # Qwen3's rule: block i is dense if it is in mlp_only_layers or (i + 1) is not a
            # multiple of decoder_sparse_step; ours: the first dense_layers blocks are.
            "decoder_sparse_step": (config.get("decoder_sparse_step", 1), 1),
            "mlp_only_layers": (config.get("mlp_only_layers") or [], list(range(dense))),
        })  # fmt: skip
    elif name == "olmoe":
        dense = 0
        unsupported["clip_qkv"] = (config.get("clip_qkv"), None)
    else:
        dense = config.get("first_k_dense_replace", 1)  # Glm4MoeConfig's defaults
        partial = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))
        unsupported.update({
            "partial_rotary_factor": (partial, 1.0),
            # More than one group: GLM-4.5's group-limited choice, which ours is not.
            "n_group": (config.get("n_group", 1), 1),
            "topk_group": (config.get("topk_group", 1), 1),
        })  # fmt: skip
        # GLM-4.5's multi-token-prediction layers are extra weights transformers does not
        # compute with: they are left unread.
    refuse_unsupported(arch, config, unsupported, "MoEGPT")
    # transformers writes num_experts as num_local_experts, and GLM's n_routed_experts
    experts = next(config[k] for k in ("num_experts", "n_routed_experts", "num_local_experts")
                   if k in config)  # fmt: skip
    cfg = ModelConfig(
        family="moe", vocab_size=config["vocab_size"], n_layer=n_layer, n_head=n_head,
        n_kv_head=0 if kv == n_head else kv, d_model=d, mlp="swiglu",
        head_size=head_size_of(config),  # Qwen3-30B-A3B's: 32 heads of 128 over 2048
        tie_embeddings=config.get("tie_word_embeddings", False),  # the configs' default
        rope_base=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_seq_len=config["max_position_embeddings"], norm_eps=config.get("rms_norm_eps", 1e-6),
        experts=experts, top_k=config["num_experts_per_tok"], dense_layers=dense,
    )  # fmt: skip
    if name == "glm4":
        cfg.qk_norm = bool(config.get("use_qk_norm", False))
        cfg.expert_hidden = config["moe_intermediate_size"]
        cfg.shared_experts = config.get("n_shared_experts", 1)
        cfg.router_score = "sigmoid"
        cfg.norm_topk = config.get("norm_topk_prob", True)
        cfg.route_scale = float(config.get("routed_scaling_factor", 1.0))
        # GLM-4.5 balances with the bias (DeepSeek-V3), not a loss.
        cfg.balance_rate, cfg.aux_loss = DEFAULT_BALANCE_RATE, 0.0
    else:
        cfg.qk_norm, cfg.router_score, cfg.shared_experts, cfg.route_scale = True, "softmax", 0, 1.0
        cfg.qk_norm_scope = "projection" if name == "olmoe" else "head"
        width = "intermediate_size" if name == "olmoe" else "moe_intermediate_size"
        cfg.expert_hidden = config[width]
        cfg.norm_topk = config.get("norm_topk_prob", False)  # both configs' default
        # Both balance with the global aux loss, pooled over the layers, and no bias.
        default_coef = 0.01 if name == "olmoe" else 0.001
        cfg.balance_rate, cfg.aux_loss_scope = 0.0, "model"
        cfg.aux_loss = config.get("router_aux_loss_coef", default_coef)
    if name != "olmoe":
        cfg.mlp_ratio = config["intermediate_size"] / d / (2 / 3)
        # Only dense blocks use intermediate_size: without them any width reads (and is
        # written back as mlp_hidden, which computes the same).
        if dense and cfg.mlp_hidden != config["intermediate_size"]:
            raise NotExportable(
                f"{arch} with intermediate_size {config['intermediate_size']}: pytrain's MLP "
                "widths are multiples of 64"
            )
    return cfg


def from_hf(config: dict, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict]:
    """A Qwen3-MoE, GLM-4.5-style or OLMoE directory's config.json and weights ->
    (ModelConfig, state dict), its experts one tensor per expert (the Hub's,
    save_pretrained's) or fused (transformers' in-memory `experts.gate_up_proj` /
    `experts.down_proj`)."""
    cfg = config_from_hf(config)
    glm = cfg.router_score == "sigmoid"
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
        if cfg.qk_norm:
            state[p + "attn.q_norm.weight"] = weights[q + "self_attn.q_norm.weight"]
            state[p + "attn.k_norm.weight"] = weights[q + "self_attn.k_norm.weight"]
        state[p + "norm1.weight"] = weights[q + "input_layernorm.weight"]
        state[p + "norm2.weight"] = weights[q + "post_attention_layernorm.weight"]
        if not cfg.is_moe_block(i):
            state.update(swiglu_from_hf(weights, q + "mlp.", p + "mlp."))
            continue
        state[p + "mlp.router.weight"] = weights[q + "mlp.gate.weight"]
        bias = weights.get(q + "mlp.gate.e_score_correction_bias")
        state[p + "mlp.expert_bias"] = (torch.zeros(cfg.experts) if bias is None else bias).float()
        if glm and cfg.shared_experts:
            state.update(swiglu_from_hf(weights, q + "mlp.shared_experts.", p + "mlp.shared."))
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
