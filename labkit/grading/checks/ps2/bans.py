"""What each part of set 2 asks the student to write, so its check refuses labkit's own.

A check traps each of these while the student's code runs (``core.forbid``); the grader
installs the traps before any student code (``labkit.grading.harness``).
"""

# read_run's z-scores and RollingDetector: labkit's rolling z-score and the detector
SPIKE_FUNCS = ("labkit.spikes.rolling_z", "labkit.spikes.SpikeDetector", "labkit.spikes.spike_score")

# ZScoreClipper: every clipper labkit has, and the step that runs them
ZCLIP_FUNCS = ("labkit.clippers.ZClip", "labkit.clippers.zclip.zclip_update",
               "labkit.clippers.zclip.zclip_limit", "labkit.clippers.GlobalClipper",
               "labkit.clippers.NormClip", "labkit.clippers.AutoClip", "labkit.clippers.AdaGC",
               "labkit.clippers.AGC", "labkit.clippers.UpdateNormClip", "labkit.clippers.base.feed_value",
               "labkit.clippers.base.lockin_guard", "labkit.TrainStep")
