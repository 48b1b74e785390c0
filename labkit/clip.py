"""Gradient clipping to a global norm, in two halves that compose (as torch's ``clip_grad.py``).

``grad_norm`` reads the gradients and returns one number (``get_total_norm`` the same for
plain tensors); ``clip_grads_with_norm_`` scales them by a given norm; ``clip_grad_norm_``
is the one followed by the other. Two deliberate deviations from torch: fp16/bf16 norms are
accumulated and returned in float32 (an fp16 norm above 65504 is ``inf`` in torch, and
clipping by it zeroes every gradient), float32 and float64 stay in their own dtype as in
torch; and a non-finite norm never touches the gradients (torch turns them into NaN or zeros). With
FSDP2's sharded
``DTensor`` gradients the norm is the whole model's: the local shards' p-th powers are
reduced across the mesh (see ``distributed.reduce_sharded_norms_``), so every rank gets the
same norm and clips with the same coefficient; DDP's replicated gradients need no collective.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import struct
import types
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .distributed import is_distributed, local_tensor, reduce_sharded_norms_
from .grouping import group_by_device_and_dtype

__all__ = ["clip_grad_norm_", "clip_grads_with_norm_", "get_total_norm", "grad_norm"]

Parameters = Tensor | Iterable[Tensor] | Iterable[tuple[str, Tensor]]

HALF = (torch.float16, torch.bfloat16)

# torch's epsilon in ``max_norm / (total_norm + 1e-6)``; kept so results match torch's.
EPS = 1e-6


def check_norm_type(norm_type: float | str) -> float:
    """Return ``norm_type`` as a float (any order torch takes: ``inf``, 0, negative), or raise
    ``ValueError``."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = math.nan
    if math.isnan(p):
        raise ValueError(
            f"norm_type must be a number or 'inf', got {norm_type!r}; use 2.0 for the usual L2 norm, "
            "1.0 for L1 or float('inf') for the largest |g| (as torch: 0 counts non-zeros, -inf is the min)."
        )
    return p


# With a loss scaler TrainStep reads the norm of the *scaled* gradients (no unscale pass). A finite
# order p sums |g * scale|**p: fp16 holds scaled values below 65504, and 65504**4 < 2**64, so at p <= 4
# a sum over fewer than 2**64 of them stays finite; at p = 16 one value above 256 overflows float32.
MAX_SCALED_NORM_TYPE = 4.0


def check_scaled_norm_type(norm_type: float) -> float:
    """Return ``norm_type`` if a norm of scaled gradients of this order overflows only with them, or raise.

    >>> check_scaled_norm_type(2.0), check_scaled_norm_type(math.inf)
    (2.0, inf)
    """
    if MAX_SCALED_NORM_TYPE < norm_type < math.inf:
        raise ValueError(
            f"norm_type {norm_type!r} with a loss scaler: the norm is taken of the scaled gradients, and "
            f"their {norm_type:g}-th powers overflow float32 while every gradient is finite (at 16, any "
            f"above 256), so steps would skip for nothing. Use norm_type <= {MAX_SCALED_NORM_TYPE:g} or "
            "float('inf') (the largest |g|, a p-norm's limit), or precision='bf16' (no scaler)."
        )
    return norm_type


def check_max_norm(max_norm: float) -> float:
    """Return ``max_norm`` as a float > 0, or raise ``ValueError`` saying how to fix it."""
    try:
        m = float(max_norm)
    except (TypeError, ValueError):
        m = math.nan
    if not m > 0:
        raise ValueError(
            f"max_norm must be a number > 0, got {max_norm!r}; to measure the norm without "
            "clipping call labkit.grad_norm(parameters), or pass max_norm=float('inf')."
        )
    return m


WHAT_TO_PASS = "tensors (model.parameters()), (name, tensor) pairs (model.named_parameters()) or one tensor"


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor"
    if isinstance(x, tuple):
        return f"a tuple of {len(x)} ({', '.join(type(v).__name__ for v in x)})"
    if isinstance(x, str):
        return f"the str {x[:40]!r}"
    name = type(x).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def named_tensors(parameters: Parameters) -> list[tuple[str, Tensor]]:
    """Return ``parameters`` as ``(name, tensor)`` pairs (an unnamed tensor is named by its index).

    Anything else, a ``None`` among them, a pair the wrong way round, a dict, raises ``TypeError``
    saying what was passed and what to pass.

    >>> named_tensors([torch.ones(1)]), named_tensors([("w", torch.ones(1))])[0][0]
    ([('0', tensor([1.]))], 'w')
    """
    if isinstance(parameters, Tensor):
        return [("0", parameters)]
    if isinstance(parameters, (str, bytes, Mapping)) or not isinstance(parameters, Iterable):
        hint = " (pass its .values() or .items())" if isinstance(parameters, Mapping) else ""
        raise TypeError(f"parameters must be {WHAT_TO_PASS}; got {_describe(parameters)}{hint}.")
    out = []
    for i, item in enumerate(parameters):
        if isinstance(item, Tensor):
            out.append((str(i), item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and \
                isinstance(item[1], Tensor):
            out.append((item[0], item[1]))
        else:
            hint = " (the keys of a dict? pass its .values() or .items())" if isinstance(item, str) else ""
            raise TypeError(f"parameters must be {WHAT_TO_PASS}; item {i} is {_describe(item)}{hint}.")
    return out


def named_grads(parameters: Parameters) -> tuple[list[Tensor], list[str]]:
    """Return the gradients that exist and a name for each (the given name, or the index)."""
    grads, names = [], []
    for name, p in named_tensors(parameters):
        if p.grad is not None:
            grads.append(p.grad)
            names.append(name)
    return grads, names


def per_tensor_norms(grads: list[Tensor], norm_type: float, foreach: bool | None = None) -> Tensor:
    """Return a 1-d tensor of each gradient's ``norm_type``-norm, in order.

    >>> per_tensor_norms([torch.tensor([3.0]), torch.tensor([4.0])], 2.0)
    tensor([3., 4.])
    """
    return grouped_norms(grads, norm_type, foreach)[0]


def grouped_norms(
    grads: list[Tensor], norm_type: float, foreach: bool | None = None
) -> tuple[Tensor, Tensor | None]:
    """Return each gradient's ``norm_type``-norm, in order, and the order torch sums them in.

    The order is ``None`` where it is the list's own (one device and dtype, the usual case);
    else it is torch's grouping by device and dtype (``total_norm``'s ``order``), so that the
    global norm of mixed float32/float64 gradients is torch's to the bit.

    fp16/bf16 gradients are accumulated in float32; the result has the promoted dtype of
    float32 and the other gradients' dtypes (float64 gradients keep a float64 norm, so
    ``[3e20, 4e20]`` has norm ``5e20``, as in torch, not ``inf``).

    A sharded ``DTensor`` gradient gets the norm of the whole tensor, the same on every rank
    (one all-reduce per mesh, for all such gradients together).

    >>> f64 = torch.tensor([4.0], dtype=torch.float64)
    >>> grouped_norms([torch.tensor([3.0]), f64, torch.tensor([0.0])], 2.0)  # torch's order: float64's first
    (tensor([3., 4., 0.], dtype=torch.float64), tensor([1, 0, 2]))
    """
    if not grads:
        return torch.zeros(0), None
    dtype, device = grads[0].dtype, grads[0].device
    if foreach is not False and device.type in ("cpu", "cuda") and all(
        type(g) is Tensor and g.dtype is dtype and g.device == device and g.numel() for g in grads
    ):  # the usual case (no DTensor, one device and dtype): no grouping, less Python a step
        return torch.stack(foreach_norm(grads, norm_type, torch.float32 if dtype in HALF else None)), None
    sharded, grads = grads, [local_tensor(g) for g in grads]
    first = grads[0].device
    out_dtype = functools.reduce(torch.promote_types, [_acc_dtype(g.dtype) for g in grads])
    # An empty tensor's norm is 0, and is set here: torch has no inf-norm of an empty tensor
    # (no identity for max), and FSDP2 leaves a rank empty shards when a dim is < world size.
    norms: list[Tensor | None] = [torch.zeros((), device=first, dtype=out_dtype) if g.numel() == 0 else None
                                  for g in grads]
    order: list[int] = []
    # one grouping of every gradient, an empty one in its group: the order torch sums the norms in
    for (device, _), (_, where) in group_by_device_and_dtype(grads).items():
        order += where
        idx = [i for i in where if norms[i] is None]
        if not idx:
            continue
        use_foreach = device.type in ("cpu", "cuda") if foreach is None else foreach
        if use_foreach and device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"foreach=True was passed, but there is no foreach norm on {device.type}")
        live = [grads[i] for i in idx]
        # fp16/bf16 grads are accumulated in fp32, so 300 * 60000 is not inf; fp64 stays fp64
        # until the end (torch refuses to narrow it inside the norm).
        acc = torch.float32 if live[0].dtype in HALF else None
        if use_foreach:
            out = foreach_norm(live, norm_type, acc)
        else:
            out = [torch.linalg.vector_norm(g, norm_type, dtype=acc) for g in live]
        # one device and dtype, none empty (the usual case): one stack, no per-norm copies
        if len(idx) == len(grads):
            stacked = torch.stack(out)
            return reduce_sharded_norms_(stacked if stacked.dtype == out_dtype else stacked.to(out_dtype),
                                         sharded, norm_type), None
        for i, n in zip(idx, out):
            norms[i] = n.to(device=first, dtype=out_dtype)
    return (reduce_sharded_norms_(torch.stack(norms), sharded, norm_type),  # type: ignore[arg-type]
            torch.tensor(order, device=first))


# Below this many elements a second thread's hand-off costs more than it saves.
SPLIT_NUMEL = 1 << 22
# After a parallel kernel, libgomp's idle threads spin (~300k pause loops) and hold the other
# cores, so a Python thread handed half the norms waits for them: split, 50 x 1M norms after a
# multiply are no faster. Where they sleep (read once: libgomp reads the same variables when
# torch loads it) the split pays (benchmarks/bench_step.py (a) with OMP_WAIT_POLICY=passive).
OMP_THREADS_SLEEP = (os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"
                     or os.environ.get("GOMP_SPINCOUNT") == "0")


@functools.cache
def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="labkit-norm")


# A forked child has none of its parent's threads: the parent's pool would take its work and never run
# it (a forked mutation run hung so). The child makes its own.
os.register_at_fork(after_in_child=_pool.cache_clear)


def foreach_norm(tensors: list[Tensor], norm_type: float, dtype: torch.dtype | None = None) -> list[Tensor]:
    """Return ``torch._foreach_norm(tensors, norm_type, dtype=dtype)``, on CPU over torch's threads.

    torch's CPU norm reduces each tensor on one thread: 50 x 1M fp32 take as long at one
    thread as at two. ATen releases the GIL, so with OpenMP's idle threads asleep
    (``OMP_WAIT_POLICY=passive``, see ``OMP_THREADS_SLEEP``) contiguous slices of the list
    (>= 4M elements each) go to ``torch.get_num_threads()`` Python threads and run side by side. Each
    norm comes from the same kernel on the same
    tensor, so the result is bitwise torch's; CUDA's fused kernel is called as is.

    >>> foreach_norm([torch.tensor([3.0, 4.0]), torch.tensor([1.0])], 2.0)
    [tensor(5.), tensor(1.)]
    """
    parts = numel = 0
    if OMP_THREADS_SLEEP and tensors[0].device.type == "cpu":  # else one call: no Python a step can spare
        numel = sum(t.numel() for t in tensors)
        parts = min(torch.get_num_threads(), len(tensors), numel // SPLIT_NUMEL)
    if parts < 2:
        return list(torch._foreach_norm(tensors, norm_type, dtype=dtype))
    cuts, seen = [], 0
    for i, t in enumerate(tensors):
        seen += t.numel()
        if seen * parts >= numel * (len(cuts) + 1) and len(cuts) < parts - 1 and i + 1 < len(tensors):
            cuts.append(i + 1)
    slices = [tensors[a:b] for a, b in zip([0, *cuts], [*cuts, len(tensors)]) if b > a]
    grad_mode = torch.is_grad_enabled()  # thread-local: a worker starts with grad on

    def norms(part: list[Tensor]) -> tuple[Tensor, ...]:
        with torch.set_grad_enabled(grad_mode):
            return torch._foreach_norm(part, norm_type, dtype=dtype)

    futures = [_pool(len(slices) - 1).submit(norms, s) for s in slices[1:]]
    out = list(torch._foreach_norm(slices[0], norm_type, dtype=dtype))
    for f in futures:
        out.extend(f.result())
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in HALF else dtype


def total_norm(norms: Tensor, norm_type: float, order: Tensor | None = None) -> Tensor:
    """Combine per-tensor norms into the norm of all gradients viewed as one vector.

    ``order`` (``grouped_norms``') is the order the norms are summed in, as torch sums them.

    >>> total_norm(torch.tensor([3.0, 4.0]), 2.0)
    tensor(5.)
    """
    if norms.numel() == 0:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(norms if order is None else norms[order], norm_type)


NONFINITE = ("The total norm of order {p} for gradients from `parameters` is non-finite, "
             "so it cannot be clipped.")


@torch.no_grad()
def get_total_norm(
    tensors: Tensor | Iterable[Tensor], norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Return the norm of ``tensors`` viewed as one vector (torch's ``nn.utils.get_total_norm``).

    torch's contract, except that fp16/bf16 tensors are accumulated in float32. With
    ``error_if_nonfinite=True`` a NaN/inf norm raises ``RuntimeError`` (one host sync).

    >>> get_total_norm([torch.tensor([3.0]), torch.tensor([4.0])])
    tensor(5.)
    """
    p = check_norm_type(norm_type)
    tensors = [t for _, t in named_tensors(tensors)]
    for i, t in enumerate(tensors):
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"get_total_norm takes floating-point tensors (gradients); item {i} is "
                            f"{_describe(t)}. Convert it with .float(), or pass the parameters to grad_norm.")
    norms, order = grouped_norms(tensors, p, foreach)
    norm = total_norm(norms, p, order)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            NONFINITE.format(p=p) + " To disable this error pass error_if_nonfinite=False "
            "(labkit then leaves the gradients unchanged, where torch would scale them by the "
            "non-finite norm)."
        )
    return norm


@torch.no_grad()
def grad_norm(parameters: Parameters, norm_type: float = 2.0, foreach: bool | None = None) -> Tensor:
    """Return the norm of all ``.grad`` viewed as one vector, as a 0-dim tensor.

    The norm is float32 for fp16/bf16/fp32 gradients.

    Parameters without a gradient are skipped; none at all gives ``tensor(0.)``. A NaN or
    inf gradient gives a non-finite norm. Reads only, and never syncs with the device.
    Handed tensors that are no parameters (none has a ``.grad`` and some do not require
    grad: the gradients themselves, most likely) it raises ``ValueError`` pointing to
    ``get_total_norm``. With sharded (FSDP2) gradients it is the global norm, identical on
    every rank: every rank must call it (it runs one all-reduce over the mesh).

    >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
    >>> grad_norm([w])
    tensor(5.)
    """
    p = check_norm_type(norm_type)
    parameters = named_tensors(parameters)
    grads, _ = named_grads(parameters)
    if not grads and any(not t.requires_grad for _, t in parameters):
        raise ValueError(
            "grad_norm reads the .grad of parameters, but none of these tensors has a .grad and some do not "
            "require grad: they look like the gradients themselves. Pass the parameters "
            "(model.parameters()), or call labkit.get_total_norm(tensors) for the norm of plain tensors."
        )
    norms, order = grouped_norms(grads, p, foreach)
    return total_norm(norms, p, order)


@functools.lru_cache(maxsize=64)
def constant(value: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Return a 0-dim tensor holding ``value``, made once per device and dtype; nobody may write into it.

    A Python number in an operation on a 0-dim tensor is wrapped in a new tensor at every call,
    which costs more than the operation; the step's few constants are made once instead. In
    float32 and float64 an operation rounds such a tensor's value as it rounds the number's.

    >>> constant(0.5, torch.device("cpu"), torch.float32)
    tensor(0.5000)
    """
    return torch.full((), value, dtype=dtype, device=device)


def clip_coef(norm: Tensor, max_norm: float | Tensor) -> Tensor:
    """Return ``min(1, max_norm / (norm + 1e-6))``, or exactly 1 when ``norm`` is not finite.

    ``max_norm`` is a float or a 0-dim tensor on ``norm``'s device (an adaptive clipper's
    threshold), so the coefficient never leaves the device.

    >>> clip_coef(torch.tensor(5.0), 1.0), clip_coef(torch.tensor(float("inf")), torch.tensor(1.0))
    (tensor(0.2000), tensor(1.))
    """
    eps, one = _eps_one(norm.device, norm.dtype)
    if isinstance(max_norm, Tensor):
        coef = torch.div(max_norm, norm + EPS)
        one = one if coef.dtype is norm.dtype else constant(1.0, coef.device, coef.dtype)
    elif eps is not None:  # torch's `max_norm / t` is t.reciprocal() * max_norm: the same bits
        coef = (norm + eps).reciprocal_().mul_(constant(max_norm, norm.device, norm.dtype))
    else:  # fp16/bf16 take a Python number in float32
        coef = (norm + EPS).reciprocal_().mul_(max_norm)
    # a select, not `if`: a Python branch on a device tensor forces a host sync. sqrt(norm) * 0 is 0, or NaN
    # for a NaN, infinite or negative norm (no norm is negative; torch would flip the gradients' sign), and
    # is added in the same operation (coef + 0 is coef, bit for bit); fmin(NaN, 1) is 1: those gradients
    # are left alone, and min(coef, 1) is torch's clamp
    guarded = torch.addcmul(coef, norm.sqrt(), constant(0.0, coef.device, coef.dtype))
    return torch.fmin(guarded, one)


@functools.lru_cache(maxsize=16)
def _eps_one(device: torch.device, dtype: torch.dtype) -> tuple[Tensor | None, Tensor]:
    # clip_coef's constants in one lookup: 1e-6 (None where a Python number is rounded as torch rounds
    # it: fp16/bf16) and 1 in the norm's dtype
    exact = dtype in (torch.float32, torch.float64)
    return (constant(EPS, device, dtype) if exact else None), constant(1.0, device, dtype)


def round_to(x: float, dtype: torch.dtype) -> float:
    """Return the Python float ``x`` rounded to ``dtype`` (float32 or float64), as a tensor of it would
    hold it.

    One IEEE operation on two float32 numbers done in float64 and rounded once to float32 is
    the float32 operation's own result (53 >= 2 * 24 + 2 bits): ``TrainStep`` sums its
    micro-batches' losses on the host with a float32 tensor's bits.

    >>> round_to(0.1, torch.float32), round_to(1e39, torch.float32)
    (0.10000000149011612, inf)
    """
    if dtype == torch.float64 or not math.isfinite(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # past float32's largest finite number, as the tensor's cast gives
        return math.copysign(math.inf, x)


@torch.no_grad()
def clip_grads_with_norm_(
    parameters: Parameters, max_norm: float, total_norm: Tensor, foreach: bool | None = None
) -> None:
    """Scale the gradients in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    A non-finite or negative ``total_norm`` leaves the gradients exactly as they were. ``DTensor``
    gradients are scaled shard by shard, with no collective.

    >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grads_with_norm_([w], 1.0, torch.tensor(5.0)); w.grad
    tensor([0.6000, 0.8000])
    """
    max_norm = check_max_norm(max_norm)
    if not isinstance(total_norm, Tensor):
        if isinstance(total_norm, bool) or not isinstance(total_norm, (int, float)):
            raise TypeError(f"total_norm must be a tensor or a number, got {type(total_norm).__name__}.")
        if total_norm < 0:  # a tensor is not asked (a sync): a negative one leaves the gradients alone
            raise ValueError(f"total_norm must be >= 0 (a norm), got {total_norm!r}; "
                             "pass what labkit.grad_norm returned.")
        total_norm = torch.tensor(float(total_norm))
    grads, _ = named_grads(parameters)
    if not grads:
        return
    scale_grads_(grads, clip_coef(total_norm, max_norm), foreach)


def scale_grads_(grads: list[Tensor], factor: Tensor, foreach: bool | None = None) -> None:
    """Multiply every gradient in place by the 0-dim tensor ``factor``: one read-write pass, no sync.

    ``DTensor`` gradients are scaled shard by shard (their local views), with no collective.

    >>> g = [torch.tensor([2.0, 4.0])]; scale_grads_(g, torch.tensor(0.5)); g
    [tensor([1., 2.])]
    """
    if not grads:
        return
    device = grads[0].device
    if foreach is not False and device.type in ("cpu", "cuda") and all(
            type(g) is Tensor and g.device == device for g in grads):
        # the usual case (no DTensor, one device): no grouping
        torch._foreach_mul_(grads, factor.to(device))
        return
    local = [local_tensor(g) for g in grads]  # views: scaling a shard in place scales the DTensor
    for (device, _), (group, _) in group_by_device_and_dtype(local).items():
        c = factor.to(device)
        # Multiplying by 1 costs a read and a write but no sync; torch makes the same trade.
        if (device.type in ("cpu", "cuda")) if foreach is None else foreach:
            torch._foreach_mul_(group, c)
        else:
            for g in group:
                g.mul_(c)


def first_nonfinite(grads: list[Tensor], names: list[str]) -> str | None:
    """Return the name of the first gradient holding a NaN or inf (syncs once per gradient).

    A ``DTensor`` is asked about its local shard only: no collective, so it may be called
    on one rank alone.
    """
    for g, name in zip(grads, names):
        if not bool(torch.isfinite(local_tensor(g)).all()):
            return name
    return None


@torch.no_grad()
def clip_grad_norm_(
    parameters: Parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip all gradients in place to a global norm of ``max_norm``; return the pre-clip norm.

    Same contract as ``torch.nn.utils.clip_grad_norm_``; ``parameters`` may also be
    ``model.named_parameters()`` so that errors name the parameter. A non-finite norm leaves
    the gradients untouched; with ``error_if_nonfinite=True`` it raises ``RuntimeError``
    naming the first offending parameter (this costs one host sync).

    >>> w = torch.zeros(2, requires_grad=True); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_([w], max_norm=1.0), w.grad
    (tensor(5.), tensor([0.6000, 0.8000]))
    """
    max_norm = check_max_norm(max_norm)
    p = check_norm_type(norm_type)
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = named_tensors(parameters)  # a list: a generator would be exhausted by the first half
    if is_generator and not parameters:  # torch's warning: a spent model.parameters() is a common bug
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    grads, names = named_grads(parameters)
    norms, order = grouped_norms(grads, p, foreach)
    norm = total_norm(norms, p, order)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        culprit = first_nonfinite(grads, names)
        where = (f"parameter {culprit}" if culprit is not None
                 else "the sum of the gradients (it overflowed float32)")
        if culprit is None and is_distributed():  # asked about the local shards only: no collective
            where += ", or a shard on another rank,"
        raise RuntimeError(
            NONFINITE.format(p=p) + f" It is {norm.item()}: {where} holds a non-finite value; nothing "
            "was clipped and the gradients are unchanged. Skip this step (a NaN batch is not repaired by "
            "clipping), or pass error_if_nonfinite=False."
        )
    clip_grads_with_norm_(parameters, max_norm, norm, foreach)
    return norm
