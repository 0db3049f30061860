"""A GPT in one file: RMSNorm, rotary positions, SwiGLU (or GELU) MLP, optional tied
embeddings, attention through `scaled_dot_product_attention` with document masking
for packed rows, and a loss summed over the tokens the loss mask keeps.

Document masking: a token attends only to earlier tokens of its own document (doc_ids).
Backends: 'fa4' (FlashAttention-4 over document segments, `pytrain.model.flash4`; Hopper and
Blackwell with flash-attn-4 installed), 'flex' (FlexAttention block mask; CUDA), 'sdpa_mask'
(a boolean mask given to SDPA; correct everywhere, O(T^2) memory), 'causal' (plain causal
attention across documents, as nanoGPT does). 'auto' picks fa4 where it runs, else flex on
CUDA when compiled, else sdpa_mask."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pytrain.config import SELECTIVE, ConfigError, checkpoint_every
from pytrain.model import flash4, fused_ce, fused_gelu, fused_swiglu, quack_swiglu, selective_ac
from pytrain.model.config import ModelConfig

__all__ = ["GPT", "ModelConfig", "document_mask"]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on for x's device, else x's own."""
    t = x.device.type
    return torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else x.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16/fp16 autocast.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(
            x
        ) * self.weight


def rope_tables(head_dim: int, max_len: int, base: float, cfg: ModelConfig | None = None):
    """(cos, sin) of each position's angles, (max_len, head_dim / 2), in fp32."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if cfg is not None and cfg.rope_scaling == "llama3":
        inv = llama3_scaled(inv, cfg.rope_factor, cfg.rope_original_len)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def llama3_scaled(inv: torch.Tensor, factor: float, original_len: int) -> torch.Tensor:
    """Llama 3.1's RoPE frequency scaling (as transformers' `rope_type: llama3` computes it,
    low_freq_factor 1, high_freq_factor 4): long wavelengths slowed by `factor`, short ones
    kept, a smooth blend between."""
    low, high = 1.0, 4.0
    wavelen = 2 * math.pi / inv
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > original_len / low, inv / factor, inv)
    middle = (wavelen <= original_len / low) & (wavelen >= original_len / high)
    return torch.where(middle, blended, out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/sin: (B, T, 1, D/2), gathered at the position ids and already
    in x's dtype (rotating in bf16 halves the traffic; the angles were computed in fp32)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean: causal and within the same document. Padding (-1) attends
    to itself only, so no row of the mask is empty (an empty row would give NaN)."""
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    eye = torch.eye(T, dtype=torch.bool, device=doc_ids.device)
    return ((causal & same) | eye)[:, None]


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def sdpa(q, k, v, backend: str = "auto", **kwargs) -> torch.Tensor:
    """scaled_dot_product_attention, restricted to one kernel unless backend is 'auto'.
    torch.compile traces the sdpa_kernel context (one backend, no priority list)."""
    if backend in ("auto", "fa4"):  # fa4 takes no boolean mask: torch's choice does
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]
    with sdpa_kernel([kind]):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


class KVCache:
    """One layer's keys and values during generation, (B, n_kv_head, max_len, D), filled in
    order: each new token attends to the cached ones instead of recomputing the prefix (with
    grouped-query attention the cache holds the key/value heads only)."""

    def __init__(self, max_len: int) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.max_len = max_len

    def update(self, k: torch.Tensor, v: torch.Tensor):
        """Appends (B, H, T, D) keys/values; returns all of them so far."""
        max_len = self.max_len
        if self.k is None:
            B, H, _, D = k.shape
            self.k = k.new_empty(B, H, max_len, D)
            self.v = v.new_empty(B, H, max_len, D)
        assert self.v is not None
        end = self.length + k.shape[2]
        if end > max_len:
            raise ValueError(f"generation past the model's {max_len} positions")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.kv_heads, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # One projection for q, k, v: n_head + 2 * kv_heads heads, queries first.
        self.qkv = nn.Linear(
            cfg.d_model, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False
        )
        self.enable_gqa = cfg.kv_heads != cfg.n_head
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        self.backend = cfg.sdpa_backend
        # Queries and keys normalised before RoPE: each head alone (Qwen3), or all the
        # heads of the projection together (OLMoE: one weight as wide as it).
        self.qk_norm = cfg.qk_norm and cfg.qk_norm_scope
        if self.qk_norm:
            span = {"head": (1, 1), "projection": (cfg.n_head, cfg.kv_heads)}[cfg.qk_norm_scope]
            self.q_norm = RMSNorm(span[0] * cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(span[1] * cfg.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        C = self.n_head * self.head_dim  # d_model, unless model.head_size sets it (Qwen3)
        # (B, T, H, D) views of one projection: FA4's layout; SDPA and flex take the
        # (B, H, T, D) transpose of the same views (no copy).
        q, k, v = (
            self.qkv(x)
            .view(B, T, -1, self.head_dim)
            .split((self.n_head, self.kv_heads, self.kv_heads), dim=2)
        )
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm:  # over (B, T, heads x D), back to the heads' view
            q, k = (n(t.flatten(2)).view_as(t) for n, t in ((self.q_norm, q), (self.k_norm, k)))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(mask, flash4.Segments) or (mask is None and self.backend == "fa4"):
            if self.training and self.dropout:
                raise ValueError("FlashAttention-4 has no attention dropout; set dropout=0")
            return self.proj(flash4.attention(q, k, v, mask).reshape(B, T, C))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if cache is not None:  # generation: a causal prefill, then one token at a time
            past = cache.length
            if past and T > 1:
                raise ValueError(
                    "a cached forward takes the whole prompt first, then one token at a time"
                )
            k, v = cache.update(k, v)
            y = sdpa(q, k, v, self.backend, is_causal=T > 1, enable_gqa=self.enable_gqa)
            return self.proj(y.transpose(1, 2).reshape(B, T, C))
        if mask is None:
            y = sdpa(q, k, v, self.backend, is_causal=True, dropout_p=p, enable_gqa=self.enable_gqa)
        elif isinstance(mask, torch.Tensor):
            y = sdpa(q, k, v, self.backend, attn_mask=mask, dropout_p=p, enable_gqa=self.enable_gqa)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=self.enable_gqa)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, hidden: int = 0):
        """`hidden`: the width, where not cfg.mlp_hidden (a mixture's shared experts)."""
        super().__init__()
        self.cfg = cfg
        self.swiglu = cfg.mlp == "swiglu"
        hidden = hidden or cfg.mlp_hidden
        self.up = nn.Linear(cfg.d_model, hidden * (2 if self.swiglu else 1), bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x):
        training, dtype = self.training and torch.is_grad_enabled(), compute_dtype(x)
        if self.swiglu and training and quack_swiglu.used(self.cfg, x.device, dtype):
            return quack_swiglu.mlp(x, self.up.weight, self.down.weight, dtype)
        if self.swiglu:
            u = self.up(x)
            if training and fused_swiglu.used(self.cfg, x.device):
                return self.down(fused_swiglu.swiglu(u))
            a, b = u.chunk(2, dim=-1)
            return self.down(F.silu(a) * b)
        if training and fused_gelu.used(self.cfg, x.device, dtype):
            return fused_gelu.mlp(x, self.up.weight, self.down.weight, dtype)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    recompute: dict | None

    def __init__(self, cfg: ModelConfig, mlp: nn.Module):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = mlp
        # A mixture of experts returns its auxiliary loss beside its output (None where it
        # has none): it travels up through the blocks' returns, not as a module attribute,
        # so that compiled and recomputed blocks give it alike.
        self.mlp_returns_aux = getattr(mlp, "returns_aux", False)
        # checkpoint()'s options where training recomputes this block's forward in the
        # backward, else None (GPT.set_activation_checkpointing).
        self.recompute: dict | None = None

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None):
        if self.training and self.recompute is not None:
            # Inside the block's forward, not around its call: FSDP2's hooks on the block
            # (Dynamo may not trace them) stay outside the checkpointed region, which
            # torch.compile then traces whole; a hook inside made it run the region eagerly.
            return checkpoint(
                self.compute, x, cos, sin, mask, use_reentrant=False, **self.recompute
            )
        return self.compute(x, cos, sin, mask, cache)

    def compute(self, x, cos, sin, mask, cache: KVCache | None = None):
        """(the block's output, its auxiliary loss or None)."""
        x = x + self.attn(self.norm1(x), cos, sin, mask, cache)
        if self.mlp_returns_aux:
            y, aux = self.mlp(self.norm2(x))
            return x + y, aux
        return x + self.mlp(self.norm2(x)), None


class GPT(nn.Module):
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.vocab = 64 * math.ceil(cfg.vocab_size / 64)
        self.embed = nn.Embedding(self.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, self.make_mlp(cfg, i)) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, self.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        # RoPE's (cos, sin) tables, filled by fill_rope_tables (init_weights calls it).
        for name in ("rope_cos", "rope_sin"):
            table = torch.empty(cfg.max_seq_len, cfg.head_dim // 2)
            self.register_buffer(name, table, persistent=False)
        self.init_weights()

    def make_mlp(self, cfg: ModelConfig, i: int) -> nn.Module:
        """Block i's MLP (a family's model class chooses its own: pytrain.model.moe)."""
        return MLP(cfg)

    @classmethod
    def create(cls, cfg: ModelConfig, device: torch.device | str) -> GPT:
        """A randomly initialised GPT built where it will live: the modules are made on the
        meta device (no memory, no draws), then allocated on `device` and initialised there
        from that device's default generator. An 8B's initialisation then takes the GPU
        moments, not minutes of one CPU thread and a host-to-device copy; ranks
        seeded alike build identical weights (on the same kind of device)."""
        gpt = cls.empty(cfg, device)
        gpt.init_weights()
        return gpt

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str = "cpu") -> GPT:
        """A GPT whose parameters are allocated on `device` but not initialised, for weights
        about to be loaded over them (a checkpoint, an export): no random draws, which for
        an 8B on the CPU take minutes of the load. Only the RoPE tables, which no state
        holds, are filled."""
        with torch.device("meta"):
            gpt = cls(cfg)
        gpt.to_empty(device=device)
        if cfg.tie_embeddings:  # to_empty gives each module its own new tensor
            gpt.head.weight = gpt.embed.weight
        gpt.fill_rope_tables()
        return gpt

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialises every parameter and the RoPE buffers in place, on the model's device:
        linear and embedding weights normal with std 0.02, the residual projections (each
        block's attention `proj` and MLP `down`) with GPT-2's 0.02 / sqrt(2 * n_layer),
        norm weights ones, biases zero. The draws are the ones GPT() always made, in the
        same order (the residual projections are drawn twice, the first draw overwritten),
        so GPT(cfg) under a seed keeps its weights. On the meta device there is nothing to
        fill: GPT.create calls it again once the model has memory."""
        if self.rope_cos.is_meta:
            return
        self.init_extra()
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            if isinstance(bias := getattr(m, "bias", None), torch.Tensor):
                nn.init.zeros_(bias)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                # GPT-2's scaled init of residual projections.
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
        self.fill_rope_tables()

    def init_extra(self) -> None:
        """What a family initialises beside the linear, embedding and norm weights (its
        buffers, weights of other shapes): nothing here."""

    @torch.no_grad()
    def fill_rope_tables(self) -> None:
        """RoPE's (cos, sin) buffers, computed on the CPU, as GPT() does, and copied: the
        same tables on every device (a GPU's cos and sin may differ from the CPU's in the
        last bit)."""
        cfg = self.cfg
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_base, cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def set_activation_checkpointing(self, every: int | str, lean: int = 0) -> None:
        """The run's activation_checkpointing ('off', 'full', 'selective', 'every-N'), or the
        blocks' stride (0: off; 1: every block, 'full'; N: every N-th block). Non-reentrant;
        'selective' keeps each block's attention and matmul outputs
        (pytrain.model.selective_ac), but the first `lean` blocks recompute their MLP's up
        projection too (ac_lean_blocks)."""
        stride = checkpoint_every(every) if isinstance(every, str) else every
        selective = every == SELECTIVE
        options = {"context_fn": selective_ac.context} if selective else {}
        blocks: list[Block] = list(self.blocks)  # type: ignore[arg-type]  # ModuleList's items
        up = getattr(blocks[0].mlp, "up", None) if blocks else None  # a dense first block's
        up_width = up.out_features if isinstance(up, nn.Linear) else 0
        lean_options = {"context_fn": functools.partial(selective_ac.lean_context, up_width)}
        for i, block in enumerate(blocks):
            chosen = lean_options if selective and i < lean else options
            block.recompute = chosen if stride and i % stride == 0 else None

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding and not self.cfg.tie_embeddings else n

    def active_params(self) -> int:
        """The non-embedding parameters one token's forward multiplies by: all of them in a
        dense model (a mixture of experts counts only the experts a token is routed to)."""
        return self.num_params()

    # ---- a family's hooks around the optimizer step (none for a dense model) ----------------
    def after_micro_batch(self) -> None:
        """Called after each micro-batch's backward (a mixture of experts adds up its load)."""

    def after_update(self, skipped: torch.Tensor) -> torch.Tensor | None:
        """Called after each optimizer step, `skipped` 1 on the device where the step guard
        skipped it (a mixture of experts moves its balancing bias). Returns what the logs
        read of this step, on the device, with routing_stats (a mixture of experts: its
        loads); a dense model nothing."""
        return None

    def step_sums(self) -> list[torch.Tensor]:
        """State of the step, beside the gradients, that replica groups sum over each other
        (pytrain.train.replica_groups; a mixture of experts: its loads); none here."""
        return []

    def discard_step(self) -> None:
        """Forgets what a step that did not commit added to step_sums."""

    def routing_stats(self, window: torch.Tensor) -> dict[str, float]:
        """Scalars for the logs at a log step from `window`, the sum of after_update's
        returns over the steps since the last log line (a mixture of experts: each layer's
        expert load); a dense model has none."""
        return {}

    def attention_backend(self, device: torch.device, compiled: bool) -> str:
        """FA4 runs compiled or not; FlexAttention is fast only when compiled (uncompiled
        it materialises scores)."""
        a = self.cfg.attention
        fa4 = device.type == "cuda" and flash4.available(device.index or 0)
        if a == "auto":
            if fa4:
                return "fa4"
            return (
                "flex" if compiled and device.type == "cuda" and flex_available() else "sdpa_mask"
            )
        if a == "fa4" and not fa4:
            raise ConfigError(flash4.NEEDS)
        return a

    def make_mask(
        self, doc_ids: torch.Tensor | None, backend: str, cu_seqlens: torch.Tensor | None = None
    ):
        """What the blocks take as `mask` for this batch: None (plain causal), a boolean
        mask, a flex BlockMask, or FA4 segments (`cu_seqlens` from the host batch)."""
        if doc_ids is None or backend == "causal":
            return None
        if backend == "fa4":
            if cu_seqlens is None:
                raise ValueError("attention 'fa4' needs the batch's cu_seqlens")
            return flash4.Segments(cu_seqlens, doc_ids.shape[-1])
        if backend == "sdpa_mask":
            return document_mask(doc_ids)
        from torch.nn.attention.flex_attention import create_block_mask

        def doc_causal(b, h, q, kv):
            return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

        B, T = doc_ids.shape
        return create_block_mask(doc_causal, B, None, T, T, device=doc_ids.device)

    def forward(self, input_ids, position_ids=None, mask=None) -> torch.Tensor:
        """Logits (B, T, vocab). `mask` comes from make_mask (None: plain causal)."""
        return self.head(self.hidden(input_ids, position_ids, mask))

    def hidden(
        self, input_ids, position_ids=None, mask=None, caches: list[KVCache] | None = None
    ) -> torch.Tensor:
        """The normalised last hidden state (B, T, d_model), what the output layer reads.
        With `caches` (generation), positions continue after the cached tokens."""
        return self.trunk(input_ids, position_ids, mask, caches)[0]

    def trunk(
        self, input_ids, position_ids=None, mask=None, caches: list[KVCache] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, the blocks' auxiliary losses summed, or None where no block has one)."""
        B, T = input_ids.shape
        if position_ids is None:
            start = caches[0].length if caches else 0
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        pos = position_ids.long()
        x = self.embed(input_ids)
        dtype = compute_dtype(x)
        # The embedding's dtype is the parameters' (bf16 with master weights).
        x = x.to(dtype if self.cfg.residual == "compute" else torch.float32)
        cos, sin = (t[pos][:, :, None].to(dtype) for t in (self.rope_cos, self.rope_sin))
        aux = None
        for i, block in enumerate(self.blocks):
            x, a = block(x, cos, sin, mask, caches[i] if caches else None)
            aux = a if aux is None else aux if a is None else aux + a
        return self.norm(x), aux

    def aux_objective(self, aux: torch.Tensor) -> torch.Tensor:
        """The loss of the blocks' summed auxiliary terms (a family whose blocks return
        statistics to pool over layers turns them into one here)."""
        return aux

    def uses_fused_ce(self, device: torch.device) -> bool:
        """Whether training steps compute the loss with pytrain.model.fused_ce."""
        choice = self.cfg.fused_ce
        return choice == "on" or (choice == "auto" and fused_ce.triton_available(device))

    def uses_float8_head(self, device: torch.device) -> bool:
        """Whether the fused output layer multiplies in FP8: where training uses it, 'on',
        or 'auto' on a GPU with FP8 matmuls (compute capability 8.9 and later: Ada, Hopper,
        Blackwell)."""
        choice = self.cfg.float8_head
        if choice == "auto" and device.type == "cuda":
            choice = "on" if torch.cuda.get_device_capability(device) >= (8, 9) else "off"
        return choice == "on" and self.uses_fused_ce(device)

    def loss_sum(self, input_ids, targets, position_ids, loss_mask, mask) -> torch.Tensor:
        """Cross-entropy summed over the tokens where loss_mask is true. Masked targets
        become ignore_index, so no fp32 copy of the logits is made outside the fused
        kernel (cross_entropy computes in fp32 under autocast). In training with
        `fused_ce`, the output layer and the loss are one op (pytrain.model.fused_ce).

        The blocks' auxiliary losses (a mixture of experts' balancing terms, each a mean
        over the micro-batch) count once a loss token, so that the step's objective is the
        mean cross-entropy plus their token-weighted mean; they enter the gradient only,
        the value returned (and logged) being the cross-entropy alone."""
        h, aux = self.trunk(input_ids, position_ids, mask)
        targets = torch.where(loss_mask, targets, fused_ce.IGNORE_INDEX).flatten()
        if self.training and torch.is_grad_enabled() and self.uses_fused_ce(h.device):
            x = h.flatten(0, 1).to(compute_dtype(h))
            fp8 = self.uses_float8_head(h.device)
            loss = fused_ce.linear_cross_entropy(x, self.head.weight, targets, fp8=fp8)
        else:
            logits = self.head(h)
            loss = F.cross_entropy(
                logits.flatten(0, 1), targets, ignore_index=fused_ce.IGNORE_INDEX, reduction="sum"
            )
        if aux is not None:
            aux = self.aux_objective(aux)
            loss = loss + (aux - aux.detach()) * loss_mask.sum()
        return loss

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        n: int,
        temperature: float = 0.8,
        top_k: int = 50,
        stop: int | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Up to n tokens after `ids` (1, T): greedy at temperature 0, else sampled from
        the top_k. With `use_cache` the prompt is run once and each new token attends to
        cached keys and values (stops at max_seq_len); without, the window of the last
        max_seq_len tokens is recomputed for every token."""
        caches = [KVCache(self.cfg.max_seq_len) for _ in self.blocks] if use_cache else None
        if use_cache:
            n = min(n, self.cfg.max_seq_len - ids.shape[1])
        nxt = ids
        for _ in range(n):
            ctx = nxt if use_cache else ids[:, -self.cfg.max_seq_len :]
            h = self.hidden(ctx, caches=caches)[:, -1:]
            logits = self.head(h)[:, -1, : self.cfg.vocab_size].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
                logits[logits < v[:, [-1]]] = -float("inf")
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
            if stop is not None and int(nxt) == stop:
                break
        return ids


class LossModule(nn.Module):
    """What is compiled and wrapped: GPT plus the summed, masked loss."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, targets, position_ids, loss_mask, mask):
        return self.gpt.loss_sum(input_ids, targets, position_ids, loss_mask, mask)
