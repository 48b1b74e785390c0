"""Count host reads of tensors (syncs on a GPU) made from labkit's code, for the tests that promise few."""

import sys

import torch

READS = ("item", "__bool__", "tolist", "__float__", "__int__", "cpu", "numpy")


class SyncCounter:
    """Trap ``names`` on ``torch.Tensor`` (through ``monkeypatch``); count the calls from labkit's frames."""

    def __init__(self, monkeypatch, names=READS):
        self.count = 0
        for name in names:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))

    def _wrap(self, real):
        def trapped(t, *args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("labkit"):
                self.count += 1
            return real(t, *args, **kwargs)
        return trapped
