"""benchmarks/titan.py: the ways ours runs (--ours-ac, --ours-variant), each a row of its own,
--memory-peaks: what held each run's peak, and the mixture-of-experts shape (qwen3-moe-8l):
both sides' commands (--dry-run) and the active parameters behind its MFU."""

import os

import pytest
from conftest import load_script

titan = load_script("benchmarks/titan.py", "titan_bench")


def test_ours_runs_once_per_policy_and_named_variant():
    assert titan.ours_variants("", []) == [(None, [])]  # the preset as it is
    got = titan.ours_variants(
        "selective, every-2", ["fp32 moments=", "bf16 moments=--optim.state_dtype bf16"]
    )
    assert got == [
        ("selective", ["--activation_checkpointing", "selective"]),
        ("every-2", ["--activation_checkpointing", "every-2"]),
        ("fp32 moments", []),
        ("bf16 moments", ["--optim.state_dtype", "bf16"]),
    ]
    for bad in ("no flags", "=--fsdp"):
        with pytest.raises(ValueError, match="expected NAME=FLAGS"):
            titan.ours_variants("", [bad])


def test_memory_peaks_reads_a_pickled_snapshot_and_needs_the_window(tmp_path):
    """--memory-peaks: what held the peak of a snapshot where torchtitan writes it; a run
    too short for ours' window is refused in one line."""
    import pickle
    import subprocess
    import sys

    snap = titan.titan_snapshot(tmp_path / "titan-out", 10)
    snap.parent.mkdir(parents=True)
    trace = [{"action": "alloc", "addr": 1, "size": 2**30,
              "frames": [{"filename": "/x/pytrain/model/gpt.py", "line": 5, "name": "f"}]}]  # fmt: skip
    segments = [{"device": 0, "stream": 0, "total_size": 4 * 2**30,
                 "blocks": [{"size": 3 * 2**30, "state": "active_allocated"}]}]  # fmt: skip
    snap.write_bytes(pickle.dumps({"segments": segments, "device_traces": [trace]}))
    table = titan.peak_table(snap)
    assert "Peak allocated: 3.00 GiB" in table and "| `gpt.py:5 f` | 1.00 | 1 |" in table
    assert "Reserved at the window's end: 4.00 GiB" in table  # and by stream
    r = subprocess.run([sys.executable, "benchmarks/titan.py", "--titan-site", str(tmp_path),
                        "--memory-peaks", "--steps", "4"], capture_output=True, text=True,
                       cwd=titan.ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--steps at least 5" in r.stderr and "Traceback" not in r.stderr


def test_quality_pairs_each_run_with_its_reference():
    """--quality: float8 runs against their side's bf16 run of the same variant; another
    variant's bf16 run against the first variant's."""
    plain = titan.quality_pairs([("bf16", None), ("preset", None), ("fp8", None)],
                                ["bf16", "fp8 output-bf16"])  # fmt: skip
    assert plain == [("ours bf16", "ours preset"), ("ours bf16", "ours fp8"),
                     ("torchtitan bf16", "torchtitan fp8 output-bf16")]  # fmt: skip
    moments = titan.quality_pairs(
        [("bf16", "fp32 moments"), ("bf16", "bf16 moments"), ("fp8", "bf16 moments")], []
    )
    assert moments == [
        ("ours bf16 (bf16 moments)", "ours fp8 (bf16 moments)"),
        ("ours bf16 (fp32 moments)", "ours bf16 (bf16 moments)"),
    ]


def test_the_comparisons_pair_each_precision_and_the_fastest_with_their_memory():
    results = {
        "ours preset (bf16 moments)": {"tokens_per_s": 10578.0, "peak_gib": 52.5},
        "ours bf16 (bf16 moments)": {"tokens_per_s": 10490.0, "peak_gib": 52.0},
        "ours bf16 (3 lean blocks)": {"tokens_per_s": 10300.0, "peak_gib": 50.7},
        "ours fp8": {"error": "out of memory"},
        "torchtitan bf16": {"tokens_per_s": 8820.0, "peak_gib": 51.2},
        "torchtitan fp8 output-bf16": {"tokens_per_s": 11072.0, "peak_gib": 50.9},
    }
    assert titan.comparisons(results) == [
        ["bf16 vs bf16", "ours bf16 (bf16 moments)", "torchtitan bf16", "1.19x", "+0.8"],
        ["fp8 vs fp8", "-", "torchtitan fp8 output-bf16", "-", "-"],  # ours failed
        [
            "best vs best",
            "ours preset (bf16 moments)",
            "torchtitan fp8 output-bf16",
            "0.96x",
            "+1.6",
        ],
    ]
    assert titan.comparisons({})[0] == ["bf16 vs bf16", "-", "-", "-", "-"]


def test_more_runs_are_asked_for_by_name_and_unknown_runs_refused(tmp_path):
    """Ours in float8 with the output layer in bf16, rowwise float8 on both sides; every
    run name belongs to one side's table; a run name neither side has is refused in one
    line, before anything runs."""
    import subprocess
    import sys

    assert titan.OURS_RUNS["fp8 rowwise"] == ["--model.float8", "rowwise"]
    assert titan.OURS_RUNS["fp8 output-bf16"][-2:] == ["--model.float8_head", "off"]
    assert titan.TITAN_RUNS["fp8 rowwise output-bf16"] == ("rowwise", ["output"])
    assert set(titan.RUNS) < set(titan.ALL_RUNS)  # the default is some of them
    assert titan.chosen_runs("ours fp8 rowwise, torchtitan bf16,ours bf16,ours bf16") == (
        ["fp8 rowwise", "bf16"],
        ["bf16"],
    )  # in the order named, each once
    assert set(titan.chosen_runs(",".join(titan.RUNS))[0]) <= set(titan.OURS_RUNS)
    r = subprocess.run([sys.executable, "benchmarks/titan.py", "--titan-site", str(tmp_path),
                        "--runs", "ours fp8,ours fp9"], capture_output=True, text=True,
                       cwd=titan.ROOT, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "no run named 'ours fp9'" in r.stderr
    assert "Traceback" not in r.stderr


def test_torchtitan_float8_flags_follow_its_recipes():
    assert titan.titan_float8_flags(None, 4) == []
    four = titan.titan_float8_flags(titan.TITAN_RUNS["fp8 output-bf16"], 4)
    assert "--quantize.linear.float8.recipe_name" not in four  # its default, not to be named
    assert "--quantize.linear.float8.enable_fsdp_float8_all_gather" in four
    assert four[four.index("--quantize.linear.float8.filter_fqns") + 1] == "output"
    one = titan.titan_float8_flags(titan.TITAN_RUNS["fp8"], 1)
    assert one[-2:] == ["--quantize.linear.float8.recipe_name", "tensorwise"]
    rowwise = titan.titan_float8_flags(titan.TITAN_RUNS["fp8 rowwise output-bf16"], 4)
    assert rowwise[rowwise.index("--quantize.linear.float8.recipe_name") + 1] == "rowwise"
    assert not any("all_gather" in f or "precompute" in f for f in rowwise)


def test_the_quality_table_shows_the_training_loss_gap_quarter_by_quarter():
    """--quality: beside the validation loss at the last step, the training loss's ratio over
    each quarter of the steps (closing or widening); torchtitan's step lines give theirs."""
    losses = [
        8.0,
        8.0,
        6.0,
        6.0,
        5.0,
        5.0,
        4.0,
        4.0,
        9.0,
    ]  # 9 steps: quarters of 2, the last dropped
    assert titan.quarter_means(losses) == [8.0, 6.0, 5.0, 4.0]
    assert titan.quarter_means([3.0, 2.0, 1.0]) == []
    ref = {"train_loss": [8.0, 6.0, 5.0, 4.0]}
    assert (
        titan.loss_trend(ref, {"train_loss": [8.8, 6.3, 5.1, 4.0]}) == "1.100, 1.050, 1.020, 1.000"
    )
    assert titan.loss_trend(ref, {}) == "-"
    line = ("step: 12  loss:  6.2031  grad_norm:  1.0042  memory: 51.21GiB(36.70%)  tps: 8,713  "
            "tflops: 504.35  mfu: 51.00%")  # fmt: skip
    assert titan.titan_step_lines(line) == [
        {"step": 12, "loss": 6.2031, "tok/s": 8713.0, "memory_gib": 51.21}
    ]
    assert titan.titan_step_lines("validate step: 12  loss: 6.1 memory: 1GiB tps: 1") == []


def run_main(monkeypatch, tmp_path, ours, torchtitan, *args: str) -> None:
    """main() with --quality over 8 steps and `args`, the text's preparation and both
    trainers replaced by stand-ins: `ours(label, extra flags, warmup)` and
    `torchtitan(label, float8, seed, warmup)` give each run's result (the wrappers take
    run_ours' and run_titan's arguments as main() passes them)."""

    def fake_ours(work, shape, gpus, seq, rows, accum, steps, label, extra, text=None,
                  memory=False, warmup=None, profile=False):  # fmt: skip
        return ours(label, extra, warmup)

    def fake_titan(work, site, shape, gpus, seq, rows, accum, steps, label, float8, val=None,
                   memory=False, seed=None, warmup=None, profile=False):  # fmt: skip
        return torchtitan(label, float8, seed, warmup)

    monkeypatch.setattr(titan, "run_ours", fake_ours)
    monkeypatch.setattr(titan, "run_titan", fake_titan)
    monkeypatch.setattr(
        titan, "split_and_pack", lambda work, corpus, tok: (tmp_path, (tmp_path, tmp_path))
    )
    monkeypatch.setattr(titan, "write_text_jsonl", lambda path: path.write_text("{}\n"))
    monkeypatch.setattr(titan, "machine_line", lambda: "machine")
    monkeypatch.setattr(titan.sys, "argv", [
        "titan.py", "--titan-site", str(tmp_path), "--work", str(tmp_path / "w"), "--quality",
        "--steps", "8", *args])  # fmt: skip
    assert titan.main() == 0


def test_main_runs_in_the_order_named_and_prints_the_quality_tables(tmp_path, monkeypatch, capsys):
    """main() end to end with both trainers replaced by stand-ins that record their calls:
    the runs go in the order --runs names them with each side's flags, and --quality prints
    the validation pairs with the training loss by quarter, then the comparisons."""
    calls = []

    def ours(label, extra, warmup):
        calls.append(("ours", label, extra))
        fp8 = "--model.float8" in extra
        return {"tokens_per_s": 130.0 if fp8 else 100.0, "peak_gib": 50.0, "setup": "x",
                "val_loss": 6.30 if fp8 else 6.20,
                "train_loss": [9.9, 8.4, 7.2, 6.4] if fp8 else [9.0, 8.0, 7.0, 6.3]}  # fmt: skip

    def torchtitan(label, float8, seed, warmup):
        calls.append(("torchtitan", label, float8))
        return {"tokens_per_s": 90.0, "peak_gib": 51.0, "val_loss": 6.5, "train_loss": []}

    run_main(monkeypatch, tmp_path, ours, torchtitan,
             "--runs", "ours fp8 output-bf16,torchtitan bf16,ours bf16")  # fmt: skip
    assert calls == [
        ("ours", "fp8-output-bf16", titan.OURS_RUNS["fp8 output-bf16"]),
        ("ours", "bf16", titan.OURS_RUNS["bf16"]),
        ("torchtitan", "bf16", None),
    ]
    out = capsys.readouterr().out
    assert "| 2048 | ours bf16 | 6.2000 | ours fp8 output-bf16 | 6.3000 | 1.0161 | NO | " \
        "1.100, 1.050, 1.029, 1.016 |" in out  # fmt: skip
    assert "| 2048 | fp8 vs fp8 | ours fp8 output-bf16 | - | - | - |" in out
    assert "| 2048 | bf16 vs bf16 | ours bf16 | torchtitan bf16 | 1.11x | -1.0 |" in out


def test_quality_over_seeds_shows_means_spreads_and_undecided_gaps(tmp_path, monkeypatch, capsys):
    """--seeds: every run once per seed (a seed's runs before the next seed's), ours with
    --seed and torchtitan with --debug.seed, both with --warmup's warm-up; --quality's table
    shows each side's mean and its seeds' spread, and a gap that half the spread could move
    across 1% is undecided."""
    calls, warmups = [], set()
    ours_loss = {("bf16", "1337"): 6.20, ("bf16", "2"): 6.30,  # 1.6% apart
                 ("fp8 output-bf16", "1337"): 6.18, ("fp8 output-bf16", "2"): 6.26}  # fmt: skip

    def ours(label, extra, warmup):
        seed = extra[extra.index("--seed") + 1]
        name = "fp8 output-bf16" if "--model.float8" in extra else "bf16"
        calls.append(("ours", label, seed))
        warmups.add(warmup)
        return {"tokens_per_s": 100.0, "peak_gib": 50.0, "setup": "x",
                "val_loss": ours_loss[name, seed], "train_loss": [9.0, 8.0, 7.0, 6.0]}  # fmt: skip

    def torchtitan(label, float8, seed, warmup):
        calls.append(("torchtitan", label, str(seed)))
        warmups.add(warmup)
        loss = 6.80 if float8 else {1337: 6.50, 2: 6.52}[seed]
        return {"tokens_per_s": 90.0, "peak_gib": 51.0, "val_loss": loss, "train_loss": []}

    run_main(monkeypatch, tmp_path, ours, torchtitan, "--warmup", "3", "--seeds", "1337,2",
             "--runs", "ours bf16,ours fp8 output-bf16,torchtitan bf16,torchtitan fp8 output-bf16")  # fmt: skip
    assert calls == [
        ("ours", "bf16-seed-1337", "1337"), ("ours", "fp8-output-bf16-seed-1337", "1337"),
        ("torchtitan", "bf16 seed 1337", "1337"),
        ("torchtitan", "fp8 output-bf16 seed 1337", "1337"),
        ("ours", "bf16-seed-2", "2"), ("ours", "fp8-output-bf16-seed-2", "2"),
        ("torchtitan", "bf16 seed 2", "2"), ("torchtitan", "fp8 output-bf16 seed 2", "2"),
    ]  # fmt: skip
    assert warmups == {3}  # --warmup, both sides
    out = capsys.readouterr().out
    # ours: means 6.25 and 6.22, -0.48%, but the seeds 1.6% apart: undecided
    assert "| 2048 | ours bf16 | 6.2500 (1.6% apart) | ours fp8 output-bf16 | 6.2200 (1.3% " \
        "apart) | 0.9952 | undecided | 1.000, 1.000, 1.000, 1.000 |" in out  # fmt: skip
    # torchtitan: 6.51 against 6.80, +4.5%, the seeds 0.3% apart: outside 1% whatever they do
    assert "| 2048 | torchtitan bf16 | 6.5100 (0.3% apart) | torchtitan fp8 output-bf16 | " \
        "6.8000 (0.0% apart) | 1.0445 | NO | - |" in out  # fmt: skip


def test_the_verdict_weighs_the_gap_against_half_the_seeds_spread():
    assert titan.verdict(1.004, 0.0) == "yes" and titan.verdict(0.985, 0.0) == "NO"
    assert titan.verdict(1.003, 0.012) == "yes"  # 0.3% + 0.6% still within 1%
    assert titan.verdict(1.004, 0.017) == "undecided"
    assert titan.verdict(1.03, 0.017) == "NO"  # 3% - 0.85% still outside
    assert titan.parse_seeds("") == [None] and titan.parse_seeds("2, 1337,2") == [2, 1337]
    with pytest.raises(ValueError, match="--seeds: 'x' not a whole number"):
        titan.parse_seeds("1,x")


def test_torchtitans_8b_command_carries_its_recipe_and_the_seed(tmp_path, monkeypatch):
    """torchtitan at 8B runs its 8B recipe's learning rate (its trainer's default is 8e-4)
    and checkpointing, and --seeds' seed as its --debug.seed; its failure is one line."""
    ran = []

    def fake_run(cmd, **kwargs):
        ran.append(cmd)
        return titan.subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nValueError: no GPU")

    monkeypatch.setattr(titan.subprocess, "run", fake_run)
    out = titan.run_titan(tmp_path, tmp_path, titan.SHAPES["8b"], 4, 8192, 1, 2, 100, "bf16",
                          None, val=tmp_path / "val.json", seed=2)  # fmt: skip
    assert "error" in out and "ValueError: no GPU" in out["error"]
    cmd = " ".join(ran[0])
    for flags in ("--optimizer.lr 3e-4", "--debug.seed 2", "--activation_checkpoint.mode selective",
                  "--training.global_batch_size 8", "--lr_scheduler.warmup_steps 10"):  # fmt: skip
        assert flags in cmd, flags
    titan.run_titan(tmp_path, tmp_path, titan.SHAPES["8b"], 4, 8192, 1, 2, 10, "bf16", None)
    assert "--debug.seed" not in ran[1]  # no seed asked for: torchtitan's own


def test_the_moe_shape_counts_active_parameters_once_for_both_sides():
    """MFU at qwen3-moe-8l over the parameters a token passes through (the router, 8 of 128
    experts, the output layer; no embedding): 766,283,776, as torchtitan 0.2.2's own count
    and ours' model give for 8 layers of Qwen3-30B-A3B; the dense shapes' count unchanged."""
    moe = titan.SHAPES["qwen3-moe-8l"]
    assert titan.active_params(moe) == 766_283_776
    assert titan.flops_per_token(moe, 4096) == 6 * 766_283_776 + 12 * 8 * 32 * 128 * 4096
    assert titan.active_params(titan.SHAPES["1b"]) == 1_235_814_400  # as before the MoE shape


def test_the_moe_shapes_commands_on_both_sides(tmp_path):
    """Both sides at 2 rows of 4096 in one micro-batch: torchtitan's qwen3 through the
    flavor the worker registers, its checkpointing off, its float8 run on the experts'
    grouped GEMMs only; ours the preset at 8 layers on synthetic ids at Qwen3's vocabulary."""
    moe = titan.SHAPES["qwen3-moe-8l"]
    cmd = titan.titan_command(tmp_path, moe, 1, 4096, 2, 1, 30, titan.TITAN_RUNS["fp8 experts"])
    line = " ".join(cmd)
    for flags in ("--titan-run --model.name qwen3 --model.flavor 30B-A3B-8L",
                  "--training.local_batch_size 2 --training.global_batch_size 2",
                  "--training.seq_len 4096", "--compile.enable --activation_checkpoint.mode none",
                  "--model.converters quantize.grouped_mm.float8 "
                  "--quantize.grouped_mm.float8.fqns experts"):  # fmt: skip
        assert flags in line, flags
    assert "quantize.linear" not in line
    bf16 = titan.titan_command(tmp_path, moe, 1, 4096, 2, 1, 30, None)
    assert "--model.converters" not in bf16
    ours = " ".join(titan.ours_command(tmp_path, moe, 1, 4096, 2, 1, 30, "bf16", ["--x", "y"]))
    assert (f"--config configs/qwen3-moe-30b-a3b.toml --model.n_layer 8 --activation_checkpointing "
            f"off --data.path {tmp_path / 'syn151936'} --data.seq_len 4096 --data.batch_size 2 "
            "--optim.grad_accum 1") in ours and ours.endswith("--x y")  # fmt: skip


def test_dry_run_prints_the_moe_shapes_default_runs_and_refuses_experts_at_a_dense_shape(tmp_path):
    import subprocess
    import sys

    # A shell without an allocator setting (another test's process may have set one): then
    # torchtitan's runs get its launcher's.
    env = {k: v for k, v in os.environ.items() if k not in titan.ALLOC_VARS}

    def dry(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "benchmarks/titan.py", "--titan-site", str(tmp_path),
                               "--work", str(tmp_path / "w"), "--dry-run", *args],
                              capture_output=True, text=True, cwd=titan.ROOT, timeout=120, env=env)  # fmt: skip

    r = dry("--shape", "qwen3-moe-8l", "--seq", "4096", "--steps", "30")
    assert r.returncode == 0, r.stderr
    runs = [x for x in r.stdout.splitlines() if x.startswith("[4096] ")]
    assert runs == [f"[4096] {n}:" for n in titan.MOE_RUNS]
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in r.stdout  # torchtitan's launcher's
    assert "--data.batch_size 2 --optim.grad_accum 1" in r.stdout
    assert not (tmp_path / "w").exists()  # nothing prepared, nothing run
    r = dry("--runs", "torchtitan fp8 experts")
    assert r.returncode == 2 and "torchtitan fp8 experts needs an MoE --shape" in r.stderr


def test_torchao_017s_float8_moe_config_answers_to_torchtitans_old_name(monkeypatch):
    """torchtitan 0.2.2 imports MoETrainingConfig, which torchao 0.17 renamed: the worker
    gives the new class the old name, and leaves a torchao that has it alone."""
    import sys
    import types

    utils, config = types.ModuleType("conversion_utils"), types.ModuleType("config")
    config.Float8TrainingOpConfig = type("Float8TrainingOpConfig", (), {})
    package = types.ModuleType("moe_training")
    package.conversion_utils, package.config = utils, config
    for name, module in (("torchao", types.ModuleType("torchao")),
                         ("torchao.prototype", types.ModuleType("prototype")),
                         ("torchao.prototype.moe_training", package),
                         ("torchao.prototype.moe_training.conversion_utils", utils),
                         ("torchao.prototype.moe_training.config", config)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    titan.alias_torchao_moe_config()
    assert utils.MoETrainingConfig is config.Float8TrainingOpConfig
    utils.MoETrainingConfig = old = object()
    titan.alias_torchao_moe_config()
    assert utils.MoETrainingConfig is old


def test_kernel_profile_sums_a_chrome_trace_by_category_beside_ours(tmp_path, monkeypatch, capsys):
    """--kernel-profile: torchtitan's chrome trace (here a real torch.profiler trace of two
    CPU steps, with device events added as torchtitan's CUDA traces have them) summed a step
    by pytrain's kernel categories; both sides' commands profile their last steps; main()
    prints the categories side by side and refuses --memory-peaks beside it."""
    import json
    import subprocess
    import sys

    import torch

    chrome_trace = load_script("benchmarks/chrome_trace.py", "chrome_trace_bench")
    path = tmp_path / "rank0_trace.json"
    with torch.profiler.profile(  # as torchtitan's: the trace written when the cycle ends
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=2),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    ) as p:
        for _ in range(3):
            torch.ones(64).sum()
            p.step()
    trace = json.loads(path.read_text())
    grouped = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblem"
    trace["traceEvents"] += [
        {"ph": "X", "cat": "kernel", "name": grouped, "ts": 0, "dur": 3000.0},
        {"ph": "X", "cat": "kernel", "name": "void at::native::sbtopk::gatherTopK<float>", "ts": 0, "dur": 1000.0},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 0, "dur": 200.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9999.0},
    ]  # fmt: skip
    path.write_text(json.dumps(trace))
    s = chrome_trace.trace_summary(path)
    assert s["steps"] == 2 and s["step_ms"] > 0
    assert s["categories_ms"] == {"grouped GEMM (experts)": 1.5,
                                  "routing: top-k, sort, gathers, scatters": 0.5,
                                  "copies / memset": 0.1}  # fmt: skip
    assert s["device_busy_ms"] == pytest.approx(2.1)
    assert s["device_idle_ms"] == pytest.approx(s["step_ms"] - 2.1)
    (tmp_path / "empty.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="no ProfilerStep"):
        chrome_trace.trace_summary(tmp_path / "empty.json")

    moe = titan.SHAPES["qwen3-moe-8l"]
    line = " ".join(titan.titan_command(tmp_path, moe, 1, 4096, 2, 1, 12, None, profile=True))
    assert ("--profiling.enable_profiling --profiling.save_traces_folder profile_traces "
            "--profiling.profile_freq 12 --profiling.profiler_warmup 1 "
            "--profiling.profiler_active 2") in line  # fmt: skip
    ours = titan.ours_command(tmp_path, moe, 1, 4096, 2, 1, 12, "bf16", [], profile=True)
    assert ours[-2:] == ["--profile_steps", "10:12"]
    traced = tmp_path / "titan-out" / "profile_traces" / "iteration_12" / "rank0_trace.json"
    assert titan.titan_trace(tmp_path / "titan-out") is None
    traced.parent.mkdir(parents=True)
    traced.write_text(path.read_text())
    assert titan.titan_trace(tmp_path / "titan-out") == traced

    ours_profile = {**s, "categories_ms": {"grouped GEMM (experts)": 1.0}}

    def ours_run(label, extra, warmup):
        return {"tokens_per_s": 100.0, "peak_gib": 50.0, "setup": "x", "val_loss": 6.2,
                "train_loss": [], "kernels": ours_profile}  # fmt: skip

    def titan_run(label, float8, seed, warmup):
        return {"tokens_per_s": 90.0, "peak_gib": 51.0, "val_loss": 6.5, "train_loss": [],
                "kernels": s}  # fmt: skip

    run_main(monkeypatch, tmp_path, ours_run, titan_run, "--runs", "ours bf16,torchtitan bf16",
             "--kernel-profile")  # fmt: skip
    out = capsys.readouterr().out
    assert "| ms a step | ours bf16 | torchtitan bf16 |" in out
    assert "| grouped GEMM (experts) | 1.0 | 1.5 |" in out
    assert "| routing: top-k, sort, gathers, scatters | 0.0 | 0.5 |" in out
    r = subprocess.run([sys.executable, "benchmarks/titan.py", "--titan-site", str(tmp_path),
                        "--kernel-profile", "--memory-peaks", "--dry-run"],
                       capture_output=True, text=True, cwd=titan.ROOT)  # fmt: skip
    assert r.returncode == 2 and "one at a time" in r.stderr
