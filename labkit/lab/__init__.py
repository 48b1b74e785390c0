"""The lab: experiments run from a config, live plots, slider panels, figures and the headless demo.

The names a lesson uses, from one place (each submodule is imported on first use: the demo's
``--help`` answers before torch and matplotlib load)::

    from labkit.lab import ExperimentConfig, run_experiment, ControlPanel, LiveDashboard, describe
"""

import importlib
import typing

_LAZY = {
    ".checks": ("expect",),
    ".defenses": ("Defenses", "ledger", "plot_defenses"),
    ".explorer": ("DefenseExplorer",),
    ".experiment": ("ExperimentConfig", "default_device", "run_experiment"),
    ".formats": ("GranularityExplorer", "granularity_rows", "number_line", "round_trip", "scaling_figure",
                 "stagnation_figure"),
    ".gradients": ("GradHistogram", "GradientProbe", "Probed", "plot_flushed_by_tensor", "plot_headroom",
                   "plot_layer_heatmap", "plot_sawtooth", "plot_u_curve"),
    ".moments": ("AdamWatch", "plot_adam_moments"),
    ".plots": ("LiveDashboard", "plot_log", "plot_scale_and_skips"),
    # not the function ``sweep``: the name is its module's, which an import sets on this package
    ".sweep": ("Recipe", "Runs", "SweepPanel", "plot_runs", "plot_sweep", "run_point",
               "summarize"),
    ".text": ("culprit", "describe", "describe_rewind", "format_scale", "title"),
    ".widgets": ("ControlPanel", "episode", "event_rows"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

if typing.TYPE_CHECKING:  # what type checkers and IDEs see
    from .checks import expect
    from .defenses import Defenses, ledger, plot_defenses
    from .experiment import ExperimentConfig, default_device, run_experiment
    from .explorer import DefenseExplorer
    from .formats import (
        GranularityExplorer,
        granularity_rows,
        number_line,
        round_trip,
        scaling_figure,
        stagnation_figure,
    )
    from .gradients import (
        GradHistogram,
        GradientProbe,
        Probed,
        plot_flushed_by_tensor,
        plot_headroom,
        plot_layer_heatmap,
        plot_sawtooth,
        plot_u_curve,
    )
    from .moments import AdamWatch, plot_adam_moments
    from .plots import LiveDashboard, plot_log, plot_scale_and_skips
    from .sweep import Recipe, Runs, SweepPanel, plot_runs, plot_sweep, run_point, summarize
    from .text import culprit, describe, describe_rewind, format_scale, title
    from .widgets import ControlPanel, episode, event_rows


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name not in _HOME:  # a submodule (`labkit.lab.demo`) is found by the import system, not here
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AdamWatch", "ControlPanel", "DefenseExplorer", "Defenses", "ExperimentConfig", "GradHistogram",
    "GradientProbe", "GranularityExplorer", "LiveDashboard", "Probed", "Recipe", "Runs", "SweepPanel",
    "culprit", "default_device", "describe", "describe_rewind", "episode", "event_rows", "expect",
    "format_scale", "granularity_rows",
    "ledger", "number_line", "plot_adam_moments", "plot_defenses", "plot_flushed_by_tensor", "plot_headroom",
    "plot_layer_heatmap", "plot_log", "plot_runs", "plot_sawtooth", "plot_scale_and_skips", "plot_sweep",
    "plot_u_curve", "round_trip", "run_experiment", "run_point", "scaling_figure", "stagnation_figure",
    "summarize", "title",
]
