"""What each part of set 3 asks the student to write, so its check refuses labkit's own.

A check traps each of these while the student's code runs (``core.forbid``); the grader
installs the traps before any student code (``labkit.grading.harness``).
"""

# quantize_tiles and saturation: the cast, the amax check and the history
FP8_FUNCS = ("labkit.formats.fp8.quantize", "labkit.formats.fp8.check_amax", "labkit.formats.fp8.Fp8Guard",
             "labkit.formats.fp8.update_amax_history", "labkit.formats.fp8._block_amax",
             "labkit.formats.fp8._block_view", "labkit.formats.fp8._expand")

# kahan_update: the compensated add, and stochastic rounding (another way to the same end)
KAHAN_FUNCS = ("labkit.formats.bf16.kahan_add", "labkit.formats.bf16.stochastic_round_bf16")

# lost_fraction: the counter and the monitor that uses it
STALE_FUNCS = ("labkit.formats.bf16.stale_fraction", "labkit.formats.bf16._stale",
               "labkit.formats.bf16.StaleMonitor")
