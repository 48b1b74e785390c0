"""Number formats below fp32, beside the guarded step: what they lose and how training keeps it.

``bf16``: stale weights (updates below half an ulp round away) and their remedies
(``StaleMonitor``, stochastic rounding, Kahan, fp32 accumulation). ``fp8``: FP8 scaling with
real casts, per tensor down to MX blocks, its guard and its faults. The lab draws them in
``labkit.lab.formats``.
"""
