"""Submissions that attack the grader: none earns a point it did not, escapes its sandbox, or survives.

Attacks the grader reads and refuses (tampering) cost no sandbox run; the ones that get past
that reading run for real, grouped so one sandboxed run shows several.
"""

import hashlib
import json
import os
import socket
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading import notebook, sandbox, static
from labkit.grading.__main__ import main
from labkit.grading.notebook import grade, release

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import AUTOGRADED, SOURCE, sandboxed, solution, source, submission  # noqa: E402

SOLVED = {
    a: solution(a) for a in ("grad_norm_answer", "clip_answer", "skip_answer", "scale_answer", "step_answer")
}
LABKIT_FILE = Path(notebook.__file__).parents[1] / "clip.py"

# each would have given full marks (11/11) to the instructor's solutions plus this one cell, or more to less
TAMPERING = {
    "checks replaced": ("import labkit.grading as G\nG.check_grad_norm = lambda *a, **k: None",
                        "line 1: imports labkit.grading (the grader)"),
    "checks replaced, from-import": ("from labkit import grading\ngrading.check_clip = print",
                                     "line 1: imports labkit.grading (the grader)"),
    "builtins.__import__": ("import builtins\nbuiltins.__import__ = lambda *a, **k: None",
                            "line 1: imports builtins (the builtins)", "line 2: reads __import__"),
    "an input transformer": ("get_ipython().input_transformers_post.append(lambda lines: ['pass\\n'])",
                             "line 1: uses get_ipython"),
    "sys.modules": ("import sys\nnorm = sys.modules['labkit.clip'].grad_norm",
                    "line 1: imports sys (the interpreter)"),
    "the grader's command line": ("import os\nprint(open(f'/proc/{os.getppid()}/cmdline').read())",
                                  "line 1: imports os (the process)", "line 2: uses open"),
    "the instructor's solutions": ("exec(open('notebooks/exercises/ps1_clipping_and_scaling.ipynb').read())",
                                   "line 1: uses exec", "line 1: uses open"),
    "a shell escape": ("!cat /proc/1/cmdline", "line 1: uses get_ipython"),
    "a cell magic": ("%%writefile /tmp/x.py\nprint(1)", "line 1: uses get_ipython"),
    "the wrapper's insides": ("import labkit\nnorm = labkit.grad_norm.__wrapped__",
                              "line 2: reads __wrapped__"),
    "a name built at run time": ("import labkit\nnorm = getattr(labkit, 'grad' + '_norm')",
                                 "line 2: uses getattr"),
    "frames": ("try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    up = e.__traceback__.tb_frame.f_back",
               "line 4: reads __traceback__", "line 4: reads f_back (a frame)",
               "line 4: reads tb_frame (a frame)"),
    "the alarm": ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)",
                  "line 1: imports signal (the grader's timers)"),
    "an attribute named in a string": ("from operator import attrgetter\ng = attrgetter('__globals__')",
                                       "line 1: imports operator (attributes by name)",
                                       "line 2: names __globals__ in a string"),
    "a pickle that imports": ("import torch\nobj = torch.load(PAYLOAD, weights_only=False)",
                              "line 2: uses torch.load (loads code or reaches C)"),
    "C through numpy": ("import numpy\napi = numpy.ctypeslib.ctypes.pythonapi",
                        "line 2: uses numpy.ctypeslib (loads code or reaches C)"),
    "a setsid child": ("import subprocess\nsubprocess.Popen(['sleep', '100'], start_new_session=True)",
                       "line 1: imports subprocess (other processes)"),
}


@pytest.mark.parametrize("attack", TAMPERING)
def test_code_that_reaches_into_the_grader_is_reported_and_not_run(attack, monkeypatch):
    code, *findings = TAMPERING[attack]
    monkeypatch.setattr(sandbox, "run", lambda *a, **k: pytest.fail("a tampering submission was run"))
    report = grade(source(), submission(SOLVED, prepend=[code]))
    assert report.score() == 0
    assert report.tampering == [f"cell 2, {finding}" for finding in findings]
    assert {p.status for p in report.parts if not p.manual} == {"tampering"}
    assert report.format().startswith(f"TAMPERING (not scored): cell 2, {findings[0]}")


def test_an_attack_in_an_answer_cell_loses_its_part_and_is_not_run():
    """The cell is left out of the run (its attack never happens); the other parts are graded as usual."""
    sandboxed()
    attack = SOLVED["grad_norm_answer"] + "\nimport labkit.grading as G\nG.check_clip = lambda *a, **k: None"
    report = grade(source(), submission({**SOLVED, "grad_norm_answer": attack}), timeout=30)
    by_id = {p.grade_id: p for p in report.parts if not p.manual}
    assert {g: p.points for g, p in by_id.items()} == {**AUTOGRADED, "grad_norm_tests": 0}
    assert by_id["grad_norm_tests"].status == "tampering"
    label = report.tampering[0].split(", line")[0]
    assert label.endswith("'grad_norm_answer'") and len(report.tampering) == 1
    assert (
        report.tampering[0] == f"{label}, line {attack.count(chr(10))}: imports labkit.grading (the grader)"
    )
    assert by_id["grad_norm_tests"].message.startswith(f"not scored: {label} was not run")
    assert report.format().startswith(f"TAMPERING (not scored): {label}, line")


# one line an honest student wrote in ps2's z-clipper (issue 32, point 23): it cost every part, 0/12
HONEST_GETATTR = ("    def state_dict(self):",
                  "    def state_dict(self):\n"
                  "        return {k: getattr(self, k).clone() "
                  "for k in ('mean', 'var', 'buffer', 'count')}\n\n"
                  "    def _unused_state_dict(self):")


def _getattr_answer():
    import grading_answers as ga

    answer = ga.solutions(ga.PS2)["zclip_answer"]
    assert HONEST_GETATTR[0] in answer
    answer = answer.replace(*HONEST_GETATTR)
    return answer, answer.split("\n").index(HONEST_GETATTR[1].split("\n")[1]) + 1


def test_honest_work_with_one_banned_line_scores_every_other_part():
    sandboxed()
    import grading_answers as ga

    answer, line = _getattr_answer()
    answers = {**ga.solutions(ga.PS2), "zclip_answer": answer}
    report = grade(nbformat.read(ga.PS2, as_version=4), set_submission(ga.PS2, answers, "x = 1"), timeout=60)
    by_id = {p.grade_id: p for p in report.parts if not p.manual}
    assert {g: p.points for g, p in by_id.items()} == {**ga.PARTS[ga.PS2], "zclip_tests": 0}, report.format()
    assert by_id["zclip_tests"].status == "tampering"
    assert f"line {line}: uses getattr (reads an attribute named by a string" in by_id["zclip_tests"].message
    assert [t.split(", ", 1)[1] for t in report.tampering] == [f"line {line}: uses getattr"]
    assert {p.status for g, p in by_id.items() if g != "zclip_tests"} == {"ok"}


def _shell_output(cells, capsys):
    """Run ``cells`` in a fresh IPython shell, as a kernel does; return what the last one printed."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell()
    try:
        for cell in cells:
            capsys.readouterr()
            shell.run_cell(cell, store_history=True)
        return capsys.readouterr().out.strip()
    finally:
        shell.cleanup()


def test_the_visible_test_names_the_banned_line_and_why(capsys):
    """What the student sees when the grader would withhold the part: the line, what it reaches, what
    instead."""
    answer, line = _getattr_answer()
    seen = _shell_output(["import math\nimport torch\nimport labkit", answer,
                          "from labkit.grading import check_zscore_clipper\n"
                          "check_zscore_clipper(ZScoreClipper)"],
                         capsys)
    assert seen == ("AssertionError: ZScoreClipper's cell cannot be graded as written: the grader never runs "
                    "a cell that could reach into it, so this part would score 0 (the other parts are graded "
                    f"as usual). line {line}: uses getattr ({static.NAMES['getattr']}; instead, "
                    f"{static.INSTEAD['getattr']}).")


def test_the_visible_test_reads_the_cells_of_the_helpers_too(capsys):
    """A helper in a cell of its own is read too: a flagged cell outside every answer costs the whole
    notebook."""
    helper = "def square(t):\n    return getattr(t, 'pow')(2)"
    norm = ("def global_grad_norm(parameters):\n"
            "    return square(torch.cat([p.grad.flatten() for p in parameters])).sum()")
    seen = _shell_output(["import torch", helper, norm,
                          "from labkit.grading import check_grad_norm\ncheck_grad_norm(global_grad_norm)"],
                         capsys)
    assert seen.startswith("AssertionError: the cell that defines square (which global_grad_norm uses) "
                           "cannot be graded as written: the grader never runs a cell that could reach into "
                           "it, so the part it answers would score 0, or, outside every answer, the whole "
                           "notebook. line 2: uses getattr")


def test_a_stub_shows_one_line_not_the_graders_frames(capsys):
    """Issue 32, point 25: a stub's NotImplementedError printed 20 lines through grading/checks/core.py."""
    stub = "def global_grad_norm(parameters):\n    # YOUR CODE HERE\n    raise NotImplementedError()"
    seen = _shell_output([stub,
                          "from labkit.grading import check_grad_norm\ncheck_grad_norm(global_grad_norm)"],
                         capsys)
    assert seen == ("AssertionError: global_grad_norm is not implemented yet: replace `raise "
                    "NotImplementedError()` with your code.")
    # the student's own error keeps its frame (their line), not the grader's
    bug = ("import torch\ndef global_grad_norm(parameters):\n"
           "    return torch.stack([p.grad for p in parameters]).norm()")
    seen = _shell_output([bug,
                          "from labkit.grading import check_grad_norm\ncheck_grad_norm(global_grad_norm)"],
                         capsys).split("\n")
    assert seen[0] == "Traceback of your code (the grader's own frames left out):"
    assert "in global_grad_norm" in seen[1] and "grading" not in "\n".join(seen[:-1])
    assert seen[-1].startswith(
        "AssertionError: global_grad_norm raised RuntimeError: stack expects each tensor"
    )


# ---------------------------------------------------------------- past the reading: the traps and the harness

SAVED = """import labkit, torch
saved_norm = labkit.grad_norm
from torch.nn.utils import clip_grad_norm_ as torch_clip
Step = labkit.TrainStep
"""
BANNED = {
    # a reference saved before the test, called in a try that swallows the trap
    "grad_norm_answer": """def global_grad_norm(parameters):
    try:
        return saved_norm(parameters)
    except BaseException:
        return torch.tensor(0.0)""",
    "clip_answer": """def clip_to_norm_(parameters, max_norm):
    return torch_clip(parameters, max_norm)""",
    # right answers, but labkit's rule is named in the cell (on a path the cases never take)
    "scale_answer": solution("scale_answer").replace(
        "    if found_inf:",
        "    if config is None:\n        return labkit.update_scale(scale)\n    if found_inf:", 1),
    "step_answer": """def guarded_step(step, model, optimizer, scaler, scheduler, loss_fn, inputs, targets,
                 max_norm):
    return Step(model, optimizer, loss_fn, precision="fp16", max_norm=max_norm, scaler=scaler,
                scheduler=scheduler,
                hooks=[labkit.SkipAlarm(None), labkit.ClipAlarm(None)])(inputs, targets)""",
    "skip_answer": solution("skip_answer"),
}


@pytest.fixture(scope="module")
def banned_report():
    sandboxed()
    return grade(source(), submission(BANNED, prepend=[SAVED]), timeout=30, student="mallory")


def test_library_calls_a_part_bans_earn_nothing_however_they_are_reached(banned_report):
    by_id = {p.grade_id: p for p in banned_report.parts}
    assert {g: by_id[g].points for g in AUTOGRADED} == {
        "grad_norm_tests": 0, "clip_tests": 0, "skip_tests": 2, "scale_tests": 0, "step_tests": 0}
    assert (
        "called labkit.grad_norm: this part asks you to compute the norm yourself"
        in by_id["grad_norm_tests"].message
    )
    assert "called torch.nn.utils.clip_grad_norm_: this part asks you to write the clipping yourself" in \
        by_id["clip_tests"].message
    assert by_id["scale_tests"].message == ("uses what this part asks you to write yourself: cell 14 "
                                            "'scale_answer', line 4: labkit.update_scale")
    assert (
        "called labkit.TrainStep: this part asks you to write the step yourself"
        in by_id["step_tests"].message
    )
    assert banned_report.tampering == []


def test_a_harness_changed_at_run_time_is_reported_as_tampering_not_scored(monkeypatch):
    """Past the reading (switched off here), replacing the harness's caller would have given 11/11."""
    sandboxed()
    monkeypatch.setattr(static, "tampering", lambda source: [])
    attack = "import labkit.grading.checks as c\nc.run = lambda *a, **k: None"
    report = grade(source(), submission(SOLVED, prepend=[attack]), timeout=30)
    assert report.score() == 0
    assert report.tampering == ["the harness's results: ['checks.run']"]
    assert {p.status for p in report.parts if not p.manual} == {"tampering"}


# ---------------------------------------------------------------- the sandbox itself

HOSTILE = r'''
import json, os, resource, signal, socket, subprocess
found = {"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
found["seen"] = [p for p in PATHS if os.path.exists(p)]
found["labkit_writable"] = False
for path in (LABKIT_FILE, "/labkit/labkit/clip.py"):  # the grader's path, and the sandbox's view of it
    try:
        with open(path, "a") as f:
            f.write("# owned")
        found["labkit_writable"] = True
    except OSError:
        pass
try:  # a server the test listens with on the host's loopback: reachable unless the network is unshared
    socket.create_connection(("127.0.0.1", PORT), timeout=2).close()
    found["network"] = True
except OSError as e:
    found["network"] = False
    found["network_error"] = e.strerror
found["limits"] = [resource.getrlimit(r)[0]
                   for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CPU)]
try:
    hog = bytearray(8 << 30)
    found["8 GiB"] = True
except MemoryError:
    found["8 GiB"] = False
with open("/tmp/labkit-sandbox-marker", "w") as f:
    f.write("left behind?")
subprocess.Popen(["sleep", "1234.5"], start_new_session=True)
print("FOUND " + json.dumps(found), flush=True)
print("x" * (3 << 20), flush=True)
for s in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM):
    signal.signal(s, signal.SIG_IGN)
while True:
    pass
'''


def _sleepers() -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x001234.5\x00":
                out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 (any free port) that nobody is meant to reach; yields the socket."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        yield server


def connections(server):
    """How many connections reached ``server`` (accepted here and closed)."""
    n = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            return n
        n += 1


def test_the_sandbox_holds_and_its_wall_clock_kills_everything(tmp_path, listener):
    """No instructor file, other submission, gradebook, network or writable labkit; limits; nothing
    survives."""
    sandboxed()
    other = tmp_path / "submitted" / "bob" / "ps1" / "ps1.ipynb"
    other.parent.mkdir(parents=True)
    other.write_text("{}")
    paths = [str(SOURCE), str(other), str(tmp_path / "gradebook.csv"), str(Path.cwd() / "tests")]
    (tmp_path / "gradebook.csv").write_text("student,points\n")
    labkit_sha = hashlib.sha256(LABKIT_FILE.read_bytes()).hexdigest()
    job, out = tmp_path / "job", tmp_path / "out"
    job.mkdir()
    out.mkdir()
    port = listener.getsockname()[1]
    code = f"PATHS = {paths!r}\nLABKIT_FILE = {str(LABKIT_FILE)!r}\nPORT = {port}\n" + HOSTILE
    (job / "job.json").write_text(json.dumps({"timeout": 2, "cells": [{"label": "cell 3", "source": code}],
                                              "parts": []}))
    limits = sandbox.Limits(wall=8)
    outcome = sandbox.run(sandbox.command(job, out, limits), limits)

    assert outcome.timed_out and 8 <= outcome.seconds < 16
    assert (out / "status").read_text() == "cell cell 3"  # the cell that was running is the one blamed
    found = json.loads(outcome.output.split("FOUND ", 1)[1].split("\n", 1)[0])
    assert found["seen"] == [] and found["labkit_writable"] is False
    assert found["network"] is False and connections(listener) == 0, found.get("network_error")
    assert found["uid"] == (sandbox.NOBODY if os.geteuid() == 0 else os.geteuid())
    assert max(found["pids"]) < 50  # its own PID namespace: the grader's processes are not there
    assert (
        found["limits"] == [limits.memory, limits.processes, int(limits.wall) + 5] and found["8 GiB"] is False
    )
    assert len(outcome.output.encode()) <= limits.output  # 3 MiB printed, 1 MiB kept
    assert hashlib.sha256(LABKIT_FILE.read_bytes()).hexdigest() == labkit_sha
    assert not Path("/tmp/labkit-sandbox-marker").exists()
    assert _sleepers() == []  # the setsid child died with the sandbox


def test_without_bubblewrap_grading_refuses_and_says_how_to_fix_it(monkeypatch, tmp_path, capsys):
    real = sandbox.shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None if name == "bwrap" else real(name))
    with pytest.raises(sandbox.SandboxMissing, match="apt-get install bubblewrap"):
        grade(source(), submission(SOLVED))
    path = tmp_path / "ada.ipynb"
    nbformat.write(submission(SOLVED), path)
    assert main(["grade", str(SOURCE), str(path)]) == 1
    assert "pass --no-sandbox to grade notebooks you trust" in capsys.readouterr().err


def test_no_sandbox_runs_the_same_harness_in_its_own_session(tmp_path, listener):
    """Unsandboxed, the same harness reaches the test's server: the sandbox test's probe can succeed."""
    job, out = tmp_path / "job", tmp_path / "out"
    job.mkdir()
    out.mkdir()
    port = listener.getsockname()[1]
    probe = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5).close()\nprint(6 * 7)"
    job_spec = {"timeout": 5, "cells": [{"label": "a", "source": probe}], "parts": []}
    (job / "job.json").write_text(json.dumps(job_spec))
    limits = sandbox.Limits(wall=60)
    outcome = sandbox.run(sandbox.unsandboxed(job, out, limits), limits)
    assert outcome.returncode == 0 and not outcome.timed_out and "42" in outcome.output
    assert connections(listener) == 1
    assert (out / "status").read_text() == "done"
    assert json.loads((out / "cells.json").read_text())["cells"][0]["error"] is None


def test_a_sandbox_that_cannot_start_stops_grading_instead_of_giving_zeros(monkeypatch):
    monkeypatch.setattr(
        sandbox, "command", lambda job, out, limits: ["sh", "-c", "echo 'bwrap: No permissions'; exit 1"]
    )
    with pytest.raises(
        sandbox.SandboxError, match=r"did not start the harness \(exit code 1\): bwrap: No permissions"
    ):
        grade(source(), submission(SOLVED))


# --------------------------------------------------- problem sets 2, 3 and 4: one part each, past the reading

import grading_answers as ga  # noqa: E402

# references made in cells that define no answer, so only the run-time traps can see them
PS2_SAVED = """import labkit.lab.defenses, labkit.spikes
Lab = labkit.lab.defenses.Defenses
z_of = labkit.spikes.rolling_z
"""
PS2_BANNED = {
    # labkit's own code builds the ZClip: a trap that trusted labkit's callers would let this through
    "zclip_answer": """class ZScoreClipper:
    def __init__(self, alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6):
        self.inner = Lab(method="zclip", threshold=z_thresh, window=warmup, feed="clipped",
                         max_consecutive_clips=None).clipper()

    def clip_(self, parameters):
        return self.inner.clip_(parameters)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)""",
    "read_run_answer": ga.solutions(ga.PS2)["read_run_answer"].replace(
        "z = (r.grad_norm - mean) / std if std > 0 else (math.inf if r.grad_norm > mean else 0.0)",
        "z = z_of(recent, r.grad_norm, window)"),
    # right answers, but labkit's rule is named in a class, on a path the cases never take: the reading
    # sees it
    "detector_answer": ga.solutions(ga.PS2)["detector_answer"].replace(
        "        if std == 0:",
        "        if self.window < 0:\n            return labkit.spikes.rolling_z(values, x, 1)\n"
        "        if std == 0:"),
}
PS3_SAVED = "import functools\nimport labkit.formats.fp8, labkit.formats.bf16\n"
PS3_BANNED = {
    # the library's own function as the answer: the grader itself calls the ban's wrapper
    "kahan_answer": "kahan_update = labkit.formats.bf16.kahan_add",
    "fp8_answer": "quantize_tiles = functools.partial(labkit.formats.fp8.quantize, granularity='tile128')",
    # the trap raised in a try that swallows it, with an honest fallback that would pass
    "stale_answer": ga.solutions(ga.PS3)["stale_answer"].replace(
        "    toward = ",
        "    try:\n        return labkit.formats.bf16.stale_fraction(update, weight, mask=update != 0)\n"
        "    except BaseException:\n        pass\n    toward = ", 1),
}

PS4_SAVED = "import labkit.optim, labkit.update_monitor\n"
PS4_BANNED = {
    # the oracle itself as the answer: the grader calls the ban's wrapper
    "rms_answer": "update_rms_per_tensor = labkit.optim.read_update_rms",
    # labkit's StableAdamW takes the step, on copies: trapped at its constructor
    "stable_answer": '''def stable_adamw_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps,
                      weight_decay):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = labkit.optim.StableAdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    for p, g, m, v in zip(ps, grads, exp_avgs, exp_avg_sqs):
        p.grad = g.clone()
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    state = [opt.state[p] for p in ps]
    return [p.detach() for p in ps], [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state]''',
}
# the oracle replaced in the student's process by what the answers return: the grader's verdict is its own
PS4_PATCHED = """import labkit.optim
labkit.optim.read_update_rms = lambda optimizer, params=None: [1.0 for g in optimizer.param_groups
                                                               for p in g["params"]]
labkit.optim.update_rms = lambda *args, **kwargs: torch.tensor(1.0)
labkit.optim.StableAdamW = torch.optim.AdamW
"""
PS4_ATTACKS = {
    # what the patched oracle says
    "rms_answer": "def update_rms_per_tensor(optimizer):\n"
                  "    return [1.0 for group in optimizer.param_groups for p in group['params']]",
    # AdamW's step, unclipped: right only against the patched oracle
    "stable_answer": ga.solutions(ga.PS4)["stable_answer"].replace("eta = lr / rms.clamp(min=1.0)",
                                                                   "eta = lr"),
    # the hidden cases' own answers, read from the grader's checks
    "spike_answer": '''from labkit.grading.checks.ps4 import spike


def find_spike(records, threshold, factor, window):
    return spike._answer(spike._SpikeCase("", tuple(records), threshold, factor, window))''',
}


def set_submission(path, answers, prepend):
    nb = release(nbformat.read(path, as_version=4))
    for cell in nb.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in answers:
            cell.source = answers[gid]
    nb.cells[1:1] = [nbformat.v4.new_code_cell(prepend)]
    return nb


@pytest.mark.parametrize("path, banned, prepend, lost", [
    (ga.PS2, PS2_BANNED, PS2_SAVED, {
        "zclip_tests": "called labkit.clippers.ZClip: this part asks you to write the clipper yourself",
        "read_run_tests": "called labkit.spikes.rolling_z: this part asks you to compute the z-scores "
                          "yourself",
        "detector_tests": "uses what this part asks you to write yourself: cell 15 'detector_answer', "
                          "line 34: labkit.spikes.rolling_z"}),
    (ga.PS3, PS3_BANNED, PS3_SAVED, {
        "kahan_tests": "called labkit.formats.bf16.kahan_add: this part asks you to write the compensated "
                       "update yourself",
        "fp8_tests": "called labkit.formats.fp8.quantize: this part asks you to write the cast yourself",
        "stale_tests": "called labkit.formats.bf16.stale_fraction: this part asks you to count the lost "
                       "updates yourself"}),
    (ga.PS4, PS4_BANNED, PS4_SAVED, {
        "rms_tests": "called labkit.optim.read_update_rms: this part asks you to compute the RMS yourself",
        "stable_tests": "called labkit.optim.StableAdamW: this part asks you to write the update-clipped "
                        "step yourself"}),
], ids=["ps2", "ps3", "ps4"])
def test_the_new_sets_bans_hold_however_the_library_is_reached(path, banned, prepend, lost):
    sandboxed()
    answers = {**ga.solutions(path), **banned}
    report = grade(nbformat.read(path, as_version=4), set_submission(path, answers, prepend), timeout=60,
                   student="mallory")
    assert report.tampering == [], report.tampering
    by_id = {p.grade_id: p for p in report.parts if not p.manual}
    assert {g: p.points for g, p in by_id.items()} == {
        g: 0 if g in lost else v for g, v in ga.PARTS[path].items()
    }
    for gid, message in lost.items():
        assert message in by_id[gid].message, by_id[gid].message


def test_ps4_the_oracle_patched_in_the_students_process_read_or_handed_in_scores_zero():
    sandboxed()
    nb = nbformat.read(ga.PS4, as_version=4)
    answers = {**ga.solutions(ga.PS4), **PS4_ATTACKS}
    report = grade(nb, set_submission(ga.PS4, answers, PS4_PATCHED), timeout=60, student="mallory")
    by_id = {p.grade_id: p for p in report.parts if not p.manual}
    assert {g: p.points for g, p in by_id.items()} == {"rms_tests": 0, "stable_tests": 0, "spike_tests": 0}
    assert report.score() == 0
    # patched here, the oracle is untouched where the verdict is made: the answers are judged wrong
    assert "update_rms_per_tensor gave 1 for group 0, tensor 0" in by_id["rms_tests"].message
    assert "no tensor was clipped: that is AdamW's step" in by_id["stable_tests"].message
    # reading the grader is tampering: that cell never runs, its part is not scored
    assert by_id["spike_tests"].status == "tampering"
    assert any("imports labkit.grading (the grader)" in t for t in report.tampering), report.tampering
