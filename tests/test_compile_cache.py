"""The pieces that make a warm start of a compiled run fast (pytrain.train.compile_cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from pytrain.train import compile_cache


class _Result:
    def __init__(self, config):
        self.config = config


def _config(block: int, coordesc: bool = False):
    from torch._inductor.runtime.triton_compat import Config

    c = Config({"XBLOCK": block}, num_warps=4, num_stages=1)
    c.found_by_coordesc = coordesc
    return c


def _autotuner(monkeypatch, compiled: list, cached: list):
    th = compile_cache._heuristics()
    monkeypatch.setattr(
        th, "check_autotune_cache", lambda configs, *a, **k: (cached, None, {"hit": 1})
    )
    return SimpleNamespace(
        is_statically_launchable=lambda: True,
        compile_results=[_Result(c) for c in compiled],
        filename="k.py",
        inductor_meta={"coordinate_descent_tuning": True},
    )


def test_a_kernel_with_one_config_keeps_its_cached_coordinate_descent_result(monkeypatch):
    """pytorch#172819: one compiled config and a cached config found by coordinate descent
    equal to it: the kernel must say so, or its first run tunes it again."""
    tuner = _autotuner(monkeypatch, [_config(64)], [_config(64, coordesc=True)])
    compile_cache.recheck_autotune_cache(tuner, reload_kernel_from_src=None)
    assert len(tuner.compile_results) == 1
    assert tuner.compile_results[0].config.found_by_coordesc is True
    assert tuner.autotune_cache_info == {"hit": 1}


def test_the_cached_config_is_chosen_among_several(monkeypatch):
    tuner = _autotuner(monkeypatch, [_config(32), _config(64), _config(128)], [_config(64)])
    compile_cache.recheck_autotune_cache(tuner, reload_kernel_from_src=None)
    assert [r.config.kwargs["XBLOCK"] for r in tuner.compile_results] == [64]
    assert tuner.compile_results[0].config.found_by_coordesc is False


def test_a_cache_miss_keeps_every_config(monkeypatch):
    tuner = _autotuner(monkeypatch, [_config(32), _config(64)], [_config(32), _config(64)])
    compile_cache.recheck_autotune_cache(tuner, reload_kernel_from_src=None)
    assert len(tuner.compile_results) == 2


def test_a_coordinate_descent_config_not_compiled_is_compiled_from_the_cache(monkeypatch):
    tuner = _autotuner(monkeypatch, [_config(32)], [_config(256, coordesc=True)])
    tuner.fn = SimpleNamespace(fn=object())
    tuner._precompile_config = lambda c: _Result(c)
    compile_cache.recheck_autotune_cache(tuner, reload_kernel_from_src=None)
    assert [r.config.kwargs["XBLOCK"] for r in tuner.compile_results] == [256]


def test_the_backport_patches_only_a_torch_with_the_bug():
    import inspect

    source = inspect.getsource(compile_cache._heuristics().CachingAutotuner.recheck_autotune_cache)
    patched = getattr(compile_cache._heuristics().CachingAutotuner, "_pytrain_patched", False)
    assert patched or "len(configs) > 1" not in source  # patched, or fixed upstream
    assert compile_cache.patch_coordesc_recheck() is False  # never twice


@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU backend needs a C++ compiler")
def test_a_graph_with_our_autograd_functions_is_saved_to_the_aot_autograd_cache(tmp_path):
    """Without enable_warm_caches the training graph (fused GELU, fused CE are
    autograd.Functions) bypasses the AOTAutograd cache and every warm start traces it."""
    code = textwrap.dedent(
        """
        import sys, torch
        from pytrain.train import compile_cache
        from torch._dynamo.utils import counters

        class Sin(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x.sin()

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                return g * x.cos()

        if sys.argv[1] == "warm":
            compile_cache.enable_warm_caches()
        f = torch.compile(lambda x: Sin.apply(x * 2).sum())
        f(torch.randn(8, requires_grad=True)).backward()
        print(dict(counters["aot_autograd"]))
        """
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    got = {}
    for how in ("plain", "warm"):
        r = subprocess.run(
            [sys.executable, "-c", code, how], capture_output=True, text=True, env=env
        )
        assert r.returncode == 0, r.stderr[-2000:]
        got[how] = r.stdout
    assert "autograd_cache_bypass" in got["plain"]  # torch's default, the cause of slow warm starts
    assert "autograd_cache_bypass" not in got["warm"] and "autograd_cache_saved" in got["warm"]


def test_a_config_keeps_its_coordinate_descent_mark_through_a_compile_worker():
    """Kernels come back from Inductor's compile workers pickled; Triton's Config drops the
    `found_by_coordesc` mark on unpickling, and the kernel tunes again at every warm start."""
    import pickle

    triton = pytest.importorskip("triton")
    compile_cache.enable_warm_caches()
    config = triton.Config({"XBLOCK": 64}, num_warps=4)
    config.found_by_coordesc = True
    back = pickle.loads(pickle.dumps(config))
    assert back.found_by_coordesc is True and back.kwargs == {"XBLOCK": 64} and back.num_warps == 4
    plain = pickle.loads(pickle.dumps(triton.Config({"XBLOCK": 8})))
    assert not getattr(plain, "found_by_coordesc", False)  # nothing invented
    assert compile_cache.patch_config_pickle() is False  # never twice
