"""MLflow: a run in a local store, read with ``MlflowClient`` (``pip install labkit[mlflow]``).

The store is ``MLFLOW_TRACKING_URI`` when set (MLflow's own setting), else a SQLite file,
``sqlite:///out/mlflow.db`` (artifacts in ``out/mlflow-artifacts``), MLflow's recommended local
backend; view it with
``mlflow ui --backend-store-uri sqlite:///out/mlflow.db``. MLflow keeps float64 metrics, so
the values are the JSONL's bits, except that its SQLite store writes +-inf as +-max float.
MLflow has no per-step text, histograms or alert API: texts (skip reasons, faults, rewinds)
go to the run's ``events.txt`` artifact when the run closes, alarms to ``alerts.txt`` and the
run's ``labkit.alerts`` tag (a count) as they happen.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .telemetry import Sink

__all__ = ["EXPERIMENT", "MLflowSink", "open"]

EXPERIMENT = "labkit"
BATCH = 900  # metrics per log_batch call (MLflow takes at most 1000): one write per ~40 steps, not per step


class MLflowSink(Sink):
    """Log to a new run ``run_name`` of ``experiment`` in the store at ``tracking_uri``."""

    def __init__(self, tracking_uri: str, run_name: str, experiment: str = EXPERIMENT,
                 artifact_location: str | None = None) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric, self.client = Metric, MlflowClient(tracking_uri=tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            experiment, artifact_location=artifact_location)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        self.pending: list = []
        self.events: list[str] = []
        self.alerts: list[str] = []

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        now = int(time.time() * 1000)
        self.pending += [self._metric(tag, v, now, step) for tag, v in scalars.items()]
        self.events += [f"step {step}  {tag}: {text}" for tag, text in texts.items()]
        if len(self.pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        for i in range(0, len(self.pending), 1000):
            self.client.log_batch(self.run_id, metrics=self.pending[i:i + 1000])
        self.pending = []

    def alert(self, step: int, title: str, text: str) -> None:
        self.alerts.append(f"step {step}  {title}: {text}")
        self.client.log_text(self.run_id, "\n".join(self.alerts) + "\n", "alerts.txt")
        self.client.set_tag(self.run_id, "labkit.alerts", str(len(self.alerts)))

    def close(self) -> None:
        self.flush()
        self.client.log_text(self.run_id, "\n".join(self.events) + "\n", "events.txt")
        self.client.set_terminated(self.run_id)


def open(out: str | os.PathLike, run_name: str) -> MLflowSink:  # noqa: A001 (the sinks' one entry point)
    """Open a sink for run ``run_name`` in ``MLFLOW_TRACKING_URI``, else in ``out/mlflow.db``."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return MLflowSink(os.environ["MLFLOW_TRACKING_URI"], run_name)
    # a SQLite store's artifacts would otherwise go to ./mlruns, wherever the process happens to run
    out = os.path.abspath(out)
    return MLflowSink("sqlite:///" + os.path.join(out, "mlflow.db"), run_name,
                      artifact_location=Path(out, "mlflow-artifacts").as_uri())
