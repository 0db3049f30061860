"""What makes the second start of a compiled run fast: Inductor's cache artifacts saved in
the run directory, two caches of torch made to hit where they would miss, and the table of
where a warm-up's seconds went.

A restart (a requeued job, a resume) with a warm cache should cost seconds, not the minute
of a cold compile. Measured on the GPT-2 preset (BENCHMARKS.md, "Warm
restarts"), two things made warm starts slow on torch 2.11:
- coordinate-descent tuning ran again for kernels whose tuned config was cached
  (pytorch/pytorch#172819, fixed upstream after 2.11; `patch_coordesc_recheck` backports it);
- the training graph bypassed the AOTAutograd cache because it holds custom
  autograd.Functions (ours: fused_gelu, fused_ce), which torch does not cache unless told.

The artifacts file is signed (pytrain.train.signing): loading it writes cache entries that
Inductor later unpickles and imports (and whose keys are paths), so one from a run directory
someone else wrote is skipped with one line and the run compiles afresh."""

from __future__ import annotations

import inspect
import os
import pickle
from pathlib import Path

import torch

from pytrain.train import disk, signing

ARTIFACTS = "compile artifacts"
"""What the artifacts file's signature is for (signing.sign's `purpose`)."""


def enable_warm_caches() -> list[str]:
    """Makes the caches that a warm start needs hit; returns what it changed (for the log)."""
    changed = []
    import torch._functorch.config as functorch_config

    # Dynamo traces an autograd.Function's forward and backward into the graph that the
    # AOTAutograd cache key is computed from, so a changed function is a new key. Torch keeps
    # this off by default for functions it cannot vouch for; the ones in our graphs are ours.
    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
        changed.append("AOTAutograd cache for custom autograd functions")
    if patch_coordesc_recheck():
        changed.append("cached coordinate-descent results reused (pytorch#172819 backport)")
    if patch_config_pickle():
        changed.append("coordinate-descent marks kept through compile workers")
    return changed


def patch_config_pickle() -> bool:
    """Keeps a Triton config's `found_by_coordesc` when it is pickled; True if patched.

    Inductor marks a config that its autotune cache says coordinate descent found, and a
    kernel whose config has the mark is not tuned again. Kernels are compiled in worker
    processes and pickled back to the trainer, and `triton.Config.__setstate__` (Triton 3.6,
    torch 2.11's) restores its own fields only: the mark is lost, and every such kernel tunes
    again on its first run at a warm start. Seen on an H100 (BENCHMARKS.md, "Warm restarts"):
    14 of the GPT-2 preset's 32 tuned kernels tuned again on the first restart (18 s), each
    with a cached config marked `found_by_coordesc`; compiling in-process (no pickle) had
    tuned 0-4 s. A Triton that keeps the attribute is left alone (checked by a round trip)."""
    try:
        from triton import Config
    except ImportError:
        return False
    probe = Config({"XBLOCK": 1})
    probe.found_by_coordesc = True
    if getattr(pickle.loads(pickle.dumps(probe)), "found_by_coordesc", False):
        return False  # kept already (a fixed Triton, or patched before)
    restore = getattr(Config, "__setstate__", None)
    if restore is None:  # dropped some other way: not the bug this mends
        return False

    def __setstate__(self, state) -> None:
        restore(self, state)
        if "found_by_coordesc" in state:
            self.found_by_coordesc = state["found_by_coordesc"]

    Config.__setstate__ = __setstate__
    return True


def patch_coordesc_recheck() -> bool:
    """Backports pytorch/pytorch#173391 where torch has the bug it fixes; True if patched.

    A kernel restored from the FX graph cache through the static CUDA launcher rechecks
    Inductor's autotune cache. Torch 2.11 skips that when the kernel has one config (always
    so with coordinate-descent tuning) and does not carry the cached `found_by_coordesc`
    onto the chosen config, so the first run of every such kernel tunes it again (4-62 s
    per warm start of the GPT-2 preset). The method below is upstream's fixed one, written
    against 2.11's helpers; torch versions with the fix are left alone."""
    try:
        cls = _heuristics().CachingAutotuner
        source = inspect.getsource(cls.recheck_autotune_cache)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    if "len(configs) > 1" not in source or getattr(cls, "_pytrain_patched", False):
        return False

    cls.recheck_autotune_cache = recheck_autotune_cache
    cls._pytrain_patched = True
    return True


def recheck_autotune_cache(self, reload_kernel_from_src) -> None:
    """CachingAutotuner.recheck_autotune_cache as fixed upstream (see patch_coordesc_recheck)."""
    th = _heuristics()
    assert self.is_statically_launchable()
    configs = [result.config for result in self.compile_results]
    cached, _, info = th.check_autotune_cache(configs, self.filename, self.inductor_meta)
    self.autotune_cache_info = info
    if len(cached) != 1:  # no autotune cache hit
        return
    best = cached[0]
    found_by_coordesc = getattr(best, "found_by_coordesc", False)
    best_hash = th.triton_config_to_hashable(best)
    for result in self.compile_results:
        if th.triton_config_to_hashable(result.config) == best_hash:
            result.config.found_by_coordesc = found_by_coordesc
            self.compile_results = [result]
            return
    # Not among the precompiled configs: coordinate descent found it after the
    # kernel was cached. Compile it now (Triton's own cache makes this quick).
    if found_by_coordesc:
        with th.dynamo_timed("CachingAutotuner.slow_precompile_config"):
            if self.fn.fn is None:
                self.fn = reload_kernel_from_src().fn
            self.compile_results = [self._precompile_config(best)]


def _heuristics():
    from torch._inductor.runtime import triton_heuristics

    return triton_heuristics


def save_artifacts(path) -> bool:
    """Saves Inductor's compiled artifacts (torch >= 2.7) so a restart skips most of the
    compile time; False where unsupported."""
    try:
        got = torch.compiler.save_cache_artifacts()
    except (AttributeError, RuntimeError):
        return False
    if not got:
        return False
    p = Path(path)
    try:
        signed = signing.sign(got[0], ARTIFACTS)
    except signing.NoKey as e:
        print(f"warning: compile cache artifacts not saved to {p}: {e}; the next start compiles from scratch")  # fmt: skip
        return False
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:  # atomic: a restart never loads half a file
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(signed)
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        full = " (disk full)" if disk.full_disk_error(e) else ""
        print(f"warning: compile cache artifacts not saved to {p}{full}: {e.strerror or e}; "
              f"{disk.human(disk.free_bytes(p.parent))} free there; the next start compiles from scratch")  # fmt: skip
        return False
    return True


def phase_table() -> str:
    """Dynamo's and Inductor's seconds by phase in this process (what a warm restart still
    spends, e.g. tracing vs. loading cached kernels); '' where torch does not say."""
    try:
        from torch._dynamo.utils import compile_times, counters

        caches = {
            f"{group}.{k}": v
            for group in ("aot_autograd", "inductor")
            for k, v in sorted(counters[group].items())
            if "cache" in k or "autotuner" in k
        }
        hits = ", ".join(f"{k} {v}" for k, v in caches.items())
        return f"{compile_times(repr='str', aggregate=True)}\ncache counters: {hits or 'none'}"
    except Exception:  # a private API: its absence only loses the table
        return ""


def load_artifacts(path) -> bool:
    """Loads the artifacts `save_artifacts` wrote with this user's key into Inductor's caches;
    False (and one line, said by rank 0) for a file it did not sign, or where none loads."""
    p = Path(path)
    if not p.exists():
        return False
    try:
        data = signing.unsign(p.read_bytes(), ARTIFACTS)
    except (signing.NotTrusted, signing.NoKey) as e:
        if os.environ.get("RANK", "0") == "0":  # every rank skips it: one says so
            print(f"compile cache artifacts {p} skipped: {e}; loading them could run code "
                  "this user did not write, so the run compiles afresh")  # fmt: skip
        return False
    try:
        return torch.compiler.load_cache_artifacts(data) is not None
    except Exception:  # a stale cache only costs a normal compile
        return False
