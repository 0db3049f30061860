"""FP8 training of the blocks' linear layers through torchao (`--model.float8`).

torchao's Float8Linear casts a layer's input, weight and output gradient to float8 with
dynamic scales (per tensor, or per row) and multiplies with `torch._scaled_mm`; the
weights, the optimizer and the checkpoints stay as they are (same state dict keys), so
export and resume do not change. The embedding and the output layer (fused with the loss)
stay in bf16, as in the FP8 recipes of torchtitan and modded-nanogpt.

Under FSDP2 with per-tensor scales, the weights are all-gathered in float8 (half the bytes
of bf16), their scales computed for every layer at once after each optimizer step (one
all-reduce; `scale_updater`), as torchtitan's float8 recipes do."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from pytrain.config import ConfigError
from pytrain.model.config import CHOICES

RECIPES = CHOICES["float8"]


def convert(model: nn.Module, recipe: str, device: torch.device, fsdp: bool = False) -> int:
    """Swaps the blocks' nn.Linear layers for torchao's Float8Linear; returns how many.
    `fsdp`: the model is about to be sharded by FSDP2 (tensorwise: float8 all-gathers)."""
    if recipe not in RECIPES:
        raise ConfigError(f"model.float8 is {recipe!r}; expected one of {', '.join(RECIPES)}")
    if recipe == "off":
        return 0
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            f"model.float8={recipe} needs an NVIDIA GPU with FP8 matmuls (Ada, Hopper or later); "
            f"this run is on {device}"
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            f"model.float8={recipe} needs torchao: pip install 'pytrain[float8]'"
        ) from None

    def blocks_linear(module: nn.Module, fqn: str) -> bool:
        # _scaled_mm needs both dimensions divisible by 16.
        return (
            fqn.startswith("blocks.")
            and isinstance(module, nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "rowwise":
        # Compiled, Inductor fuses rowwise's casts to float8 with their scaling and may round
        # unlike eager; under activation checkpointing and compile rowwise then went to NaN
        # (pytorch/pytorch#150859). torchtitan's rowwise recipe emulates eager's casts too.
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = True
    if fsdp and recipe == "tensorwise":  # torchao's float8 all-gather is per tensor only
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=blocks_linear)
    return before - sum(type(m) is nn.Linear for m in model.modules())


def scale_updater(model: nn.Module) -> Callable[[], None] | None:
    """What runs after each optimizer step where weights are all-gathered in float8: their
    scales, for all layers in one all-reduce (else each layer's gather would all-reduce its
    own); None for a model without such layers."""
    if not any(
        getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
        for m in model.modules()
    ):
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
