"""Telemetry where practitioners look: TensorBoard, trackio, MLflow and W&B from one schema.

JSONL stays the source of truth; a ``Telemetry`` streams the same records, unscaled and
named once (``schema``), into the trackers named in ``log_to``, each an optional extra
imported only when used (``pip install labkit[tensorboard]``, ``[trackio]``, ``[mlflow]``,
``[wandb]``), and ``replay`` (``python -m labkit export``) writes a finished ``log.jsonl``
into any of them afterwards.

>>> from labkit.export import parse_trackers, row
>>> parse_trackers("tensorboard,wandb"), sorted(row({"step": 0, "loss": 0.5}).scalars)
(['tensorboard', 'wandb'], ['train/loss'])
"""

from .replay import replay
from .schema import LOG2_EDGES, SCALARS, TEXTS, Histogram, Row, log2_histogram, row
from .telemetry import TRACKERS, Sink, Telemetry, check_trackers, parse_trackers

__all__ = [
    "LOG2_EDGES",
    "SCALARS",
    "TEXTS",
    "TRACKERS",
    "Histogram",
    "Row",
    "Sink",
    "Telemetry",
    "check_trackers",
    "log2_histogram",
    "parse_trackers",
    "replay",
    "row",
]
