"""The pieces that make a warm start of a compiled run fast (pytrain.train.compile_cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
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


@pytest.mark.slow  # Inductor compiles C++, twice
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


# ---- nothing of a run directory someone else wrote is loaded as code ------------------------


def _planted_artifacts(marker: Path) -> bytes:
    """An artifacts file as torch.compiler.save_cache_artifacts writes one, whose loading
    writes `marker`: an autotune entry's key is a path that torch joins to its cache
    directory (an absolute one replaces it) and writes the entry to. A key naming a
    `.pth` file of site-packages, or an entry in Inductor's graph cache (a pickle it loads
    later), runs code; the marker shows that a load happened."""
    import torch
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager._ensure_cache_artifacts_registered()
        CacheArtifactManager.record_artifact("autotune", str(marker), {"planted": True})
        data, _ = torch.compiler.save_cache_artifacts()
    return data


def test_compile_artifacts_load_only_when_signed_with_this_users_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(mine))
    marker = tmp_path / "PWNED"
    planted = _planted_artifacts(marker)
    path = tmp_path / "run" / "compile-artifacts.bin"
    path.parent.mkdir()
    path.write_bytes(planted)  # in a run directory someone else wrote
    loaded = compile_cache.load_artifacts(path)
    assert not marker.exists(), "an unsigned artifacts file was loaded"
    assert loaded is False
    key = mine / "signing.key"
    assert capsys.readouterr().out.splitlines() == [
        f"compile cache artifacts {path} skipped: not signed with this user's key ({key}); "
        "loading them could run code this user did not write, so the run compiles afresh"
    ]
    from pytrain.train import signing

    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(theirs))  # another user's trainer signs it
    path.write_bytes(signing.sign(planted, compile_cache.ARTIFACTS))
    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(mine))
    assert compile_cache.load_artifacts(path) is False and not marker.exists()
    assert capsys.readouterr().out.splitlines() == [
        f"compile cache artifacts {path} skipped: signed with another key than this user's "
        f"({key}), or changed since; loading them could run code this user did not write, so "
        "the run compiles afresh"
    ]
    # This user's trainer signs what it saves, and loads it (the planted entry is written:
    # the file above would have been loaded).
    path.write_bytes(signing.sign(planted, compile_cache.ARTIFACTS))
    assert compile_cache.load_artifacts(path) is True and marker.exists()
    assert capsys.readouterr().out == ""


def test_the_signing_key_is_made_once_outside_the_run_readable_by_this_user_only(
    tmp_path, monkeypatch
):
    from pytrain.train import signing

    monkeypatch.delenv("PYTRAIN_CONFIG_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert signing.key_path() == tmp_path / "xdg" / "pytrain" / "signing.key"
    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(tmp_path / "cfg"))
    key = signing.key()
    path = tmp_path / "cfg" / "signing.key"
    assert signing.key_path() == path and len(key) == signing.KEY_BYTES
    assert path.stat().st_mode & 0o777 == 0o600
    assert signing.key() == key  # made once
    assert list(path.parent.iterdir()) == [path]  # no temporary left
    blob = signing.sign(b"data", "a")
    assert signing.unsign(blob, "a") == b"data"
    with pytest.raises(signing.NotTrusted):  # signed for something else
        signing.unsign(blob, "b")
    with pytest.raises(signing.NotTrusted):  # changed
        signing.unsign(blob[:-1] + b"x", "a")
    path.chmod(0o644)  # readable by others: it would sign for them too
    with pytest.raises(signing.NoKey, match="not this user's alone"):
        signing.key()


def test_the_runs_inductor_cache_is_used_only_where_this_users_trainer_made_it(
    tmp_path, monkeypatch
):
    """Inductor loads its cache entries itself (pickles, kernel modules it imports): the
    run's cache directory is used where the trainer signed it, else not at all."""
    import shutil

    from pytrain.train.env_guards import run_inductor_cache

    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(tmp_path / "mine"))
    run = tmp_path / "runs" / "a"
    cache = run / "inductor-cache"
    assert run_inductor_cache(run) == (str(cache), None)  # made now, and signed
    (cache / "fxgraph").mkdir()  # Inductor's entries
    (cache / "fxgraph" / "entry").write_bytes(b"a pickle")
    assert run_inductor_cache(run) == (str(cache), None)  # ours: used
    key = tmp_path / "mine" / "signing.key"
    shutil.copytree(run, tmp_path / "runs" / "b")  # copied, with its signature
    got, note = run_inductor_cache(tmp_path / "runs" / "b")
    assert got is None and note == (
        f"Inductor cache {tmp_path / 'runs' / 'b' / 'inductor-cache'} not used: signed with "
        f"another key than this user's ({key}), or copied or moved since, and its entries could "
        "run code this user did not write; Inductor uses its default cache (remove the "
        "directory for the run to keep a cache of its own again)"
    )
    (run / "inductor-cache" / ".pytrain-signature").unlink()  # someone else's: unsigned
    got, note = run_inductor_cache(run)
    assert got is None and note and f"not used: not signed with this user's key ({key})" in note
    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(tmp_path / "theirs"))  # another user's key
    got, note = run_inductor_cache(tmp_path / "runs" / "b")
    assert got is None and note and "signed with another key" in note
    empty = tmp_path / "runs" / "c" / "inductor-cache"
    empty.mkdir(parents=True)  # nothing in it to load: made ours
    assert run_inductor_cache(empty.parent) == (str(empty), None)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU backend needs a C++ compiler")
def test_a_copied_run_directory_resumes_compiled_and_loads_none_of_its_compile_caches(
    small_corpus, tmp_path, monkeypatch
):
    import torch
    from test_run_safety import ENV, train_cmd

    from pytrain.train import checkpoint

    (tmp_path / "tmp").mkdir()  # Inductor's default cache goes under TMPDIR
    theirs = {
        **ENV,
        "PYTRAIN_CONFIG_DIR": str(tmp_path / "theirs"),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    mine = {**theirs, "PYTRAIN_CONFIG_DIR": str(tmp_path / "mine")}

    def train(env: dict, *flags: str) -> str:
        cmd = train_cmd(small_corpus, tmp_path, "copied", *flags)
        cmd.remove("--no-compile.safe_env")  # the guards name the run's Inductor cache
        at = cmd.index("--data.val_path")  # no evaluation: half the graphs to compile
        del cmd[at : at + 2]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return r.stdout

    train(theirs, "--max_steps", "2")  # someone else's run
    run = tmp_path / "runs" / "copied"
    ckpt = run / "ckpt-00000002.pt"
    # It ran eager (compiling it too would double this test's time); its checkpoint says it
    # compiled, as it would have, or the resumed run would keep to eager.
    torch.save({**checkpoint.read(ckpt), "compile_mode": "default"}, ckpt)
    # What such a run directory may hold besides: an artifacts file whose loading writes
    # where its keys say, and entries in its Inductor cache.
    marker = tmp_path / "PWNED"
    (run / "compile-artifacts.bin").write_bytes(_planted_artifacts(marker))
    entry = run / "inductor-cache" / "fxgraph" / "planted"
    entry.parent.mkdir()
    entry.write_bytes(b"a pickle Inductor would load")
    cache_before = sorted((run / "inductor-cache").rglob("*"))

    out = train(mine, "--max_steps", "3", "--compile")
    assert not marker.exists(), "the copied run's compile artifacts were loaded"
    key = tmp_path / "mine" / "signing.key"
    lines = out.splitlines()
    assert (
        f"compile cache artifacts {run / 'compile-artifacts.bin'} skipped: not signed with this "
        f"user's key ({key}); loading them could run code this user did not write, so the run "
        "compiles afresh"
    ) in lines, out[-3000:]
    assert (
        f"Inductor cache {run / 'inductor-cache'} not used: signed with another key than this "
        f"user's ({key}), or copied or moved since, and its entries could run code this user "
        "did not write; Inductor uses its default cache (remove the directory for the run to "
        "keep a cache of its own again)"
    ) in lines, out[-3000:]
    assert f"resumed from {run / 'ckpt-00000002.pt'} at step 2 (read in " in out
    assert "compile: default" in out  # it compiled
    assert sorted((run / "inductor-cache").rglob("*")) == cache_before  # Inductor kept off it
    assert any((tmp_path / "tmp").glob("torchinductor_*"))  # its default cache instead
    # What this run saved is signed with this user's key: the next start loads it.
    from pytrain.train import signing

    monkeypatch.setenv("PYTRAIN_CONFIG_DIR", str(tmp_path / "mine"))
    assert signing.unsign((run / "compile-artifacts.bin").read_bytes(), compile_cache.ARTIFACTS)
