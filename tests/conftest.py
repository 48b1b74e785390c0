"""Keep the grader's ban wrappers (labkit.grading.checks) out of the other tests.

The wrappers are installed once and stay, by design, in the process that runs a submission. When
the grading tests run the checks in pytest's own process, put every home they touched back at the
end of the module, so that `labkit.update_scale is labkit.scaler.update_scale` holds elsewhere.
"""

import importlib

import pytest


@pytest.fixture(autouse=True, scope="module")
def _undo_grading_bans(request):
    if "grading" not in request.module.__name__:
        yield
        return
    from labkit.grading import checks

    homes = {name: importlib.import_module(name) for name in checks._HOMES}
    saved = {name: dict(vars(module)) for name, module in homes.items()}
    classes = {v: v.__init__ for d in saved.values() for v in d.values() if isinstance(v, type)}
    yield
    for name, module in homes.items():
        for attr, value in saved[name].items():
            if getattr(module, attr, value) is not value:
                setattr(module, attr, value)
    for cls, init in classes.items():
        if cls.__dict__.get("__init__") is not init and "__init__" in cls.__dict__:
            cls.__init__ = init
