"""The built-in tasks: deterministic data and a fresh model per run, no download."""

from .toy import ToyTask

__all__ = ["ToyTask"]
