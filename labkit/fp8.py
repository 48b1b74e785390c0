"""Renamed ``labkit.formats.fp8``: this name is that module, for one release (a ``DeprecationWarning``)."""

import sys
import warnings

from .formats import fp8

warnings.warn("labkit.fp8 is now labkit.formats.fp8: import from there.", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = fp8  # the same module object: monkeypatching and pickles see one module
