"""The guarded training step: the one place where the AMP order lives, and its parts.

``train``: ``TrainStep``, the order read top to bottom. Its parts pass data explicitly and
never import it: ``batch`` (the batch checked, moved and split; the buffers kept),
``decision`` (unscale, check and clip: one pure decision, on the host or on the device),
``record`` (the record, forensics, deferred records), ``parts`` (what it is built from,
checked). Defenses and monitors join through ``labkit.hooks``.
"""

from ..autocast import PRECISIONS
from .record import DeferredRecord
from .train import TrainStep

__all__ = ["PRECISIONS", "DeferredRecord", "TrainStep"]
