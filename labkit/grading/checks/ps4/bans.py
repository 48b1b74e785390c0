"""What each part of set 4 asks the student to write, so its check refuses labkit's own.

A check traps each of these while the student's code runs (``core.forbid``); the grader
installs the traps before any student code (``labkit.grading.harness``).
"""

# update_rms_per_tensor and stable_adamw_step: the RMS, its bias correction, and the optimizer that clips
# with it (UpdateMonitor reads read_update_rms, which computes through _update_rms_together: a reference
# to either taken before the traps still reaches a trapped name)
RMS_FUNCS = ("labkit.optim.update_rms", "labkit.optim.read_update_rms", "labkit.optim._bias_correction",
             "labkit.optim._update_rms_together", "labkit.optim.StableAdamW")

# find_spike: nothing in labkit answers it; the part is reading records
SPIKE_FUNCS: tuple[str, ...] = ()
