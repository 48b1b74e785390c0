"""Weights & Biases, offline: a run folder under ``out/wandb`` (``pip install labkit[wandb]``).

The run is written offline (``mode="offline"``, nothing leaves the machine; upload it later
with ``wandb sync out/wandb/offline-run-*``). Every metric is plotted against
``train/step`` (``define_metric``), the record's step, so a rewind draws over the same
steps instead of being dropped as W&B drops a smaller ``step=``. Alarms go to
``run.alert``; histograms are ``wandb.Histogram`` over the same log2 bins.
"""

from __future__ import annotations

import os

from .schema import Histogram
from .telemetry import Sink

__all__ = ["PROJECT", "WandbSink", "open"]

PROJECT = "labkit"


class WandbSink(Sink):
    """Log to an offline W&B run ``run_name`` stored under ``directory``."""

    def __init__(self, directory: str | os.PathLike, run_name: str, project: str = PROJECT) -> None:
        import wandb

        self._wandb = wandb
        os.makedirs(directory, exist_ok=True)
        # no console capture or system stats: a sink logs the records, nothing else of the process
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True,
                                  x_disable_machine_info=True, silent=True)
        self.run = wandb.init(mode="offline", dir=os.fspath(directory), project=project, name=run_name,
                              settings=settings, reinit="create_new")
        self.run.define_metric("train/step")
        self.run.define_metric("*", step_metric="train/step")

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.run.log({"train/step": step, **scalars, **texts})

    def histogram(self, step: int, tag: str, hist: Histogram) -> None:
        self.run.log({"train/step": step, tag: self._wandb.Histogram(np_histogram=(hist.counts, hist.edges))})

    def alert(self, step: int, title: str, text: str) -> None:
        self.run.alert(title=title, text=f"step {step}: {text}", level=self._wandb.AlertLevel.WARN)

    def close(self) -> None:
        self.run.finish()


def open(out: str | os.PathLike, run_name: str) -> WandbSink:  # noqa: A001 (the sinks' one entry point)
    """Open an offline run ``run_name`` in ``out`` (W&B makes ``out/wandb/offline-run-*``)."""
    return WandbSink(out, run_name)
