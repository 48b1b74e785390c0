"""A dynamic loss scaler: a drop-in for ``torch.amp.GradScaler`` that says when it skipped.

The rule that moves the scale is the pure function ``update_scale``; ``GradScaler`` keeps
its state in 0-dim device tensors and applies the rule without a host sync. Beyond torch:
``step()`` returns whether the optimizer stepped, DeepSpeed/Megatron-style ``hysteresis``,
a ``min_scale`` floor and a ``max_scale`` cap, skip counters, and a ``state_dict`` that
resumes the exact trajectory. Under ``torch.distributed`` ``found_inf`` is reduced (MAX)
across the ranks before any decision, so every rank skips together and the scales stay equal.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .clip import constant
from .distributed import ProcessGroup, all_reduce_, local_tensor
from .grouping import group_by_device_and_dtype
from .validate import check_int, real

__all__ = [
    "GradScaler", "ScalerConfig", "ScalerUsageError", "ScalerValueError", "grow_or_keep", "update_scale",
]

class Stage(enum.Enum):
    """Where one optimizer is in an iteration: ``update()`` brings every optimizer back to ``READY``."""

    READY = "ready"
    CHECKED = "checked"  # found_inf recorded from the norms TrainStep read (no unscale pass), still scaled
    UNSCALED = "unscaled"
    STEPPED = "stepped"



class ScalerUsageError(RuntimeError, AssertionError):
    """A ``GradScaler`` method called out of order; also an ``AssertionError``, which torch raises there.

    >>> isinstance(ScalerUsageError("x"), AssertionError), isinstance(ScalerUsageError("x"), RuntimeError)
    (True, True)
    """


class ScalerValueError(ValueError, AssertionError):
    """A setting torch asserts on (``growth_factor <= 1``, a bad ``new_scale``); also an ``AssertionError``.

    >>> isinstance(ScalerValueError("x"), AssertionError), isinstance(ScalerValueError("x"), ValueError)
    (True, True)
    """

F32 = torch.finfo(torch.float32)
# The floor when min_scale is None: float32's smallest normal number (2**-126), the smallest
# scale whose reciprocal (2**126) is finite and exact. Below it ``1/scale`` overflows, unscaling
# turns finite gradients into inf and every later step skips: a dead scale. torch has no floor
# and agrees with this rule for every trajectory that never dies.
DEFAULT_MIN_SCALE = F32.tiny
# int32 counters on the device: a growth_interval past them would wrap and grow every step.
INT32_MAX = 2**31 - 1
# The scaler's state, 0-dim device tensors, in this order
STATE_KEYS = ("scale", "growth_tracker", "hysteresis_left", "skip_count", "skip_streak")
# One back-off by more than 2**-24 (fp16's whole subnormal range) is a reset, not a back-off.
MIN_BACKOFF = 2.0**-24


def check_init_scale(scale: float, name: str = "init_scale") -> float:
    """Return ``scale`` if it is a float32 normal number > 0, else raise ``ValueError`` saying why."""
    if not 0.0 < scale <= F32.max:
        raise ValueError(
            f"{name} must be a float32-finite number > 0, got {scale!r}; torch's default is 2.0**16."
        )
    if scale < F32.tiny:
        raise ValueError(
            f"{name} {scale!r} is below float32's normal range ({F32.tiny:.3g}): 1/scale overflows and every "
            "step would skip. torch's default is 2.0**16."
        )
    return scale


def check_device(device: Any) -> torch.device:
    """Return ``torch.device(device)``, or raise ``ValueError`` naming the valid forms."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be a str such as 'cpu' or 'cuda' or a torch.device, got {type(device).__name__}."
        )
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"device must name a torch device such as 'cpu', 'cuda' or 'cuda:1', got {device!r}."
        ) from None


@functools.lru_cache(maxsize=64)  # a constant of the config: not recomputed every update()
def _f32_inside(bound: float, upward: bool) -> float:
    """Return the float32 nearest ``bound`` on the inside: a floor rounds up, a cap down."""
    b = torch.tensor(bound, dtype=torch.float64)
    f = b.float()
    if (f.double() < b) if upward else (f.double() > b):
        f = torch.nextafter(f, torch.tensor(math.inf if upward else 0.0))
    return f.item()


@dataclass(frozen=True)
class ScalerConfig:
    """The constants of the scale-update rule, validated once.

    >>> ScalerConfig(growth_interval=100).backoff_factor
    0.5
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            if getattr(self, name) is not None:
                real(name, getattr(self, name))
        if not self.growth_factor > 1.0 or math.isinf(self.growth_factor):
            raise ScalerValueError("growth_factor must be a finite number > 1.0, got "
                                   f"{self.growth_factor!r}; torch's default is 2.0.")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ScalerValueError(
                f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}; torch's default is 0.5."
            )
        if self.backoff_factor < MIN_BACKOFF:
            raise ScalerValueError(
                f"backoff_factor {self.backoff_factor!r} is below 2**-24: one overflow would drop the scale "
                "by more than fp16's whole range. Use 0.5 (torch's default); to reset the scale call "
                "update(new_scale)."
            )
        for name in ("growth_interval", "hysteresis"):
            check_int(name, getattr(self, name), 1, INT32_MAX)  # the counters are int32 on the device
        for name in ("min_scale", "max_scale"):
            value = getattr(self, name)
            if value is not None and not (F32.tiny <= value <= F32.max):
                raise ValueError(
                    f"{name} must be None or a number > 0 in float32's normal range [{F32.tiny:.3g}, "
                    f"{F32.max:.3g}], got {value!r}; the scale is a float32."
                )
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale}).")


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step: Callable) -> bool:
    # torch reads the signature on every step; it never changes for one step function
    return "grad_scaler" in inspect.signature(step).parameters


_CPU = torch.device("cpu")


def update_scale(
    scale: Tensor, growth_tracker: Tensor, hysteresis_left: Tensor, found_inf: Tensor, config: ScalerConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Return the next ``(scale, growth_tracker, hysteresis_left)`` after one iteration.

    All arguments are 0-dim tensors on one device (``scale`` float32, the counters int32,
    ``hysteresis_left`` in ``[0, hysteresis]``, ``found_inf`` nonzero on overflow); the inputs
    are left as they were and nothing is read to the host::

        if found_inf:
            growth_tracker = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:                 # H overflows since the last growth
                scale = max(scale * backoff_factor, min_scale or 2**-126)
        else:
            growth_tracker += 1
            if growth_tracker >= growth_interval:
                growth_tracker = 0
                hysteresis_left = hysteresis
                grown = scale * growth_factor
                if isfinite(grown):
                    scale = min(grown, max(scale, max_scale))   # a cap never lowers the scale

    Defaults (torch's): ``growth_factor=2.0``, ``backoff_factor=0.5``, ``growth_interval=2000``,
    ``hysteresis=1``; ``min_scale=None`` floors at float32's smallest normal number (see
    ``DEFAULT_MIN_SCALE``), ``max_scale=None`` caps nothing. Source: torch's
    ``_amp_update_scale_`` (``aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp`` and its CUDA
    twin), which this rule runs on copies of the state, so with ``hysteresis=1`` and no
    bounds it is torch's rule to the bit (products taken in float64, rounded once to float32);
    hysteresis is DeepSpeed's and Megatron-LM's ``DynamicLossScaler``'s. Torch's kernel grows
    only at ``tracker + 1 == growth_interval``: the tracker is clamped below the interval first,
    so one left past a lowered interval grows at the next clean step.

    >>> t = lambda v, d=torch.int32: torch.tensor(v, dtype=d)
    >>> s, g, h = update_scale(t(1024.0, torch.float32), t(0), t(1), t(1.0, torch.float32), ScalerConfig())
    >>> s.item(), g.item(), h.item()
    (512.0, 0, 0)
    """
    dev = scale.device
    # every operand in its tensor's dtype (the constants made once): with a Python number or a mixed-dtype
    # select torch promotes the types first, which costs more than the 0-dim operation, every step
    clean = found_inf.eq(constant(0.0, dev, found_inf.dtype))  # no overflow: the selects' condition
    new_scale, new_tracker = _kernel_step(
        scale, growth_tracker, found_inf if found_inf.dtype == torch.float32 else found_inf.float(), config)
    floor = DEFAULT_MIN_SCALE if config.min_scale is None else _f32_inside(config.min_scale, upward=True)
    # without a floor it could die (float32's floor is exact in a float32 constant)
    new_scale = torch.where(clean, new_scale, torch.maximum(new_scale, constant(floor, dev, torch.float32)))
    if config.hysteresis == 1:  # every overflow backs off; hysteresis_left is 0 after one, 1 after a growth
        after = clean.to(hysteresis_left.dtype)
    else:  # fewer than H overflows since the last growth: the back-off waits
        hyst_after = (hysteresis_left - 1).clamp_(min=0)
        new_scale = torch.where(~clean & (hyst_after > 0), scale, new_scale)
        after = torch.where(clean, config.hysteresis, hyst_after)
    # the tracker is 0 after an overflow and after a growth, which refills the hysteresis
    new_hyst = torch.where(new_tracker.eq(constant(0, dev, new_tracker.dtype)), after, hysteresis_left)
    return new_scale, new_tracker, new_hyst


def _kernel_step(
    scale: Tensor, growth_tracker: Tensor, found_inf: Tensor, config: ScalerConfig
) -> tuple[Tensor, Tensor]:
    # both rules' first part: torch's kernel on copies (it writes its arguments in place; the minimum's
    # result is a fresh tracker), the tracker clamped below a lowered interval first, then the cap
    new_scale = scale.clone()
    last = constant(config.growth_interval - 1, scale.device, growth_tracker.dtype)
    new_tracker = torch.minimum(growth_tracker, last)
    torch._amp_update_scale_(new_scale, new_tracker, found_inf, config.growth_factor, config.backoff_factor,
                             config.growth_interval)
    if config.max_scale is not None:  # bounds rounded inwards to float32, so 0.7 stays a floor
        # on a clean step the kernel's scale is the scale or its growth; a back-off is below both
        new_scale = torch.minimum(new_scale, scale.clamp(min=_f32_inside(config.max_scale, upward=False)))
    return new_scale, new_tracker


def grow_or_keep(
    scale: Tensor, growth_tracker: Tensor, hysteresis_left: Tensor, config: ScalerConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Return ``update_scale(scale, growth_tracker, hysteresis_left, found_inf=0, config)``: a clean step.

    ``update_scale``'s rule with its selects on "no overflow" taken::

        growth_tracker = min(growth_tracker, growth_interval - 1) + 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_left = hysteresis
            grown = scale * growth_factor
            if isfinite(grown):
                scale = min(grown, max(scale, max_scale))

    Neither the floor nor the hysteresis count-down is computed only to be thrown away.
    ``GradScaler.update`` takes it when every check was already read on the host (``TrainStep``'s
    decision), where those 0-dim operations are a visible part of a small model's step. The same
    three tensors, bit for bit; defaults and sources: ``update_scale``.

    >>> t = lambda v, d=torch.int32: torch.tensor(v, dtype=d)
    >>> s, g, h = grow_or_keep(t(1024.0, torch.float32), t(1), t(0), ScalerConfig(growth_interval=2))
    >>> s.item(), g.item(), h.item()
    (2048.0, 0, 1)
    """
    dev = scale.device
    new_scale, new_tracker = _kernel_step(scale, growth_tracker, constant(0.0, dev, torch.float32), config)
    # a growth zeroes the tracker and refills the hysteresis
    grew = new_tracker.eq(constant(0, dev, new_tracker.dtype))
    return new_scale, new_tracker, torch.where(grew, constant(config.hysteresis, dev, hysteresis_left.dtype),
                                               hysteresis_left)


class GradScaler:
    """Scale the loss, unscale and check the gradients, skip bad steps, adapt the scale.

    A drop-in for ``torch.amp.GradScaler``: the same methods, arguments, misuse errors and,
    with ``hysteresis=1`` and no bounds, the same scales and parameter updates. ``step``
    returns ``True`` when the optimizer stepped and ``False`` when it skipped.
    ``device=None`` takes the device of the first loss passed to ``scale``. Disabled, every
    method passes through (scale 1.0, ``step`` just steps) so call sites never branch.
    When ``torch.distributed`` is initialized, ``unscale_`` all-reduces ``found_inf`` (MAX,
    one number) over ``process_group`` (default: the world): with FSDP2 each rank sees only
    its shard, and without DDP's sync (``no_sync``) only its own gradients, so without this
    one rank would skip and back off while another stepped. Every rank must call it.

    >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    >>> loss = model(torch.ones(1, 2)).sum()
    >>> scaler.scale(loss).backward(); scaler.step(opt), scaler.skip_count
    (True, 0)
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        process_group: ProcessGroup | None = None,
    ) -> None:
        self.process_group = process_group
        self._device = check_device(device) if device is not None else None
        if (enabled and self._device is not None and self._device.type == "cuda"
                and not torch.cuda.is_available()):
            warnings.warn("GradScaler is enabled, but CUDA is not available. Disabling.", stacklevel=2)
            enabled = False
        self._enabled = bool(enabled)
        self.config = ScalerConfig(
            growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale
        )
        check_init_scale(real("init_scale", init_scale))
        lo, hi = min_scale or 0.0, max_scale or math.inf
        if not lo <= init_scale <= hi:
            raise ValueError(f"init_scale ({init_scale}) must lie in [min_scale, max_scale] = [{lo}, {hi}].")
        self._init_scale = float(init_scale)
        self._init_tracker = 0
        self._init_hysteresis = hysteresis
        self._init_skips = (0, 0)
        self._state: dict[str, Tensor] | None = None  # created lazily on the loss's device
        self._per_optimizer: dict[int, dict[str, Any]] = {}
        self._flags: dict[tuple[torch.device, bool], Tensor] = {}  # see _flag

    # -- state ------------------------------------------------------------------------

    def _lazy_init(self, device: torch.device) -> dict[str, Tensor]:
        if self._state is None:
            dev = self._device or device
            i32 = dict(dtype=torch.int32, device=dev)
            self._state = {
                "scale": torch.full((), self._init_scale, dtype=torch.float32, device=dev),
                "growth_tracker": torch.full((), self._init_tracker, **i32),
                "hysteresis_left": torch.full((), self._init_hysteresis, **i32),
                # counters live on the device too: incrementing a Python int would need a sync
                "skip_count": torch.full((), self._init_skips[0], dtype=torch.int64, device=dev),
                "skip_streak": torch.full((), self._init_skips[1], dtype=torch.int64, device=dev),
            }
        return self._state

    def _require_state(self, funcname: str) -> dict[str, Tensor]:
        if self._state is None:
            raise ScalerUsageError(
                f"Attempted {funcname}() before scale(): call scaler.scale(loss).backward() first in this "
                "iteration."
            )
        return self._state

    def _opt_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = self._per_optimizer.get(id(optimizer))  # no fresh dict made per call, as setdefault would
        if state is None:
            state = self._per_optimizer[id(optimizer)] = {"stage": Stage.READY, "found_inf": None,
                                                          "has_grads": False}
        return state

    def is_enabled(self) -> bool:
        """Return whether this scaler scales (a disabled one passes everything through)."""
        return self._enabled

    # -- the AMP order: scale -> (backward) -> unscale_ -> step -> update ---------------

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Any:
        """Return ``outputs`` multiplied by the current scale (a tensor, list or tuple)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            scale = self._lazy_init(outputs.device)["scale"]
            return outputs * (scale if scale.device == outputs.device else
                              scale.to(outputs.device, non_blocking=True))
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place and record whether any is inf/NaN."""
        if not self._enabled:
            return
        state = self._require_state("unscale_")
        opt_state = self._opt_state(optimizer)
        if opt_state["stage"] == Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if opt_state["stage"] == Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        scale = state["scale"]
        inv_scale = scale.double().reciprocal().float()  # as torch: exact for powers of two
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        grads: list[Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError(
                        "Attempting to unscale FP16 gradients: keep the parameters in float32 and run "
                        "the forward under torch.autocast(dtype=torch.float16) instead of model.half()."
                    )
                # a view: unscaled in place
                g = p.grad._values() if p.grad.is_sparse else local_tensor(p.grad)
                grads.append(g)
        opt_state["has_grads"] = bool(grads)
        with torch.no_grad():
            for (device, _), (same, _) in group_by_device_and_dtype(grads).items():
                local_inf = torch.zeros((), dtype=torch.float32, device=device)
                # torch's fused kernel: one read + one write per gradient, sets local_inf on inf/NaN.
                torch._amp_foreach_non_finite_check_and_unscale_(same, local_inf, inv_scale.to(device))
                found_inf += local_inf.to(found_inf.device)
        # torch's kernel checks the gradients before multiplying: a dead scale (1/scale = inf, set by
        # hand) would turn finite gradients into inf unflagged. Flag it (no sync), so it skips, is
        # counted and backs off onto the floor, which revives it.
        found_inf += (~torch.isfinite(inv_scale)).float().to(found_inf.device)
        # before step() reads it: a rank with finite shards must still skip when another overflowed
        all_reduce_(found_inf, "max", self.process_group)
        opt_state["found_inf"] = found_inf
        opt_state["stage"] = Stage.UNSCALED

    def inf_check_(
        self, optimizer: torch.optim.Optimizer, found_inf: Tensor | bool, *, unscaled: bool
    ) -> None:
        """Record ``found_inf`` for ``optimizer`` from a check made elsewhere, instead of ``unscale_``'s pass.

        ``TrainStep`` reads the per-tensor norms of the *scaled* gradients once: a NaN/inf
        norm is the inf check, so no second read pass is needed. ``unscaled=True`` says the
        gradients were also divided by the scale (then ``step`` must not unscale them again).
        Under ``torch.distributed`` a tensor ``found_inf`` is reduced (MAX) here, as in
        ``unscale_``. A Python bool is a decision already read to the host (``TrainStep``'s,
        from the global norm, the same on every rank): it is not reduced, and ``will_skip``
        and ``step`` then need no sync.

        >>> s = GradScaler("cpu"); w = torch.ones(1, requires_grad=True); opt = torch.optim.SGD([w], lr=1.0)
        >>> s.scale(w.sum()).backward(); s.inf_check_(opt, torch.tensor(1.0), unscaled=False)
        >>> s.update(); s.get_scale()
        32768.0
        """
        if self._enabled:  # disabled, it still records: a disabled scaler still skips on what TrainStep found
            self._require_state("inf_check_")
        opt_state = self._opt_state(optimizer)
        if opt_state["stage"] != Stage.READY:
            raise RuntimeError(
                f"inf_check_() needs a fresh iteration for this optimizer; it is {opt_state['stage'].value}."
            )
        if isinstance(found_inf, bool):
            device = self._state["scale"].device if self._state is not None else _CPU
            opt_state["host"] = found_inf
            found = self._flag(device, found_inf)  # update() moves the scale on the device
        else:
            found = (found_inf if found_inf.dtype == torch.float32 and found_inf.dim() == 0
                     else found_inf.float().reshape(()))
            all_reduce_(found, "max", self.process_group)
        opt_state.update(found_inf=found, has_grads=True, stage=Stage.UNSCALED if unscaled else Stage.CHECKED)

    def _flag(self, device: torch.device, value: bool) -> Tensor:
        """Return ``found_inf`` for a decision read to the host: one of two tensors made once per device.

        Every reader of ``found_inf`` (``update``, a fused optimizer's kernel) only reads it.
        """
        key = (device, value)
        flag = self._flags.get(key)
        if flag is None:
            flag = self._flags[key] = torch.full((), float(value), dtype=torch.float32, device=device)
        return flag

    def will_skip(self, optimizer: torch.optim.Optimizer) -> bool:
        """Return whether ``step`` will skip ``optimizer`` (one host sync; ``step`` then reuses it).

        >>> s = GradScaler("cpu"); w = torch.ones(1, requires_grad=True); opt = torch.optim.SGD([w], lr=1.0)
        >>> s.scale(w.sum()).backward(); s.unscale_(opt); s.will_skip(opt)
        False
        """
        opt_state = self._per_optimizer.get(id(optimizer))
        if opt_state is None or opt_state["found_inf"] is None:
            if self._enabled:
                self.unscale_(optimizer)
                opt_state = self._opt_state(optimizer)
            else:
                return False
        if "host" not in opt_state:
            opt_state["host"] = bool(opt_state["found_inf"])
        return opt_state["host"]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale if not done yet, then step the optimizer unless a gradient was inf/NaN.

        Return ``True`` if the optimizer stepped, ``False`` if the step was skipped (then
        nothing is written to the parameters or the optimizer state). Reading the decision
        costs one host sync, as torch's ``step`` does. An optimizer with
        ``_step_supports_amp_scaling`` (torch's ``fused=True`` Adam, AdamW, SGD, Adagrad) is
        handed ``grad_scale`` and ``found_inf`` and unscales and skips inside its own kernel,
        as with torch (see ``step_async`` for the same without the sync).
        """
        return not bool(self.step_async(optimizer, *args, **kwargs))

    def step_async(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Tensor:
        """Do ``step``'s work and return ``found_inf`` as a 0-dim device tensor (nonzero: skipped).

        With an optimizer that takes ``grad_scale``/``found_inf`` this never syncs; any other
        optimizer must be skipped from the host, which costs one sync, as in torch.

        >>> s = GradScaler("cpu"); w = torch.ones(1, requires_grad=True); opt = torch.optim.SGD([w], lr=1.0)
        >>> s.scale(w.sum()).backward(); s.step_async(opt)
        tensor(0.)
        """
        checked = self._per_optimizer.get(id(optimizer), {}).get("found_inf") is not None
        if not self._enabled and not checked:
            optimizer.step(*args, **kwargs)
            return torch.zeros(())
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale = self._require_state("step")["scale"] if self._enabled else None
        opt_state = self._opt_state(optimizer)
        if opt_state["stage"] == Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, opt_state, scale, args, kwargs)
        if opt_state["stage"] == Stage.READY:
            self.unscale_(optimizer)
        elif opt_state["stage"] == Stage.CHECKED:
            raise RuntimeError(
                "inf_check_(unscaled=False) is only for optimizers that unscale themselves (fused=True)."
            )
        if not opt_state["has_grads"]:
            raise ScalerUsageError(
                "No inf checks were recorded for this optimizer: none of its parameters has a gradient. Call "
                "scaler.scale(loss).backward() before step(), and check the optimizer holds the model's "
                "parameters."
            )
        found_inf = opt_state["found_inf"]
        if not self.will_skip(optimizer):  # host sync: a plain optimizer can only be skipped from the host
            optimizer.step(*args, **kwargs)
        opt_state["stage"] = Stage.STEPPED
        return found_inf

    def abandon_iteration(self) -> None:
        """Forget this iteration's unscale/step stages (not the scale), so the next one starts clean.

        ``TrainStep`` calls it when the user's model, loss or optimizer raised mid-iteration;
        without it the next ``unscale_`` would refuse ("already called since the last update()").
        A plain loop that catches such an error does the same.
        """
        self._per_optimizer = {}

    def _fused_step(
        self, optimizer: torch.optim.Optimizer, opt_state: dict[str, Any], scale: Tensor | None,
        args: tuple, kwargs: dict
    ) -> Tensor:
        """torch's contract for ``_step_supports_amp_scaling`` optimizers (``torch.amp.GradScaler.step``)."""
        if _takes_grad_scaler(getattr(optimizer.step, "__func__", optimizer.step)):  # torch's older contract
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. "
                "In the near future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the "
                "passed optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            opt_state["stage"] = Stage.STEPPED
            return torch.zeros(()) if opt_state["found_inf"] is None else opt_state["found_inf"]
        if opt_state["stage"] == Stage.READY:  # check only (inv_scale 1): the optimizer's kernel unscales
            self._check_only(optimizer, opt_state)
        # a grad_scale the caller set (TrainStep's clip coefficient) multiplies the loss scale, as in torch
        user = getattr(optimizer, "grad_scale", None)
        if opt_state["stage"] == Stage.UNSCALED or scale is None:
            grad_scale = user
        else:
            grad_scale = scale if user is None else scale * user
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        # a step known on the host to go ahead needs no flag: torch's fused Adam(W) then spares the kernel's
        # check and the step counters' second pass (a _foreach_sub_ of found_inf). A known skip still goes
        # to the kernel, which creates the optimizer's state on a first step as torch's scaler leaves it
        go = opt_state.get("host") is False
        optimizer.found_inf = None if go else opt_state["found_inf"]  # type: ignore[attr-defined]
        try:
            optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        opt_state["stage"] = Stage.STEPPED
        return opt_state["found_inf"]

    def _check_only(self, optimizer: torch.optim.Optimizer, opt_state: dict[str, Any]) -> None:
        state = self._state
        assert state is not None
        found_inf = torch.zeros((), dtype=torch.float32, device=state["scale"].device)
        groups: dict[torch.device, list[Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad._values() if p.grad.is_sparse else local_tensor(p.grad)
                    groups.setdefault(g.device, []).append(g)
        one = torch.ones((), dtype=torch.float32, device=found_inf.device)
        with torch.no_grad():
            for device, grads in groups.items():
                local_inf = torch.zeros((), dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, local_inf, one.to(device))
                found_inf += local_inf.to(found_inf.device)
        all_reduce_(found_inf, "max", self.process_group)
        opt_state.update(found_inf=found_inf, has_grads=bool(groups), stage=Stage.CHECKED)

    def update(
        self, new_scale: float | Tensor | None = None, *, keep_if: Tensor | bool | None = None
    ) -> None:
        """Back off, keep or grow the scale from this iteration's inf checks (see ``update_scale``).

        ``keep_if`` (labkit's): a 0-dim device bool, or a Python bool; where true the state is
        left exactly as it was, without a host sync (``TrainStep`` passes "the loss was NaN/inf": a
        bad batch is no scaling problem; ``True``: a hook's skip). ``new_scale`` sets the scale
        instead; a deliberate difference from torch, which takes any value: it must be a number > 0
        that is finite in float32, else ``ScalerValueError`` (a scale <= 0 zeroes or flips the sign
        of every gradient, an inf or NaN one skips every step). Checking a tensor costs one host
        read.

        >>> s = GradScaler("cpu"); _ = s.scale(torch.ones(())); s.update(new_scale=-1.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        labkit.scaler.ScalerValueError: new_scale must be a number > 0 that is finite in float32, got -1.0 ...
        """
        if not self._enabled:
            self._per_optimizer = {}
            return
        state = self._require_state("update")
        if isinstance(keep_if, bool):  # known on the host: nothing to select
            if keep_if and new_scale is None:
                self._per_optimizer = {}
                return
            keep_if = None
        if new_scale is not None:
            value = torch.as_tensor(new_scale, dtype=torch.float32).to(state["scale"].device)
            if value.numel() != 1 or value.requires_grad:
                raise ScalerValueError(
                    "new_scale must be a float or a 1-element tensor that does not require grad."
                )
            checked = float(value.reshape(()))  # host read: a reset is rare, and a bad one must fail here
            if not 0.0 < checked < math.inf:
                raise ScalerValueError(
                    f"new_scale must be a number > 0 that is finite in float32, got {new_scale!r} (torch "
                    "takes any value, but a scale <= 0 zeroes or flips every gradient and inf or NaN skips "
                    "every step). To restart the scale pass a power of two such as 2.0**16."
                )
            state["scale"] = value.reshape(()).clone()  # a new tensor, as every update() gives
        else:
            checks = [opt_state for opt_state in self._per_optimizer.values()
                       if opt_state["found_inf"] is not None and opt_state["has_grads"]]
            if not checks:
                raise ScalerUsageError(
                    "No inf checks were recorded prior to update(): call scaler.unscale_(optimizer) or "
                    "scaler.step(optimizer) after backward and before update()."
                )
            device = state["scale"].device
            if keep_if is None and all(opt_state.get("host") is False for opt_state in checks):
                # every optimizer's check already read on the host, clean: nothing skipped to count (the
                # streak's 0 is a constant: the state's tensors are replaced, never written into)
                new = grow_or_keep(state["scale"], state["growth_tracker"], state["hysteresis_left"],
                                   self.config)
                counters = (state["skip_count"], constant(0, device, torch.int64))
            else:
                found = [opt_state["found_inf"] for opt_state in checks]
                if len(found) == 1:  # one optimizer: no copy when its flag is on the scale's device already
                    found_inf = found[0] if found[0].device == device else found[0].to(device)
                else:
                    found_inf = torch.stack([f.to(device) for f in found]).sum()
                new = update_scale(state["scale"], state["growth_tracker"], state["hysteresis_left"],
                                   found_inf, self.config)
                skipped = found_inf.ne(constant(0.0, device, found_inf.dtype)).long()  # the counters' dtype
                # the streak is (streak + 1) * skipped, in one operation: skipped + streak * skipped
                counters = (state["skip_count"] + skipped,
                            torch.addcmul(skipped, state["skip_streak"], skipped))
            # new tensors, not writes into the old ones: a scale read before (get_scale_async) stays this
            # iteration's, as a record needs it, with no copy
            for key, value in zip(STATE_KEYS, (*new, *counters)):
                state[key] = value if keep_if is None else torch.where(keep_if, state[key], value)
        self._per_optimizer = {}

    # -- reading it ---------------------------------------------------------------------

    def _read(self, key: str, initial: float) -> float:
        if not self._enabled:
            return 1.0 if key == "scale" else 0
        return initial if self._state is None else self._state[key].item()

    def get_scale_async(self) -> Tensor:
        """Return the current scale as a 0-dim float32 tensor on its device, with no sync (1.0 when disabled).

        ``update()`` puts a new tensor in its place and never writes into this one: it stays the
        scale this iteration ran with (torch's ``_scale`` is updated in place).

        >>> GradScaler("cpu", init_scale=8.0).get_scale_async()
        tensor(8.)
        """
        if not self._enabled:
            return torch.ones(())
        if self._state is None:
            return torch.tensor(self._init_scale, dtype=torch.float32)
        return self._state["scale"]

    def get_scale(self) -> float:
        """Return the current scale as a float (1.0 when disabled); costs a host sync."""
        return self._read("scale", self._init_scale)

    @property
    def skip_count(self) -> int:
        """How many iterations ``update`` has seen with an inf/NaN gradient (syncs)."""
        return int(self._read("skip_count", self._init_skips[0]))

    @property
    def skip_streak(self) -> int:
        """How many of the most recent iterations in a row had an inf/NaN gradient (syncs)."""
        return int(self._read("skip_streak", self._init_skips[1]))

    def get_growth_factor(self) -> float:
        return self.config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.config = dataclasses.replace(self.config, growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        return self.config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.config = dataclasses.replace(self.config, backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        return self.config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.config = dataclasses.replace(self.config, growth_interval=new_interval)

    # -- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return everything needed to resume exactly; a superset of torch's keys ({} when disabled).

        Take it after ``update()``; it syncs once per entry read from the device.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self.config.growth_factor,
            "backoff_factor": self.config.backoff_factor,
            "growth_interval": self.config.growth_interval,
            "_growth_tracker": int(self._read("growth_tracker", self._init_tracker)),
            "hysteresis": self.config.hysteresis,
            "_hysteresis_left": int(self._read("hysteresis_left", self._init_hysteresis)),
            "min_scale": self.config.min_scale,
            "max_scale": self.config.max_scale,
            "skip_count": self.skip_count,
            "skip_streak": self.skip_streak,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict`` (ours or torch's); its config replaces the constructor's."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled GradScaler."
            )
        config, initial = self.parse_state(state_dict)  # everything validated before anything is written
        self.config = config
        self._init_scale, self._init_tracker, self._init_hysteresis = initial[:3]
        self._init_skips = initial[3:]
        if self._state is not None:  # new tensors, as update() gives: a shared constant may be among them
            for key, value in zip(STATE_KEYS, initial):
                self._state[key] = torch.full_like(self._state[key], value)

    @staticmethod
    def parse_state(state_dict: dict[str, Any]) -> tuple[ScalerConfig, tuple[float, int, int, int, int]]:
        """Return the config and ``(scale, tracker, hysteresis_left, skip_count, skip_streak)``, or raise.

        Writes nothing: call it to validate a state before loading it with anything else.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"GradScaler state_dict must be a dict, got {type(state_dict).__name__}.")
        missing = ({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
                   - state_dict.keys())
        if missing:
            raise KeyError(
                f"GradScaler state_dict lacks {sorted(missing)}; pass what GradScaler.state_dict() returned."
            )
        hysteresis = state_dict.get("hysteresis", 1)
        config = ScalerConfig(
            real("state_dict['growth_factor']", state_dict["growth_factor"]),
            real("state_dict['backoff_factor']", state_dict["backoff_factor"]),
            state_dict["growth_interval"],
            hysteresis,
            state_dict.get("min_scale"),
            state_dict.get("max_scale"),
        )
        scale = check_init_scale(real("state_dict['scale']", state_dict["scale"]), "state_dict['scale']")
        # torch keeps (and saves) a tracker >= growth_interval after set_growth_interval lowers the interval;
        # the rule grows at the next clean step either way, so it is clamped, as update() clamps it
        tracker = min(check_int("state_dict['_growth_tracker']", state_dict["_growth_tracker"], 0, INT32_MAX),
                      config.growth_interval - 1)
        # a hysteresis_left above hysteresis would postpone the back-off (10**9: never back off)
        left = check_int(
            "state_dict['_hysteresis_left']", state_dict.get("_hysteresis_left", hysteresis), 0, hysteresis
        )
        count = check_int("state_dict['skip_count']", state_dict.get("skip_count", 0), 0, 2**63 - 1)
        streak = check_int("state_dict['skip_streak']", state_dict.get("skip_streak", 0), 0, count)
        return config, (scale, tracker, left, count, streak)

    def __getstate__(self) -> dict[str, Any]:
        if any(s["stage"] != Stage.READY for s in self._per_optimizer.values()):
            raise ScalerUsageError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, "
                "or at the end after scaler.update()."
            )
        return self.__dict__.copy()

    def __repr__(self) -> str:
        if not self._enabled:
            return "GradScaler(enabled=False)"
        return f"GradScaler(scale={self.get_scale():g}, {self.config})"
