"""TensorBoard: event files by ``torch.utils.tensorboard.SummaryWriter`` (needs ``labkit[tensorboard]``).

Scalars are written as float64 tensors (``double_precision=True``), so TensorBoard's reader
gives back the JSONL's exact bits; texts and alerts go to the Text tab, histograms to the
Histograms tab. After a rewind the writer is reopened with ``purge_step``, as TensorBoard
expects after a restart from a checkpoint: the curves show the branch the run kept.
"""

from __future__ import annotations

import os

from .schema import Histogram
from .telemetry import Sink

__all__ = ["TensorBoardSink", "open"]


class TensorBoardSink(Sink):
    """Write to ``log_dir`` (open it with ``tensorboard --logdir`` on its parent)."""

    def __init__(self, log_dir: str | os.PathLike) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer_cls, self.log_dir = SummaryWriter, os.fspath(log_dir)
        # purge_step=0 writes the session START a later purge needs: TensorBoard's readers take the first
        # START as the run's beginning and only a second one as a restart (it also hides an older run here)
        self.writer = SummaryWriter(self.log_dir, purge_step=0)

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for tag, v in scalars.items():
            self.writer.add_scalar(tag, v, step, new_style=True, double_precision=True)
        for tag, text in texts.items():
            self.writer.add_text(tag, text, step)

    def histogram(self, step: int, tag: str, hist: Histogram) -> None:
        num = sum(hist.counts)
        # bucket [e, e+1) of log2|g| holds count c: min and max are the outer edges of the non-empty
        # buckets (TensorBoard draws its end buckets up to them), the moments use the buckets' centres
        e = [x for x, c in zip(hist.edges, hist.counts) if c]
        self.writer.add_histogram_raw(
            tag, min=e[0], max=e[-1] + 1.0, num=num,
            sum=sum((x + 0.5) * c for x, c in zip(hist.edges, hist.counts)),
            sum_squares=sum((x + 0.5) ** 2 * c for x, c in zip(hist.edges, hist.counts)),
            bucket_limits=hist.edges[1:], bucket_counts=hist.counts, global_step=step,
        )

    def rewind(self, step: int) -> None:
        self.writer.close()
        self.writer = self._writer_cls(self.log_dir, purge_step=step)

    def close(self) -> None:
        self.writer.close()


def open(out: str | os.PathLike, run_name: str) -> TensorBoardSink:  # noqa: A001 (the sinks' one entry point)
    """Open a sink writing to ``out/tensorboard/run_name``."""
    return TensorBoardSink(os.path.join(out, "tensorboard", run_name))
