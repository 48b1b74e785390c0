"""What one step did: ``StepRecord`` (an immutable core plus the fields hooks measured) and ``RewindEvent``.

The core is what every guarded step has, whatever joined it: the numbers of the AMP order
(loss, norm, clip coefficient, scale before and after, skip and its reason) and the learning
rates. Everything else a hook measures (spike scores, blame, staleness, a GPT's logits...) is
a *field*: the hook declares it (``Hook.record_fields``, or ``declare``), and the step writes
it through ``put``, the one function that checks and sets a field. A record is written as one
flat line of strict JSON, core and fields side by side, so a log from an older labkit (every
field on every line) reads as it always did.

This module imports nothing of labkit: the hooks, the log and the writer import it.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

__all__ = ["CORE", "Field", "RewindEvent", "StepRecord", "declare", "declared", "parse_line", "put",
           "read_line"]

# Strict JSON has no NaN/Infinity (JavaScript's JSON.parse rejects Python's bare NaN): non-finite
# floats are written as these strings, and read back from them or from the bare tokens.
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

# What every step has. ``clipped`` and ``lrs`` are in it because every run has a clip stage's
# outcome (off is "not clipped") and an optimizer's param groups (``lr`` is group 0's).
CORE = ("step", "loss", "grad_norm", "clip_coef", "clipped", "scale", "next_scale", "skipped", "reason", "lr",
        "lrs")


def _to_json(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, (list, tuple)):
        return [_to_json(v) for v in x]
    if isinstance(x, dict):  # a float key is written as its text, a non-finite one as "Infinity"...
        return {(_to_json(k) if isinstance(k, float) else k): _to_json(v) for k, v in x.items()}
    return x


def _from_json(x: Any, pairs: bool = True) -> Any:
    """Decode the non-finite strings in a value, at any depth (not dict keys); with ``pairs``, a list of
    ``[name, value]`` comes back as a list of tuples (JSON has none: ``top_grads`` is written so)."""
    if isinstance(x, str):
        return NONFINITE.get(x, x)
    if isinstance(x, dict):
        return {k: _from_json(v, pairs) for k, v in x.items()}
    if isinstance(x, list):
        items = [_from_json(v, pairs) for v in x]
        if pairs and x and all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) for v in x):
            return [tuple(v) for v in items]
        return items
    return x


def parse_line(line: str) -> dict[str, Any]:
    """Return one JSONL line as a dict, its non-finite numbers (``"NaN"`` or bare ``NaN``) as floats.

    Fields this labkit does not know are kept as they are.

    >>> parse_line('{"step": 3, "loss": "NaN", "lrs": ["Infinity"], "fault": "nan"}')
    {'step': 3, 'loss': nan, 'lrs': [inf], 'fault': 'nan'}
    """
    return {k: (v if k == "reason" else _from_json(v, pairs=False)) for k, v in json.loads(line).items()}


class Field(NamedTuple):
    """A hook's record field: what it reads as when the hook did not set it, and whether it is per layer.

    A per-layer field is a dict ``{layer: number}``; a hook sets one entry as ``"name/layer"``.
    """

    default: Any = None
    per_layer: bool = False


_DECLARED: dict[str, tuple[Field, str]] = {}  # name -> (field, who declared it)


def declare(owner: str, fields: Mapping[str, Field]) -> None:
    """Declare the record fields ``owner`` (a hook, a clipper...) sets; declaring the same again is harmless.

    >>> declare("Doctest", {"doctest_hits": Field(0)}); StepRecord(0, 1.0).doctest_hits
    0
    """
    for name, f in fields.items():
        if name in CORE or "/" in name or not name.isidentifier():
            raise ValueError(f"{owner} declares the record field {name!r}: a field is a Python name, not one "
                             f"of the core's ({', '.join(CORE)}) and without '/'.")
        if not isinstance(f, Field):
            raise TypeError(f"{owner} declares {name!r} as {f!r}: give labkit.records.Field(default).")
        known = _DECLARED.get(name)
        if known is not None and known[0] != f and not (_is_nan(known[0].default) and _is_nan(f.default)):
            raise ValueError(f"{owner} declares the record field {name!r}, which {known[1]} declares "
                             f"otherwise ({known[0]}): give it another name.")
        _DECLARED.setdefault(name, (f, owner))


def declared() -> dict[str, Field]:
    """Return every field declared so far (by the modules imported): ``{name: Field}``."""
    return {name: f for name, (f, _) in _DECLARED.items()}


def _is_nan(x: Any) -> bool:
    return isinstance(x, float) and math.isnan(x)


def put(fields: MutableMapping[str, Any], name: str, value: Any) -> None:
    """Set a declared field in a record's ``fields``: ``name``, or ``name/key`` (an entry of a per-layer one).

    The one check of a hook's field: a name nobody declared, or ``/key`` on a field that is not
    per layer, raises before anything is set.

    >>> declare("Doctest", {"doctest_layers": Field({}, per_layer=True)})
    >>> r = StepRecord(0, 1.0); put(r.fields, "doctest_layers/h.0", 4.5); r.doctest_layers
    {'h.0': 4.5}
    >>> put(r.fields, "loss/h.0", 1.0)
    Traceback (most recent call last):
    ...
    ValueError: a hook set the record field 'loss/h.0': 'loss' is the core's, not a per-layer field; declare \
the hook's fields (Hook.record_fields, or labkit.records.declare) and set one of them, or 'field/key' of a \
per-layer one.
    """
    base, slash, key = name.partition("/")
    known = _DECLARED.get(base)
    if known is None or (slash and not known[0].per_layer):
        what = "the core's" if base in CORE else "declared by no hook" if known is None else "not per layer"
        raise ValueError(f"a hook set the record field {name!r}: {base!r} is {what}"
                         f"{', not a per-layer field' if slash and base in CORE else ''}; declare the hook's "
                         "fields (Hook.record_fields, or labkit.records.declare) and set one of them, or "
                         "'field/key' of a per-layer one.")
    if slash:
        fields.setdefault(base, {})[key] = value
    else:
        fields[base] = value


class StepRecord:
    """One training step, as ``TrainStep`` saw it; every number is a plain Python value.

    ``grad_norm`` is the unclipped norm of the unscaled gradients (NaN when backward was
    skipped); ``scale`` is the loss scale used for this step, ``next_scale`` the one after.
    The core (``CORE``) cannot be changed once built. ``fields`` holds what hooks measured
    (keywords beyond the core go there too); each reads as an attribute, ``record.z_loss``,
    and a declared field a hook did not set reads as its default. ``get(name, default)``
    reads a field without needing its hook imported (a log read back in another process).

    >>> r = StepRecord(step=0, loss=0.5, z_loss=1.5); r.post_clip_norm, r.z_loss, r.get("culprit_module")
    (nan, 1.5, None)
    """

    __slots__ = (*CORE, "fields")

    def __init__(self, step: int, loss: float, grad_norm: float = math.nan, clip_coef: float = 1.0,
                 clipped: bool = False, scale: float = 1.0, next_scale: float = 1.0, skipped: bool = False,
                 reason: str | None = None, *, lr: float = math.nan,
                 lrs: list[float] | tuple[float, ...] = (), fields: Mapping[str, Any] | None = None,
                 **more: Any) -> None:
        # the core's one write, by the slots' own setters (__setattr__ refuses every later one): a record is
        # built every step, and a call of object.__setattr__ per field costs more than the setter itself
        values = (step, loss, grad_norm, clip_coef, clipped, scale, next_scale, skipped, reason, lr,
                  list(lrs), {**fields, **more} if fields else more)
        for set_, value in zip(_SETTERS, values):
            set_(self, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a StepRecord is not changed once built (record.{name} = ...): build it with "
                             "every core number, and let a hook set its fields with labkit.records.put("
                             "record.fields, name, value) before the record is logged.")

    def __getattr__(self, name: str) -> Any:  # only for what is no slot: a field
        if name.startswith("__") or name == "fields":
            raise AttributeError(name)
        fields = self.fields
        if name in fields:
            return fields[name]
        known = _DECLARED.get(name)
        if known is not None:
            return copy.copy(known[0].default)  # a fresh {} or []: no shared mutable default
        if name in _LEGACY:
            raise AttributeError(f"record.{name}: a rewind is an event in the log now, not a mark on "
                                 "records: read log.rewound (a flag per record), log.rewound_steps, "
                                 "log.kept() or log.rewinds (RewindEvent: step, to, reason, data_from, "
                                 "data_to).")
        raise AttributeError(f"StepRecord has no field {name!r}: it holds {sorted(fields)}, the core "
                             f"{list(CORE)} and the fields declared by the hooks imported "
                             f"({sorted(_DECLARED)}); record.get({name!r}) reads None for a field never set.")

    def get(self, name: str, default: Any = None) -> Any:
        """Return the core number or field ``name`` if the record holds it, else ``default``."""
        return getattr(self, name) if name in CORE else self.fields.get(name, default)

    @property
    def post_clip_norm(self) -> float:
        """The norm the optimizer stepped with (NaN on a skipped step)."""
        return math.nan if self.skipped else self.grad_norm * self.clip_coef

    def to_dict(self) -> dict[str, Any]:
        """Return the core and the fields as one flat dict (a copy)."""
        return copy.deepcopy({**{name: getattr(self, name) for name in CORE}, **self.fields})

    def to_json(self) -> str:
        """Return one line of strict JSON (non-finite numbers as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``).

        >>> StepRecord(0, math.nan).to_json()[:29]
        '{"step": 0, "loss": "NaN", "g'
        """
        flat = {**{name: getattr(self, name) for name in CORE}, **self.fields}
        return json.dumps(_to_json(flat), allow_nan=False)  # _to_json copies: no deepcopy needed

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepRecord:
        """Build a record from ``to_dict()`` or from a parsed ``to_json()`` line (either form of NaN).

        Keys beyond the core are fields, kept whatever labkit wrote them (an older one wrote every
        field on every line; a newer one may know more). ``rewound``/``rewind_to`` of an older
        labkit are left out: ``read_line`` turns them into a ``RewindEvent``. A record without
        ``step`` and ``loss`` is refused.

        >>> StepRecord.from_dict({"step": 1, "loss": "NaN", "from_the_future": 3}).from_the_future
        3
        """
        d = {k: (v if k == "reason" else _from_json(v)) for k, v in d.items() if k not in _LEGACY}
        core = {k: d.pop(k) for k in CORE if k in d}
        if "step" not in core or "loss" not in core:
            raise TypeError(f"a StepRecord needs 'step' and 'loss', got the keys {sorted(core) + sorted(d)}.")
        return cls(**core, fields=d)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepRecord):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    # copy and pickle: the core cannot be set one attribute at a time
    def __reduce__(self) -> tuple[Any, ...]:
        return (StepRecord.from_dict, (self.to_dict(),))

    def __repr__(self) -> str:
        core = ", ".join(f"{name}={getattr(self, name)!r}" for name in CORE)
        return f"StepRecord({core}, fields={self.fields!r})"


_SETTERS = tuple(getattr(StepRecord, name).__set__ for name in (*CORE, "fields"))  # in __init__'s order
_LEGACY = frozenset({"rewound", "rewind_to"})  # an older labkit's rewind marks: a RewindEvent now


@dataclass(frozen=True)
class RewindEvent:
    """A rewind, as the log keeps it: appended after the record that triggered it, never editing a record.

    The records it undid are those appended before it whose step is ``to`` or later: the run
    returned to its snapshot of step ``to`` from ``step`` (whose record says why, ``reason``),
    and the batches of data indices ``data_from <= i < data_to`` are never fed again.

    >>> e = RewindEvent(step=12, to=9, reason="spike_grad", data_from=9, data_to=15); e.undone
    range(9, 13)
    >>> read_line(e.to_json()) == [e]
    True
    """

    step: int
    to: int
    reason: str | None = None
    data_from: int | None = None
    data_to: int | None = None

    @property
    def undone(self) -> range:
        """The step numbers whose records it undid (one branch; earlier branches' records may share them)."""
        return range(self.to, self.step + 1)

    def to_json(self) -> str:
        return json.dumps({"event": "rewind", **asdict(self)})


def read_line(line: str) -> list[StepRecord | RewindEvent]:
    """Read one JSONL line: a record, an event, or (an older labkit's trigger) a record and its event.

    >>> [type(x).__name__ for x in read_line('{"step": 4, "loss": 1.0, "rewound": true, "rewind_to": 2}')]
    ['StepRecord', 'RewindEvent']
    """
    d = json.loads(line)
    if not isinstance(d, dict):
        raise TypeError(f"a JSONL line of a log is an object, got {type(d).__name__}.")
    if "event" in d:
        kind = d.pop("event")
        if kind != "rewind":
            raise ValueError(f"unknown event {kind!r}")
        return [RewindEvent(**d)]
    record = StepRecord.from_dict(d)
    if d.get("rewind_to") is not None:  # an older labkit marked the trigger itself
        return [record, RewindEvent(record.step, int(d["rewind_to"]), record.reason)]
    return [record]

