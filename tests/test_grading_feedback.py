"""Feedback pages from a graded class, in nbgrader's layout, without a hub.

A class of four hands in the two-part problem set of test_grading_class (the skip decision, the
loss-scale rule, a written question): right and hand-graded; a classic bug with its written answer
not graded yet; right with the written question left unanswered, HTML in its text and kernel output
saved in the notebook; and one collected without nbgrader's submission secret. It is graded once
(unsandboxed: the sandbox is not what is tested here, tests/test_classroom.py grades in it), then
``feedback`` writes the pages, which are read back as a student's browser would get them.
"""

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from labkit.grading.__main__ import main
from labkit.grading.batch import grade_class
from labkit.grading.feedback import write_feedback

sys.path.insert(0, str(Path(__file__).parent))
from test_grading import nbgrader_env  # noqa: E402,F401 (a fixture: nbgrader's HOME and a course in tmp)
from test_grading_class import KINDS, SCALE, SKIP, problem_set  # noqa: E402

STUDENTS = {  # skip body, scale body, written answer
    "ada": (*KINDS["right"][:2], "Because the scale multiplies the norm."),
    "bo": (*KINDS["no hysteresis"][:2], "The norm is scaled."),
    "cy": (*KINDS["right"][:2], "YOUR ANSWER HERE"),
    "dee": (*KINDS["right"][:2], "Unscale first."),
}
SECRET = {name: f"{name}-secret-" + "0" * 100 for name in STUDENTS}


class Parts(HTMLParser):
    """Read a feedback page's score and its parts table back: ``score``, ``max_score``, ``parts``."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.score = self.max_score = None
        self.parts: dict[str, tuple[float, float, str]] = {}
        self.feed(page)

    def handle_starttag(self, tag, attrs):  # type: ignore[no-untyped-def]
        a = dict(attrs)
        if tag == "h1" and a.get("id") == "score":
            self.score, self.max_score = float(a["data-score"]), float(a["data-max-score"])
        if tag == "tr" and "data-grade-id" in a:
            self.parts[a["data-grade-id"]] = (float(a["data-points"]), float(a["data-max-points"]),
                                              a["data-status"])


def gradebook_parts(book, student):
    entry = next(s for s in book["students"] if s["student"] == student)
    return entry["score"], entry["max_score"], {p["grade_id"]: (p["points"], p["max_points"], p["status"])
                                                for p in entry["parts"]}


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """nbgrader's course layout with the four submissions collected, graded into grades/ps0."""
    root = tmp_path_factory.mktemp("course")
    source = root / "source" / "ps0" / "ps0.ipynb"
    source.parent.mkdir(parents=True)
    nbformat.write(problem_set(), source)
    for name, (skip, scale, written) in STUDENTS.items():
        nb = problem_set()
        nb.cells[2].source = SKIP.format(body=skip)
        nb.cells[4].source = SCALE.format(body=scale)
        nb.cells[6].source = written
        if name == "cy":
            nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="PRINTED-BY-KERNEL\n")]
            nb.cells.insert(1, nbformat.v4.new_markdown_cell(
                "Mine: **bold** <script>alert('cy')</script> <img src=x onerror=alert(1)> "
                "[a](javascript:alert(1))"))
        folder = root / "submitted" / name / "ps0"
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / "ps0.ipynb")
        (folder / "timestamp.txt").write_text(f"2026-01-0{len(name)} 10:00:00.000000 UTC")
        if name != "dee":
            (folder / "submission_secret.txt").write_text(SECRET[name])
    (root / "manual.csv").write_text("student,grade_id,points,comment\nada,why,1,clear & right\n")
    book = grade_class(source, root / "submitted", root / "grades", jobs=2, manual=root / "manual.csv",
                       progress=False, timeout=30.0, wall=None, seed=None, sandbox=False)
    return root, source, book


@pytest.fixture(scope="module")
def pages(course):
    root, source, book = course
    done = write_feedback(source, root / "submitted", root / "grades", root / "feedback")
    return done, {p.parent.parent.name: p.read_text() for p in done.written}


def test_each_page_is_in_nbgraders_layout_with_the_secret_and_timestamp_beside_it(course, pages):
    root, _, _ = course
    done, _ = pages
    assert sorted(p.relative_to(root / "feedback").as_posix() for p in done.written) == [
        f"{name}/ps0/ps0.html" for name in ("ada", "bo", "cy")]
    for name in ("ada", "bo", "cy"):
        for copied in ("timestamp.txt", "submission_secret.txt"):
            assert (root / "feedback" / name / "ps0" / copied).read_bytes() == \
                (root / "submitted" / name / "ps0" / copied).read_bytes()
    assert list(done.skipped) == ["dee"] and "submission_secret.txt" in done.skipped["dee"]
    assert not (root / "feedback" / "dee").exists()  # release_feedback would stop on a folder without one


def test_the_page_has_the_gradebooks_score_part_by_part(course, pages):
    _, _, book = course
    _, html = pages
    for name in ("ada", "bo", "cy"):
        page = Parts(html[name])
        assert (page.score, page.max_score, page.parts) == gradebook_parts(book, name), name
    assert Parts(html["ada"]).parts == {"skip_tests": (2, 2, "ok"), "scale_tests": (2, 2, "ok"),
                                        "why": (1, 1, "hand-graded")}
    assert Parts(html["bo"]).parts["scale_tests"] == (0, 2, "failed")
    assert "back off only when hysteresis_left reaches 0" in html["bo"]  # the grader's hint
    assert "graded by hand: clear &amp; right" in html["ada"]  # the instructor's comment, escaped


def test_an_unanswered_written_question_counts_zero_and_an_ungraded_one_is_marked(course, pages):
    done, html = pages
    # cy left the written question as released: 0 of its 1 point, in the total (4 of 5), nothing to wait for
    assert Parts(html["cy"]).parts["why"] == (0, 1, "manual") and Parts(html["cy"]).max_score == 5
    assert "not answered (0 points)" in html["cy"] and "still to be graded by hand" not in html["cy"]
    # bo answered it and the instructor has not graded it: shown as waiting, its point not in the score yet
    assert Parts(html["bo"]).score == 2 and "awaiting grading by hand (not in the score yet)" in html["bo"]
    assert "1 points of written answers are still to be graded by hand" in html["bo"]
    assert done.awaiting == {"bo": ["why"]}


def test_what_the_student_wrote_is_escaped_and_saved_outputs_are_left_out(pages):
    _, html = pages
    assert "&lt;script&gt;alert('cy')&lt;/script&gt; &lt;img src=x onerror=alert(1)&gt;" in html["cy"]
    assert "<script" not in html["cy"] and "<img" not in html["cy"] and "javascript:" not in html["cy"]
    assert "Mine: <strong>bold</strong>" in html["cy"]  # the student's Markdown is still rendered
    assert "PRINTED-BY-KERNEL" not in html["cy"]  # what their kernel printed is not what was graded
    assert 'class="cell graded" id="cell-scale_tests"' in html["cy"]


def test_feedback_refuses_a_gradebook_made_from_other_submissions(course, tmp_path):
    root, source, _ = course
    submitted = tmp_path / "submitted"
    shutil.copytree(root / "submitted", submitted)
    nb = nbformat.read(submitted / "bo" / "ps0" / "ps0.ipynb", as_version=4)
    nb.cells[4].source = SCALE.format(body=KINDS["right"][1])  # bo fixed it after grading
    nbformat.write(nb, submitted / "bo" / "ps0" / "ps0.ipynb")
    with pytest.raises(ValueError, match="not made from these submissions of bo .*run the same grade"):
        write_feedback(source, submitted, root / "grades", tmp_path / "feedback")
    with pytest.raises(ValueError, match="has no gradebook.json: grade the class first"):
        write_feedback(source, submitted, tmp_path / "nothing", tmp_path / "feedback")
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(submitted / "ada" / "ps0" / "ps0.ipynb", flat / "ada.ipynb")
    with pytest.raises(ValueError, match="flat folder of notebooks: feedback needs nbgrader's submitted/"):
        write_feedback(source, flat, root / "grades", tmp_path / "feedback")
    assert not (tmp_path / "feedback").exists()


def test_the_command_writes_the_pages_and_says_what_is_missing(course, tmp_path, capsys):
    root, source, _ = course
    out = tmp_path / "feedback"
    assert main(["feedback", str(source), str(root / "submitted"), "--grades", str(root / "grades"),
                 "-o", str(out)]) == 0
    said = capsys.readouterr()
    assert "wrote 3 feedback pages under" in said.out
    assert "no feedback for dee: no submission_secret.txt" in said.err
    assert "bo's why not graded by hand yet" in said.err
    assert main(["feedback", str(source), str(root / "submitted"), "--grades", str(tmp_path / "none"),
                 "-o", str(out)]) == 1
    assert "grade the class first" in capsys.readouterr().err


@pytest.mark.nbgrader
def test_nbgrader_release_feedback_returns_each_page_under_its_secrets_hash(course, pages,
                                                                           nbgrader_env):  # noqa: F811
    """release_feedback takes our folder as its own: the exchange's file is named as fetch_feedback looks."""
    root, _, _ = course
    home, env = nbgrader_env
    shutil.copytree(root / "feedback", home / "feedback")
    exchange = home / "exchange"
    exchange.mkdir(mode=0o777)  # an instructor makes it once, for all (docs/classroom.md)
    done = subprocess.run([sys.executable, "-m", "nbgrader", "release_feedback", "ps0", "--course", "labkit",
                           f"--Exchange.root={exchange}"], cwd=home, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    from nbgrader.utils import notebook_hash

    released = {p.name: p.read_text() for p in (exchange / "labkit" / "feedback").iterdir()}
    _, html = pages
    assert released == {f"{notebook_hash(secret=SECRET[n], notebook_id='ps0')}.html": html[n]
                        for n in ("ada", "bo", "cy")}

