"""The model in Hugging Face terms: which standard `transformers` class computes what a
GPT of a given ModelConfig computes, and the weights renamed both ways. No transformers
import here (the trainer never needs it); pytrain.export writes the directory.

    mlp="swiglu" -> LlamaForCausalLM  (RMSNorm, rotary, SwiGLU, no biases)
    mlp="gelu"   -> ArceeForCausalLM  (Llama with a plain up/down MLP; hidden_act "gelu")

Both: pre-norm RMSNorm (model.norm_eps), rotary on the first/second halves of each head
(Llama's rotate_half), no biases, a final RMSNorm, tied or untied output layer, the
vocabulary as the model pads it (a multiple of 64; ids past the tokenizer are never
produced by it). `from_hf` reads such a directory back, whether pytrain or someone else
wrote it (Meta's Llama 3.x checkpoints included), and refuses the variants our GPT does not
compute (biases, another head size or activation, other RoPE scaling) by name."""

from __future__ import annotations

import re

import torch

from pytrain.model.config import ModelConfig

ARCHITECTURES = {"swiglu": ("llama", "LlamaForCausalLM"), "gelu": ("arcee", "ArceeForCausalLM")}
CLASSES = tuple(arch for _, arch in ARCHITECTURES.values())
"""The transformers classes from_hf reads (pytrain.model.families looks a directory up)."""
LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
"""Llama 3.1's RoPE scaling as pytrain computes it (those of every Llama 3.x checkpoint)."""
LOGITS_TOLERANCE = 1e-4
"""The largest |logit| difference allowed between our GPT and the transformers class it is
exported as, both in fp32 on the CPU on the same ids (the tests and scripts/gpu_acceptance.py
check exports against it; measured: 0 for the 1B preset)."""


class NotExportable(ValueError):
    """A model variant no standard transformers class computes."""


def hf_config(cfg: ModelConfig, vocab: int, eos_id: int | None, bos_id: int | None) -> dict:
    """config.json's contents for `cfg` (a GPT with `vocab` output rows)."""
    if cfg.mlp not in ARCHITECTURES:
        raise NotExportable(
            f"model.mlp {cfg.mlp!r} has no standard transformers class; exportable: "
            + ", ".join(f"{k} ({v[1]})" for k, v in ARCHITECTURES.items())
        )
    model_type, arch = ARCHITECTURES[cfg.mlp]
    hidden = cfg.mlp_hidden
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_base}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor, **LLAMA3_FREQ_FACTORS,
                    original_max_position_embeddings=cfg.rope_original_len)  # fmt: skip
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu" if cfg.mlp == "swiglu" else "gelu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": rope,
        "rope_scaling": None if cfg.rope_scaling == "none" else rope,  # transformers 4's key
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }
    return out


def shared_to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What every family's transformers class names alike (Llama's names, which Qwen3's
    share): embedding, final norm, output layer, and each block's attention and norms (with
    QK-norm where the model has it)."""
    q_rows, kv, out = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, {}
    out["model.embed_tokens.weight"] = state["embed.weight"]
    out["model.norm.weight"] = state["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"]
    for i in range(cfg.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        qkv = state[p + "attn.qkv.weight"]
        out[q + "self_attn.q_proj.weight"] = qkv[:q_rows]
        out[q + "self_attn.k_proj.weight"] = qkv[q_rows : q_rows + kv]
        out[q + "self_attn.v_proj.weight"] = qkv[q_rows + kv :]
        out[q + "self_attn.o_proj.weight"] = state[p + "attn.proj.weight"]
        if cfg.qk_norm:
            out[q + "self_attn.q_norm.weight"] = state[p + "attn.q_norm.weight"]
            out[q + "self_attn.k_norm.weight"] = state[p + "attn.k_norm.weight"]
        out[q + "input_layernorm.weight"] = state[p + "norm1.weight"]
        out[q + "post_attention_layernorm.weight"] = state[p + "norm2.weight"]
    return out


def to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """pytrain's state dict -> the transformers class's (fp32, contiguous)."""
    out = shared_to_hf(cfg, state)
    for i in range(cfg.n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        up = state[p + "mlp.up.weight"]
        if cfg.mlp == "swiglu":  # up = [gate (through SiLU); up]
            h = up.shape[0] // 2
            out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = up[:h], up[h:]
        else:
            out[q + "mlp.up_proj.weight"] = up
        out[q + "mlp.down_proj.weight"] = state[p + "mlp.down.weight"]
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def from_hf(config: dict, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict]:
    """A Hugging Face directory's config.json and weights -> (ModelConfig, state dict):
    one written by pytrain.export, or a Llama/Arcee checkpoint from elsewhere. NotExportable
    names the first setting our GPT does not compute."""
    arch = (config.get("architectures") or ["?"])[0]
    mlp = {v[1]: k for k, v in ARCHITECTURES.items()}.get(arch)
    if mlp is None:
        raise NotExportable(
            f"{arch} is not a class pytrain reads ({', '.join(v[1] for v in ARCHITECTURES.values())})"
        )
    d, n_layer = config["hidden_size"], config["num_hidden_layers"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    n_head = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or n_head
    unsupported: dict[str, tuple[object, object]] = {
        "attention_bias": (config.get("attention_bias", False), False),
        "mlp_bias": (config.get("mlp_bias", False), False),
        "hidden_act": (config.get("hidden_act"), "silu" if mlp == "swiglu" else "gelu"),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        for k, v in LLAMA3_FREQ_FACTORS.items():
            unsupported[f"rope {k}"] = (rope.get(k, v), v)
    elif rope_type != "default":
        unsupported["rope_type"] = (rope_type, "default or llama3")
    refuse_unsupported(arch, config, unsupported, "GPT")
    cfg = ModelConfig(
        vocab_size=config["vocab_size"], n_layer=n_layer, n_head=n_head,
        n_kv_head=0 if kv == n_head else kv, d_model=d, mlp=mlp, head_size=head_size_of(config),
        # Without the key (LlamaConfig's default is untied), the weights tell.
        tie_embeddings=config.get("tie_word_embeddings", "lm_head.weight" not in weights),
        rope_base=config.get("rope_theta") or rope.get("rope_theta", 10000.0),
        max_seq_len=config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
    )  # fmt: skip
    if rope_type == "llama3":
        cfg.rope_scaling, cfg.rope_factor = "llama3", rope["factor"]
        cfg.rope_original_len = rope["original_max_position_embeddings"]
    cfg.mlp_ratio = config["intermediate_size"] / d / (2 / 3 if mlp == "swiglu" else 1)
    if cfg.mlp_hidden != config["intermediate_size"]:
        raise NotExportable(
            f"{arch} with intermediate_size {config['intermediate_size']}: pytrain's MLP widths "
            "are multiples of 64"
        )
    state = {
        "embed.weight": weights["model.embed_tokens.weight"],
        "norm.weight": weights["model.norm.weight"],
    }
    state["head.weight"] = weights.get("lm_head.weight", state["embed.weight"])
    for i in range(n_layer):
        p, q = f"blocks.{i}.", f"model.layers.{i}."
        qkv = [weights[q + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        state[p + "attn.qkv.weight"] = torch.cat(qkv)
        state[p + "attn.proj.weight"] = weights[q + "self_attn.o_proj.weight"]
        state[p + "norm1.weight"] = weights[q + "input_layernorm.weight"]
        state[p + "norm2.weight"] = weights[q + "post_attention_layernorm.weight"]
        if mlp == "swiglu":
            parts = [weights[q + "mlp.gate_proj.weight"], weights[q + "mlp.up_proj.weight"]]
            state[p + "mlp.up.weight"] = torch.cat(parts)
        else:
            state[p + "mlp.up.weight"] = weights[q + "mlp.up_proj.weight"]
        state[p + "mlp.down.weight"] = weights[q + "mlp.down_proj.weight"]
    return cfg, state


def refuse_unsupported(arch: str, config: dict, unsupported: dict, ours: str) -> None:
    """NotExportable naming the first of `unsupported`'s settings ({key: (the config's,
    what our `ours` model computes)}) that differs, the vocabulary's size included."""
    if config["vocab_size"] % 64:  # ours pads it: the extra logits would change the loss
        unsupported = {**unsupported, "vocab_size": (config["vocab_size"], "a multiple of 64")}
    for key, (got, computed) in unsupported.items():
        if got != computed:
            raise NotExportable(
                f"{arch} with {key} {got!r}: pytrain's {ours} computes {computed!r}"
            )


def head_size_of(config: dict) -> int:
    """model.head_size for a config.json: 0 where its heads are hidden_size / heads wide."""
    plain = config["hidden_size"] // config["num_attention_heads"]
    return 0 if (config.get("head_dim") or plain) == plain else config["head_dim"]


def strip_prefixes(state: dict) -> dict:
    """Keys as GPT names them (without torch.compile's or a wrapper's prefixes)."""
    return {re.sub(r"^(_orig_mod\.|module\.|gpt\.)+", "", k): v for k, v in state.items()}
