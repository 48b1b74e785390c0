"""The shape of the code, read with ``ast``: no import cycle in labkit, a step package of small parts
that never reach back into ``TrainStep``, and an AMP order short enough to read at a glance."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

LABKIT = Path(__file__).resolve().parents[1] / "labkit"
STEP = LABKIT / "step"


def module_name(path: Path) -> str:
    parts = path.relative_to(LABKIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in LABKIT.rglob("*.py")}


def imports_of(source: str, name: str, package: str) -> set[str]:
    """The labkit modules ``source`` (module ``name`` in ``package``) imports anywhere: module level,
    ``if TYPE_CHECKING``, and inside functions too (a lazy import still ties the two modules: a cycle
    closed in a function is a cycle). ``from package import name`` counts the submodule if ``name`` is one."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("labkit"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("labkit"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    return {m for m in found if m in MODULES and m != name}


def imports(path: Path) -> set[str]:
    name = module_name(path)
    return imports_of(path.read_text(), name, name if path.name == "__init__.py" else name.rpartition(".")[0])


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_no_import_cycle_in_labkit():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            walk(node)


def test_the_cycle_finder_finds_a_cycle():
    GRAPH["labkit.hooks"].add("labkit.step.train")  # as if the protocol reached back into the step
    try:
        with pytest.raises(pytest.fail.Exception, match="import cycle: .*labkit.step.train"):
            test_no_import_cycle_in_labkit()
    finally:
        GRAPH["labkit.hooks"].discard("labkit.step.train")


def test_a_cycle_closed_inside_a_function_is_seen():
    """A lazy import (in a function body) is an edge: hidden there, a cycle still fails the test."""
    hidden = "def later():\n    from .step import train\n    return train\n"
    edges = imports_of(hidden, "labkit.hooks", "labkit")
    assert "labkit.step.train" in edges
    saved = set(GRAPH["labkit.hooks"])
    GRAPH["labkit.hooks"] |= edges
    try:
        with pytest.raises(pytest.fail.Exception, match=r"import cycle: labkit\.hooks -> labkit\.step"):
            test_no_import_cycle_in_labkit()
    finally:
        GRAPH["labkit.hooks"] = saved


def test_the_parts_never_import_the_step_and_the_step_imports_no_defense():
    parts = [name for name in GRAPH if name.startswith("labkit.step.") and name != "labkit.step.train"]
    assert sorted(parts) == [f"labkit.step.{p}" for p in ("batch", "decision", "parts", "record")]
    for name in parts:
        assert "labkit.step.train" not in GRAPH[name] and "labkit.step" not in GRAPH[name], name
    defenses = {"labkit.spikes", "labkit.rewind", "labkit.formats.bf16", "labkit.formats.fp8"}
    for name in [*parts, "labkit.step.train", "labkit.step", "labkit.hooks"]:
        assert not GRAPH[name] & defenses, (name, GRAPH[name] & defenses)
    assert "labkit.step" not in GRAPH["labkit.rewind"] and "labkit.rewind" not in GRAPH["labkit.step.train"]


@pytest.mark.parametrize("path", sorted(STEP.glob("*.py")), ids=lambda p: p.name)
def test_step_modules_are_small(path):
    assert len(path.read_text().splitlines()) <= 400, f"{path.name} has grown past 400 lines: split it"


def _method(path: Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_amp_order_reads_at_a_glance():
    call = _method(STEP / "train.py", "TrainStep", "__call__")
    assert call.end_lineno - call.lineno + 1 <= 40, "TrainStep.__call__ must stay short enough to read"
    # and it names the order's stages, in order
    source = ast.get_source_segment((STEP / "train.py").read_text(), call)
    stages = ["_forward_backward", "post_backward", "_decide", "_step_or_skip", "_update_scale", "_finish"]
    positions = [source.index(s) for s in stages]
    assert positions == sorted(positions)


def test_the_step_never_asks_a_clipper_its_type():
    """One clipper interface: no isinstance/type checks against clipper classes anywhere in the step."""
    clippers = {"Clipper", "GlobalClipper", "NormClip", "ZClip", "AutoClip", "AdaGC", "AGC", "ValueClip",
                "UpdateNormClip"}
    for path in STEP.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not named & clippers - {"Clipper"}, f"{path.name}:{node.lineno} asks a clipper's type"
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                assert not named & clippers, f"{path.name}:{node.lineno} compares a clipper's type"


# torch's own registries of a module, which torch's named_modules, DDP and FSDP read: a walk over them is
# what a step can afford per call (Buffers), and they are torch's, not another labkit part's
TORCH_MODULE_DICTS = ("_buffers", "_modules", "_parameters")


def private_reaches(source: str) -> list[str]:
    """``owner._name`` where the owner is another object (``self.scaler._x``, ``clipper._to``); torch's
    own names (``torch._foreach_norm``, ``torch.autograd._profiler_enabled``, a module's ``_buffers``)
    are torch's to keep."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner, root = node.value, node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if (isinstance(root, ast.Name) and root.id == "torch") or node.attr in TORCH_MODULE_DICTS:
                continue
            found.append(f"{ast.unparse(owner)}.{node.attr} (line {node.lineno})")
    return found


def test_no_part_reaches_into_anothers_privates():
    """The step's parts and the hooks use the public names of the objects they are given."""
    assert sorted(private_reaches("self.scaler._abandon_iteration()\nclipper._to(d)\nself._log.append(r)\n"
                                  "torch.autograd._profiler_enabled()\nm._buffers\nself.hooks._at")) == [
        "clipper._to (line 2)", "self.hooks._at (line 6)", "self.scaler._abandon_iteration (line 1)"]
    for path in [*STEP.glob("*.py"), LABKIT / "hooks.py", LABKIT / "rewind.py", LABKIT / "spikes.py"]:
        assert private_reaches(path.read_text()) == [], path.name


def test_the_step_never_knows_a_hook_by_type_or_state_key():
    """The alarms, blame, faults and triage are ordinary hooks: the step names none of them, builds none,
    and reads no hook's state by its key (the defaults are parts.default_hooks')."""
    hooks = {"BackwardOrder", "SkipAlarm", "ClipAlarm", "Triage", "Faults", "FaultSchedule", "Rewind",
             "SpikeDetector", "StaleMonitor", "UpdateMonitor"}
    keys = {"skip_alarm", "clip_alarm", "spike_detector", "rewind", "stale_monitor"}
    tree = ast.parse((STEP / "train.py").read_text())
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not named & hooks, named & hooks
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & keys, strings & keys
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "state_key"]


def test_the_steps_constructor_takes_few_parameters():
    init = _method(STEP / "train.py", "TrainStep", "__init__")
    params = [a.arg for a in init.args.args + init.args.kwonlyargs if a.arg != "self"]
    assert params == ["model", "optimizer", "loss_fn", "precision", "max_norm", "clipper", "scaler",
                      "scheduler", "accumulation_steps", "hooks", "log", "process_group", "sync_every"]
    assert init.args.kwarg.arg == "removed"  # to say what a removed keyword became (parts.refuse_removed)


def private_imports(source: str) -> list[str]:
    """``from module import _name``: a private name taken from another module (the name, not its alias)."""
    return [f"{a.name} (line {node.lineno})" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")]


def test_no_module_takes_a_private_name_from_another():
    """A helper that another module uses is public where it lives (``sweep.analysis.peak``,
    ``grading.checks.core.call_student``), documented and in its ``__all__``."""
    source = "from .a import b, _c\nfrom x import _d as d\nfrom __future__ import annotations\n"
    assert private_imports(source) == ["_c (line 1)", "_d (line 2)"]
    found = {str(path.relative_to(LABKIT)): private_imports(path.read_text())
             for path in sorted(LABKIT.rglob("*.py"))}
    assert {path: names for path, names in found.items() if names} == {}


@pytest.mark.parametrize("package, order", [
    ("labkit.lab.sweep", ["recipe", "analysis", "store", "runner", "plots", "panel", "cli"]),
    ("labkit.lab.gradients", ["ranges", "probe", "histogram", "plots"]),
], ids=["sweep", "gradients"])
def test_a_package_split_by_job_imports_only_down_the_order_its_docstring_gives(package, order):
    """Each module imports only the modules before it, never its package's face (which imports them all)."""
    assert sorted(m for m in GRAPH if m.startswith(package + ".")) == sorted(f"{package}.{m}" for m in order)
    said = ast.get_docstring(ast.parse(MODULES[package].read_text())).split("One module per job")[1]
    assert [m for m in re.findall(r"``(\w+)``", said) if m in order] == order  # the order the docstring gives
    for i, name in enumerate(order):
        inside = {m for m in GRAPH[f"{package}.{name}"] if m == package or m.startswith(package + ".")}
        assert inside <= {f"{package}.{m}" for m in order[:i]}, (name, inside)


GRADING = LABKIT / "grading"
SETS = sorted(p.parent for p in (GRADING / "checks").glob("*/__init__.py"))


def parts_of(package: Path) -> list[str]:
    """The modules of a problem set's package that define a part's ``CHECK``; the others are shared."""
    def defines_check(path: Path) -> bool:
        return any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "CHECK" for t in n.targets)
                   for n in ast.parse(path.read_text()).body)
    modules = [p for p in package.glob("*.py") if p.name != "__init__.py"]
    return sorted(module_name(p) for p in modules if defines_check(p))


@pytest.mark.parametrize("package", SETS, ids=lambda p: p.name)
def test_a_problem_sets_parts_stand_alone(package):
    """One module per part: a part imports the set's shared modules (bans, cases), never another part
    or the set's face (which imports every part)."""
    face, parts = module_name(package / "__init__.py"), parts_of(package)
    assert len(parts) >= 2 and all(m.startswith(face + ".") for m in parts), parts
    for part in parts:
        assert not GRAPH[part] & {face, *parts}, (part, GRAPH[part] & {face, *parts})


@pytest.mark.parametrize("path", sorted((GRADING / "checks").rglob("*.py")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_grading_check_modules_are_small(path):
    assert len(path.read_text().splitlines()) <= 400, f"{path.name} has grown past 400 lines: split it"
