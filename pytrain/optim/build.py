"""The optimizer a run asks for (optim.name), with its refusals."""

from __future__ import annotations

import torch
from torch import nn

from pytrain.config import ConfigError, OptimConfig
from pytrain.optim import adamw, muon
from pytrain.optim.master_adamw import MasterAdamW

NAMES = ("adamw", "muon")


def keeps_masters(
    o: OptimConfig, device: torch.device, dtype: torch.dtype | None, sharded: bool
) -> bool:
    """Whether build_optimizer would keep fp32 master weights of bf16 parameters."""
    return o.name == "adamw" and adamw.use_master_weights(o.master_weights, device, dtype, sharded)


def build_optimizer(
    model: nn.Module,
    o: OptimConfig,
    device: torch.device,
    dtype: torch.dtype | None,
    *,
    sharded: bool,
    fp16_scaler: bool,
) -> tuple[torch.optim.Optimizer | MasterAdamW | muon.MuonAdamW, bool]:
    """(optimizer, whether it keeps fp32 master weights of bf16 parameters)."""
    if o.name == "adamw":
        master = adamw.use_master_weights(o.master_weights, device, dtype, sharded)
        return adamw.make_optimizer(model, o, device, master), master
    if o.name != "muon":
        raise ConfigError(f"optim.name is {o.name!r}; expected one of {', '.join(NAMES)}")
    if sharded:
        raise ConfigError(
            "optim.name=muon needs each weight matrix whole and FSDP2 shards them: "
            "use DDP (drop --fsdp) or --optim.name adamw"
        )
    if fp16_scaler:
        raise ConfigError(
            "optim.name=muon runs in bf16 or fp32, not fp16: set --precision bf16 or fp32"
        )
    if o.state_dtype != "fp32":
        raise ConfigError(
            f"optim.state_dtype={o.state_dtype} is AdamW's; optim.name=muon keeps its state in fp32"
        )
    if o.master_weights == "on":
        raise ConfigError(
            "optim.master_weights=on is AdamW's (bf16 parameters with fp32 masters); "
            "with optim.name=muon set it to auto or off (fp32 parameters under autocast)"
        )
    return muon.MuonAdamW(model, o, device), False
