"""Read a submission's code without running it: what would reach the grader, and banned calls.

The grader runs this in its own process, before the sandbox: a submission that reaches into
the interpreter (``sys.modules``, ``builtins``, frames, ``gc``, ``importlib``...) could rewrite
the harness that ships its results, so it is reported as tampering and not run; a call into
the library function a part asks the student to write loses that part, whatever the kernel did.

>>> tampering("import labkit.grading as G\\nG.check_grad_norm = lambda *a, **k: None")
['line 1: imports labkit.grading (the grader)']
>>> banned_calls("norm = labkit.clip.grad_norm(ps)", ("labkit.grad_norm",))
['line 1: labkit.clip.grad_norm']
"""

from __future__ import annotations

import ast
import re

__all__ = ["banned_calls", "explain", "python_source", "tampering"]

# modules that reach the interpreter, the process or the file system: nothing a norm or a step needs
MODULES = {
    "sys": "the interpreter", "os": "the process", "posix": "the process", "builtins": "the builtins",
    "importlib": "the import system", "gc": "every live object", "inspect": "frames and sources",
    "ctypes": "raw memory", "signal": "the grader's timers", "subprocess": "other processes",
    "multiprocessing": "other processes", "threading": "threads", "_thread": "threads",
    "socket": "the network", "IPython": "the shell", "ipykernel": "the kernel", "pickle": "arbitrary objects",
    "marshal": "code objects", "types": "code and frame types", "runpy": "the import system",
    "code": "the interpreter", "atexit": "the exit", "faulthandler": "the process", "resource": "the limits",
    "io": "files", "pathlib": "files", "shutil": "files", "tempfile": "files", "glob": "files",
    "sysconfig": "the install", "site": "the import system", "dis": "code objects", "weakref": "live objects",
    "operator": "attributes by name", "copyreg": "arbitrary objects", "shelve": "arbitrary objects",
}
# each banned name, and what it reaches: what a student is told (a visible test names it, issue 32 point 23)
NAMES = {
    "exec": "runs code built at run time, which no reading can check",
    "eval": "runs code built at run time, which no reading can check",
    "compile": "builds code at run time, which no reading can check",
    "__import__": "imports a module named at run time",
    "open": "reads and writes files, the grader's included",
    "globals": "reaches every global of a module by name",
    "locals": "reaches a frame's variables by name",
    "vars": "reaches an object's or a module's insides by name",
    "breakpoint": "stops the process in a debugger",
    "get_ipython": "reaches the shell that runs every cell (magics and ! run code unread)",
    "getattr": "reads an attribute named by a string: no reading can tell which, the grader's own included",
    "setattr": "writes an attribute named by a string: no reading can tell which, the grader's own included",
    "delattr": "deletes an attribute named by a string: no reading can tell which",
    "__builtins__": "reaches the builtins every module shares",
    "input": "waits for a keyboard the grader does not have",
    "exit": "ends the grader's process",
    "quit": "ends the grader's process",
}
# how to write the same without it, where a student meets it in honest work
INSTEAD = {
    "getattr": "name the attribute (self.mean), or keep the values in a dict (self.state['mean'])",
    "setattr": ("assign the attribute by name (self.mean = ...), or keep the values in a dict "
                "(self.state[key] = ...)"),
    "delattr": "keep the values in a dict and delete the key",
    "vars": "keep the values in a dict",
    "globals": "pass what the function needs as an argument",
    "locals": "pass what the function needs as an argument",
    "open": "keep the data in a tensor or a list",
    "eval": "write the expression out",
    "exec": "write the code out",
}
# the dunders a norm or a step may use; any other reaches into objects' insides (code, globals, frames)
DUNDERS = {"__init__", "__name__", "__call__", "__len__", "__iter__", "__next__", "__repr__", "__str__"}
FRAMES = {"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame", "cr_frame", "ag_frame"}
# attributes of torch and numpy that load code or objects, or reach C: pickle's __reduce__ runs any import
LOADERS = {"load", "loads", "load_library", "load_inline", "cpp_extension", "ctypeslib", "_C",
           "multiprocessing"}
MAGICS = {"matplotlib"}


def python_source(cell_source: str) -> str:
    """Return a cell's source as Python, IPython magics turned into the calls IPython makes.

    >>> python_source("%matplotlib inline\\nx = 1").splitlines()[0]
    "get_ipython().run_line_magic('matplotlib', 'inline')"
    """
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(cell_source)


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _magic(node: ast.Call) -> bool:
    """Return whether ``node`` is ``get_ipython().run_line_magic('<allowed>', ...)`` (a transformed magic)."""
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == "run_line_magic"
            and isinstance(func.value, ast.Call) and _dotted(func.value.func) == "get_ipython"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value in MAGICS)


def tampering(source: str) -> list[str]:
    """Return what in ``source`` (Python) could reach the grader, one ``"line N: ..."`` each; [] if none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # it fails in the sandbox like any syntax error, and loses only its own parts
    found, allowed = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _magic(node):
            allowed.add(id(node.func.value.func))
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top in MODULES:
                    found.append(f"line {line}: imports {name} ({MODULES[top]})")
                elif name.startswith("labkit.grading") or (
                        name == "labkit" and isinstance(node, ast.ImportFrom)
                        and any(a.name == "grading" for a in node.names)):
                    found.append(f"line {line}: imports labkit.grading (the grader)")
        elif isinstance(node, ast.Name) and node.id in NAMES and id(node) not in allowed:
            found.append(f"line {line}: uses {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value != "__main__" \
                and re.fullmatch(r"__\w+__", node.value):
            found.append(f"line {line}: names {node.value} in a string")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node) or ""
            if node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in DUNDERS:
                found.append(f"line {line}: reads {node.attr}")
            elif node.attr in FRAMES:
                found.append(f"line {line}: reads {node.attr} (a frame)")
            elif node.attr in LOADERS:
                found.append(f"line {line}: uses {dotted or node.attr} (loads code or reaches C)")
            elif dotted.startswith("labkit.grading"):
                found.append(f"line {line}: reaches labkit.grading (the grader)")
    return sorted(set(found), key=lambda s: (int(s.split(":")[0].split()[1]), s))


def explain(finding: str) -> str:
    """Explain a ``tampering`` finding: why it is banned and, if honest code meets it, what to write instead.

    >>> explain("line 3: uses exit")
    "line 3: uses exit (ends the grader's process)"
    >>> explain("line 4: uses setattr").split("; ")[1]  # doctest: +NORMALIZE_WHITESPACE
    'instead, assign the attribute by name (self.mean = ...), or keep the values in a dict
    (self.state[key] = ...))'
    """
    what = finding.split(": ", 1)[1] if ": " in finding else finding
    name = what.split()[-1]
    if what.startswith("uses ") and name in NAMES:
        why = NAMES[name] + (f"; instead, {INSTEAD[name]}" if name in INSTEAD else "")
        return f"{finding} ({why})"
    if what.startswith("reads __") or what.startswith("names __"):
        return f"{finding} (a dunder reaches an object's insides: its code, globals or frames)"
    return finding


def banned_calls(source: str, banned: tuple[str, ...]) -> list[str]:
    """Return the references in ``source`` to the functions ``banned`` names, one ``"line N: name"`` each.

    A function counts under any of its homes and aliases (``labkit.clip.grad_norm``,
    ``lk.grad_norm``), imported or reached by attribute.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    short = {name.rsplit(".", 1)[1] for name in banned}
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom):
            found += [f"line {line}: {node.module}.{a.name}" for a in node.names if a.name in short]
        elif isinstance(node, ast.Attribute) and node.attr in short:
            found.append(f"line {line}: {_dotted(node) or node.attr}")
    return found
