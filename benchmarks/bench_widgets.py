"""Time what a student waits for: slider release -> re-run -> redraw, for each lesson's panel.

    python benchmarks/bench_widgets.py

The panels are the notebooks' defaults. Each row moves one slider (the callback runs the
experiment and redraws), takes the median of several moves after a warm-up, and prints it
with the bare ``run_experiment`` time of the same settings measured in the same run, so the
ratio is the panel's own cost (redraw, status, table). The redraw is a real Agg render to
PNG (the non-ipympl path); under ipympl the browser asks for the same render.
The lesson target is <= 0.5 s on 2 CPU cores for the auto-run panels (01, 02); notebook 03
runs on a button, with a live redraw every 20 steps.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings

import torch

from labkit.lab.experiment import ExperimentConfig, run_experiment
from labkit.lab.widgets import ControlPanel

LESSONS = {
    "01 clipping (2 runs)": (
        ExperimentConfig(precision="fp32", steps=120, faults=["60:spike:30"], device="cpu"),
        dict(controls={"max_norm": 1.0, "fault_step": 60, "fault_magnitude": 30.0}, fixed={"fault": "spike"},
             variants={"clipped": {}, "unclipped": {"max_norm": None}}, panels=("norm", "loss")),
        ("fault_step", [61, 62, 63, 64, 65]),
    ),
    "02 loss scaling": (
        ExperimentConfig(precision="fp16", steps=160, init_scale=2.0**10, growth_interval=50,
                         faults=["100-104:overflow"], device="cpu"),
        dict(controls={"init_scale": 2.0**10, "growth_interval": 50, "fault_step": 100, "fault_count": 5},
             fixed={"fault": "overflow"}, panels=("scale", "norm")),
        ("init_scale", [11, 12, 13, 14, 15]),
    ),
    "03 guarded step (Run, live)": (
        ExperimentConfig(precision="fp16", steps=200, scheduler="cosine", device="cpu"),
        dict(controls={"fault": "nan", "fault_step": 60, "fault_count": 1, "max_norm": 1.0,
                       "init_scale": 2.0**10, "precision": "fp16"}, auto_run=False, live=True, every=20),
        ("fault_step", [61, 62, 63]),
    ),
}


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'panel':30s} {'slider -> redrawn':>18s} {'bare run':>10s} {'ratio':>6s}")
    for name, (base, kwargs, (control, values)) in LESSONS.items():
        panel = ControlPanel(base, **kwargs)
        panel.run()  # warm-up: first-run costs (torch's lazy imports, font cache) are not a slider's
        times = []
        for value in values:
            start = time.perf_counter()
            panel.controls[control].value = value
            if not panel.auto_run:
                panel.run_button.click()
            times.append(time.perf_counter() - start)
        assert panel.error is None, panel.error
        bare = []
        for _ in values:
            start = time.perf_counter()
            for changes in panel.variants.values():
                run_experiment(dataclasses.replace(panel.config, **changes))
            bare.append(time.perf_counter() - start)
        med, bare_med = statistics.median(times), statistics.median(bare)
        print(f"{name:30s} {med:16.3f} s {bare_med:8.3f} s {med / bare_med:6.2f}")


if __name__ == "__main__":
    main()
