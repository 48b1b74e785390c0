"""What the gradients look like inside a run: the probe that reads them and the pictures of them.

``GradientProbe`` records, by hooks, each step's per-layer gradient norms, flushed fractions,
gradient samples and every gradient in backward order; ``Probed(task, probe)`` carries it
wherever a task goes. The pictures: ``GradHistogram`` (log2|g| over fp16's and bf16's ranges,
with a loss-scale slider; Micikevicius et al. 2018, "Mixed Precision Training", Fig. 3, live),
``plot_u_curve`` (flushed and overflowing fractions against log2 of the scale),
``plot_headroom`` (each step's largest |gradient| x scale against fp16's 65504, the overflows and
the tensor each started in), ``plot_flushed_by_tensor`` (how zeros compound from the loss down),
``plot_layer_heatmap`` and ``plot_sawtooth``.

One module per job, each importing only those listed before it: ``ranges`` (what fp16 and bf16
keep of a gradient at a scale), ``probe`` (reading a run), ``histogram`` (the slider's widget),
``plots`` (the figures).
"""

from .histogram import GradHistogram
from .plots import plot_flushed_by_tensor, plot_headroom, plot_layer_heatmap, plot_sawtooth, plot_u_curve
from .probe import GradientProbe, GradStat, Probed
from .ranges import BF16_RANGE, FP16_RANGE, flush_fractions, u_curve

__all__ = ["FP16_RANGE", "BF16_RANGE", "GradHistogram", "GradStat", "GradientProbe", "Probed",
           "flush_fractions", "plot_flushed_by_tensor", "plot_headroom", "plot_layer_heatmap",
           "plot_sawtooth", "plot_u_curve", "u_curve"]
