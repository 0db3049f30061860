"""Weights & Biases and MLflow beside TensorBoard (pytrain.train.trackers), as a user runs
them: `python -m pytrain.train --wandb --mlflow`, W&B offline (its files read back with W&B's
own reader, `wandb leet inspect --json`), MLflow on a local SQLite store (read back with
MlflowClient). A run of a small mixture of experts, stopped and resumed: both trackers hold
every step's loss as train.log has it, the evaluations and the expert loads, the run's
configuration, one tracked run across the two processes, and how it ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import losses_by_step

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

MOE = ["--model.family", "moe", "--model.experts", "4", "--model.top_k", "2",
       "--model.expert_hidden", "64", "--model.n_layer", "2", "--model.n_head", "2",
       "--model.d_model", "64", "--data.seq_len", "64", "--data.batch_size", "4"]  # fmt: skip


def train(tmp_path: Path, data: tuple[Path, Path], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytrain.train", "--data.path", str(data[0]),
           "--data.val_path", str(data[1]), "--out_dir", str(tmp_path / "runs"), "--name", "t",
           "--device", "cpu", "--no-progress", "--no-compile.safe_env", "--samples", "0",
           "--max_steps", "6", "--eval_every", "3", "--eval_batches", "2", "--log_every", "1",
           "--ckpt_every", "3", "--deterministic", *MOE, *extra]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_PROJECT": "tracked", "PYTHONPATH": str(ROOT),
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "MLFLOW_EXPERIMENT_NAME": "moe-runs", "WANDB_SILENT": "true"}  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def wandb_records(run_file: Path) -> list[dict]:
    """The records of a W&B run's transaction log (run-ID.wandb), by W&B's own reader."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    r = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_file)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_wandb_and_mlflow_log_what_tensorboard_gets_across_a_resume(tmp_path, small_corpus):
    train(tmp_path, small_corpus, "--wandb", "--mlflow", "--halt_after", "3")
    train(tmp_path, small_corpus, "--wandb", "--mlflow")
    run_dir = tmp_path / "runs" / "t"
    losses = losses_by_step((run_dir / "train.log").read_text())
    assert sorted(losses) == list(range(1, 7))
    ids = json.loads((run_dir / "trackers.json").read_text())

    # W&B: one offline run directory a process, both of the same run.
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{ids['wandb']}.wandb" for f in files)
    history: dict[int, dict] = {}
    for f in files:
        records = wandb_records(f)
        run = next(x["run"] for x in records if x["type"] == "run")
        assert run["project"] == "tracked" and run["display_name"] == "t"
        config = run["config"]["update"]
        assert config["model"]["family"] == "moe" and config["model"]["experts"] == 4
        assert config["max_steps"] == 6
        for x in records:
            if x["type"] == "history":
                history.setdefault(x["history"]["item"]["step"], {}).update(x["history"]["item"])
        assert next(x for x in records if x["type"] == "exit")["exit"].get("exit_code", 0) == 0
    assert {s: history[s]["train/loss"] for s in range(1, 7)} == losses
    assert {"val/loss", "perf/tokens_per_s", "train/lr"} <= history[6].keys()
    # Each step's own loads, the last step's too (read at once, before its evaluation).
    for step in range(1, 7):
        assert {"moe/load_max_over_mean/0", "moe/unused_experts/1"} <= history[step].keys()

    # MLflow: one run in the experiment, finished, its parameters the configuration.
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("moe-runs")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == ids["mlflow"] and run.info.run_name == "t"
    assert run.info.status == "FINISHED"
    assert run.data.params["model.family"] == "moe" and run.data.params["optim.lr"]
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert logged == losses
    for name in ("val/loss", "moe/load_max_over_mean/0", "perf/tokens_per_s"):
        steps = {m.step for m in client.get_metric_history(run.info.run_id, name)}
        assert 6 in steps, name
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [3, 6]


def test_a_fresh_run_in_a_used_directory_is_a_new_tracked_run(tmp_path, monkeypatch):
    """trackers.json names the tracked runs only to a resumed run: a run from step 0 (its
    checkpoints deleted) starts new ones."""
    from pytrain.config import parse_args
    from pytrain.train import trackers

    cfg = parse_args(["--mlflow", "--out_dir", str(tmp_path)])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # MLflow writes nothing where the run starts
    first = trackers.open_trackers(cfg, tmp_path, enabled=True, resumed=False)
    first[0].close(trackers.KILLED)
    again = trackers.open_trackers(cfg, tmp_path, enabled=True, resumed=True)
    again[0].close(trackers.FINISHED)
    fresh = trackers.open_trackers(cfg, tmp_path, enabled=True, resumed=False)
    fresh[0].close(trackers.FAILED)
    assert first[0].run_id == again[0].run_id != fresh[0].run_id
    assert (tmp_path / "mlflow.db").exists()  # the default store, beside the runs
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(first[0].run_id).info.status == "FINISHED"
    assert client.get_run(fresh[0].run_id).info.status == "FAILED"
    assert not trackers.open_trackers(cfg, tmp_path, enabled=False, resumed=False)  # rank > 0
    assert not any((tmp_path / "cwd").iterdir())


@pytest.mark.slow  # a process, importing torch
def test_a_tracker_that_does_not_import_is_one_line_before_any_data(tmp_path):
    """The package shadowed by one that fails to import, as a missing one does."""
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{ROOT}",
           "PYTRAIN_CACHE": str(tmp_path / "cache")}  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "pytrain.train", "--wandb", "--out_dir", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "cache").exists()  # no embedded default built before the line
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, r.stderr
    assert "--wandb needs wandb" in lines[0] and "pip install 'pytrain[wandb]'" in lines[0]


def test_mlflow_that_does_not_import_is_named_with_its_extra(monkeypatch):
    from pytrain.config import ConfigError, parse_args
    from pytrain.train import trackers

    monkeypatch.setitem(sys.modules, "mlflow", None)  # what a missing package raises
    with pytest.raises(
        ConfigError, match=r"--mlflow needs mlflow.*pip install 'pytrain\[mlflow\]'"
    ):
        trackers.check_installed(parse_args(["--mlflow"]))
    trackers.check_installed(parse_args(["--no-mlflow"]))  # not asked for: not imported


def test_a_tracker_that_cannot_start_its_run_is_one_line(tmp_path, monkeypatch):
    """MLflow pointed at a server that is not there: the ConfigError of one line (which the
    command line prints as it is) names it; W&B, started first, is closed as failed."""
    import socket

    from pytrain.config import ConfigError, parse_args
    from pytrain.train import trackers

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "WANDB_MODE": "offline",
                 "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "WANDB_SILENT": "true"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    cfg = parse_args(["--wandb", "--mlflow", "--out_dir", str(tmp_path)])
    with pytest.raises(ConfigError) as e:
        trackers.open_trackers(cfg, tmp_path / "run", enabled=True, resumed=False)
    assert str(e.value).startswith("--mlflow: MLflow could not start its run: API request to ")
    assert "\n" not in str(e.value) and f"127.0.0.1:{port}" in str(e.value)
    assert not (tmp_path / "run" / trackers.IDS).exists()


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, capsys):
    """Its server gone mid-run: one line (stderr and train.log), the other trackers and
    TensorBoard's file go on."""
    from pytrain.train import trackers
    from pytrain.train.metrics import RunLog

    class Gone:
        name = "MLflow"

        def scalars(self, step, values):
            raise ConnectionError("API request to http://mlflow:5000 failed\nretries exhausted")

        def close(self, status):
            raise AssertionError("a dropped tracker is not closed")

    class Kept:
        name = "W&B"

        def __init__(self):
            self.got, self.status = [], None

        def scalars(self, step, values):
            self.got.append((step, dict(values)))

        def close(self, status):
            self.status = status

    kept = Kept()
    log = RunLog(tmp_path, True, False, [Gone(), kept])
    log.scalars(7, {"train/loss": 2.5, "perf/mfu": None})
    log.scalars(8, {"train/loss": 2.25})
    log.close(trackers.FINISHED)
    assert kept.got == [(7, {"train/loss": 2.5}), (8, {"train/loss": 2.25})]
    assert kept.status == "FINISHED"
    want = ("MLflow: logging failed at step 7 (API request to http://mlflow:5000 failed); "
            "the run goes on without it")  # fmt: skip
    assert capsys.readouterr().err.strip() == want
    assert (tmp_path / "train.log").read_text().rstrip().endswith(want)
