"""The install: the library alone needs torch, matplotlib and tqdm; the extras and the pinned requirement
files name the same packages at versions that agree; no requirement file depends on the folder pip runs in.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the checks are of files, one Python is enough

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
FILES = ["requirements.txt", "requirements-nbgrader.txt", "requirements-trackers.txt",
         "classroom/requirements.txt", "requirements-docs.txt"]


def requirement_lines(name: str) -> list[str]:
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def pins() -> dict[str, Version]:
    """Every ``name==version`` of the requirement files CI installs."""
    found = {}
    for name in FILES:
        for line in requirement_lines(name):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line!r} is not pinned"
            found[canonicalize_name(req.name)] = Version(spec.version)
    return found


def extra(name: str) -> list[Requirement]:
    """The packages of an extra, its ``labkit[...]`` references followed."""
    out = []
    for line in PROJECT["optional-dependencies"][name]:
        req = Requirement(line)
        if req.name == "labkit":
            out += [r for e in sorted(req.extras) for r in extra(e)]
        else:
            out.append(req)
    return out


def test_the_library_alone_needs_torch_matplotlib_and_tqdm_with_torch_held_to_the_tested_release():
    deps = {canonicalize_name(Requirement(d).name): Requirement(d) for d in PROJECT["dependencies"]}
    assert sorted(deps) == ["matplotlib", "torch", "tqdm"]
    torch_spec = deps["torch"].specifier
    # this disk's CPU build, the version CI runs, is admitted; the next minor release (a CUDA build) is not
    assert torch_spec.contains("2.13.0+cpu") and torch_spec.contains("2.13.0")
    assert not torch_spec.contains("2.14.0") and not torch_spec.contains("2.15.0")
    assert pins()["torch"] == Version("2.13.0")


def test_no_requirement_file_depends_on_the_folder_pip_runs_in():
    for name in FILES:
        for line in requirement_lines(name):
            assert not re.match(r"^(-e|--editable|-r|-c|\.|/|file:)", line), f"{name}: {line!r}"


@pytest.mark.parametrize("name", ["lab", "grading", "trackers", "docs", "test"])
def test_each_extra_is_pinned_where_ci_installs_it_at_a_version_the_extra_admits(name):
    pinned = pins()
    for req in extra(name):
        key = canonicalize_name(req.name)
        if key == "trackio":  # installed by .ci/run itself, --no-deps (requirements-trackers.txt says why)
            assert "trackio==0.43.0" in (ROOT / ".ci/run").read_text(encoding="utf-8")
            continue
        assert key in pinned, f"[{name}] needs {req.name}, which no requirement file pins (CI lacks it)"
        assert req.specifier.contains(pinned[key]), f"[{name}] {req} refuses {pinned[key]}, the pin"

