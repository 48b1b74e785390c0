"""Problem set 4's checks: spikes that gradient clipping cannot see (after lesson 08).

One module per part (and ``bans``, what the parts ask the student to write):

1. ``rms``, ``check_update_rms``: RMS(g/sqrt(v_hat)) per parameter tensor from an AdamW's state,
   against ``labkit.optim.read_update_rms``;
2. ``step``, ``check_update_clipping``: one update-clipped AdamW step, Algorithm 2 of arXiv
   2304.13013, against ``labkit.optim.StableAdamW`` on float64, step by step along its trajectory;
3. ``spike``, ``check_find_spike``: the tensor and optimizer step of an RMS spike and whether it
   came before the loss spike, read from a real monitored run's records (``UpdateMonitor``'s
   fields, one record late).

Each judge that finds a wrong answer replays the classic mistakes of its part and names the one
that gives the student's numbers.
"""

from __future__ import annotations

from ..core import Check
from . import bans, rms, spike, step
from .rms import check_update_rms
from .spike import check_find_spike
from .step import check_update_clipping

__all__ = ["BANNED", "CHECKS", "check_find_spike", "check_update_clipping", "check_update_rms"]

CHECKS: dict[str, Check] = {
    "check_update_rms": rms.CHECK,
    "check_update_clipping": step.CHECK,
    "check_find_spike": spike.CHECK,
}
# the library functions each part asks the student to write (trapped while it runs)
BANNED: dict[str, tuple[str, ...]] = {
    "check_update_rms": bans.RMS_FUNCS,
    "check_update_clipping": bans.RMS_FUNCS,
    "check_find_spike": bans.SPIKE_FUNCS,
}
