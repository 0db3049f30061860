"""The trainer on CPU: per-token gradient accumulation, exact resume, NaN/spike guard,
compile fallback, and a short end-to-end run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from pytrain.config import ConfigError, parse_args
from pytrain.data import DeviceBatch
from pytrain.data.batch import FeedTime
from pytrain.model.config import ModelConfig
from pytrain.optim.schedule import lr_at
from pytrain.train import checkpoint
from pytrain.train.checkpoint import CheckpointMismatch
from pytrain.train.guard import StepGuard, TrainingStopped
from pytrain.train.trainer import Trainer


def small_cfg(small_corpus, tmp_path: Path, *extra: str):
    train, val = small_corpus
    return parse_args(
        [
            "--data.path", str(train), "--data.val_path", str(val),
            "--out_dir", str(tmp_path / "runs"), "--name", "t",
            "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64",
            "--data.seq_len", "64", "--data.batch_size", "4", "--data.frames_per_block", "2",
            "--max_steps", "12", "--eval_every", "0", "--eval_batches", "2", "--ckpt_every", "0",
            "--log_every", "1", "--no-progress", "--no-tensorboard", "--samples", "0",
            "--optim.warmup_steps", "2", "--optim.lr", "3e-3", "--deterministic",
            *extra,
        ]
    )  # fmt: skip


def device_batches(trainer: Trainer, n: int) -> list[DeviceBatch]:
    return [next(trainer.loader).to("cpu") for _ in range(n)]


def grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.gpt.parameters()]


def cat_rows(parts: list[DeviceBatch]) -> DeviceBatch:
    f = {
        k: torch.cat([getattr(p, k) for p in parts])
        for k in ("input_ids", "targets", "position_ids", "doc_ids", "loss_mask")
    }
    return DeviceBatch(**f, epoch=0, doc_tokens=0, pad_tokens=0)


def test_accumulation_matches_one_big_batch_with_variable_token_counts(small_corpus, tmp_path):
    t = Trainer(small_cfg(small_corpus, tmp_path))
    micro = device_batches(t, 3)
    # Make the loss-token counts differ between micro-batches: a per-micro-batch mean
    # would then weight tokens unequally and give different gradients.
    micro[0].loss_mask[:, 40:] = False
    micro[2].loss_mask[1:, :] = False
    counts = [int(b.loss_mask.sum()) for b in micro]
    assert len(set(counts)) == 3
    t.optimizer.zero_grad()
    t._forward_backward(micro, sum(counts))
    accumulated = grads(t)
    t.optimizer.zero_grad()
    t._forward_backward([cat_rows(micro)], sum(counts))
    big = grads(t)
    for a, b in zip(accumulated, big, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # The mistake the project exists to prevent: averaging per micro-batch.
    t.optimizer.zero_grad()
    for b in micro:
        (t._micro_loss(b) / int(b.loss_mask.sum()) / len(micro)).backward()
    wrong = grads(t)
    assert any(
        not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(wrong, big, strict=True)
    )
    t.close()


def test_resume_gives_exactly_the_same_losses(small_corpus, tmp_path):
    full = Trainer(small_cfg(small_corpus, tmp_path / "a", "--optim.grad_accum", "2"))
    want = full.fit()["losses"]
    full.close()
    assert len(want) == 12 and want[-1] < want[0]

    first = Trainer(
        small_cfg(small_corpus, tmp_path / "b", "--optim.grad_accum", "2", "--halt_after", "5")
    )
    got = first.fit()["losses"]
    first.close()
    second = Trainer(small_cfg(small_corpus, tmp_path / "b", "--optim.grad_accum", "2"))
    assert second.step == 5
    got += second.fit()["losses"]
    second.close()
    assert got == want  # bit for bit
    ckpts = sorted((tmp_path / "b" / "runs" / "t").glob("ckpt-*.pt"))
    assert [p.name for p in ckpts] == ["ckpt-00000005.pt", "ckpt-00000012.pt"]


def test_logged_data_waits_add_up_to_the_loaders_wait_that_the_end_line_prints(
    small_corpus, tmp_path
):
    """train.log's per-step data_wait_ms (every step logged here) sums to the loader's
    wait_s, the end line's "data wait": one measure, not two (a GPU table once read
    18 ms a step where the end line said 0.00 s). feed_ms holds the rest of the host's
    data time, and is never less than the wait."""
    t = Trainer(small_cfg(small_corpus, tmp_path, "--optim.grad_accum", "3", "--max_steps", "6"))
    t.fit()
    total = t.loader.stats()["wait_s"]
    t.close()
    logged = [
        (float(w), float(f))
        for w, f in re.findall(
            r"data_wait_ms ([\d.]+) feed_ms ([\d.]+)",
            (tmp_path / "runs" / "t" / "train.log").read_text(),
        )
    ]
    assert len(logged) == 6
    assert all(w <= f for w, f in logged)
    assert total > 0  # the first step waits for the ring to fill
    assert sum(w for w, _ in logged) / 1e3 == pytest.approx(total, abs=6 * 0.005e-3 + 1e-6)


def test_a_step_read_at_once_before_a_checkpoint_or_evaluation_is_timed_as_a_step(
    small_corpus, tmp_path
):
    """Each step is timed from its start to the next step's, or to the end of its own work
    where it is read at once (before an evaluation or a checkpoint): never as the moment
    between two reads. That moment made a 1,640 ms step of the 8B read 17 ms (mfu 5669%)."""
    from pytrain.train.metrics import read_step_lines

    t = Trainer(small_cfg(small_corpus, tmp_path, "--ckpt_every", "3", "--eval_every", "4"))
    t.fit()
    t.close()
    lines = read_step_lines((tmp_path / "runs" / "t" / "train.log").read_text())
    ms = {int(x["step"]): x["step_ms"] for x in lines}
    assert sorted(ms) == list(range(1, 13))
    usual = sorted(ms.values())[len(ms) // 2]
    read_at_once = [3, 4, 6, 8, 9, 12]  # checkpoints, evaluations, the end
    assert all(ms[k] > 0.2 * usual for k in read_at_once), (usual, ms)


def test_truncated_checkpoint_is_skipped_with_a_warning(small_corpus, tmp_path):
    t = Trainer(small_cfg(small_corpus, tmp_path, "--halt_after", "3"))
    t.fit()
    t.close()
    t = Trainer(small_cfg(small_corpus, tmp_path, "--halt_after", "2"))
    t.fit()
    t.close()
    run = tmp_path / "runs" / "t"
    newest = run / "ckpt-00000005.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint .*ckpt-00000005.pt"):
        t = Trainer(small_cfg(small_corpus, tmp_path))
    assert t.step == 3
    t.close()


def test_nan_step_is_skipped_and_repeated_failures_stop(small_corpus, tmp_path, monkeypatch):
    t = Trainer(small_cfg(small_corpus, tmp_path, "--optim.max_bad_steps", "3"))
    t.fit()  # a normal run first
    before = [p.detach().clone() for p in t.gpt.parameters()]
    real = t._micro_loss
    monkeypatch.setattr(t, "_micro_loss", lambda b: real(b) * float("nan"))
    moments = [dict(t.optimizer.state[p]) for p in t.gpt.parameters()]
    r = t.settle(t.train_step(device_batches(t, 1)))
    assert r.skipped and "non-finite" in r.skipped
    assert all(torch.equal(a, b) for a, b in zip(before, t.gpt.parameters(), strict=True))
    for m, p in zip(moments, t.gpt.parameters(), strict=True):  # moments untouched too
        assert all(torch.equal(v, t.optimizer.state[p][k]) for k, v in m.items())
    t.settle(t.train_step(device_batches(t, 1)))
    with pytest.raises(TrainingStopped, match="3 bad steps in a row"):
        t.settle(t.train_step(device_batches(t, 1)))
    t.close()


def test_spike_guard_decides_on_tensors_and_explains_on_the_host():
    g = StepGuard(spike_factor=3.0, max_bad=5, warmup=2)

    def step(n: int, loss: float, norm: float = 1.0) -> str | None:
        bad, ema = g.check(n, torch.tensor(loss), torch.tensor(norm))
        assert bad.dtype == torch.bool and bad.dim() == 0
        return g.record(bool(bad), loss, norm, float(ema))

    assert all(step(n, 2.0) is None for n in range(5))
    assert step(5, 5.0) is None  # below 3 x 2.0; it moves the running mean up a little
    assert "spike" in step(6, 7.0) and "running mean 2.150" in step(7, 7.0)
    assert "non-finite" in step(8, 2.0, math.inf) and g.skipped == 3
    assert step(9, 2.0) is None and g.bad_in_row == 0
    # The running mean survives a checkpoint exactly.
    h = StepGuard(spike_factor=3.0, max_bad=5, warmup=2)
    h.load_state_dict(g.state_dict())
    assert float(h.check(10, torch.tensor(2.0), torch.tensor(1.0))[1]) == float(g._ema_t)


def test_compile_failure_falls_back_and_reruns_the_same_step(small_corpus, tmp_path):
    eager = Trainer(small_cfg(small_corpus, tmp_path / "eager", "--max_steps", "4"))
    want = eager.fit()["losses"]
    eager.close()
    t = Trainer(small_cfg(small_corpus, tmp_path / "fb", "--max_steps", "4"))
    # Pretend a compiled level is active (real compilation is covered on the GPU by
    # scripts/compile_matrix.py); the injected failure takes the real fallback path.
    t.compiler.mode = "default"
    t.compiler.inject_failure = (2, "default")
    got = t.fit()
    assert got["losses"] == want  # step 2 rerun in eager: same loss, no double update
    assert t.compiler.mode == "eager"
    assert len(got["fallbacks"]) == 1 and "step 2: default failed" in got["fallbacks"][0]
    state = checkpoint.read(sorted((tmp_path / "fb" / "runs" / "t").glob("ckpt-*.pt"))[-1])
    assert state["compile_mode"] == "eager"
    t.close()
    # A resumed run does not retry the level that failed.
    again = Trainer(
        small_cfg(
            small_corpus,
            tmp_path / "fb",
            "--max_steps",
            "5",
            "--compile.mode",
            "default",
            "--compile",
        )
    )
    assert again.compiler.mode == "eager"
    again.close()


def test_lr_schedule_warms_up_and_decays():
    cfg = parse_args(
        [
            "--max_steps",
            "100",
            "--optim.warmup_steps",
            "10",
            "--optim.lr",
            "1.0",
            "--optim.min_lr_ratio",
            "0.1",
        ]
    )
    assert lr_at(0, cfg.optim, cfg.max_steps) == pytest.approx(0.1)
    assert lr_at(9, cfg.optim, cfg.max_steps) == pytest.approx(1.0)
    assert lr_at(100, cfg.optim, cfg.max_steps) == pytest.approx(0.1)
    assert lr_at(55, cfg.optim, cfg.max_steps) == pytest.approx(0.55)


def test_wsd_schedule_holds_then_decays_over_its_last_share():
    cfg = parse_args(["--max_steps", "100", "--optim.warmup_steps", "10", "--optim.lr", "1.0",
                      "--optim.min_lr_ratio", "0.0", "--optim.schedule", "wsd",
                      "--optim.decay_frac", "0.2"])  # fmt: skip
    lrs = [lr_at(s, cfg.optim, cfg.max_steps) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x == 1.0 for x in lrs[10:80])  # stable
    assert lrs[90] == pytest.approx(0.5) and lrs[100] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(lrs[80:100], lrs[81:101], strict=True))  # decays
    with pytest.raises(ConfigError, match="optim.decay_frac is 0.0"):
        parse_args(["--optim.schedule", "wsd", "--optim.decay_frac", "0"])


def test_compile_policy_avoids_known_bad_combinations(monkeypatch):
    from pytrain.train.compile_policy import decide, next_level

    monkeypatch.delenv("TORCH_COMPILE_DISABLE_CUDAGRAPHS", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert decide("auto", None, cpu, False, False, False).mode == "eager"
    assert decide("auto", None, cuda, False, False, False).mode == "default"
    d = decide("reduce-overhead", True, cuda, True, False, False)
    assert d.mode == "default" and "activation checkpointing" in d.reason
    assert decide("reduce-overhead", True, cuda, False, True, False).mode == "default"
    assert decide("reduce-overhead", True, cuda, False, False, False).mode == "reduce-overhead"
    d = decide("reduce-overhead", True, cuda, False, False, False, fsdp2=True)
    assert d.mode == "default" and "FSDP2" in d.reason
    assert (
        decide("reduce-overhead", True, cuda, True, False, False, guard=False).mode
        == "reduce-overhead"
    )
    assert decide("auto", False, cuda, False, False, False).mode == "eager"
    # Fallbacks never go from CUDA graphs into autotuning.
    assert [
        next_level(m) for m in ("reduce-overhead", "max-autotune-no-cudagraphs", "default", "eager")
    ] == ["default", "default", "eager", "eager"]
    monkeypatch.setenv("TORCH_COMPILE_DISABLE_CUDAGRAPHS", "1")
    assert (
        "TORCH_COMPILE_DISABLE_CUDAGRAPHS"
        in decide("reduce-overhead", True, cuda, False, False, False).reason
    )


def test_warm_up_visits_every_bucket_shape_without_touching_data_or_rng(small_corpus, tmp_path):
    bucket = ("--max_steps", "4", "--data.mode", "bucket", "--data.bucket_lengths", "16", "32", "64", "--data.token_budget", "256")  # fmt: skip
    plain = Trainer(small_cfg(small_corpus, tmp_path / "plain", *bucket))
    want = plain.fit()["losses"]
    plain.close()
    t = Trainer(small_cfg(small_corpus, tmp_path / "warm", *bucket))
    assert t.warm_up_shapes() == [(16, 16), (8, 32), (4, 64)]
    seen = []
    real = t._forward_backward
    t._forward_backward = lambda batches, denom: (
        seen.append(tuple(batches[0].input_ids.shape)) or real(batches, denom)
    )
    t.compiler.mode = "default"  # pretend compiled, so the warm-up runs (the module stays eager)
    got = t.fit()["losses"]
    assert seen[:3] == [(16, 16), (8, 32), (4, 64)]
    assert got == want  # no batch consumed, no RNG drawn, no update applied
    t.close()


def test_sdpa_backend_choice_keeps_the_loss_and_unknown_names_fail():
    from pytrain.model.config import ModelConfig
    from pytrain.model.gpt import GPT

    ids = torch.randint(0, 64, (2, 16))
    losses = {}
    for backend in ("auto", "math"):
        torch.manual_seed(0)
        gpt = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, sdpa_backend=backend))
        losses[backend] = gpt(ids).float().logsumexp(-1).mean()
    assert torch.allclose(losses["auto"], losses["math"], atol=1e-5)
    with pytest.raises(ValueError, match="model.sdpa_backend is 'fa3'"):
        GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, sdpa_backend="fa3"))


def test_profile_window_writes_a_trace_and_a_summary(small_corpus, tmp_path):
    t = Trainer(small_cfg(small_corpus, tmp_path, "--max_steps", "4", "--profile_steps", "1:3"))
    t.fit()
    out = tmp_path / "runs" / "t" / "profile"
    summary = (out / "summary.json").read_text()
    assert (out / "trace.json").stat().st_size > 0
    assert '"steps": 2' in summary and (out / "summary.md").exists()
    # The matmuls by shape: the model's linear layers, each with its FLOP rate.
    matmuls = json.loads(summary)["matmuls"]
    assert matmuls and all(m["calls"] > 0 and m["tflops"] > 0 for m in matmuls), matmuls
    # Forward and backward apart: the backward of x @ W.T multiplies by the (out, in) weight.
    assert {m["pass"] for m in matmuls} == {"forward", "backward"}, matmuls
    md = (out / "summary.md").read_text()
    # The rows' sum beside the matmul kernels' comes with kernels (tests/test_gpu.py).
    assert "| pass | matmul | input shapes |" in md and "rows above" not in md
    # The kernel each shape ran: none on the CPU (tests/test_gpu.py checks cuBLAS's names).
    assert all(m["kernel"] == "-" for m in matmuls), matmuls
    t.close()
    with pytest.raises(ValueError, match="profile_steps '3:1'"):
        Trainer(small_cfg(small_corpus, tmp_path / "b", "--profile_steps", "3:1"))


@pytest.mark.parametrize(
    "kernel, want",
    [  # names from the 1B model's profile on an H200
        ("triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_5", "Inductor's kernels"),
        ("triton_poi_fused_cat_view_5", "Inductor's kernels"),
        ("_swiglu_backward_kernel", "hand-written Triton kernels"),
        ("_adamw_kernel", "optimizer"),
        ("_ce_grad_kernel", "cross-entropy / softmax"),
        ("Memset (Device)", "copies / memset"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matmul"),
        ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90", "attention backward"),
        # torch._grouped_mm's CUTLASS kernel on an H100 (the MoE preset's profile): a matmul before
        ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblem", "grouped GEMM"),
    ],
)  # fmt: skip
def test_profile_categories(kernel, want):
    """An Inductor kernel is not a copy although its name holds `_to_copy` (the RMSNorm's
    kernels were counted as copies before)."""
    from pytrain.train.profiling import category

    assert category(kernel).startswith(want)


def test_profile_matmul_time_is_its_own_matmul_kernels():
    """A matmul's time in the summary is the matmul kernels it launched: an mm nested in
    another mm is counted once (in the outer one), and a kernel of another kind that the
    profiler linked to the op is not a matmul's. The profiler's device_time_total, used
    before, counts the nested mm twice here and the Triton kernel once; on the GPU the 1B
    step's rows summed to more than its matmul kernels ran."""
    from torch.autograd.profiler_util import FunctionEvent

    from pytrain.train.profiling import matmuls_by_shape

    def op(i: int, name: str, start: int, end: int, kernels: list) -> FunctionEvent:
        e = FunctionEvent(i, name, thread=0, start_us=start, end_us=end, use_device="cuda",
                          input_shapes=[[64, 32], [32, 16]])  # fmt: skip
        for k, us in kernels:
            e.append_kernel(k, 0, us)
        return e

    outer = op(1, "aten::mm", 0, 100, [("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 40.0)])
    inner = op(2, "aten::mm", 10, 90, [("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", 60.0),
                                       ("triton_poi_fused_add_0", 500.0)])  # fmt: skip
    outer.append_cpu_child(inner)
    inner.set_cpu_parent(outer)
    other = op(
        3, "aten::addmm", 200, 300, [("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 10.0)]
    )
    other.input_shapes = [[16], [64, 32], [32, 16]]

    class Profile:
        def events(self):
            return [outer, inner, other]

    rows = {m["op"]: m for m in matmuls_by_shape(Profile(), steps=2)}
    assert rows["mm"]["calls"] == 0.5 and rows["mm"]["ms"] == pytest.approx(0.05), rows
    # 2 M N K = 65,536 FLOP in 100 us of kernels over two steps.
    assert rows["mm"]["tflops"] == pytest.approx(65536 / 100e-6 / 1e12), rows
    assert rows["addmm"]["ms"] == pytest.approx(0.005), rows
    assert rows["mm"]["kernel"].startswith("nvjet"), rows


def test_fa4_without_its_gpu_is_a_clear_error():
    from pytrain.model.config import ModelConfig
    from pytrain.model.gpt import GPT

    gpt = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, attention="fa4"))
    with pytest.raises(ValueError, match="needs a Hopper or Blackwell GPU"):
        gpt.attention_backend(torch.device("cpu"), compiled=False)
    with pytest.raises(ValueError, match="needs the batch's cu_seqlens"):
        gpt.make_mask(torch.zeros(1, 4, dtype=torch.int32), "fa4", None)


def test_float8_refusals_name_what_is_missing(small_corpus, tmp_path):
    from pytrain.config import ConfigError
    from pytrain.model import float8
    from pytrain.model.config import ModelConfig
    from pytrain.model.gpt import GPT

    gpt = GPT(ModelConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32))
    with pytest.raises(ConfigError, match="expected one of off, tensorwise, rowwise"):
        float8.convert(gpt, "e4m3", torch.device("cpu"))
    assert float8.convert(gpt, "off", torch.device("cpu")) == 0
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU with FP8"):
        Trainer(small_cfg(small_corpus, tmp_path, "--model.float8", "tensorwise"))


def test_fused_optimizer_path_with_clipping_inside_matches_the_plain_path(
    small_corpus, tmp_path, monkeypatch
):
    """The trainer's CUDA path (fused AdamW; clipping as grad_scale, skip as found_inf) run
    on CPU's fused AdamW gives the losses of the plain path (clip_grad_norm_ + step). A low
    clip threshold makes clipping act on every step, so a fold that ignored it would differ."""
    from pytrain.optim import adamw as optim

    def run(fused: bool, name: str) -> list[float]:
        real = optim.make_optimizer

        def make(model, o, device, master=False):
            opt = real(model, o, device, master)
            if not fused:
                return opt
            groups = [
                {"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups
            ]
            return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), fused=True)

        monkeypatch.setattr(optim, "make_optimizer", make)
        cfg = small_cfg(
            small_corpus, tmp_path / name, "--max_steps", "6", "--optim.grad_clip", "0.05"
        )
        t = Trainer(cfg)
        assert bool(t.optimizer.defaults.get("fused")) == fused
        return t.fit()["losses"]

    plain, fused = run(False, "plain"), run(True, "fused")
    assert fused == pytest.approx(plain, rel=1e-6)
    unclipped = Trainer(
        small_cfg(
            small_corpus, tmp_path / "unclipped", "--max_steps", "6", "--optim.grad_clip", "0"
        )
    ).fit()["losses"]
    # Clipping moved the losses by far more than the tolerance above.
    assert max(abs(a - b) / b for a, b in zip(unclipped, plain, strict=True)) > 1e-4


def test_mixture_training_logs_sources_and_a_validation_loss_per_set(small_corpus, tmp_path):
    train, val = small_corpus
    t = Trainer(
        small_cfg(
            small_corpus,
            tmp_path,
            "--data.path",
            "",
            "--data.val_path",
            "",
            "--data.mix",
            f"a={train}:0.8",
            f"b={val}:0.2",
            "--data.stages",
            "3:a=0.2,b=0.8",
            "--data.val_mix",
            f"a={val}",
            f"b={train}",
            "--max_steps",
            "6",
            "--eval_every",
            "3",
        )  # fmt: skip
    )
    result = t.fit()
    by = t.evaluator.by_source
    assert set(by) == {"a", "b"} and all(v is not None and math.isfinite(v) for v in by.values())
    # The overall validation loss is the token-weighted mean of the two sets' losses.
    assert min(by.values()) <= result["val_loss"] <= max(by.values())
    srcs = t.feed.state_dict()["sources"]
    assert all(s["tokens"] > 0 for s in srcs)
    t.close()


def test_step_log_averages_throughput_over_the_window_between_lines(tmp_path):
    """A step read late then one read early (0.9 ms, seen next to checkpoints on the H100)
    log their average, not a 1000x tokens/s."""
    from types import SimpleNamespace

    from pytrain.train.metrics import RunLog, StepLog

    log = RunLog(tmp_path, True, False)
    steps = StepLog(log, lambda *a: None, flops_token=1.0, peak=None, world_size=1,
                    log_every=2, progress=False, device=torch.device("cpu"))  # fmt: skip
    r = SimpleNamespace(tokens=1000, loss=1.0, grad_norm=1.0, skipped=None, routing=None)
    for number, dt in ((1, 1.0), (2, 1.999), (3, 0.001), (4, 1.0), (5, 1.0), (6, 1.0)):
        steps.step(r, number, dt, FeedTime(), 1e-3, 0, 0)
    log.close()
    text = (tmp_path / "train.log").read_text()
    got = [float(t.replace(",", "")) for t in re.findall(r"tok/s ([\d,]+)", text)]
    # step 1 alone; step 2 (1.999 s); steps 3-4: 2,000 tokens in 1.001 s, not 1,000 in 1 ms.
    assert got == [1000, 500, 1998, 1000], got


def test_a_step_lines_expert_loads_are_those_of_its_own_steps(tmp_path):
    """Each line's loads sum the routing of the steps it covers (since the previous line),
    whenever the steps are read: once, the loads of the step queued after it were in them
    and the line of a step read at once (an evaluation's, the last) had none."""
    from types import SimpleNamespace

    from pytrain.model.moe import MoEGPT
    from pytrain.train.metrics import RunLog, StepLog

    gpt = MoEGPT(ModelConfig(family="moe", n_layer=1, n_head=2, d_model=32, vocab_size=64,
                             experts=2, top_k=1, expert_hidden=16))  # fmt: skip
    log = RunLog(tmp_path, True, False)
    steps = StepLog(log, lambda *a: None, flops_token=1.0, peak=None, world_size=1,
                    log_every=2, progress=False, device=torch.device("cpu"),
                    stats=gpt.routing_stats)  # fmt: skip
    for number, load in enumerate(([4.0, 0.0], [0.0, 4.0], [3.0, 1.0], [1.0, 3.0]), start=1):
        r = SimpleNamespace(tokens=8, loss=1.0, grad_norm=1.0, skipped=None,
                            routing=torch.tensor([load]))  # fmt: skip
        steps.step(r, number, 1.0, FeedTime(), 1e-3, 0, 0)
    log.close()
    text = (tmp_path / "train.log").read_text()
    got = re.findall(
        r"step (\d+) loss .* expert_load_max_over_mean ([\d.]+) unused_experts (\d)", text
    )
    # step 1 alone ([4, 0]), step 2 alone ([0, 4]), steps 3-4 together ([4, 4]).
    assert got == [("1", "2.00", "1"), ("2", "2.00", "1"), ("4", "1.00", "0")], text


def test_step_lines_read_back_as_the_step_log_writes_them(tmp_path):
    """read_step_lines, what the benchmark scripts parse train.log with, gets every field
    of StepLog's lines (MFU as a fraction), and not the evaluation lines between them."""
    from types import SimpleNamespace

    from pytrain.train.metrics import RunLog, StepLog, read_step_lines

    log = RunLog(tmp_path, True, False)
    steps = StepLog(log, lambda *a: None, flops_token=2.0, peak=4000.0, world_size=1,
                    log_every=1, progress=False, device=torch.device("cpu"))  # fmt: skip
    r = SimpleNamespace(tokens=1000, loss=2.5, grad_norm=0.75, skipped=None, routing=None)
    steps.step(r, 1, 1.0, FeedTime(0.002, 0.003), 1e-3, 0, 0)
    steps.eval(1, 3.25)
    steps.step(r, 2, 0.5, FeedTime(0.0, 0.001), 2e-3, 0, 0)
    log.close()
    rows = read_step_lines((tmp_path / "train.log").read_text())
    assert [x["step"] for x in rows] == [1, 2]
    assert rows[0] == {"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.75, "tok/s": 1000.0,
                       "step_ms": 1000.0, "data_wait_ms": 2.0, "feed_ms": 3.0, "mfu": 0.5}  # fmt: skip
    assert rows[1]["tok/s"] == 2000.0 and rows[1]["mfu"] == 1.0


def test_resume_with_other_batch_settings_names_them_and_the_flags(small_corpus, tmp_path, capsys):
    """A checkpoint's loader position belongs to the batches its settings cut: resuming
    with other ones is refused with the settings named and the flags that resume it."""
    first = Trainer(small_cfg(small_corpus, tmp_path, "--max_steps", "2", "--ckpt_every", "2"))
    first.fit()
    first.close()
    cfg = small_cfg(small_corpus, tmp_path, "--data.frames_per_block", "3", "--no-data.shuffle")
    with pytest.raises(CheckpointMismatch) as e:
        Trainer(cfg)
    msg = str(e.value)
    assert "data.frames_per_block 2 (now 3)" in msg and "data.shuffle true (now false)" in msg
    assert "resume it with --data.shuffle true --data.frames_per_block 2," in msg
    # The model's architecture likewise (n_head keeps every shape: only the name says it).
    for flag, said in (("--model.d_model", "model.d_model 64 (now 32)"),
                       ("--model.n_head", "model.n_head 2 (now 4)")):  # fmt: skip
        value = said.split("now ")[1].rstrip(")")
        with pytest.raises(CheckpointMismatch, match=re.escape(said)):
            Trainer(small_cfg(small_corpus, tmp_path, flag, value))
    # Those flags resume it.
    again = Trainer(small_cfg(small_corpus, tmp_path, "--data.frames_per_block", "2"))
    assert again.step == 2
    again.close()
    # A micro-batch of other rows resumes too (the loader continues from the same row).
    capsys.readouterr()
    other = Trainer(small_cfg(small_corpus, tmp_path, "--data.batch_size", "3"))
    assert other.step == 2
    assert (
        "resuming a run saved with 4-row micro-batches with 3-row ones" in capsys.readouterr().out
    )
    other.close()


def test_a_run_chosen_eager_resumes_compiled_when_asked(small_corpus, tmp_path):
    """Eager by choice is no failure: resumed with --compile, the run takes the compile
    level it asks for, and its line does not speak of a fallback; a level a run fell back
    to after a failure is kept (test_compile_failure_falls_back_and_reruns_the_same_step)."""
    from pytrain.train import compile_policy

    first = Trainer(small_cfg(small_corpus, tmp_path, "--max_steps", "2"))
    first.fit()
    assert first.compiler.mode == "eager" and not first.compiler.fallbacks
    first.close()
    decision = compile_policy.CompileDecision("default", "requested")
    compiled = compile_policy.CompiledModel(None, None, decision, True, print)
    compiled.load_state_dict(
        checkpoint.read(sorted((tmp_path / "runs" / "t").glob("ckpt-*.pt"))[-1])
    )
    assert compiled.mode == "default" and "fell back" not in compiled.reason
    compiled.load_state_dict({"compile_mode": "eager", "fallbacks": ["step 2: default failed"]})
    assert compiled.mode == "eager" and "fell back" in compiled.reason
