"""Logging: TensorBoard scalars, a plain text log line every N steps, and MFU.

MFU = achieved FLOP/s / peak FLOP/s, with FLOPs per token = 6 N + 12 L H Q T
(N non-embedding parameters, L layers, H heads, Q head size, T sequence length: the
PaLM appendix B formula that nanoGPT uses). Peak is the dense bf16 tensor-core rate of
the GPU (table below); MFU is not reported where the peak is unknown (e.g. CPU)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10": 125e12,
    "4090": 165e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    return 6 * n_params + 12 * n_layer * n_head * head_dim * seq_len


class RunLog:
    """TensorBoard writer (rank 0) plus a text log file runs/<name>/train.log."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled = enabled
        self.tb = None
        self.file = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "train.log", "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for k, v in values.items():
                if v is not None:
                    self.tb.add_scalar(k, v, step)

    def text(self, line: str) -> None:
        if self.file is not None:
            self.file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
            self.file.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()


def loader_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process's loader threads (named "ptl-*"), from
    /proc (Linux); None elsewhere."""
    import os

    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("ptl-"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    except OSError:
        return None
    return total
