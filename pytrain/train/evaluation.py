"""Validation loss during training: the first `batches` batches of each validation set,
the same every time, split over the ranks, through the compiled evaluation module. With
several sets (a mixture's), a loss per set and their token-weighted mean."""

from __future__ import annotations

from pathlib import Path

import torch

from pytrain.config import DataConfig
from pytrain.data.batch import DeviceBatch, DeviceFeed
from pytrain.data.loader import TokenLoader
from pytrain.model.gpt import GPT
from pytrain.train import distributed
from pytrain.train.compile_policy import CompiledModel
from pytrain.train.distributed import DistInfo
from pytrain.train.precision import Precision


class Evaluator:
    """Mean loss per loss token over the first `batches` batches of each validation set."""

    def __init__(
        self,
        paths: dict[str, Path | str],
        data: DataConfig,
        gpt: GPT,
        compiler: CompiledModel,
        precision: Precision,
        dist: DistInfo,
        device: torch.device,
        mask_of,
        segments: bool,
        sharded: bool,
        batches: int,
    ):
        self.paths, self.data, self.gpt, self.compiler = paths, data, gpt, compiler
        self.by_source: dict[str, float | None] = {}
        self.precision, self.dist, self.device = precision, dist, device
        self.mask_of, self.segments, self.sharded, self.batches = (
            mask_of,
            segments,
            sharded,
            batches,
        )

    def loader(self, path: Path | str) -> TokenLoader:
        """A validation set in its stored order, once, the same on every rank."""
        return TokenLoader(path, self.data, shuffle=False, num_epochs=1, threads=1, slots=2)

    @torch.no_grad()
    def loss_sum(self, b: DeviceBatch) -> torch.Tensor:
        """Summed loss of one batch in evaluation mode (no dropout, no activation
        checkpointing, the plain output layer), with the training's attention."""
        mask = self.mask_of(b, self.compiler.eval_mode != "eager")
        with self.precision.autocast(self.device):
            args = (b.input_ids, b.targets, b.position_ids, b.loss_mask, mask)
            return self.compiler.evaluate(*args).float()

    def compile_for(self, b: DeviceBatch) -> None:
        """Compiles the evaluation graph of `b`'s shape (warm-up)."""
        self.gpt.eval()
        try:
            self.loss_sum(b)
        finally:
            self.gpt.train()

    def __call__(self) -> float | None:
        """The token-weighted mean over every set (each set's own in `by_source`)."""
        loss = tokens = 0.0
        for name, path in self.paths.items():
            s, n = self.sums(path)
            self.by_source[name] = s / n if n else None
            loss, tokens = loss + s, tokens + n
        return loss / tokens if tokens else None

    @torch.no_grad()
    def sums(self, path: Path | str) -> tuple[float, float]:
        """(summed loss, loss tokens) over one set, all ranks. Every rank reads the batches
        in the same order and evaluates every world_size-th one (a set smaller than the
        world leaves some ranks idle). The feed releases every slot it took, also when it
        stops early."""
        world, rank = self.dist.world_size, self.dist.rank
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count, seen, last = 0, 0, None
        self.gpt.eval()
        try:
            with DeviceFeed(self.loader(path), self.device, self.segments) as feed:
                for i, b in enumerate(feed):
                    if i >= self.batches:
                        break
                    seen, last = i + 1, b
                    if i % world == rank:
                        total += self.loss_sum(b)
                        count += b.loss_tokens
                # FSDP2 gathers parameters in every forward, so every rank runs as many
                # forwards as the busiest one; a spare one counts for nothing.
                if self.sharded and last is not None and seen % world and rank >= seen % world:
                    self.loss_sum(last)
        finally:
            self.gpt.train()
        sums = torch.stack(
            [total, torch.tensor(float(count), dtype=torch.float64, device=self.device)]
        )
        loss, tokens = distributed.all_sum_tensor(sums, self.dist).tolist()
        return loss, tokens
