"""The model's settings, apart from the model so that config parsing needs no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

ARCHITECTURE = ("family", "vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "mlp",
                "mlp_ratio", "tie_embeddings", "rope_base", "rope_scaling", "rope_factor",
                "rope_original_len", "norm_eps", "head_size", "qk_norm", "qk_norm_scope", "experts", "top_k", "expert_hidden",
                "shared_experts", "dense_layers", "router_score", "norm_topk",
                "route_scale")  # fmt: skip

BALANCE = ("balance_rate", "aux_loss", "aux_loss_scope", "seq_aux_loss", "z_loss")
"""How a mixture of experts balances its load (a source's own where --init_from reads a
Hugging Face directory)."""

CHOICES = {
    "mlp": ("swiglu", "gelu"),
    "attention": ("auto", "fa4", "flex", "sdpa_mask", "causal"),
    "sdpa_backend": ("auto", "cudnn", "flash", "efficient", "math", "fa4"),
    "residual": ("fp32", "compute"),
    "fused_ce": ("auto", "on", "off"),
    "float8_head": ("auto", "on", "off"),
    "fused_gelu": ("auto", "on", "off"),
    "fused_swiglu": ("auto", "on", "off", "quack"),
    "float8": ("off", "tensorwise", "rowwise"),
    "rope_scaling": ("none", "llama3"),
    "family": ("dense", "moe"),
    "router_score": ("softmax", "sigmoid"),
    "qk_norm_scope": ("head", "projection"),
    "aux_loss_scope": ("layer", "model"),
    "moe_kernel": ("auto", "grouped", "loop", "float8"),
}
"""The settings that take one of a few words, and the words: checked where the command line
and presets are read (one line naming the setting) and where a model is built."""


@dataclass
class ModelConfig:
    family: str = "dense"
    """The model registry's entry (pytrain.model.families): 'dense' (every block's MLP
    dense: Llama, or GPT with GELU) or 'moe' (mixture of experts: each block's MLP a router
    over `experts` SwiGLU experts, the first `dense_layers` blocks dense; Qwen3-MoE,
    OLMoE, DeepSeek-V3's routing)."""
    vocab_size: int = 4096
    """Rounded up to a multiple of 64 for fast matmuls; set from the dataset if 0."""
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 0
    """Key/value heads (grouped-query attention: each serves n_head / n_kv_head query heads,
    a smaller KV cache and qkv projection); 0 = n_head (multi-head attention)."""
    d_model: int = 256
    mlp: str = "swiglu"
    """'swiglu' or 'gelu'."""
    mlp_ratio: float = 4.0
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    rope_scaling: str = "none"
    """'none', or 'llama3': Llama 3.1's RoPE frequency scaling, as Llama-3.1/3.2 models use
    it: frequencies whose wavelength exceeds rope_original_len are divided by rope_factor,
    those under rope_original_len / 4 kept, a smooth blend between."""
    rope_factor: float = 32.0
    rope_original_len: int = 8192
    norm_eps: float = 1e-6
    """The RMSNorms' epsilon. Llama 3's checkpoints use 1e-5 (`--init_from` takes it from
    their config.json)."""
    dropout: float = 0.0
    attention: str = "auto"
    """'auto', 'fa4', 'flex', 'sdpa_mask' or 'causal' (see pytrain.model.gpt's docstring)."""
    sdpa_backend: str = "auto"
    """Kernel behind scaled_dot_product_attention: 'auto' (torch's choice), 'cudnn',
    'flash', 'efficient', 'math', or 'fa4' (FlashAttention-4 from the flash-attn-4 package,
    for plain causal attention: attention='causal' and evaluation without documents)."""
    residual: str = "fp32"
    """dtype of the residual stream under autocast: 'fp32' (as nanoGPT keeps it, also
    when the parameters are bf16) or 'compute' (bf16/fp16: half the memory traffic of the norms and
    residual adds, as trainers with bf16 parameters have it)."""
    fused_ce: str = "auto"
    """Output layer + cross-entropy as one op that never keeps the logits
    (`pytrain.model.fused_ce`), in training: 'auto' (on CUDA with Triton), 'on', 'off'."""
    float8_head: str = "off"
    """The fused output layer's three matmuls in FP8 (`torch._scaled_mm`, e4m3 input and
    weight, e5m2 logit gradient; pytrain.model.fused_ce), in training: 'auto' (on GPUs with
    FP8 matmuls: Ada, Hopper, Blackwell), 'on', 'off'. Evaluation stays in bf16."""
    fused_gelu: str = "off"
    """The GELU MLP's activation inside its two matmuls (cuBLASLt epilogues through
    nvmath-python, the `cublaslt` extra; pytrain.model.fused_gelu), in training: 'auto' (on
    CUDA where nvmath-python imports, in bf16/fp16), 'on', 'off'. Its GELU is the tanh form,
    within bf16 rounding of the erf form that evaluation keeps."""
    fused_swiglu: str = "off"
    """The SwiGLU MLP's activation fused, in training. 'quack': the whole MLP as quack's
    gated GEMMs, the activation inside the matmuls (pytrain.model.quack_swiglu; Hopper or
    Blackwell with quack-kernels, bf16/fp16, float8 off). 'on': the activation as two
    Triton ops whose backward writes the up projection's gradient in one pass
    (pytrain.model.fused_swiglu; keeps the activation's output for backward). 'auto':
    quack where it runs, else the Triton ops on CUDA. 'off'. The Llama presets set 'auto'
    (BENCHMARKS.md, "Llama 1B against torchtitan")."""
    float8: str = "off"
    """FP8 matmuls for the blocks' linear layers in training, through torchao (optional
    extra `float8`; GPUs with FP8: Ada, Hopper, Blackwell): 'off', 'tensorwise' or
    'rowwise' (torchao's recipes). pytrain/model/float8.py."""
    max_seq_len: int = 4096
    head_size: int = 0
    """Each attention head's width; 0 = d_model / n_head. Qwen3's are wider: 32 heads of
    128 over d_model 2048 (queries of 4096 projected back to 2048)."""
    qk_norm: bool = False
    """An RMSNorm over the queries and keys before RoPE (Qwen3, OLMoE, GLM-4.5), over the
    span qk_norm_scope names."""
    qk_norm_scope: str = "head"
    """What one QK-norm normalises: 'head' (each query and key head on its own, with one
    weight of head_size: Qwen3, GLM-4.5) or 'projection' (all the query heads together, and
    all the key heads, with a weight as wide as the projection: OLMoE)."""
    # ---- mixture of experts (family 'moe'; pytrain.model.moe) ----------------------------
    experts: int = 8
    """Routed experts in each MoE block."""
    top_k: int = 2
    """Experts each token is routed to (dropless: every token reaches all of its top_k)."""
    expert_hidden: int = 0
    """Each expert's SwiGLU width; 0 = the dense MLP's (mlp_hidden)."""
    shared_experts: int = 0
    """Experts every token passes through besides its routed ones (DeepSeek-V3: 1), as one
    SwiGLU of shared_experts x expert_hidden."""
    dense_layers: int = 0
    """The first blocks with a dense MLP instead of experts (DeepSeek-V3: 3)."""
    router_score: str = "softmax"
    """The router's scores from its fp32 logits: 'softmax' (Qwen3-MoE, OLMoE: exported as
    theirs where no bias moved) or 'sigmoid' (DeepSeek-V3, GLM-4.5: exported as
    Glm4MoeForCausalLM, the bias included). Softmax stays the default: under the bias, at
    8 experts and top-2, sigmoid's validation loss was 0.6% higher on both of two seeds
    (BENCHMARKS.md, "Mixture of experts: quality")."""
    norm_topk: bool = True
    """The top_k weights rescaled to sum to 1 (Qwen3-MoE: yes; OLMoE: no)."""
    route_scale: float = 1.0
    """The routed experts' output multiplied by this (DeepSeek-V3's routed_scaling_factor)."""
    balance_rate: float = 1e-3
    """Auxiliary-loss-free load balancing (DeepSeek-V3): after each optimizer step, each
    expert's bias, added to its score for choosing experts only, moves by this much towards
    the mean load (up when underused, down when overused); 0 = off. The bias is in the
    checkpoint."""
    aux_loss: float = 0.0
    """The global load-balancing loss's weight (Switch, Qwen3-MoE: 0.001, OLMoE: 0.01):
    experts x sum over experts of (tokens routed to it / tokens) x its mean score, over each
    micro-batch, pooled as aux_loss_scope says."""
    aux_loss_scope: str = "layer"
    """Where the balancing loss's statistics are pooled: 'layer' (a product per MoE layer,
    the products summed: Megatron's; balanced, it is top_k a layer) or 'model' (the tokens
    and scores summed over every MoE layer first, one product: transformers' Qwen3-MoE and
    OLMoE, whose loss is about 1 / layers of the 'layer' form's)."""
    seq_aux_loss: float = 0.0
    """The sequence-level balancing loss's weight (DeepSeek-V3: 1e-4): the same within
    each row, averaged over rows."""
    z_loss: float = 0.0
    """The router z-loss's weight (ST-MoE: 1e-3): the mean squared log-sum-exp of the
    router's logits."""
    moe_kernel: str = "auto"
    """The experts' matmuls: 'grouped' (torch._grouped_mm over the tokens sorted by expert,
    no host sync), 'loop' (one matmul an expert: the reference), 'auto' (grouped on CUDA,
    loop elsewhere), 'float8' (grouped in FP8 with rowwise scales in training, through
    torchao's MoE path, as torchtitan's float8 experts; GPUs with FP8 matmuls; evaluation
    stays grouped in bf16)."""

    @classmethod
    def from_saved(cls, model: dict) -> ModelConfig:
        """A [model] section as a checkpoint saved it (keys this version lacks are dropped;
        keys the checkpoint lacks take their defaults)."""
        return cls(**{k: v for k, v in model.items() if k in cls.__dataclass_fields__})

    def check(self) -> None:
        """ValueError naming the first setting that is not one of its words, or that does
        not fit the others."""
        for key, words in CHOICES.items():
            if getattr(self, key) not in words:
                raise ValueError(
                    f"model.{key} is {getattr(self, key)!r}; expected one of {', '.join(words)}"
                )
        if self.n_head < 1 or self.d_model < 1:
            raise ValueError(
                f"model.n_head {self.n_head} and model.d_model {self.d_model}: need >= 1"
            )
        if self.d_model % self.n_head and not self.head_size:
            raise ValueError(
                f"model.d_model {self.d_model} is not a multiple of model.n_head {self.n_head}"
            )
        if self.head_dim % 2:
            where = (f"model.head_size {self.head_size}" if self.head_size else
                     f"model.d_model {self.d_model} / model.n_head {self.n_head} = {self.head_dim}")  # fmt: skip
            raise ValueError(f"{where}, an odd head size: RoPE rotates pairs of dimensions")
        if self.n_kv_head < 0 or self.n_head % self.kv_heads:
            raise ValueError(
                f"model.n_kv_head {self.n_kv_head} does not divide model.n_head {self.n_head} "
                "(each key/value head serves a whole group of query heads; 0 = n_head)"
            )
        if self.fused_gelu == "on" and (self.mlp != "gelu" or self.float8 != "off"):
            raise ValueError(
                "model.fused_gelu=on needs model.mlp=gelu and model.float8=off "
                f"(here mlp={self.mlp}, float8={self.float8})"
            )
        if self.fused_swiglu in ("on", "quack") and self.mlp != "swiglu":
            raise ValueError(
                f"model.fused_swiglu={self.fused_swiglu} needs model.mlp=swiglu (here {self.mlp})"
            )
        if self.fused_swiglu == "quack" and self.float8 != "off":
            raise ValueError(
                f"model.fused_swiglu=quack needs model.float8=off (here {self.float8}): "
                "quack's GEMMs would bypass torchao's float8 linear layers"
            )
        if self.family == "moe":
            self.check_moe()
        if self.float8_head == "on" and self.fused_ce == "off":
            raise ValueError(
                "model.float8_head=on needs the fused output layer (model.fused_ce auto or on)"
            )

    def check_moe(self) -> None:
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"model.top_k {self.top_k} with model.experts {self.experts}: need "
                "1 <= top_k <= experts"
            )
        if not 0 <= self.dense_layers <= self.n_layer:
            raise ValueError(
                f"model.dense_layers {self.dense_layers}: need 0 <= it <= model.n_layer "
                f"{self.n_layer}"
            )
        if self.mlp != "swiglu":
            raise ValueError(f"model.family moe has SwiGLU experts: model.mlp is {self.mlp!r}")
        for key in ("expert_hidden", "shared_experts", "balance_rate", "aux_loss",
                    "seq_aux_loss", "z_loss"):  # fmt: skip
            if getattr(self, key) < 0:
                raise ValueError(f"model.{key} is {getattr(self, key)}; expected >= 0")

    def balancing(self) -> str:
        """How a mixture of experts balances its load, in words (a run's log says it)."""
        parts = []
        if self.balance_rate:
            parts.append(f"bias moved {self.balance_rate:g} a step (DeepSeek-V3)")
        if self.aux_loss:
            pooled = {"layer": "a product per MoE layer, summed (Megatron's form)",
                      "model": "its statistics pooled over the MoE layers (transformers' form)"}  # fmt: skip
            parts.append(f"aux loss {self.aux_loss:g}, {pooled[self.aux_loss_scope]}")
        if self.seq_aux_loss:
            parts.append(f"sequence aux loss {self.seq_aux_loss:g}")
        if self.z_loss:
            parts.append(f"z-loss {self.z_loss:g}")
        return "; ".join(parts) or "nothing"

    def architecture(self) -> dict:
        """The settings that define the function the weights compute, by name: a checkpoint
        resumes only under the same ones."""
        return {k: getattr(self, k) for k in ARCHITECTURE}

    @property
    def kv_heads(self) -> int:
        """Key/value heads in force (n_kv_head, or n_head where it is 0)."""
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: SwiGLU's three matrices use 2/3 of GELU's width (the same
        parameters), rounded up to a multiple of 64 for fast matmuls."""
        h = int(self.mlp_ratio * self.d_model * (2 / 3 if self.mlp == "swiglu" else 1))
        return 64 * math.ceil(h / 64)

    @property
    def expert_width(self) -> int:
        """Each expert's SwiGLU width (expert_hidden, or the dense MLP's)."""
        return self.expert_hidden or self.mlp_hidden

    def is_moe_block(self, i: int) -> bool:
        """Whether block i routes over experts."""
        return self.family == "moe" and i >= self.dense_layers
