"""FP8 scaling, the grown-up loss scale: a scale per tensor, row, tile or block, chosen from amax.

FP8 has too little range for any tensor as it comes (e4m3: 448 down to 2**-9; a gradient of
1e-6 flushes to zero), so every FP8 recipe rescales each tensor before the cast, as a loss
scaler does for fp16, but per tensor and every step, mapping the largest magnitude (amax) onto
the format's largest value. Two conventions name that factor: Transformer Engine and torchao
call ``fmt_max / amax`` the scale and multiply by it before the cast; here, as in the
``scale_a``/``scale_b`` that ``torch._scaled_mm`` takes, ``scale = amax / fmt_max`` is the
*dequantization* scale: the cast divides by it and ``x ~= data * scale``. Where amax comes from is the recipe:
*current* scaling takes this tensor's amax now; *delayed* scaling (Transformer Engine's
``DelayedScaling``) takes the largest amax of the last steps, so a tensor whose range jumps
saturates silently; finer granularity (rows, 1x128 tiles, 128x128 blocks, MX's 32-element
blocks with power-of-two scales) stops one outlier from flushing everything else to zero.

Every cast here is a real one (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, MX through
torchao); ``linear`` runs ``torch._scaled_mm`` for per-tensor and rowwise scales (the CPU has
both) and dequantises first for the others (the CPU refuses block scales).

The guard's order: **amax is checked before the cast** (``check_amax``), because torch 2.13's
e4m3fn cast saturates, even ``inf`` becomes 448 (older torch, and ml_dtypes, gave NaN; torchao
clamps to the format's range before casting), so after the cast an overflow cannot be seen.
amax = 0 (padding, a dead branch) breaks naive code: fmt_max / 0 = inf, and 0 * inf = NaN.
Transformer Engine answers by recipe. Under ``DelayedScaling`` its scale update keeps the
previous scale when the history's amax is 0 or not finite (``transformer_engine/common/recipe/
delayed_scaling.cu``: ``isfinite(amax) && amax > 0 ? scaled_max / amax : scale``); its current
scaling (``Float8CurrentScaling``, ``compute_scale_from_amax`` in ``common/recipe/
recipe_common.cuh``) has no previous scale to keep and returns a scale of 1 for an amax of 0 or
inf (a NaN scale becomes 1 too). torchao clamps amax to at least a small eps. labkit casts such a
block with scale 1 (its data is 0) and records it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..distributed import all_reduce_, is_distributed
from ..validate import check_int, check_number

__all__ = [
    "FAULT_KINDS", "FORMATS", "GRANULARITIES", "REASONS", "CastRecord", "Fp8Fault", "Fp8Guard", "Quantized",
    "check_amax", "import_torchao_mx", "linear", "quantize", "update_amax_history",
]

FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRANULARITIES = ("tensor", "row", "tile128", "block128", "mx32")
SMALLEST_SCALE = 2.0**-149  # float32's smallest subnormal number
REASONS = {
    "nonfinite_amax": "amax is inf or NaN: the cast would hide it (e4m3 turns inf into 448); skip this step",
    "zero_amax": "amax is 0: fmt_max / amax is inf and 0 * inf is NaN; labkit casts it with scale 1 instead",
    "saturated": "more than saturate_limit of the values were above the scale's amax and clamped to the "
                 "format's max (a stale delayed scale?)",
    "flushed": "more nonzero values than flush_limit became 0 (an outlier set the scale? use finer blocks)",
}


@dataclass(frozen=True)
class Quantized:
    """A tensor cast to float8 with its scales: ``x ~= data * scale`` (scale broadcast over each block).

    ``saturated`` and ``flushed`` are what the cast did: the fraction of entries clamped to the
    format's max, and the fraction that were nonzero and became 0.
    """

    data: Tensor
    scale: Tensor
    fmt: str
    granularity: str
    amax: float
    saturated: float
    flushed: float

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Return ``data * scale`` in ``dtype``.

        >>> quantize(torch.tensor([[1.0, -2.0, 448.0]])).dequantize().tolist()
        [[1.0, -2.0, 448.0]]
        """
        return (self.data.float() * _expand(self.scale.float(), self.granularity, self.data.shape)).to(dtype)


def _block_view(x: Tensor, granularity: str) -> Tensor:
    """Return ``x`` viewed as (blocks..., elements of a block): amax over the last dim is each block's."""
    if granularity == "tensor":
        return x.reshape(1, -1)
    if x.dim() != 2:
        raise ValueError(f"granularity {granularity!r} needs a 2-D tensor (rows, columns), "
                         f"got shape {tuple(x.shape)}.")
    m, n = x.shape
    if granularity == "row":
        return x
    if granularity == "tile128":
        _divisible(n, 128, granularity, x.shape)
        return x.reshape(m, n // 128, 128)
    _divisible(n, 128, granularity, x.shape)
    _divisible(m, 128, granularity, x.shape)
    return x.reshape(m // 128, 128, n // 128, 128).transpose(1, 2).reshape(m // 128, n // 128, 128 * 128)


def _divisible(size: int, block: int, granularity: str, shape: torch.Size) -> None:
    if size % block:
        raise ValueError(f"granularity {granularity!r} needs dimensions divisible by {block}, "
                         f"got shape {tuple(shape)}; pad the tensor or choose 'row' or 'tensor'.")


def _expand(scale: Tensor, granularity: str, shape: torch.Size) -> Tensor:
    """Broadcast the per-block ``scale`` back to ``shape``."""
    if granularity in ("tensor", "row"):
        return scale
    width = {"tile128": 128, "block128": 128, "mx32": 32}[granularity]
    scale = scale.repeat_interleave(width, dim=-1)
    return scale.repeat_interleave(128, dim=0) if granularity == "block128" else scale


def _block_amax(magnitude: Tensor, granularity: str) -> Tensor:
    """Return each block's amax from ``magnitude`` (``x.abs()``), shaped like the scale of ``granularity``."""
    if granularity == "mx32":
        _check_mx(magnitude)
        return magnitude.reshape(*magnitude.shape[:-1], -1, 32).amax(dim=-1)
    amax = _block_view(magnitude, granularity).amax(dim=-1)
    return (amax.reshape(()) if granularity == "tensor"
            else amax.reshape(-1, 1) if granularity == "row" else amax)


def _check_mx(x: Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] % 32:
        raise ValueError("granularity 'mx32' needs a last dimension divisible by 32, "
                         f"got shape {tuple(x.shape)}.")


def check_amax(x: Tensor, granularity: str = "tensor") -> str | None:
    """Return why ``x`` cannot be cast to FP8 safely (a key of ``REASONS``), or None; call it before the cast.

    Reads amax per block of ``granularity``: a non-finite amax anywhere is ``"nonfinite_amax"``,
    else a block whose amax is 0 is ``"zero_amax"``. One host sync (the verdict is a string).

    >>> (check_amax(torch.tensor([1.0, float("inf")])),
    ...  torch.tensor([float("inf")]).to(torch.float8_e4m3fn).float().item())
    ('nonfinite_amax', 448.0)
    >>> check_amax(torch.zeros(3)), check_amax(torch.ones(3))
    ('zero_amax', None)
    """
    _check_granularity(granularity)
    amax = _block_amax(x.detach().float().abs(), granularity)
    if not bool(torch.isfinite(amax).all()):
        return "nonfinite_amax"
    return "zero_amax" if bool((amax == 0).any()) else None


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}.")


def quantize(
    x: Tensor, fmt: str = "e4m3", granularity: str = "tensor", amax_history: Tensor | None = None,
    *, round_scales_to_power_of_2: bool = False,
) -> Quantized:
    """Cast ``x`` to float8 with one scale per block of ``granularity``: ``scale = amax / fmt_max``.

    ``scale`` is the dequantization scale (``x ~= data * scale``; the cast divides by it); TE
    and torchao call its inverse, ``fmt_max / amax``, the scale and multiply by it.

    ``amax_history`` (per-tensor only) switches to delayed scaling: amax is the largest of
    the history (Transformer Engine's ``amax_compute_algo="max"``, margin 0), not this
    tensor's; update it after the cast with ``update_amax_history``. A block whose amax is 0
    gets scale 1 (its data is 0 anyway) instead of NaN. ``mx32`` is OCP MX through torchao:
    32-element blocks, power-of-two e8m0 scales rounded up (``RCEIL``, as the Blackwell cast
    does), so no element saturates. Values beyond the scaled range are clamped to fmt_max
    before the cast, as every recipe does (e5m2 would make them inf); ``saturated`` counts them.
    ``round_scales_to_power_of_2=True`` rounds each scale up to a power of two (torchao's
    option of that name, on by default in its rowwise recipes; MX scales always are): then
    multiplying and dividing by it is exact, so products of the data are the same bits on
    every CPU and GPU, and amax still fits (up to half the format's range goes unused).
    Costs: a few elementwise passes and two host syncs (the fractions and amax are numbers).

    >>> q = quantize(torch.tensor([[0.5, -3.0, 7.0, 1e-5]]))
    >>> q.data.dtype, q.scale.item() == 7.0 / 448, q.flushed
    (torch.float8_e4m3fn, True, 0.25)
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}.")
    _check_granularity(granularity)
    if amax_history is not None and granularity != "tensor":
        raise ValueError(f"delayed scaling (amax_history) is per tensor; got granularity {granularity!r}. "
                         "Finer granularities take the current amax of each block.")
    dtype, x32 = FORMATS[fmt], x.detach().float()
    magnitude, fmt_max = x32.abs(), torch.finfo(dtype).max
    if granularity == "mx32":
        data, scale = _mx(x32, dtype)
        limit = scale.float() * fmt_max  # exact: the scale is a power of two
    else:
        limit = _block_amax(magnitude, granularity)
        if amax_history is not None and amax_history.numel():
            limit = amax_history.detach().float().amax().to(x32.device)
        # at least float32's smallest subnormal: an amax below fmt_max * 2**-149 would give a scale of 0
        scale = torch.where(limit > 0, (limit / fmt_max).clamp(min=SMALLEST_SCALE), torch.ones_like(limit))
        if round_scales_to_power_of_2:
            # scale = m * 2**e with m in [0.5, 1): scale / m is 2**e exactly (no pow kernel's rounding
            # to trust), the power of two at or above it; torchao rounds its fmt_max / amax down, the same
            mantissa, _ = torch.frexp(scale)
            scale = torch.where(torch.isfinite(scale) & (mantissa != 0.5), scale / mantissa, scale)
        data = (x32 / _expand(scale, granularity, x32.shape)).clamp(-fmt_max, fmt_max).to(dtype)
    # saturated: above the amax the scale was made for (not x / scale > fmt_max, which the
    # division's rounding can make true for amax itself)
    saturated = (magnitude > _expand(limit, granularity, x32.shape)).float().mean()
    flushed = ((x32 != 0) & (data.float() == 0)).float().mean()
    # host sync: the record of what the cast did is plain numbers
    amax_value, saturated_value, flushed_value = torch.stack([magnitude.amax(), saturated, flushed]).tolist()
    return Quantized(data, scale, fmt, granularity, amax_value, saturated_value, flushed_value)


def _mx(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Return torchao's MX data and e8m0 scales for ``x`` (blocks of 32 along the last dim)."""
    _check_mx(x)
    mx_tensor, mode = import_torchao_mx()
    mx = mx_tensor.to_mx(x, dtype, block_size=32, scaling_mode=mode.RCEIL)
    return mx.qdata, mx.scale


def import_torchao_mx():  # type: ignore[no-untyped-def]
    """Import torchao's MX pieces with its import-time noise quieted.

    On a CPU build torchao logs a warning for each CUDA extension it cannot load, and torch
    one for each enum it registers: harmless, and not the student's business.

    >>> MXTensor, mode = import_torchao_mx(); mode.RCEIL.name
    'RCEIL'
    """
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
    except ImportError as e:
        raise ImportError(f"granularity 'mx32' needs torchao (pip install torchao==0.18.0): {e}") from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    return MXTensor, ScaleCalculationMode


def update_amax_history(history: Tensor, amax: float | Tensor, length: int = 16) -> Tensor:
    """Return ``history`` with ``amax`` appended, keeping the last ``length`` values (a new tensor).

    The delayed-scaling rule: the scale of step t comes from max(history) over steps
    t-length..t-1 (Transformer Engine's ``DelayedScaling``, default length 1024, rolled by -1
    each step; torchao removed delayed scaling in 0.10).

    >>> update_amax_history(torch.tensor([1.0, 2.0]), 5.0, length=2)
    tensor([2., 5.])
    """
    check_int("length", length, 1)
    amax = torch.as_tensor(amax, dtype=torch.float32, device=history.device).reshape(1)
    return torch.cat([history.float(), amax])[-length:]


def linear(x: Quantized, weight: Quantized, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Return ``x @ weight.T`` (``F.linear``'s contract) from two quantized operands.

    Both per-tensor or both rowwise: ``torch._scaled_mm`` (FP8 inputs; on the CPU it accumulates
    in fp32, while Hopper's FP8 tensor cores keep about 14 bits, which is why DeepSeek-V3 §3.3.2
    promotes partial sums to fp32 every 128 elements and torch offers ``use_fast_accum``). Any
    other pairing: dequantise, then matmul (the CPU's ``_scaled_mm`` refuses block scales), the
    simulation every FP8 paper uses for its error studies.

    Exact only where the arithmetic is: with power-of-two scales (``round_scales_to_power_of_2``)
    and sums that fit float32's 24 bits, the result is the same on every machine. Other scales
    (``amax / 448``) are applied in a different order by each CPU's ``_scaled_mm`` (oneDNN on
    one with AVX-512 FP16, a dequantising fallback on another), so results differ by a few
    float32 ulps: compare them with ``rtol=1e-6`` (``torch.testing.assert_close``'s float32 default).

    >>> a = quantize(torch.eye(16), round_scales_to_power_of_2=True)  # scale 2**-8, not 1/448
    >>> a.scale.item() == 2**-8, linear(a, a).diagonal().tolist() == [1.0] * 16
    (True, True)
    """
    if x.data.dim() != 2 or weight.data.dim() != 2 or x.data.shape[1] != weight.data.shape[1]:
        raise ValueError(f"linear needs x (M, K) and weight (N, K), got {tuple(x.data.shape)} "
                         f"and {tuple(weight.data.shape)}.")
    if x.granularity == weight.granularity and x.granularity in ("tensor", "row"):
        return torch._scaled_mm(x.data, weight.data.t(), scale_a=x.scale.float(),
                                scale_b=weight.scale.float().t(), out_dtype=out_dtype)
    return (x.dequantize() @ weight.dequantize().t()).to(out_dtype)


FAULT_KINDS = ("range_jump", "amax_zero", "outlier_channel")


@dataclass(frozen=True)
class Fp8Fault:
    """A bad tensor for an FP8 cast: its range x``magnitude`` for one step, all zeros, or one outlier channel.

    ``range_jump`` (default x10): with delayed scaling 65% of values saturate, with no NaN
    anywhere. ``amax_zero``: padding or a dead branch. ``outlier_channel`` (default x1e4,
    column ``channel``): per-tensor scaling flushes the other values to zero.

    >>> Fp8Fault("outlier_channel", 100.0, channel=1).apply(torch.ones(2, 3)).tolist()
    [[1.0, 100.0, 1.0], [1.0, 100.0, 1.0]]
    """

    kind: str
    magnitude: float | None = None
    channel: int = 7

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown FP8 fault kind {self.kind!r}; choose one of {', '.join(FAULT_KINDS)}.")
        if self.magnitude is not None and not (0 < self.magnitude < math.inf):
            raise ValueError(f"an FP8 fault's magnitude must be a finite number > 0, got {self.magnitude!r}.")

    @property
    def label(self) -> str:
        return self.kind if self.kind == "amax_zero" else f"{self.kind}:{self._magnitude:g}"

    @property
    def _magnitude(self) -> float:
        return (self.magnitude if self.magnitude is not None
                else {"range_jump": 10.0, "outlier_channel": 1e4}.get(self.kind, 0.0))

    def apply(self, x: Tensor) -> Tensor:
        """Return the bad version of ``x`` (a new tensor)."""
        if self.kind == "range_jump":
            return x * self._magnitude
        if self.kind == "amax_zero":
            return torch.zeros_like(x)
        if x.dim() != 2 or not 0 <= self.channel < x.shape[1]:
            raise ValueError(f"outlier_channel needs a 2-D tensor with column {self.channel}, "
                             f"got shape {tuple(x.shape)}.")
        bad = x.clone()
        bad[:, self.channel] *= self._magnitude
        return bad


@dataclass
class CastRecord:
    """One guarded FP8 cast: what amax and scale were used, what the cast did, and why it was flagged."""

    step: int
    amax: float
    scale_amax: float  # the amax the scale was computed from (delayed: the history's max)
    saturated: float
    flushed: float
    reason: str | None = None
    fault: str | None = None


@dataclass
class Fp8Guard:
    """Cast one tensor stream to FP8 step by step, checking amax before each cast and recording why a cast
    was bad.

    ``history=None`` is current scaling; ``history=16`` delayed scaling over the last 16
    steps' amaxes (per tensor). Reasons, first match wins: ``check_amax``'s (``nonfinite_amax``,
    ``zero_amax``), then ``saturated`` (more than ``saturate_limit`` of the values clamped:
    a delayed scale clamps a value now and then as amax wanders; TE adds a margin for that),
    then ``flushed`` (more than ``flush_limit`` of the values flushed to 0). ``faults`` maps steps to
    ``Fp8Fault``\\ s.
    On ``nonfinite_amax`` the history is left alone: one bad tensor must not poison the scale.
    ``round_scales_to_power_of_2`` is ``quantize``'s.

    ``sharded=True`` (per tensor) says ``x`` is this rank's shard of one tensor: under
    torch.distributed the amax and the non-finite verdict are then reduced (max) over
    ``process_group`` before the cast, so every rank uses the tensor's scale, not its shard's
    (torchtitan#3109: TP shards with their own amax gave NaN from step 3). Cost: one
    all-reduce of two numbers and one host sync per cast.

    >>> guard = Fp8Guard(history=4, faults={2: Fp8Fault("range_jump")})
    >>> x = torch.linspace(-1, 1, 256)
    >>> [(r.step, r.reason) for r in (guard(x) and guard.records[-1] for _ in range(3))]
    [(0, None), (1, None), (2, 'saturated')]
    """

    fmt: str = "e4m3"
    granularity: str = "tensor"
    history: int | None = None
    flush_limit: float = 0.01
    saturate_limit: float = 0.001
    faults: Mapping[int, Fp8Fault] | None = None
    sharded: bool = False
    process_group: Any = None
    round_scales_to_power_of_2: bool = False
    records: list[CastRecord] = field(default_factory=list)
    amax_history: Tensor = field(default_factory=lambda: torch.zeros(0))

    def __post_init__(self) -> None:
        _check_granularity(self.granularity)
        if self.history is not None and self.granularity != "tensor":
            raise ValueError("delayed scaling (history=) is per tensor; "
                             "pass granularity='tensor' or history=None.")
        if self.sharded and self.granularity != "tensor":
            raise ValueError("sharded=True reduces one amax per tensor; "
                             "pass granularity='tensor' (finer blocks are local to a shard).")
        for name in ("flush_limit", "saturate_limit"):
            check_number(name, getattr(self, name), 0, 1, high_open=True, noun="a fraction")

    def __call__(self, x: Tensor) -> Quantized:
        """Quantize ``x`` (after this step's fault, if any) and append its ``CastRecord``."""
        step = len(self.records)
        fault = (self.faults or {}).get(step)
        if fault is not None:
            x = fault.apply(x)
        history = self.amax_history if self.history is not None else None
        amax = None
        if self.sharded and is_distributed():
            local = x.detach().float().abs().amax()
            stats = torch.stack([(~torch.isfinite(local)).float(),
                                 torch.nan_to_num(local, nan=0.0, posinf=0.0)])
            bad, amax = all_reduce_(stats, "max", self.process_group).tolist()  # host sync: the verdict
            reason = "nonfinite_amax" if bad else "zero_amax" if amax == 0 else None
            if history is None:  # current scaling, from the whole tensor's amax
                history = torch.tensor([amax])
        else:
            reason = check_amax(x, self.granularity)
        q = quantize(x, self.fmt, self.granularity, amax_history=history,
                     round_scales_to_power_of_2=self.round_scales_to_power_of_2)
        amax = q.amax if amax is None else amax
        if reason is None and q.saturated > self.saturate_limit:
            reason = "saturated"
        elif reason is None and q.flushed > self.flush_limit:
            reason = "flushed"
        scale_amax = float(history.amax()) if history is not None and history.numel() else q.amax
        if self.history is not None and reason != "nonfinite_amax":
            self.amax_history = update_amax_history(self.amax_history, amax, self.history)
        self.records.append(CastRecord(step, amax, scale_amax, q.saturated, q.flushed, reason,
                                       fault.label if fault is not None else None))
        return q
