"""Where a non-finite gradient started: the order in which backward produces the gradients.

An ``inf`` that appears in backward spreads into every gradient computed from it, i.e. into
every layer between it and the input. The first parameter in *registration* order holding one
is therefore the input layer, whatever overflowed; the first in *backward* order, the one
produced nearest the loss, is where it started. ``BackwardOrder`` records that order while
backward runs (a Python hook per parameter, on the host: no kernel, no host sync), and
``labkit.step.record.forensics`` names the first non-finite gradient in it
(``StepRecord.first_nonfinite``, with the module that produced it, ``culprit_module``).

Where a gradient is placed:

- a parameter, when its gradient is complete (``register_post_accumulate_grad_hook``: FSDP2
  calls these hooks itself when it assigns a sharded gradient, where a ``Tensor.register_hook``
  on the sharded parameter would never fire);
- a parameter used by several modules (a head tied to the token embedding), at the use whose
  share made it non-finite: its gradient is complete only after the last use (the embedding, at
  the very end of backward), so its own hook would place it last. A forward hook on each module
  holding it marks when that module's output gradient arrives, right before the module's
  backward computes its share, and keeps that gradient's min and max (one reduction, on the
  device; its largest magnitude is taken from them when a record reads it). The parameter is
  placed at its first use (``lm_head``: an fp16 head's share can overflow from finite inputs,
  04's sawtooth), unless that use's output gradient was finite and a later use's was not: then
  the non-finite value came from upstream of the first use (a block in between) and reached the
  later use's share (the embedding's), so it is placed there.
  ``culprit_module`` names that module (``lm_head``, not ``wte``). An overflow of the first
  share *and* a non-finite value further down in the same step reads as the latter;
- inside a compiled region (``torch.compile``): the region is one node to autograd and hands
  all its gradients over at once, in an order that says nothing about its inside. Its
  parameters share the region's position, ties broken by the order of the step's parameters (the
  optimizer's, usually registration order).

With ``accumulation_steps > 1`` the first micro-batch's backward decides (each hook keeps its
first firing of the step). Under DDP and FSDP2 every rank runs the same backward, so every rank
records the same order; ``forensics`` agrees on the culprit with one all-reduce on skipped steps
(two when a tied parameter is among the non-finite: its uses' output gradients are each rank's own).

Cost: per parameter per backward, autograd calls a hook that appends it to a list (no Python
frame); per tied use per forward, one Python call and one reduction over that use's output
gradient. The ranks are worked out from the list only when a record asks (a non-finite step).

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
>>> order = BackwardOrder(); order.attach(model); order.pre_step(None, 0)
>>> model(torch.ones(4, 2)).sum().backward()
>>> sorted(order.positions, key=lambda n: order.positions[n][0])
['2.bias', '2.weight', '0.bias', '0.weight']
>>> order.positions["2.weight"][1]
'2'
"""

from __future__ import annotations

import collections
import operator
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .distributed import all_reduce_, is_distributed
from .hooks import GradientOrder, Hook
from .names import module_of
from .records import Field

__all__ = ["BackwardOrder", "placed"]


def _weak(method: Any) -> Any:
    """Return a function that calls the bound ``method`` while its object lives, and does nothing after.

    The hooks live on the model, which outlives a ``TrainStep``: held strongly, each dropped
    step's ``BackwardOrder`` would keep firing (and keep its hooks) on every later backward.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _compiled(module: nn.Module) -> bool:
    # torch.compile(model) wraps it (the original is ``_orig_mod``); model.compile() compiles in place
    return isinstance(getattr(module, "_orig_mod", None), nn.Module) or \
        getattr(module, "_compiled_call_impl", None) is not None


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# What fired in one backward is kept up to this many entries (a plain loop that never calls pre_step
# keeps the latest ones, not an ever longer list)
FIRED_MAX = 1 << 16


def _groups(trainer: Any) -> Sequence[Any]:
    return getattr(getattr(trainer, "optimizer", None), "param_groups", ())


class _Trace:
    """One step's backward order, worked out from what fired the first time it is read (a skipped step's)."""

    __slots__ = ("_fired", "_names", "_regions", "_raw_uses", "_done")

    def __init__(self, fired: list[Any], names: Mapping[int, tuple[str, str]], regions: Mapping[str, str],
                 raw_uses: dict[str, dict[str, list[Any]]]) -> None:
        self._fired, self._names, self._regions, self._raw_uses = fired, names, regions, raw_uses
        self._done: tuple[dict, dict] | None = None

    def get(self) -> tuple[dict[str, tuple[int, str]], dict[str, dict[str, list[Any]]]]:
        if self._done is None:
            positions: dict[str, tuple[int, str]] = {}
            region_rank: dict[str, int] = {}
            ranks = []  # how many gradients were placed before each entry
            for item in self._fired:
                ranks.append(len(positions))
                name, module = item if type(item) is tuple else self._names[id(item)]
                if name in positions:  # a later micro-batch, or a tied parameter's last use
                    continue
                region = self._regions.get(name)
                # a compiled region is one node to autograd: its gradients arrive together, ranked as one
                positions[name] = (len(positions) if region is None else
                                   region_rank.setdefault(region, len(positions)), module)
            ranks.append(len(positions))
            uses = {name: {path: [ranks[i], _largest(extremes)] for path, (i, extremes) in seen.items()}
                    for name, seen in self._raw_uses.items()}
            self._done = positions, uses
        return self._done


def _largest(extremes: list[Any]) -> Tensor:
    """Return the largest |value| of a use's output gradients from their ``(min, max)`` per micro-batch.

    A NaN or an inf in any of them is in the result (on the device: read only when a record asks).
    """
    return torch.stack([t for lo, hi in extremes for t in (lo.neg(), hi)]).amax()


class _View(Mapping):
    """``positions`` or ``uses`` of one step, worked out when first read."""

    __slots__ = ("_trace", "_which")

    def __init__(self, trace: _Trace, which: int) -> None:
        self._trace, self._which = trace, which

    def _dict(self) -> dict:
        return self._trace.get()[self._which]

    def __getitem__(self, key: str) -> Any:
        return self._dict()[key]

    def __iter__(self) -> Any:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __repr__(self) -> str:
        return repr(self._dict())


class BackwardOrder(Hook):
    """Record, per step, where each gradient came in backward: ``positions[name] = (rank, module)``.

    ``rank`` orders the gradients from the loss (0) towards the input; ``module`` is the path
    of the module that produced the gradient (for a tied parameter, its first use in backward;
    ``uses[name]`` maps each module using it to ``[rank, largest |output gradient|]``, from which
    ``placed`` moves it to a later use). A parameter that got no gradient this step is missing.
    ``TrainStep`` has one among its default hooks (``labkit.step.parts.default_hooks``) and
    keeps its ``gradient_order`` with each record; in a plain loop call ``attach(model)`` once
    and ``pre_step(None, step)`` before each forward, then pass ``positions`` and ``uses`` to
    ``forensics`` (after unfreezing parameters there, call ``attach`` again: a frozen parameter
    takes no hook).
    ``positions`` and ``uses`` are read-only mappings of the last backward, worked out when first
    read: each parameter's hook only appends it to a list (no Python frame of its own).
    """

    # on a skipped or clipped step (``labkit.step.record.forensics``): the top 3 (name, norm), the first
    # gradient in backward order (nearest the loss) holding NaN/inf, and the module that produced it
    record_fields = {"top_grads": Field([]), "first_nonfinite": Field(None), "culprit_module": Field(None)}

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        # what fired this step, in order: a parameter (its hook appends it) or (name, module) (a tied use)
        self._fired: collections.deque[Any] = collections.deque(maxlen=FIRED_MAX)
        # tied parameter -> module -> [entry, [(min, max) of the output gradient per micro-batch]]
        self._raw_uses: dict[str, dict[str, list[Any]]] = {}
        self._trace: _Trace | None = None  # this step's, once read
        self._handles: list[Any] = []
        weakref.finalize(self, _remove, self._handles)  # a dropped BackwardOrder unhooks the model
        self._hooked: dict[int, tuple[str, str]] = {}  # id(parameter) -> (name, module)
        self._regions: dict[str, str] = {}  # parameter -> the compiled region it is in
        self._groups = 0  # the optimizer's parameter groups at the last hooking
        self._frozen: list[Tensor] = []  # the model's parameters that took no hook then (requires_grad off)

    @property
    def positions(self) -> Mapping[str, tuple[int, str]]:
        """``{name: (rank, module)}`` of the last backward (a later step's leaves it as it was)."""
        return _View(self._current(), 0)

    @property
    def uses(self) -> Mapping[str, Mapping[str, list[Any]]]:
        """``{tied parameter: {module: [rank, largest |output gradient|]}}`` of the last backward."""
        return _View(self._current(), 1)

    def _current(self) -> _Trace:
        trace = self._trace
        if trace is None or len(trace._fired) != len(self._fired):  # read again after more fired
            trace = self._trace = _Trace(list(self._fired), self._hooked, self._regions, self._raw_uses)
        return trace

    def attach(self, trainer: Any) -> None:
        """Hook ``trainer.model`` (or ``trainer`` itself, a module); attaching again unhooks the old one."""
        model = trainer if isinstance(trainer, nn.Module) else trainer.model
        self.detach()
        self.model = model
        regions = [path for path, m in model.named_modules() if _compiled(m)]
        named = list(model.named_parameters())
        self._regions = {}
        for name, _ in named:
            inside = [r for r in regions if r == "" or name.startswith(r + ".")]
            if inside:
                self._regions[name] = min(inside, key=len)  # the outermost region
        self._hook_params(trainer, named)
        # a parameter held by several modules: place it at its first use's contribution
        first_name = {id(p): n for n, p in named}
        owners: dict[int, list[str]] = {}
        for path, m in model.named_modules():
            for _, p in m.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append(path)
        for path, m in model.named_modules():
            tied = [first_name[id(p)] for _, p in m.named_parameters(recurse=False)
                    if len(owners.get(id(p), ())) > 1 and id(p) in first_name]
            if tied and not any(n in self._regions for n in tied):  # no hooks inside a compiled graph
                self._handles.append(m.register_forward_hook(
                    lambda mod, args, out, names=tuple(tied), path=path, used=_weak(self._used):  # noqa: B008
                    used(names, path, out)))

    def detach(self) -> None:
        """Remove every hook (the records fall back to registration order)."""
        _remove(self._handles)  # the same list: the finalizer holds it
        self._hooked = {}
        self._start()

    def _start(self) -> None:
        # a new list and dict: the last step's trace keeps its own
        self._fired.clear()
        self._raw_uses, self._trace = {}, None

    def pre_step(self, trainer: Any, step: int) -> None:
        """Start a new step's order (the last step's ``positions`` are left as they were, for its record)."""
        self._start()
        # progressive unfreezing (a frozen parameter unfrozen in place, a group added): hook what trains now.
        # A model trained whole has nothing frozen: the check is one length, read every step
        if trainer is not None and self.model is not None and (
                len(_groups(trainer)) != self._groups or any(map(_REQUIRES_GRAD, self._frozen))):
            self._hook_params(trainer, self.model.named_parameters())

    def __repr__(self) -> str:
        return "BackwardOrder()"

    def gradient_order(self, trainer: Any, step: int) -> GradientOrder:
        """Return this step's ``(positions, uses)`` (the next ``pre_step`` starts new ones: these stay)."""
        trace = self._current()
        return _View(trace, 0), _View(trace, 1)

    def _hook_params(self, trainer: Any, named: Iterable[tuple[str, Tensor]]) -> None:
        frozen = []
        for name, p in named:
            self._hook_param(name, p)
            if id(p) not in self._hooked:
                frozen.append(p)
        self._frozen, self._groups = frozen, len(_groups(trainer))

    def _hook_param(self, name: str, p: Tensor) -> None:
        if id(p) in self._hooked or not p.requires_grad:
            return
        self._hooked[id(p)] = (name, module_of(name))
        # the deque's own append: no Python frame per gradient, and no reference to this object (the hook
        # lives on the model, which outlives a TrainStep; the finalizer above removes it)
        self._handles.append(p.register_post_accumulate_grad_hook(self._fired.append))

    def _used(self, names: Sequence[str], path: str, out: Any) -> None:
        if isinstance(out, Tensor) and out.requires_grad:
            # on the node, not the tensor: a node's pre-hook sees the gradient after every tensor hook
            # (another hook's change of it is what this module's backward multiplies)
            node = out.grad_fn
            if node is None:
                out.register_hook(lambda g: self._use(names, path, g))
            else:
                # the output's index, not the output: a hook holding it would keep the graph's node and
                # the tensor alive through each other, a cycle through C++ that no gc collects
                nr = out.output_nr
                node.register_prehook(lambda grads: self._use(names, path, grads[nr]))

    def _use(self, names: Sequence[str], path: str, g: Tensor) -> None:
        # NaN/inf in the gradient reaching this use's output is in its share of the weight too; its min and
        # max hold them (one plain reduction on the device, where the inf-norm takes the norm's generic
        # path; the largest |value| is taken only when a record reads it: a skipped step)
        extremes = torch.aminmax(g.detach())
        for name in names:
            seen = self._raw_uses.setdefault(name, {})
            if path in seen:  # a later micro-batch: the order stays the first's, a NaN anywhere counts
                seen[path][1].append(extremes)
            else:
                seen[path] = [len(self._fired), [extremes]]  # its entry: the trace turns it into a rank
            self._fired.append((name, path))


def placed(positions: Mapping[str, tuple[int, str]], uses: Mapping[str, Mapping[str, list[Any]]],
           names: Sequence[str], group: Any = None) -> dict[str, tuple[int, str]]:
    """Return ``positions`` with each tied parameter of ``names`` placed at the use that made it non-finite.

    At its first use, unless that use's output gradient was finite and a later use's was not
    (see the module docstring). Reads the uses' flags in one host read (call it on a skipped
    step only); under ``torch.distributed`` the flags are all-reduced over ``group`` first
    (each rank's activations are its own), so every rank places it alike.

    >>> import torch
    >>> positions = {"wte.weight": (0, "lm_head"), "h.1.w": (3, "h.1")}
    >>> uses = {"wte.weight": {"lm_head": [0, torch.tensor(1.0)], "wte": [9, torch.tensor(float("nan"))]}}
    >>> placed(positions, uses, ["wte.weight", "h.1.w"])["wte.weight"]
    (9, 'wte')
    """
    tied = [n for n in names if len(uses.get(n, ())) > 1]
    if not tied:
        return dict(positions)
    rows = [sorted(uses[n].items(), key=lambda kv: kv[1][0]) for n in tied]
    amaxes = [amax for row in rows for _, (_, amax) in row]
    device = amaxes[0].device
    bad = torch.stack([~torch.isfinite(a.to(device)) for a in amaxes]).float()
    if is_distributed():
        bad = all_reduce_(bad, "sum", group)
    flags = iter(bad.tolist())  # host sync: on a skipped step, and only with a tied parameter non-finite
    out = dict(positions)
    for name, row in zip(tied, rows):
        seen = [(rank, path, next(flags) > 0) for path, (rank, _) in row]
        if not seen[0][2]:  # the first use's share came from finite gradients
            later = next(((rank, path) for rank, path, nonfinite in seen[1:] if nonfinite), None)
            if later is not None:
                out[name] = later
    return out
