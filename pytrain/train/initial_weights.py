"""The model a new run starts from: a random initialisation of the configured shape, or
with `--init_from` weights someone else made (continued pretraining of a Llama 3.x
checkpoint, or of another pytrain run).

The source decides what the weights compute (ModelConfig's ARCHITECTURE fields: shape,
RoPE, norms, tied embeddings, vocabulary); the preset and the command line keep deciding
how it runs (attention kernel, fused ops, float8, activation checkpointing). The dataset must
have been packed with the model's tokenizer: a dataset whose vocabulary (its manifest's)
is larger than the model's is refused here, before a step, rather than read past the
embedding; one packed with another tokenizer file gets a note."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pytrain.config import ConfigError, TrainConfig
from pytrain.data.shards import manifest_tokenizer
from pytrain.data.tokenizer import for_packing, load_tokenizer
from pytrain.model import families
from pytrain.model.config import ARCHITECTURE, BALANCE, ModelConfig
from pytrain.model.gpt import GPT
from pytrain.model.hf import strip_prefixes
from pytrain.model.load import hf_model, load


def source(
    path: str, model: ModelConfig, data_vocab: int, say, datasets: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """The source's weights (our state dict's names, on the CPU); sets `model`'s
    architecture to the source's. ConfigError for a source that is not there or not a model
    we compute, and for a dataset whose vocabulary the model does not cover; a note for a
    dataset packed with another tokenizer than the source's tokenizer.json."""
    p = Path(path)
    if (p / "config.json").is_file():  # a Hugging Face directory
        cfg, state, _ = hf_model(p)
        what = f"{p.name} (Hugging Face)"
        # It balances its experts as its authors trained it (Qwen3-MoE: a global auxiliary
        # loss, no bias), so that its export computes the same choice of experts.
        for key in BALANCE:
            setattr(model, key, getattr(cfg, key))
        if cfg.family == "moe":
            say(f"{p.name} balances its experts as its authors trained it: {cfg.balancing()}")
        if (p / "tokenizer.json").is_file():
            for note in tokenizer_notes(p / "tokenizer.json", datasets):
                say(note)
    else:
        loaded = load(p)
        cfg, state = loaded.gpt.cfg, strip_prefixes(loaded.gpt.state_dict())
        what = f"{loaded.source} (step {loaded.step})"
    if data_vocab > cfg.vocab_size:
        raise ConfigError(
            f"--init_from {path}: the dataset's vocabulary ({data_vocab}) is larger than the "
            f"model's ({cfg.vocab_size}); pack the data with the model's tokenizer"
        )
    for key in ARCHITECTURE:
        setattr(model, key, getattr(cfg, key))
    n = sum(t.numel() for k, t in state.items() if not (k == "head.weight" and cfg.tie_embeddings))
    say(f"weights from {what}: {n / 1e6:.2f}M parameters, {cfg.n_layer} layers, d_model "
        f"{cfg.d_model}, {cfg.n_head} heads / {cfg.kv_heads} key-value, vocabulary {cfg.vocab_size}")  # fmt: skip
    return state


def tokenizer_notes(tokenizer: Path, datasets: tuple[str, ...]) -> list[str]:
    """One line for each dataset whose manifest names another tokenizer than `tokenizer`
    (the hash pack-shards records: of the file's settings as packing uses them). Ids
    mean what the packing tokenizer says, so the model would read other words than it
    learned. A note, not an error: the same tokenizer saved by another version of
    `tokenizers` may hash differently."""
    tok, _ = load_tokenizer(tokenizer)
    for_packing(tok)
    ours = hashlib.sha256(tok.to_str().encode()).hexdigest()
    notes = []
    for d in datasets:
        theirs = (manifest_tokenizer(d) or {}).get("sha256")
        if theirs and theirs != ours:
            notes.append(
                f"note: {d} was packed with another tokenizer than {tokenizer} (settings hash "
                f"{theirs[:12]} against {ours[:12]}): check that it is the model's"
            )
    return notes


def build(cfg: TrainConfig, data_vocab: int, say, device: torch.device) -> GPT:
    """The run's GPT, created on `device` itself (GPT.create: no CPU copy of the model, no
    CPU initialisation): --init_from's architecture and weights where it is set, else the
    configured shape, randomly initialised (the caller seeds it). The vocabulary covers the
    dataset's ids, the RoPE table the longest row the loader makes."""
    datasets = tuple(cfg.data.mixture()[0].values()) if cfg.data.mix else (cfg.data.path,)
    start = None
    if cfg.init_from:
        start = source(cfg.init_from, cfg.model, data_vocab, say, tuple(d for d in datasets if d))
    cfg.model.vocab_size = max(cfg.model.vocab_size, data_vocab)
    cfg.model.max_seq_len = max(
        cfg.model.max_seq_len, cfg.data.seq_len, max(cfg.data.bucket_lengths)
    )
    gpt = families.of(cfg.model).create(cfg.model, device)
    if start is not None:  # overwrites the random draws (cheap where a GPU made them)
        gpt.load_state_dict(start)
    return gpt
