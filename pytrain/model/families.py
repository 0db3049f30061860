"""The model registry: one entry a family, which trainer, export, sample and eval look up
instead of asking what a model is (as torchtitan's TrainSpec).

An entry names the module class (built, loaded, sampled from), the Hugging Face mapping
(a module with ARCHITECTURES, hf_config, to_hf, from_hf: the transformers classes that
compute the family, and the weights renamed both ways), the FLOP formula behind MFU, and the
KV cache generation fills. A preset picks its family with `model.family`."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from pytrain.model.config import ModelConfig
from pytrain.model.gpt import GPT, KVCache
from pytrain.model.hf import NotExportable
from pytrain.model.moe import MoEGPT


@dataclass(frozen=True)
class Family:
    name: str
    model: type[GPT]
    hf_module: str
    """The module of its Hugging Face mapping (imported when asked for); its CLASSES are the
    transformers classes it reads."""
    kv_cache: type = KVCache
    """One layer's cache in generation: (B, kv heads, positions, head size), keys and values."""

    @property
    def hf(self) -> ModuleType:
        return importlib.import_module(self.hf_module)

    def create(self, cfg: ModelConfig, device: torch.device | str) -> GPT:
        """A randomly initialised model of `cfg`, built on `device` (GPT.create)."""
        return self.model.create(cfg, device)

    def empty(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> GPT:
        """A model whose weights are about to be loaded (GPT.empty)."""
        return self.model.empty(cfg, device)

    @staticmethod
    def flops_per_token(model: GPT, seq_len: int) -> float:
        """Training FLOPs a token: 6 x the parameters its forward multiplies by (a mixture of
        experts: its routed experts only) + 12 L H Q T for attention (PaLM's appendix B, as
        nanoGPT has it; T the sequence length)."""
        c = model.cfg
        return 6 * model.active_params() + 12 * c.n_layer * c.n_head * c.head_dim * seq_len


FAMILIES = {
    "dense": Family("dense", GPT, "pytrain.model.hf"),
    "moe": Family("moe", MoEGPT, "pytrain.model.hf_moe"),
}


def of(cfg: ModelConfig) -> Family:
    """The family of `cfg` (ModelConfig.check has refused any other name)."""
    return FAMILIES[cfg.family]


def from_hf(config: dict, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict]:
    """A Hugging Face directory's config.json and weights -> (ModelConfig, state dict), by
    the family whose mapping reads its class; NotExportable where none does."""
    arch = (config.get("architectures") or ["?"])[0]
    readers = {name: f for f in FAMILIES.values() for name in f.hf.CLASSES}
    if arch not in readers:
        raise NotExportable(f"{arch} is not a class pytrain reads ({', '.join(readers)})")
    return readers[arch].hf.from_hf(config, weights)
