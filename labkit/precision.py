"""Renamed ``labkit.formats.bf16``: this name is that module, for one release (a ``DeprecationWarning``)."""

import sys
import warnings

from .formats import bf16

warnings.warn("labkit.precision is now labkit.formats.bf16: import from there.", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = bf16  # the same module object: monkeypatching and pickles see one module
