"""A class on JupyterHub, end to end on loopback: from release to feedback, graded in the sandbox.

``classroom/classroom.py up`` stands the hub up as an instructor would (PAM passwords, one OS user
per student, LocalProcessSpawner, the Python configurable-http-proxy) for an instructor and three
students, with homes under a temporary folder. As the instructor's OS user: release ps1 (and every
other problem set in notebooks/exercises/). Student 1 logs in with Chromium and sees them in the
Assignments panel. Students 1 and 2 fetch ps1, edit it through the contents API (one right, one with a
classic bug), validate and submit through nbgrader's server extension, as the panel does, each with a
token scoped to their own server (student 3's token gets 403 on theirs). The instructor collects;
``python -m labkit.grading grade`` grades the collected folder in the sandbox; ``feedback`` writes the
pages and ``nbgrader release_feedback`` returns them; each student fetches theirs, with the gradebook's
points part by part. Then ``classroom.py down --remove`` leaves no process, user or file.

Every wait is bounded. The class's folder is named for this process (pid and start time): a run
killed midway leaves it, its users and processes behind, and the next run removes them first.
Needs root, bubblewrap, JupyterHub and its proxy (classroom/requirements.txt), nbgrader, Chromium and a
system python3 of this Python's version (students' servers cannot read a Python under /root): without
one the module skips, saying which; under CI=true it fails.
"""

import csv
import importlib.util
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE / "browser"), str(HERE.parent / "classroom")]
from lab_driver import CHROMIUM, CHROMIUM_ARGS, free_port  # noqa: E402
from test_grading import AUTOGRADED, solution  # noqa: E402
from test_grading_feedback import Parts  # noqa: E402
from test_grading_nbgrader import ANSWERS, SKIP_NAN_ONLY  # noqa: E402

import classroom  # noqa: E402

pytestmark = [pytest.mark.classroom, pytest.mark.timeout(600)]
WORK = "labkit-class-"  # + "<pid>.<start time>-": the class folder of one run of this module
PS1 = "ps1_clipping_and_scaling.ipynb"
WRITTEN = "Before unscaling, the norm is the loss scale times too large, so the threshold would be wrong."


def _started(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def missing() -> list[str]:
    """What this machine lacks to run a class, each with how to get it."""
    out = []
    if os.geteuid() != 0:
        out.append("root (it creates users and starts servers as them): run pytest as root")
    if shutil.which("bwrap") is None:
        out.append("bubblewrap (apt-get install bubblewrap)")
    for module, what in (("jupyterhub", "JupyterHub"), ("configurable_http_proxy", "configurable-http-proxy"),
                         ("nbgrader", "nbgrader")):
        if importlib.util.find_spec(module) is None:
            out.append(f"{what} (pip install -r classroom/requirements.txt -r requirements-nbgrader.txt)")
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        out.append(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    return out


def need_a_class_machine() -> None:
    lacking = missing()
    if lacking:
        message = "a class on JupyterHub needs " + "; ".join(lacking)
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {message}: .ci/run installs them", pytrace=False)
        pytest.skip(message)


def students_python(dest: Path) -> Path:
    """Return an environment students' servers can run: this venv, or a view of it from the system's python3.

    A venv from pyenv's Python under /root (CI's, mode 0700) gives students "Permission denied".
    Building the class's venv costs minutes; instead, a venv from /usr/bin/python3 (same minor
    version, so the same compiled packages) whose site-packages, share/ and etc/ are this venv's,
    and whose scripts are this venv's with their first line pointed at it: a fraction of a second.
    """
    if classroom.closed_folder(Path(sys.executable)) is None:
        return Path(sys.prefix)
    system = Path("/usr/bin/python3")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    found = subprocess.run([str(system), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True).stdout.strip() if system.exists() else "none"
    site = Path(sys.prefix) / "lib" / f"python{version}" / "site-packages"
    blocked = classroom.closed_folder(site)
    if found != version or blocked is not None:
        why = (f"{blocked} is closed to other users" if blocked else
               f"/usr/bin/python3 is Python {found}, this venv's is {version}")
        message = (f"the students' servers need a Python they can read: {Path(sys.executable).resolve()} "
                   f"is not, and {why}")
        if os.environ.get("CI") == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(dest)], check=True, timeout=60)
    ours = dest / "lib" / f"python{version}" / "site-packages"
    ours.rmdir()
    ours.symlink_to(site)
    for name in ("share", "etc"):
        (dest / name).symlink_to(Path(sys.prefix) / name)
    shebang = f"#!{sys.prefix}/bin/python".encode()
    for script in (Path(sys.prefix) / "bin").iterdir():
        target = dest / "bin" / script.name
        if script.is_file() and not script.is_symlink() and not target.exists():
            text = script.read_bytes()
            if text.startswith(shebang):
                target.write_bytes(f"#!{dest}/bin/python\n".encode() + text.split(b"\n", 1)[1])
                target.chmod(0o755)
    return dest


def sweep_stale() -> list[Path]:
    """Take down the classes that killed runs of this module left (their process is gone); return them."""
    tmp = Path(tempfile.gettempdir())
    roots = set(tmp.glob(f"{WORK}*.*-*"))
    roots |= {Path(u.pw_gecos[len(classroom.TAG):]) for u in pwd.getpwall()
              if u.pw_gecos.startswith(classroom.TAG + str(tmp / WORK))}
    stale = []
    for root in sorted(roots):
        pid, _, started = root.name[len(WORK):].split("-", 1)[0].partition(".")
        if pid.isdigit() and _started(int(pid)) != started:
            classroom.down(root, remove=True)
            stale.append(root)
    return stale


class Hub:
    """The hub's public address, the class's passwords, and HTTP through the proxy (every call bounded)."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.base = root, f"http://127.0.0.1:{port}"
        self.settings = json.loads((root / "class.json").read_text())
        self.passwords = dict(csv.reader((root / "hub" / "passwords.csv").open()))

    def call(self, method, path, token=None, body=None, form=None, timeout=60.0):
        """Return (status, parsed JSON or text) of one request."""
        data = json.dumps(body).encode() if body is not None else urllib.parse.urlencode(form).encode() \
            if form is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if token:
            request.add_header("Authorization", f"token {token}")
        if data is not None:
            request.add_header("Content-Type", "application/json" if body is not None else
                               "application/x-www-form-urlencoded")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                status, text = reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode(errors="replace")
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def token(self, user, scopes=None):  # type: ignore[no-untyped-def]
        """A token the user asks for with their password (PAM checks it), with these scopes or all theirs."""
        body = {"auth": {"username": user, "password": self.passwords[user]}}
        if scopes:
            body["scopes"] = scopes
        status, reply = self.call("POST", f"/hub/api/users/{user}/tokens", body=body)
        assert status in (200, 201), (user, status, reply)
        return reply["token"]

    def wait_ready(self, user, admin, timeout=180.0):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            status, reply = self.call("GET", f"/hub/api/users/{user}", admin)
            if status == 200 and reply["servers"].get("", {}).get("ready"):
                return
            assert time.monotonic() < deadline, f"{user}'s server not ready after {timeout:g} s: {reply}"
            time.sleep(0.5)


def start_hub(root: Path, log: Path, venv: Path, prefix: str) -> tuple[subprocess.Popen, Hub]:
    """Run ``classroom.py up`` (which becomes the hub) and wait until the hub answers through the proxy."""
    port = free_port()
    argv = [sys.executable, str(HERE.parent / "classroom" / "classroom.py"), "up", "--root", str(root),
            "--students", "3", "--prefix", f"{prefix}s", "--instructor", f"{prefix}i", "--ip", "127.0.0.1",
            "--port", str(port), "--venv", str(venv)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"classroom.py up exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/hub/api/", timeout=5) as reply:
                if reply.status == 200:
                    return proc, Hub(root, port)
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the hub did not answer in 180 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def as_instructor(hub: Hub, argv: list[str], timeout: float = 180.0) -> str:
    """Run ``argv`` as the instructor's OS user in the course folder, as from a terminal on the hub."""
    name = hub.settings["instructor"]
    home = Path(pwd.getpwnam(name).pw_dir)
    env = {"HOME": str(home), "PATH": f"{hub.settings['venv']}/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    done = subprocess.run(classroom.as_user(name, argv), cwd=home / "course", env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} as the instructor: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def own_thread(fn, *args):  # type: ignore[no-untyped-def]
    """Call ``fn(*args)`` in a thread of its own, where no asyncio loop runs.

    In a worker that ran the browser tests first, pytest-playwright's session-wide Playwright keeps
    an asyncio loop running in the main thread: a second ``sync_playwright()`` there refuses to start
    and ``asyncio.run()`` raises.
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def assignments_panel(hub: Hub, student: str, released: list[str]) -> dict:
    """Log ``student`` in with Chromium, open Nbgrader > Assignment List; return what it shows."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.set_default_timeout(180_000)  # the login spawns the student's server: more under load
            page.goto(hub.base + "/hub/login")
            page.fill("#username_input", student)
            page.fill("#password_input", hub.passwords[student])
            page.click("#login_submit")
            page.wait_for_url(f"**/user/{student}/lab**")
            page.get_by_role("menuitem", name="Nbgrader", exact=True).click()
            menu = page.locator(".lm-Menu").last.inner_text()
            page.get_by_role("menuitem", name="Assignment List", exact=True).click()
            listed = page.locator("#released_assignments_list")
            for name in released:
                listed.get_by_text(name, exact=True).wait_for()
            return {"url": page.url, "menu": menu, "released": listed.inner_text()}
        finally:
            browser.close()


def work(hub: Hub, student: str, answers: dict[str, str], written: str | None) -> dict:
    """What a student does in the panel: fetch ps1, fill it in (the contents API), validate, submit."""
    token = hub.token(student, [f"access:servers!user={student}"])
    course = {"course_id": hub.settings["course_id"], "assignment_id": "ps1"}
    status, fetched = hub.call("POST", f"/user/{student}/assignments/fetch", token, form=course)
    assert status == 200 and fetched["success"], fetched
    path = f"/user/{student}/api/contents/ps1/{PS1}"
    status, model = hub.call("GET", path, token)
    assert status == 200, model
    nb = model["content"]
    for cell in nb["cells"]:
        gid = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if gid in answers:
            cell["source"] = answers[gid]
        elif gid == "why_unscale_first" and written is not None:
            cell["source"] = written
    status, _ = hub.call("PUT", path, token, body={"type": "notebook", "format": "json", "content": nb})
    assert status == 200
    status, validated = hub.call("POST", f"/user/{student}/assignments/validate", token,
                                 form={"path": f"ps1/{PS1}"}, timeout=300)
    assert status == 200 and validated["success"], validated
    status, submitted = hub.call("POST", f"/user/{student}/assignments/submit", token, form=course)
    assert status == 200 and submitted["success"], submitted
    return {"token": token, "handed_in": nb, "validated": validated["value"]}


def in_terminal(hub: Hub, student: str, token: str, command: str, timeout: float = 60.0) -> str:
    """Run ``command`` in a new JupyterLab terminal of ``student``, over its websocket through the proxy."""
    import asyncio

    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    status, term = hub.call("POST", f"/user/{student}/api/terminals", token)
    assert status == 200, term
    url = f"{hub.base.replace('http', 'ws', 1)}/user/{student}/terminals/websocket/{term['name']}"

    async def talk() -> str:
        conn = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"},
                                                   connect_timeout=timeout, request_timeout=timeout))
        # the shell prints END-42 only by running the line (its echo shows END-$((6*7)))
        conn.write_message(json.dumps(["stdin", f"{command}; echo END-$((6*7))\r"]))
        out = ""
        while "END-42" not in out:
            message = await asyncio.wait_for(conn.read_message(), timeout)
            assert message is not None, f"the terminal closed: {out}"
            kind, *data = json.loads(message)
            out += data[0] if kind == "stdout" else ""
        conn.close()
        return out

    try:
        return asyncio.run(talk())
    finally:
        hub.call("DELETE", f"/user/{student}/api/terminals/{term['name']}", token)


@pytest.fixture(scope="module")
def lesson(tmp_path_factory):
    """Run the class from release to feedback; return what each step left, and each step's seconds."""
    need_a_class_machine()
    sweep_stale()
    root = Path(tempfile.mkdtemp(prefix=f"{WORK}{os.getpid()}.{_started(os.getpid())}-"))
    root.chmod(0o755)  # the students' homes are below it
    log = tmp_path_factory.mktemp("classroom") / "hub.log"
    seconds, start = {}, time.monotonic()

    def step(name):  # type: ignore[no-untyped-def]
        seconds[name] = round(time.monotonic() - start - sum(seconds.values()), 1)

    try:
        venv = students_python(root / "venv")
        step("students' Python")
        proc, hub = start_hub(root, log, venv, "lk" + secrets.token_hex(2))
        instructor, (s1, s2, s3) = hub.settings["instructor"], hub.settings["students"]
        step("up")
        released = sorted(classroom.assignments())
        for ident in released:
            source = f"source/{ident}/{classroom.assignments()[ident].name}"
            as_instructor(hub, ["python", "-m", "labkit.grading", "release", source, "-o",
                                f"release/{ident}"])
            as_instructor(hub, ["nbgrader", "release_assignment", ident])
        step("release")
        panel = own_thread(assignments_panel, hub, s1, released)
        step("Chromium: login, Assignments panel")
        admin = hub.token(instructor)
        status, _ = hub.call("POST", f"/hub/api/users/{s2}/server", admin)
        assert status in (201, 202), status
        hub.wait_ready(s2, admin)
        intruder = hub.token(s3, [f"access:servers!user={s3}"])
        denied = {target: hub.call("GET", f"/user/{target}/api/contents/ps1", intruder)[0]
                  for target in (s1, s2)}
        step("second server, tokens")
        right = {a: solution(a) for a in ANSWERS}
        with ThreadPoolExecutor(2) as pool:
            done = {s1: pool.submit(work, hub, s1, right, WRITTEN),
                    s2: pool.submit(work, hub, s2, {**right, "skip_answer": SKIP_NAN_ONLY}, None)}
            students = {name: future.result() for name, future in done.items()}
        cross = hub.call("GET", f"/user/{s2}/api/contents/ps1/{PS1}", students[s1]["token"])[0]
        step("fetch, edit, validate, submit")
        terminal = own_thread(in_terminal, hub, s1, students[s1]["token"],
                              "command -v python nbgrader; id -un")
        home = Path(pwd.getpwnam(s2).pw_dir)
        peeks = {what: subprocess.run(classroom.as_user(s1, argv), capture_output=True, text=True, timeout=30)
                 for what, argv in (("home", ["cat", str(home / "ps1" / PS1)]),
                                    ("inbound", ["ls", str(root / "exchange" / "labkit" / "inbound")]))}
        step("terminal, peeking")
        as_instructor(hub, ["nbgrader", "collect", "ps1"])
        step("collect")
        course = Path(pwd.getpwnam(instructor).pw_dir) / "course"
        (course / "manual.csv").write_text(f"student,grade_id,points,comment\n{s1},why_unscale_first,1.5,"
                                           "say where the scale comes from\n")
        # as root, with this venv: the sandbox binds the grader's own Python and packages (the view above is
        # links into this venv), and runs each submission as nobody; an instructor grades in the class's venv
        graded = subprocess.run([sys.executable, "-m", "labkit.grading", "grade", f"source/ps1/{PS1}",
                                 "submitted/", "--assignment", "ps1", "--out", "grades/ps1", "--jobs", "2",
                                 "--manual", "manual.csv"], cwd=course, capture_output=True, text=True,
                                timeout=400)
        assert graded.returncode == 0, graded.stdout + graded.stderr
        step("grade (sandbox)")
        as_instructor(hub, ["python", "-m", "labkit.grading", "feedback", f"source/ps1/{PS1}", "submitted/",
                            "--assignment", "ps1", "--grades", "grades/ps1", "-o", "feedback/"])
        as_instructor(hub, ["nbgrader", "release_feedback", "ps1"])
        step("feedback, release_feedback")
        fetched = {}
        for name in (s1, s2):
            token = students[name]["token"]
            status, listed = hub.call("POST", f"/user/{name}/assignments/fetch_feedback", token,
                                      form={"course_id": hub.settings["course_id"], "assignment_id": "ps1"})
            assert status == 200 and listed["success"], listed
            status, folder = hub.call("GET", f"/user/{name}/api/contents/ps1/feedback", token)
            [stamp] = folder["content"]
            html = urllib.parse.quote(f"{stamp['path']}/{PS1[:-6]}.html")
            status, page = hub.call("GET", f"/user/{name}/api/contents/{html}?content=1", token)
            assert status == 200, page
            fetched[name] = page["content"]
        step("fetch_feedback")
        yield {"hub": hub, "proc": proc, "root": root, "course": course, "panel": panel, "denied": denied,
               "cross": cross, "students": students, "fetched": fetched, "released": released,
               "terminal": terminal, "peeks": peeks,
               "book": json.loads((course / "grades" / "ps1" / "gradebook.json").read_text()),
               "uids": {pwd.getpwnam(n).pw_uid for n in [instructor, s1, s2, s3]}, "seconds": seconds}
    finally:
        print(f"classroom steps (s): {seconds}; hub log: {log}")
        classroom.down(root, remove=True)  # a no-op after test_down_...; the cleanup when a step failed


def test_a_student_logs_in_and_sees_the_problem_sets_in_the_assignments_panel(lesson):
    panel = lesson["panel"]
    s1 = lesson["hub"].settings["students"][0]
    assert f"/user/{s1}/lab" in panel["url"]
    assert "ps1" in lesson["released"]
    assert panel["released"].split() == [word for ident in lesson["released"]
                                         for word in (ident, "labkit", "Fetch")]
    # the instructor's tools are not in a student's menu
    assert "Assignment List" in panel["menu"] and "Formgrader" not in panel["menu"]


def test_a_students_token_opens_only_their_own_server(lesson):
    assert lesson["denied"] == {name: 403 for name in lesson["hub"].settings["students"][:2]}
    assert lesson["cross"] == 403


def test_a_student_cannot_read_another_students_work_on_disk(lesson):
    for what, peek in lesson["peeks"].items():
        assert peek.returncode != 0 and "Permission denied" in peek.stderr, (what, peek)


def test_a_terminal_through_the_proxy_finds_the_class_tools_as_the_student(lesson):
    venv = lesson["hub"].settings["venv"]
    lines = [line.strip() for line in lesson["terminal"].splitlines()]
    assert f"{venv}/bin/python" in lines and f"{venv}/bin/nbgrader" in lines, lines  # not a login PATH
    assert lesson["hub"].settings["students"][0] in lines


def test_validate_passes_the_right_notebook_and_shows_the_bug_in_the_other(lesson):
    s1, s2, _ = lesson["hub"].settings["students"]
    assert lesson["students"][s1]["validated"] == {}  # nbgrader's "success": no failed cell
    failed = lesson["students"][s2]["validated"]["failed"]
    assert [("check_skip_decision(skip_reason)" in f["source"], "nonfinite_grad" in f["error"])
            for f in failed] == [(True, True)], failed


def test_collect_gets_each_students_own_submission(lesson):
    course = lesson["course"]
    for name, did in lesson["students"].items():
        folder = course / "submitted" / name / "ps1"
        assert {p.name for p in folder.iterdir()} == {PS1, "timestamp.txt", "submission_secret.txt"}
        handed_in = json.loads((folder / PS1).read_text())
        text = ["".join(c["source"]) for c in handed_in["cells"]]  # nbformat writes sources as lists of lines
        assert text == [c["source"] for c in did["handed_in"]["cells"]]


def test_the_collected_class_is_graded_in_the_sandbox_part_by_part(lesson):
    s1, s2, _ = lesson["hub"].settings["students"]
    book = {s["student"]: s for s in lesson["book"]["students"]}
    assert sorted(book) == [s1, s2]
    parts = {name: {p["grade_id"]: (p["points"], p["status"]) for p in book[name]["parts"]} for name in book}
    assert parts[s1] == {**{g: (p, "ok") for g, p in AUTOGRADED.items()},
                         "why_unscale_first": (1.5, "hand-graded")}
    assert parts[s2] == {**{g: (p, "ok") for g, p in AUTOGRADED.items()}, "skip_tests": (0, "failed"),
                         "why_unscale_first": (0, "manual")}
    assert (book[s1]["score"], book[s2]["score"], book[s1]["max_score"]) == (12.5, 9, 13)
    for name in (s1, s2):
        result = json.loads((lesson["course"] / "grades" / "ps1" / "results" / f"{name}.json").read_text())
        assert result["sandbox"] == "bwrap" and result["tampering"] == []


def test_each_student_fetches_feedback_with_the_gradebooks_points_part_by_part(lesson):
    book = {s["student"]: s for s in lesson["book"]["students"]}
    for name, page in lesson["fetched"].items():
        assert page == (lesson["course"] / "feedback" / name / "ps1" / f"{PS1[:-6]}.html").read_text()
        shown = Parts(page)
        assert (shown.score, shown.max_score) == (book[name]["score"], book[name]["max_score"])
        assert shown.parts == {p["grade_id"]: (p["points"], p["max_points"], p["status"])
                               for p in book[name]["parts"]}
    s1, s2, _ = lesson["hub"].settings["students"]
    assert "graded by hand: say where the scale comes from" in lesson["fetched"][s1]
    assert "not answered (0 points)" in lesson["fetched"][s2]
    assert "expected &#x27;nonfinite_grad&#x27;" in lesson["fetched"][s2]  # the grader's hint, escaped


def test_down_leaves_no_process_user_or_file(lesson):
    root = lesson["root"]
    before = classroom.tagged(root)
    assert lesson["proc"].pid in before and len(before) >= 4  # the hub, its proxy, two servers (and kernels)
    done = subprocess.run([sys.executable, str(HERE.parent / "classroom" / "classroom.py"), "down", "--root",
                           str(root), "--remove"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert lesson["proc"].wait(timeout=10) is not None
    assert classroom.tagged(root) == [] and classroom.owned_by(lesson["uids"]) == []
    assert classroom.class_users(root) == [] and not root.exists()
    assert f"stopped the hub ({lesson['proc'].pid})" in done.stdout


def test_a_killed_runs_leftovers_go_at_the_next_start(tmp_path):
    """A run killed with SIGKILL leaves its folder, users and processes: the next start removes them."""
    need_a_class_machine()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True)
    root = Path(tempfile.gettempdir()) / f"{WORK}{int(gone.stdout)}.{_started(os.getpid())}-killed"
    (root / "home").mkdir(parents=True)
    root.chmod(0o755)
    name = "lk" + secrets.token_hex(2) + "k"
    try:
        assert classroom.ensure_user(name, root)
        env = {"PATH": "/usr/bin:/bin", classroom.ENV: str(root)}
        left = [subprocess.Popen(["sleep", "600"], env=env, start_new_session=True),  # a proxy, say
                subprocess.Popen(classroom.as_user(name, ["sleep", "600"]),  # a kernel, say
                                 start_new_session=True)]
        uid = pwd.getpwnam(name).pw_uid
        assert root in sweep_stale()
        assert [p.wait(timeout=10) for p in left] == [-signal.SIGKILL] * 2
        assert classroom.class_users(root) == [] and classroom.owned_by({uid}) == [] and not root.exists()
    finally:
        classroom.down(root, remove=True)


def test_up_refuses_what_it_cannot_do_before_changing_anything(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("up needs root")
    closed = tmp_path / "class"  # pytest's tmp folders are 0700: students could not reach homes below
    base = ["up", "--root", str(closed), "--students", "2", "--prefix", "lkz", "--instructor", "lkzi"]
    for extra, said in ((["--authenticator", "dummy"], "the dummy authenticator lets anyone in as anyone"),
                        ([], "is closed to other users: the students' homes"),
                        (["--instructor", "Bad Name"], "bad user names ['Bad Name']")):
        assert classroom.main(base + extra) == 1
        assert said in capsys.readouterr().err
    assert classroom.class_users(closed) == [] and not (closed / "home").exists()
