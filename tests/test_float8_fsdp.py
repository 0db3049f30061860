"""FP8 under FSDP2 (pytrain.model.float8): per-tensor scaled weights are all-gathered in
float8, their scales computed for every layer after each optimizer step. Runs where
torchao is installed (the float8 extra); the conversion and the scales run on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pytrain.model import float8

torchao_float8 = pytest.importorskip("torchao.float8")


def test_the_scales_of_float8_all_gathered_weights_follow_each_update(tmp_path):
    from torch.distributed.fsdp import fully_shard

    plain = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    assert float8.scale_updater(plain) is None  # nothing to do without float8 all-gathers
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        config = dataclasses.replace(
            torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise"),
            enable_fsdp_float8_all_gather=True,
        )
        torchao_float8.convert_to_float8_training(plain, config=config)
        for layer in plain:
            fully_shard(layer)
        fully_shard(plain)
        update = float8.scale_updater(plain)
        assert update is not None
        update()
        before = [layer.weight._local_tensor._precomputed_scale.clone() for layer in plain]
        with torch.no_grad():
            for layer in plain:
                layer.weight.mul_(2.0)
        update()
        for b, layer in zip(before, plain, strict=True):
            # float8's max over twice the weights' amax: half the scale
            torch.testing.assert_close(layer.weight._local_tensor._precomputed_scale, b / 2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe, emulated", [("rowwise", True), ("tensorwise", False)])
def test_rowwise_compiles_with_eagers_casts(monkeypatch, recipe, emulated):
    import torch._inductor.config as inductor_config

    # The conversion itself runs on the CPU: only the GPU check is stood in for.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    model = nn.ModuleDict({"blocks": nn.Sequential(nn.Linear(32, 32))})
    with inductor_config.patch(emulate_precision_casts=False):  # restored on leaving
        assert float8.convert(model, recipe, torch.device("cuda")) == 1
        assert inductor_config.emulate_precision_casts is emulated
