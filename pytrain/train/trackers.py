"""Weights & Biases and MLflow beside TensorBoard (`--wandb`, `--mlflow`; the wandb and mlflow
extras). Rank 0 logs to each what TensorBoard gets, at the step it belongs to: loss, learning
rate, gradient norm, throughput, MFU, memory, evaluations, a mixture's sources and a mixture
of experts' loads by layer (pytrain.train.metrics.RunLog fans them out), and the run's
configuration (W&B's config; MLflow's parameters, flattened as `model.n_layer`).

Where each logs is each tool's own setting, as other trainers read it:
- W&B: WANDB_PROJECT (else "pytrain"), WANDB_ENTITY, WANDB_MODE=offline, WANDB_API_KEY; its
  files under the run directory (runs/NAME/wandb). Steps are its `step` metric, not W&B's
  own counter: a resumed run logs the steps after its checkpoint again, which W&B's
  counter (increasing only) would drop.
- MLflow: MLFLOW_TRACKING_URI (else a SQLite store beside the runs, OUT_DIR/mlflow.db:
  `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`), MLFLOW_EXPERIMENT_NAME (else
  "pytrain"). Metrics go asynchronously (MLflow's own queue), flushed at the end.

A resumed run goes on in the same tracked run: the ids are kept in the run directory
(trackers.json). The run's end says how it ended: finished, stopped by a signal (W&B: a
nonzero exit; MLflow: KILLED), failed. A tracker that cannot start its run (no server, no
key) ends the run in one line; one that fails later (its server gone) is dropped with a line
on stderr and in train.log, and the run goes on."""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from pytrain.config import ConfigError, TrainConfig, to_dict
from pytrain.config.errors import first_line

# A run's end, in MLflow's words (RunStatus), which W&B's exit code follows (0: finished).
FINISHED, KILLED, FAILED = "FINISHED", "KILLED", "FAILED"
IDS = "trackers.json"


class Tracker(Protocol):
    name: str  # as the lines about it say it

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...
    def close(self, status: str) -> None: ...


def _import(flag: str, module: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise ConfigError(
            f"--{flag} needs {module}, which does not import here ({e}): pip install "
            f"'pytrain[{flag}]'"
        ) from None


def check_installed(cfg: TrainConfig) -> None:
    """One line (ConfigError) where a tracker asked for does not import: before any data."""
    if cfg.wandb:
        _import("wandb", "wandb")
    if cfg.mlflow:
        _import("mlflow", "mlflow")


def open_trackers(cfg: TrainConfig, run_dir: Path, enabled: bool, resumed: bool) -> list[Tracker]:
    """The trackers `cfg` asks for (rank 0: `enabled`); a `resumed` run goes on in the tracked
    runs its directory names."""
    if not enabled or not (cfg.wandb or cfg.mlflow):
        return []
    path = run_dir / IDS
    ids = json.loads(path.read_text()) if resumed and path.exists() else {}
    out: list[Tracker] = []
    for flag, make in (("wandb", WandbTracker), ("mlflow", MlflowTracker)):
        if not getattr(cfg, flag):
            continue
        try:
            out.append(make(cfg, run_dir, ids))
        except Exception as e:  # its server, its key, its store: said in one line
            for t in out:
                t.close(FAILED)
            raise ConfigError(
                f"--{flag}: {make.name} could not start its run: {first_line(e)}"
            ) from None
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids) + "\n")
    tmp.replace(path)
    return out


class WandbTracker:
    name = "W&B"

    def __init__(self, cfg: TrainConfig, run_dir: Path, ids: dict) -> None:
        wandb = _import("wandb", "wandb")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "pytrain", name=cfg.name,
            id=ids.get("wandb"), resume="allow" if "wandb" in ids else None, dir=str(run_dir),
            config=to_dict(cfg),
        )  # fmt: skip
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        ids["wandb"] = self.run.id

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({**values, "step": step})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == FINISHED else 1)


def flat_params(cfg: TrainConfig) -> dict[str, str]:
    """The configuration as MLflow's parameters: `section.key` -> its value as text."""
    out: dict[str, str] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = str(v)

    walk(to_dict(cfg), "")
    return out


class MlflowTracker:
    name = "MLflow"

    def __init__(self, cfg: TrainConfig, run_dir: Path, ids: dict) -> None:
        mlflow = _import("mlflow", "mlflow")
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (
            f"sqlite:///{(Path(cfg.out_dir) / 'mlflow.db').resolve()}"
        )
        self.client = mlflow.MlflowClient(uri)
        if run_id := ids.get("mlflow"):
            # Parameters are MLflow's once set: a resumed run keeps the first ones.
            self.client.update_run(run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "pytrain"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment, run_name=cfg.name).info.run_id
            params = [Param(k, v) for k, v in flat_params(cfg).items()]
            self.client.log_batch(run_id, params=params)
        self.run_id = ids["mlflow"] = run_id
        self.open = True
        self.queued: list = []  # MLflow's asynchronous logging operations, waited on in turn
        # A process that ends without close (an error past the trainer) marks its run failed,
        # not running forever.
        atexit.register(self.close, FAILED)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1e3)
        metrics = [Metric(k, float(v), ms, step) for k, v in values.items()]
        self.queued.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        if len(self.queued) >= 256:  # long since written, as a rule: the list stays short
            self._wait()

    def _wait(self) -> None:
        # Not mlflow.flush_async_logging(): it opens MLflow's default store (./mlflow.db).
        for op in self.queued:
            op.wait()
        self.queued = []

    def close(self, status: str) -> None:
        if self.open:
            self.open = False
            self._wait()
            self.client.set_terminated(self.run_id, status)
