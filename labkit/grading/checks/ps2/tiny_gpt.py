"""The tiny GPT whose real runs set 2's parts read, built on one thread as the sandbox builds it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run a reference on one thread, as the sandbox does: the same bits on both sides of the grader."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)


TINY_GPT = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "batch_size": 4}
