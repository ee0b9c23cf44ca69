"""A real MLflow run: the flattened config as params, every metric at its step, the HF export as artifact.

The tracking URI defaults to a local store inside the run dir (``sqlite:///<run_dir>/mlflow/mlflow.db``,
artifacts in ``<run_dir>/mlflow/artifacts``), so nothing is written to the working directory and no
server is needed; point ``monitor.mlflow.tracking_uri`` at a server to share runs.
"""

from __future__ import annotations

import os
import time
from typing import Any
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


class MlflowMonitor:
    requires = "mlflow"

    def __init__(self, run_dir: str, config: DictConfig, tracking_uri: str | None = None,
                 experiment: str = "shardyard", run_name: str | None = None, log_export: bool = True):
        from mlflow import MlflowClient  # lazy: heavy, and only when selected
        from mlflow.entities import Param

        self.log_export = log_export
        local = os.path.join(run_dir, "mlflow")
        if tracking_uri:
            uri, artifacts = tracking_uri, None
        else:
            os.makedirs(local, exist_ok=True)
            uri, artifacts = f"sqlite:///{os.path.abspath(local)}/mlflow.db", Path(local, "artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment, artifact_location=artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=run_name or os.path.basename(run_dir),
                                             tags={"engine": config.backend.name, "model": config.model.name}).info.run_id
        values: Any = OmegaConf.to_container(config, resolve=True)
        params = [Param(k, str(v)[:6000]) for k, v in flatten(values).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        print(f"shardyard | mlflow: run {self.run_id} in {uri}", flush=True)

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()
                                                    if isinstance(v, (int, float)) and not isinstance(v, bool)])

    def close(self, summary: dict) -> None:
        if self.log_export and summary.get("export"):
            self.client.log_artifacts(self.run_id, summary["export"], artifact_path="hf")
        self.client.set_terminated(self.run_id, "FINISHED")

    def fail(self, error: str) -> None:
        self.client.set_tag(self.run_id, "error", error[:5000])
        self.client.set_terminated(self.run_id, "FAILED")
