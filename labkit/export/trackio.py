"""trackio: Hugging Face's local-first tracker, runs in SQLite (``pip install labkit[trackio]``).

trackio keeps its projects in one folder, ``TRACKIO_DIR`` (read once, when trackio is first
imported). A sink opened before that points it at ``out/trackio`` unless ``TRACKIO_DIR`` is
set; view with ``TRACKIO_DIR=out/trackio trackio show --project labkit``. Scalars, texts and
histograms go to one run; alarms to ``trackio.alert`` (stored with the run, printed, and sent
to a Slack/Discord webhook when ``TRACKIO_WEBHOOK_URL`` is set).
"""

from __future__ import annotations

import os
import sys

from .schema import Histogram
from .telemetry import Sink

__all__ = ["PROJECT", "TrackioSink", "open"]

PROJECT = "labkit"


class TrackioSink(Sink):
    """Log to a trackio run ``run_name`` in ``project``."""

    def __init__(self, run_name: str, project: str = PROJECT) -> None:
        import trackio

        self._trackio = trackio
        self.project, self.dir = project, str(trackio.utils.TRACKIO_DIR)
        self.run = trackio.init(project=project, name=run_name, embed=False, auto_log_gpu=False,
                                auto_log_cpu=False)

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.run.log({**scalars, **texts}, step=step)

    def histogram(self, step: int, tag: str, hist: Histogram) -> None:
        self.run.log({tag: self._trackio.Histogram(np_histogram=(hist.counts, hist.edges))}, step=step)

    def alert(self, step: int, title: str, text: str) -> None:
        self.run.alert(title=title, text=text, level=self._trackio.AlertLevel.WARN, step=step)

    def close(self) -> None:
        # trackio.finish, not run.finish: it also forgets the run, which trackio would otherwise finish again
        # at exit
        self._trackio.finish()


def open(out: str | os.PathLike, run_name: str) -> TrackioSink:  # noqa: A001 (the sinks' one entry point)
    """Open a sink for run ``run_name``, storing in ``out/trackio`` if trackio's folder is not chosen yet."""
    if "trackio" not in sys.modules and not os.environ.get("TRACKIO_DIR"):
        os.environ["TRACKIO_DIR"] = os.path.abspath(os.path.join(out, "trackio"))
    return TrackioSink(run_name)
