"""Real text that needs no download: the Python standard library's own source, read from disk.

Every machine that runs labkit has a Python, and every Python carries its standard library as
``.py`` files. ``TextCorpus`` reads a fixed, documented selection of them (``STDLIB_MODULES``,
in that order, joined as they are), byte-level: the vocabulary is the set of byte values that
occur, so a token is one byte and ``decode(encode(text)) == text``. The first
``1 - val_fraction`` of the bytes are the training split, the rest the validation split (one
cut, no shuffling: validation text is text the model never saw). The exact bytes depend on the
Python version, so every run records ``sha256``: equal fingerprints mean equal data.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

from ..validate import check_number

__all__ = ["STDLIB_MODULES", "TextCorpus"]

# Pure-Python modules present in every CPython from 3.10 on, chosen for ordinary, well-written
# code and prose (docstrings): about 330 kB on Python 3.11.
STDLIB_MODULES = (
    "textwrap", "string", "heapq", "bisect", "functools", "json.decoder", "json.encoder", "fractions",
    "contextlib", "shlex", "colorsys", "fnmatch", "glob", "queue", "sched", "statistics", "difflib",
)


@functools.lru_cache(maxsize=8)
def _read(modules: tuple[str, ...]) -> bytes:
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"module {name!r} has no .py source in this Python; pick pure-Python stdlib "
                             "modules.")
        with open(spec.origin, "rb") as f:
            parts.append(f.read())
    return b"".join(parts)


@dataclass(frozen=True)
class TextCorpus:
    """The selected stdlib sources as bytes, with a vocabulary, a split and a fingerprint.

    >>> c = TextCorpus(modules=("bisect", "colorsys"))
    >>> c.decode(c.encode("def f(x):")) , len(c.sha256)
    ('def f(x):', 64)
    >>> len(c.train) + len(c.val) == len(c.data)
    True
    """

    modules: tuple[str, ...] = STDLIB_MODULES
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.modules, str) or not self.modules:
            raise ValueError(f"modules must be a non-empty tuple of module names, got {self.modules!r}.")
        object.__setattr__(self, "modules", tuple(self.modules))
        check_number("val_fraction", self.val_fraction, 0, 0.5, low_open=True, high_open=True)

    @property
    def data(self) -> bytes:
        """The corpus: the modules' source files, concatenated in order."""
        return _read(self.modules)

    @functools.cached_property
    def sha256(self) -> str:
        """The hex sha256 of ``data``: record it with a run; the same fingerprint, the same text."""
        return hashlib.sha256(self.data).hexdigest()

    @functools.cached_property
    def vocab(self) -> bytes:
        """The byte values that occur, sorted: token ``i`` is byte ``vocab[i]``."""
        return bytes(sorted(set(self.data)))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @functools.cached_property
    def _lookup(self) -> Tensor:
        table = torch.full((256,), -1, dtype=torch.long)
        table[torch.tensor(list(self.vocab))] = torch.arange(len(self.vocab))
        return table

    def encode(self, text: str | bytes) -> Tensor:
        """Return the token ids of ``text`` (UTF-8 bytes); a byte outside the vocabulary is an error."""
        raw = text.encode() if isinstance(text, str) else bytes(text)
        if not raw:
            return torch.zeros(0, dtype=torch.long)
        ids = self._lookup[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]
        if (ids < 0).any():
            bad = sorted({b for b in raw if b not in self.vocab})
            raise ValueError(f"bytes {bad} do not occur in the corpus, so they have no token; use text from "
                             "it.")
        return ids

    def decode(self, ids: Tensor) -> str:
        """Return the text of token ids (undecodable UTF-8 shown as U+FFFD)."""
        return bytes(self.vocab[i] for i in ids.tolist()).decode("utf-8", errors="replace")

    @functools.cached_property
    def tokens(self) -> Tensor:
        """The whole corpus as token ids (int64, on the CPU)."""
        return self.encode(self.data)

    @property
    def split_at(self) -> int:
        return int(len(self.data) * (1.0 - self.val_fraction))

    @property
    def train(self) -> Tensor:
        return self.tokens[: self.split_at]

    @property
    def val(self) -> Tensor:
        return self.tokens[self.split_at :]
