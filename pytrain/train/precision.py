"""Numeric precision of training: the autocast dtype and, for fp16, the GradScaler."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Precision:
    dtype: torch.dtype | None  # autocast dtype, None for fp32
    scaler: torch.amp.GradScaler | None
    name: str

    @property
    def short(self) -> str:
        """The matmuls' dtype in one word: bf16, fp16 or fp32."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")  # type: ignore[arg-type]

    def autocast(self, device: torch.device) -> torch.autocast:
        """The autocast context of this precision (off for fp32)."""
        return torch.autocast(device.type, dtype=self.dtype, enabled=self.dtype is not None)


def choose_precision(requested: str, device: torch.device) -> Precision:
    cuda = device.type == "cuda"
    if requested == "auto":
        requested = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if cuda else "fp32"
    if requested == "fp32":
        return Precision(None, None, "fp32")
    if requested == "bf16":
        return Precision(torch.bfloat16, None, "bf16")
    if requested == "fp16":
        return Precision(torch.float16, torch.amp.GradScaler(device.type), "fp16 + GradScaler")
    raise ValueError(f"precision {requested!r} is not auto, bf16, fp16 or fp32")
