"""Drive JupyterLab as a student does: a sandboxed server, and a notebook page in Chromium.

``LabServer`` runs ``jupyter lab`` with HOME, TMPDIR, the runtime, config, settings and
workspace folders all inside one scratch folder, so a test neither reads nor leaves anything
in the user's Jupyter setup. ``Notebook`` wraps a Playwright page on one notebook: it clicks
Run > Run All Cells, waits on JupyterLab's own model (through ``window.jupyterapp``, exposed
by ``--LabApp.expose_app_in_browser``) and reads values back from the kernel.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import quote

import numpy as np
from PIL import Image

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
CHROMIUM = Path(os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium"))
# As root Chromium needs --no-sandbox; the rest keep it off this machine's closed network
# (background, component-update and sync requests are refused, many at a time, and slow it).
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
RELEASE = "exercises/release"  # where the lab's copy holds the student version of each exercise

# The news pop-up and the update check would otherwise cover the page in screenshots (and
# ask PyPI); the notebook is rendered whole (no windowing), so every cell's output is in
# the DOM whether or not it is scrolled into view.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Return the pids of every process below ``pid`` (read from /proc; kernels included)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    """Return whether ``pid`` is a running process (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LabServer:
    """A ``jupyter lab`` on 127.0.0.1, a free port and a random token, in a scratch folder."""

    def __init__(self, root: Path, scratch: Path) -> None:
        self.root, self.scratch = root, scratch
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.log = scratch / "jupyter-lab.log"

    def env(self) -> dict[str, str]:
        dirs = {name: self.scratch / folder for name, folder in (
            ("HOME", "home"), ("TMPDIR", "tmp"), ("JUPYTER_RUNTIME_DIR", "runtime"),
            ("JUPYTER_CONFIG_DIR", "config"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
            ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"))}
        for folder in dirs.values():
            folder.mkdir(parents=True, exist_ok=True)
        for name, value in SETTINGS.items():
            path = dirs["JUPYTERLAB_SETTINGS_DIR"] / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        # The kernel spec says "python": this interpreter's folder goes first on PATH, so the
        # kernel is the Python that runs the tests (the venv), activated or not.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return {**os.environ, **{k: str(v) for k, v in dirs.items()}, "PATH": path}

    def start(self, timeout: float = 60.0) -> LabServer:
        """Start the server and wait until ``/api/status`` answers."""
        argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
                "--LabApp.expose_app_in_browser=True",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if os.geteuid() == 0:  # jupyter refuses to run as root without it; never pass it otherwise
            argv.append("--allow-root")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=self.root)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"jupyter lab exited with {self.proc.returncode}; its log:\n{self.log_tail()}"
                )
            try:
                self.api("GET", "/api/status")
                return self
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"jupyter lab did not answer /api/status in {timeout:g} s; its log:\n"
                                       f"{self.log_tail()}") from None
                time.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        return (
            "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}{'&' if '?' in path else '?'}token={self.token}"

    def api(self, method: str, path: str) -> object:
        """Call the server's REST API and return the decoded JSON (None when there is none)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            body = reply.read()
        return json.loads(body) if body else None

    def stop(self, timeout: float = 20.0) -> list[int]:
        """Shut the server and its kernels down; kill what is left. Return the pids that had to be killed."""
        if self.proc is None:
            return []
        procs = [self.proc.pid, *descendants(self.proc.pid)]
        # not up (or already gone): the signals below still run
        with contextlib.suppress(urllib.error.URLError, ConnectionError, OSError):
            self.api("POST", "/api/shutdown")  # shuts the kernels down first, then the server
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = [p for p in procs if alive(p)]
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc = None
        return killed


# The notebook panel for a path, from JupyterLab's shell (all later calls go through it); null
# while the page is still loading and JupyterLab has not set window.jupyterapp (a wait polls on;
# reading .shell of undefined would end it with a TypeError, as it did once in CI).
_FIND = """(path) => { if (!window.jupyterapp) return null;
                        for (const w of window.jupyterapp.shell.widgets('main'))
                        if (w.context && w.context.path === path) return w; return null; }"""


class Notebook:
    """One notebook open in JupyterLab, in a Playwright page."""

    def __init__(self, page, server: LabServer, path: str) -> None:  # type: ignore[no-untyped-def]
        self.page, self.server, self.path = page, server, path
        self._id: str | None = None

    @classmethod
    def open(cls, page, server: LabServer, path: str,  # type: ignore[no-untyped-def]
             timeout: float = 90.0) -> Notebook:
        """Open ``path`` in the lab on ``page`` (loading the lab first on a blank page); wait for its kernel.

        Later notebooks open as tabs of the same lab, as a student opens them: the lab's page
        loads once (about 3 s on two cores), not once per notebook.
        """
        nb = cls(page, server, path)
        if page.url == "about:blank":
            page.goto(server.url(f"/lab/workspaces/{uuid.uuid4().hex}/tree/{quote(path)}?reset"))
        else:
            page.evaluate(
                "(path) => { window.jupyterapp.commands.execute('docmanager:open', {path}); }", path
            )
        nb._wait(f"""(path) => {{ const nb = ({_FIND})(path);
                     return !!nb && nb.content.widgets.length > 0
                            && nb.sessionContext.kernelDisplayStatus === 'idle'; }}""",
                 timeout)
        return nb

    @property
    def root(self):  # type: ignore[no-untyped-def]
        """The locator of this notebook's own panel (other notebooks' tabs hold the same classes)."""
        if self._id is None:
            self._id = self._eval("return nb.content.id;")
        return self.page.locator(f'[id="{self._id}"]')

    def activate(self) -> None:
        """Bring this notebook's tab to the front (menus act on it; the mouse can reach its widgets)."""
        self._eval("window.jupyterapp.shell.activateById(nb.id);")
        self._wait(f"(path) => window.jupyterapp.shell.currentWidget === ({_FIND})(path)", 10.0)

    def _wait(self, predicate: str, timeout: float) -> None:
        self.page.wait_for_function(predicate, arg=self.path, timeout=timeout * 1000, polling=200)

    def _eval(self, body: str):  # type: ignore[no-untyped-def]
        return self.page.evaluate(f"(path) => {{ const nb = ({_FIND})(path); {body} }}", self.path)

    def run_all(self, timeout: float = 150.0) -> float:
        """Click Run > Run All Cells, wait until every code cell has run; return the seconds it took.

        A cell that raises stops Run All (later cells never run): the wait ends at the first
        error output, which is raised as an AssertionError naming its cell, at once rather than
        after ``timeout``. A cell tagged ``raises-exception`` (JupyterLab runs on past it) is not one.
        """
        start = time.perf_counter()
        self.activate()
        self.page.get_by_role("menuitem", name="Run", exact=True).click()
        self.page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        # Done = every code cell has an execution count and the kernel is idle again; stopped = an
        # error output (Run All clears every cell's outputs as it queues them, so it is this run's).
        outcome = self.page.wait_for_function(
            f"""(path) => {{ const nb = ({_FIND})(path); const cells = nb.content.model.cells;
                  let done = true;
                  for (let i = 0; i < cells.length; i++) {{ const c = cells.get(i);
                    if (c.type !== 'code') continue;
                    const tags = c.sharedModel.getMetadata().tags || [];
                    for (let j = 0; j < c.outputs.length; j++) {{ const o = c.outputs.get(j).toJSON();
                      if (o.output_type === 'error' && !tags.includes('raises-exception'))
                        return {{cell: i, ename: o.ename, evalue: o.evalue, traceback: o.traceback,
                                source: c.sharedModel.getSource()}}; }}
                    if (c.executionCount == null) done = false; }}
                  return done && nb.sessionContext.kernelDisplayStatus === 'idle'; }}""",
            arg=self.path, timeout=timeout * 1000, polling=200).json_value()
        if outcome is not True:
            source = "\n    ".join(outcome["source"].splitlines()[:6])
            # a bare assert has no message: name the line that raised (IPython's "---->" arrow)
            raised = [line for line in
                      re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(outcome["traceback"])).splitlines()
                      if line.startswith("---->")]
            raise AssertionError(f"{self.path}: Run All stopped at cell {outcome['cell']} after "
                                 f"{time.perf_counter() - start:.0f} s with {outcome['ename']}: "
                                 f"{outcome['evalue'] or (raised[-1] if raised else '')}\n"
                                 f"  the cell:\n    {source}")
        return time.perf_counter() - start

    def cells(self) -> list[dict]:
        """Return every cell as ``{type, source, outputs, count, metadata}`` from the page's model."""
        return self._eval("""const out = []; const cells = nb.content.model.cells;
            for (let i = 0; i < cells.length; i++) { const c = cells.get(i);
              out.push({type: c.type, source: c.sharedModel.getSource(),
                        metadata: c.sharedModel.getMetadata(),
                        outputs: c.type === 'code' ? c.outputs.toJSON() : [],
                        count: c.type === 'code' ? c.executionCount : null}); }
            return out;""")

    def errors(self) -> list[str]:
        """Return what the page shows as an error: error outputs, and widgets that failed to render."""
        found = [f"cell {i}: {o['ename']}: {o['evalue']}" for i, c in enumerate(self.cells())
                 for o in c["outputs"] if o["output_type"] == "error"]
        found += [f"widget: {text}" for text in self.root.get_by_text(
            "Error displaying widget").all_inner_texts()]
        return found

    def cell(self, containing: str):  # type: ignore[no-untyped-def]
        """Return the locator of the first cell whose source contains ``containing``."""
        sources = [c["source"] for c in self.cells()]
        index = next((i for i, s in enumerate(sources) if containing in s), None)
        assert index is not None, f"no cell of {self.path} contains {containing!r}"
        return self.root.locator(".jp-Cell").nth(index)

    def kernel(self, code: str, timeout: float = 60.0) -> str:
        """Run ``code`` in the notebook's kernel (unrecorded) and return what it printed."""
        result = self.page.evaluate(
            f"""async ([path, code]) => {{ const nb = ({_FIND})(path);
                const future = nb.sessionContext.session.kernel.requestExecute(
                    {{code, store_history: false}});
                let out = '', error = null;
                future.onIOPub = (msg) => {{
                  if (msg.header.msg_type === 'stream') out += msg.content.text;
                  if (msg.header.msg_type === 'error') error = msg.content.traceback.join('\\n'); }};
                await future.done; return {{out, error}}; }}""", [self.path, code])
        if result["error"] is not None:
            traceback = re.sub(r"\x1b\[[0-9;]*m", "", result["error"])  # IPython's colours
            raise AssertionError(f"kernel code failed:\n{code}\n{traceback}")
        return result["out"]

    def value(self, expression: str) -> object:
        """Return a Python expression's value from the kernel, through JSON."""
        return json.loads(
            self.kernel(f"import json as _j, numpy as np; print(_j.dumps({expression}))").strip()
        )

    def screenshot(self, path: Path, near=None) -> Path:  # type: ignore[no-untyped-def]
        """Save a screenshot of the page (scrolled to ``near`` if given) and return its path."""
        if near is not None:
            near.scroll_into_view_if_needed()
        self.page.screenshot(path=str(path))
        return path


def drag(slider, fraction: float) -> None:  # type: ignore[no-untyped-def]
    """Drag a slider's handle with the mouse to ``fraction`` (0 = left end, 1 = right end) of its track."""
    slider.scroll_into_view_if_needed()
    handle, track = (
        slider.locator(".noUi-handle").bounding_box(),
        slider.locator(".noUi-target").bounding_box(),
    )
    assert handle and track, "slider is not on screen"
    y = handle["y"] + handle["height"] / 2
    mouse = slider.page.mouse
    mouse.move(handle["x"] + handle["width"] / 2, y)
    mouse.down()
    mouse.move(track["x"] + fraction * track["width"], y, steps=8)
    mouse.up()  # continuous_update=False: the kernel hears of it on release


def type_into(slider, text: str) -> None:  # type: ignore[no-untyped-def]
    """Type a value into a slider's readout and press Enter, as a student can instead of dragging."""
    readout = slider.locator(".widget-readout")
    readout.click()
    readout.press("Control+A")
    readout.press_sequentially(text)
    readout.press("Enter")


def canvas_pixels(dashboard) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Return the RGBA pixels the ipympl canvas shows now (its bottom layer: the figure)."""
    canvas = dashboard.locator("canvas").first
    url = canvas.evaluate("(c) => c.toDataURL('image/png')")
    assert url.startswith("data:image/png;base64,"), \
        f"the canvas is empty (width, height {canvas.evaluate('(c) => [c.width, c.height]')})"
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGBA"))


def changed_fraction(before: np.ndarray, after: np.ndarray) -> float:
    """Return the fraction of pixels that differ between two canvas images."""
    if before.shape != after.shape:
        return 1.0
    return float((before != after).any(axis=-1).mean())


def wait_for_redraw(dashboard, before: np.ndarray, timeout: float = 20.0) -> float:  # type: ignore[no-untyped-def]
    """Wait until the canvas differs from ``before``; return the fraction of pixels that changed.

    The new picture reaches the page after the run that made it (the page asks for it).
    """
    deadline = time.monotonic() + timeout
    while True:
        fraction = changed_fraction(before, canvas_pixels(dashboard))
        if fraction > 0 or time.monotonic() > deadline:
            return fraction
        time.sleep(0.1)
