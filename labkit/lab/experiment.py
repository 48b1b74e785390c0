"""One run of a built-in task as a pure function of its settings: what the lab's widgets and the demo call."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..clip import check_max_norm
from ..distributed import is_distributed, rank
from ..export.telemetry import Telemetry, check_trackers, parse_trackers
from ..faults import Faults, FaultSchedule
from ..optim import StableAdamW
from ..records import StepRecord
from ..scaler import GradScaler, check_init_scale
from ..step import PRECISIONS, TrainStep
from ..steplog import StepLog
from ..tasks import TASKS, Task, make_task
from ..triage import Triage
from ..validate import check_int, check_number
from .defenses import Defenses, loss_fn_with_shift

__all__ = ["ExperimentConfig", "default_device", "make_optimizer", "make_scheduler", "one_thread_on_cpu",
           "run_experiment"]

OPTIMIZERS = ("sgd", "adam", "adamw", "stableadamw")
SCHEDULERS = (None, "cosine")
PARALLEL = (None, "ddp", "fsdp2")


def default_device() -> str:
    """Return ``"cuda"`` when a GPU is there, else ``"cpu"``: the same notebook runs on both."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _positive_int(name: str, value: object) -> int:
    return check_int(name, value, 1)


def _positive_float(name: str, value: object) -> float:
    # a number, not something float() accepts: "0.05" or True would reach the optimizer as given
    return check_number(name, value, 0, low_open=True, finite=True, noun="a finite number")


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything a run depends on; equal configs give equal logs (the data is a function of the seed).

    ``faults`` uses the demo's ``--inject`` language (``"60:spike:1000"``, ``"100-104:overflow"``).
    ``loss_scaling=False`` runs fp16 without a scaler, to see gradients underflow.
    ``loss_weight`` multiplies the loss, and so every gradient: small values give the tiny
    gradients of a small loss term (an auxiliary loss with a small coefficient). It is not neutral
    under ``optimizer="adam"``: torch's eps (1e-8) is added to sqrt(v_hat), so once the gradients
    come near it the update shrinks; compare precisions at the same weight (any difference is then
    the precision's) or pass your own optimizer with eps scaled by the weight to ``TrainStep``.
    ``betas`` are Adam's (torch's default ``(0.9, 0.999)``; LLM pretraining uses beta2 = 0.95);
    SGD (momentum 0.9) has none. ``device=None`` takes the GPU when there is one.
    Under an initialized process group each rank trains on its slice of every global batch,
    with the model wrapped by ``parallel`` (``"ddp"``, the default, or ``"fsdp2"``);
    ``fault_rank`` injects the faults on that rank only (``None``: on every rank).
    ``task`` names a built-in task (``"toy"``, ``"gpt"``: ``labkit.tasks.TASKS``, sized for the
    device) or is a task object (``model(device)``, ``batch(step, device)``, ``loss_fn``); one
    with ``monitor(model)`` (``GPTTask``) has that hook write its measurements on each record.
    ``optimizer`` is ``"sgd"`` (momentum 0.9), ``"adam"`` or ``"adamw"`` (torch's, with ``betas``), or
    ``"stableadamw"`` (``labkit.optim.StableAdamW``: AdamW with update clipping, lesson 08);
    ``weight_decay`` is torch's (AdamW's is decoupled and multiplied by the lr: Wortsman et al.'s
    *independent* decay λ is ``weight_decay=λ / lr``). ``warmup`` steps raise the lr linearly
    to ``lr`` (nanoGPT's ``lr * (t + 1) / (warmup + 1)``), then ``scheduler="cosine"`` decays it to 0.
    ``triage`` (on by default) says why a loss was not finite (``TrainStep(hooks=[Triage()])``): bad
    data (``nonfinite_input``) or an fp16 forward overflow (``forward_overflow``); off, every
    non-finite loss reads ``nonfinite_loss``.

    >>> c = ExperimentConfig(precision="fp32", faults=["60:spike:1000"])
    >>> c.faults, c.fault_schedule().get(60).label
    (('60:spike:1000',), 'spike:1000')
    >>> ExperimentConfig(max_norm=0)
    Traceback (most recent call last):
    ...
    ValueError: max_norm must be a number > 0 or None (no clipping), got 0.
    """

    precision: str = "fp16"
    max_norm: float | None = 1.0
    init_scale: float = 2.0**10
    growth_interval: int = 50
    loss_scaling: bool = True
    faults: tuple[str, ...] = ()
    steps: int = 150
    lr: float = 0.05
    optimizer: str = "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    loss_weight: float = 1.0
    scheduler: str | None = None
    seed: int = 0
    device: str | None = None
    parallel: str | None = None
    fault_rank: int | None = None
    task: str | Task = "toy"
    defenses: Defenses | None = None  # clipper, detector, rewind, spike and shift (lab/defenses.py)
    weight_decay: float = 0.0
    warmup: int = 0
    triage: bool = True  # a non-finite loss told apart: nonfinite_input, forward_overflow (labkit.triage)

    def __post_init__(self) -> None:
        # Validate everything here, so a bad slider value fails before a model is built.
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}.")
        if self.max_norm is not None:
            try:
                check_max_norm(self.max_norm)
            except ValueError:
                raise ValueError(
                    f"max_norm must be a number > 0 or None (no clipping), got {self.max_norm!r}."
                ) from None
        if _positive_float("init_scale", self.init_scale) > torch.finfo(torch.float32).max:
            raise ValueError(f"init_scale must be at most {torch.finfo(torch.float32).max:.4g} (the scale is "
                             f"a float32), got {self.init_scale!r}; torch's default is 2.0**16.")
        check_init_scale(self.init_scale)  # float32's normal range: below it 1/scale overflows
        _positive_int("growth_interval", self.growth_interval)
        _positive_int("steps", self.steps)
        _positive_float("lr", self.lr)
        _positive_float("loss_weight", self.loss_weight)
        check_int("seed", self.seed, 0, 2**32 - 1)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}.")
        check_number("weight_decay", self.weight_decay, 0, finite=True, noun="a finite number")
        if not isinstance(self.triage, bool):
            raise TypeError(f"triage must be True or False, got {self.triage!r}.")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                      and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"betas must be two numbers in [0, 1), Adam's (beta1, beta2), got {self.betas!r}."
            )
        if self.optimizer == "sgd" and betas != (0.9, 0.999):
            raise ValueError("betas are Adam's and AdamW's; optimizer='sgd' has none (SGD uses momentum "
                             "0.9). Pass optimizer='adam' or 'adamw', or leave betas out.")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        check_int("warmup", self.warmup, 0, self.steps, hint="(steps of linear warm-up, at most steps)")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {list(SCHEDULERS)}, got {self.scheduler!r}.")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {list(PARALLEL)}, got {self.parallel!r}.")
        if self.fault_rank is not None and (isinstance(self.fault_rank, bool)
                                            or not isinstance(self.fault_rank, int) or self.fault_rank < 0):
            raise ValueError(f"fault_rank must be None (every rank) or a rank >= 0, got {self.fault_rank!r}.")
        if isinstance(self.faults, str):
            raise TypeError(f"faults must be a list of specs, e.g. [{self.faults!r}], not one string.")
        object.__setattr__(self, "faults", tuple(self.faults))  # a list from the caller, frozen here
        if isinstance(self.task, str) and self.task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)} or a task object, got {self.task!r}.")
        if not isinstance(self.task, (str, Task)):
            raise TypeError("task must be a name or have name, model(device), batch(step, device) and "
                            f"loss_fn; got {type(self.task).__name__}.")
        self.fault_schedule()
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"device must be None (auto), 'cpu' or 'cuda', got {self.device!r}."
                ) from None
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(
                    f"device={self.device!r}, but there is no GPU here: use None (auto) or 'cpu'."
                )

    def fault_schedule(self) -> FaultSchedule:
        """Return the parsed ``faults``."""
        return FaultSchedule.parse(self.faults)

    def resolved_device(self) -> torch.device:
        """Return the device the run uses: ``device``, or the GPU when there is one."""
        return torch.device(self.device or default_device())

    def make_task(self) -> Task:
        """Return the task to train: the named one with ``seed``, sized for the device, or ``task`` itself."""
        return (make_task(self.task, self.seed, self.resolved_device()) if isinstance(self.task, str)
                else self.task)


def _parallelize(model: nn.Module, how: str, device: torch.device) -> nn.Module:
    """Return ``model`` wrapped for ``"ddp"`` or ``"fsdp2"`` data parallelism (each Linear, then the root)."""
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device):  # type: ignore[no-untyped-def]
    """Run the block with one intra-op thread when ``device`` is a CPU (as before, after it).

    >>> with one_thread_on_cpu(torch.device("cpu")):
    ...     torch.get_num_threads()
    1
    """
    # The toy model's matmuls (64x16, 64x64) are far too small to split across threads: on 2
    # cores torch's intra-op threads cost more than they save, and when another process holds a
    # core they spin-wait for it (an order of magnitude slower on a loaded 2-core machine). The
    # setting is process-wide, so it is put back after the run.
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_optimizer(config: ExperimentConfig, params: Any) -> torch.optim.Optimizer:
    """Return the optimizer ``config`` names over ``params``, with its lr, betas and weight decay."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9, weight_decay=config.weight_decay)
    adam = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
            "stableadamw": StableAdamW}[config.optimizer]
    return adam(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def make_scheduler(config: ExperimentConfig, optimizer: torch.optim.Optimizer) -> Any:
    """Return the lr schedule ``config`` names (None for a constant lr); it resumes from its ``state_dict``.

    Without warm-up, cosine is torch's ``CosineAnnealingLR`` over ``steps``. With ``warmup=w``
    the factor of the lr at step ``t`` is ``(t + 1) / (w + 1)`` for ``t < w``, then 1, or with
    cosine ``(1 + cos(pi * (t - w) / (steps - w))) / 2`` (nanoGPT's ``get_lr``, decaying to 0).

    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> s = make_scheduler(ExperimentConfig(steps=10, warmup=4, scheduler="cosine"), opt); lrs = []
    >>> for _ in range(10): lrs.append(round(opt.param_groups[0]["lr"], 3)); opt.step(); s.step()
    >>> lrs
    [0.2, 0.4, 0.6, 0.8, 1.0, 0.933, 0.75, 0.5, 0.25, 0.067]
    """
    steps, warmup = config.steps, config.warmup
    if not warmup:
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps) if config.scheduler else None
    cosine = config.scheduler == "cosine"

    def factor(t: int) -> float:
        if t < warmup:
            return (t + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        return (1 + math.cos(math.pi * min(t - warmup, steps - warmup) / max(steps - warmup, 1))) / 2

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def run_experiment(
    config: ExperimentConfig,
    on_record: Callable[[StepRecord], None] | None = None,
    *,
    log_path: str | os.PathLike | None = None,
    log_to: str | Sequence[str] | None = None,
    log_dir: str | os.PathLike | None = None,
    histogram_every: int = 10,
    observer: Any = None,
) -> StepLog:
    """Train a fresh model of ``config.task`` as ``config`` says and return its log.

    ``on_record`` sees each record. Nothing outside the call is touched: a widget may start it
    again with other settings while an old figure is still on screen. ``log_to``
    (``"tensorboard,trackio,mlflow,wandb"``) streams every record into those trackers under
    ``log_dir`` (default: ``log_path``'s folder, else ``runs/labkit``), with a log2|g| histogram
    per parameter every ``histogram_every`` steps (``labkit.export``; rank 0 only). ``observer``
    sees the weights around every optimizer step (``TrainStep(hooks=[...])``, e.g.
    ``labkit.formats.bf16.StaleMonitor`` or ``labkit.lab.moments.AdamWatch``: a
    ``labkit.hooks.Hook``, attached by the step). Where to show a run is not part of its config.
    With ``config.triage`` (the default) a non-finite loss is triaged
    (``TrainStep(hooks=[Triage()])``): the record says ``nonfinite_input`` (bad data) or
    ``forward_overflow`` (the fp16 forward overflowed, its fp32 re-run did not) where it can.

    >>> log = run_experiment(ExperimentConfig(precision="fp32", steps=20, faults=["5:nan"]))
    >>> len(log), log.skipped_steps, log[5].reason
    (20, [5], 'nonfinite_input')
    """
    device = config.resolved_device()
    world, me = (dist.get_world_size(), rank()) if is_distributed() else (1, 0)
    trackers = parse_trackers(log_to)  # bad names and missing packages fail here, before any training
    check_trackers(trackers)
    _positive_int("histogram_every", histogram_every)
    task = config.make_task()
    model = task.model(device)
    monitor = task.monitor(model) if callable(getattr(task, "monitor", None)) else None
    if world > 1:
        model = _parallelize(model, config.parallel or "ddp", device)
    optimizer = make_optimizer(config, model.parameters())
    scheduler = make_scheduler(config, optimizer)
    scaler = GradScaler(device.type, init_scale=config.init_scale, growth_interval=config.growth_interval,
                        enabled=config.precision == "fp16" and config.loss_scaling)
    mse, weight = task.loss_fn, config.loss_weight
    loss_fn = mse if weight == 1.0 else (lambda out, y: mse(out, y) * weight)
    faults = config.fault_schedule() if config.fault_rank in (None, me) else FaultSchedule()
    d = config.defenses
    extra = {} if d is None else {"clipper": d.clipper()}
    detector, rewind = (None, None) if d is None else (d.detector(), d.rewind())
    if d is not None:
        loss_fn = loss_fn_with_shift(loss_fn, d, lambda: step.step_count)
    hooks = [Faults(faults), *([Triage()] if config.triage else []), observer, monitor, detector, rewind]
    step = TrainStep(model, optimizer, loss_fn, precision=config.precision,
                     max_norm=config.max_norm if d is None else None, scaler=scaler, scheduler=scheduler,
                     log=log_path, hooks=[h for h in hooks if h is not None], **extra)
    telemetry = None
    try:
        if trackers and me == 0:  # the records are the same on every rank
            out = log_dir or (
                os.path.dirname(os.path.abspath(log_path)) if log_path is not None else "runs/labkit"
            )
            telemetry = Telemetry.open(trackers, out)
            step.log.sinks.append(telemetry)
        # FSDP2's gradients are shards: a histogram of rank 0's shard would not be the layer's
        histograms = telemetry is not None and (world == 1 or config.parallel in (None, "ddp"))
        with one_thread_on_cpu(device):
            # a rewind moves step_count back: the run still ends at `steps`
            while step.step_count < config.steps:
                i = rewind.data_index(step.step_count) if rewind is not None else step.step_count
                batch = task.batch(i, device) if d is None else d.corrupt(i, task.batch(i, device))
                inputs, targets = (t.tensor_split(world)[me] for t in batch)
                record = step(inputs, targets)
                if histograms and i % histogram_every == 0:
                    telemetry.histograms(record.step, model.named_parameters())
                if on_record is not None:
                    on_record(record)
    finally:
        step.log.close()
    return step.log
