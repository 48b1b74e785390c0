"""Run one submission's harness in a bubblewrap sandbox, with limits and a hard wall clock.

What the student's code gets (``bwrap``, https://github.com/containers/bubblewrap): a fresh
root holding only /usr, this Python and its packages (read-only), labkit's own package
(read-only, at /labkit/labkit), the job (read-only, /job) and an output folder (/out); a
private /tmp; its own PID, network (none), IPC and UTS namespaces; a new session; the
unprivileged user ``nobody`` (65534) when the grader runs as root (``setpriv`` drops
every capability), the grader's own user otherwise (in a user namespace). So no instructor
file, gradebook, other submission, network or writable labkit is there to reach.
``prlimit`` caps memory, CPU time, processes and file size; the grader kills the whole
session at the end or when the wall clock runs out (the PID namespace takes every process
with it, ``setsid`` children included). Without ``bwrap`` grading refuses to start
(``SandboxMissing``), unless the instructor passes ``--no-sandbox`` for trusted notebooks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Limits", "Outcome", "SandboxError", "SandboxMissing", "command", "run", "unsandboxed"]

NOBODY = 65534
INSTALL = "apt-get install bubblewrap"


class SandboxError(RuntimeError):
    """The sandbox could not run the harness: grading stops rather than give the student zeros."""


class SandboxMissing(SandboxError):
    """bwrap (or setpriv, for a root grader) is not installed: grading student code would be unsafe."""


@dataclass(frozen=True)
class Limits:
    """What one submission may use: ``wall`` seconds in all, ``memory`` bytes, ``processes``, ``output``
    bytes."""

    wall: float = 600.0
    memory: int = 4 << 30  # address space; torch maps ~1.5 GiB just by importing
    processes: int = 512  # counts threads, for the user all sandboxes share (torch starts a few per process)
    output: int = 1 << 20  # of stdout+stderr kept; the rest is dropped, not stored
    file_size: int = 64 << 20


@dataclass
class Outcome:
    """How the sandboxed run ended: exit code (negative: signal), killed at the wall clock, and its output."""

    returncode: int
    timed_out: bool
    output: str
    seconds: float


def _dirs(path: str, made: set[str]) -> list[str]:
    """bwrap arguments that create ``path``'s parents readable by all (bwrap makes them 0700 otherwise)."""
    args = []
    parts = Path(path).parts
    for i in range(2, len(parts)):
        parent = str(Path(*parts[:i]))
        if parent not in made:
            made.add(parent)
            args += ["--perms", "0755", "--dir", parent]
    return args


def command(job: Path, out: Path, limits: Limits) -> list[str]:
    """Return the argv that runs the harness on ``job`` in the sandbox, writing into ``out``."""
    bwrap = shutil.which("bwrap")
    prlimit = shutil.which("prlimit")
    root = os.geteuid() == 0
    setpriv = shutil.which("setpriv")
    if bwrap is None or prlimit is None or (root and setpriv is None):
        raise SandboxMissing(
            "grading runs each submission in a bubblewrap sandbox, but "
            f"{'bwrap' if bwrap is None else 'prlimit or setpriv'}"
            f" is not installed: {INSTALL} (util-linux has prlimit and setpriv), or pass --no-sandbox "
            "to grade notebooks you trust (your own solutions) without isolation.")
    import labkit

    labkit_dir = str(Path(labkit.__file__).parent)
    made: set[str] = {"/usr"}
    args = [prlimit, f"--as={limits.memory}", f"--nproc={limits.processes}", f"--cpu={int(limits.wall) + 5}",
            f"--fsize={limits.file_size}", "--core=0", "--",
            bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr",
            # the private /tmp first: a checkout or venv under /tmp (CI clones there) is bound on top of it
            "--perms", "1777", "--size", str(256 << 20), "--tmpfs", "/tmp"]
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
    for prefix in sorted({sys.base_prefix, sys.prefix}):
        if not prefix.startswith("/usr/"):
            args += _dirs(prefix, made) + ["--ro-bind", prefix, prefix]
    args += ["--perms", "0755", "--dir", "/labkit", "--ro-bind", labkit_dir, "/labkit/labkit",
             "--ro-bind", str(job), "/job", "--bind", str(out), "/out",
             "--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp"]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": "/labkit", "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    for key, value in env.items():
        args += ["--setenv", key, value]
    python = [sys.executable, "-m", "labkit.grading.harness", "/job/job.json", "/out"]
    if root:  # bwrap keeps only what setpriv needs to become nobody, and setpriv drops it
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
                 setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs", *python]
        os.chown(out, NOBODY, NOBODY)
    else:
        args += ["--unshare-user", "--", *python]
    return args


def unsandboxed(job: Path, out: Path, limits: Limits) -> list[str]:
    """Return the argv for ``--no-sandbox``: the same harness, limits and session, but the grader's view
    and user.

    Without a PID namespace a child that calls ``setsid`` leaves the session and can outlive the kill.
    """
    prlimit = shutil.which("prlimit")
    python = [sys.executable, "-m", "labkit.grading.harness", str(job / "job.json"), str(out)]
    if prlimit is None:
        return python
    return [prlimit, f"--as={limits.memory}", f"--cpu={int(limits.wall) + 5}", f"--fsize={limits.file_size}",
            "--core=0", "--", *python]


def run(argv: list[str], limits: Limits, env: dict[str, str] | None = None) -> Outcome:
    """Run ``argv`` in a new session; kill the whole session when it ends or after ``limits.wall`` seconds.

    The wall clock holds whatever the code does with signals: the kill is SIGKILL, to the
    process group; output beyond ``limits.output`` bytes is read and dropped.
    """
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    kept = bytearray()

    def drain() -> None:
        while chunk := proc.stdout.read1(65536):
            if len(kept) < limits.output:
                kept.extend(chunk[: limits.output - len(kept)])

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.wall)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # survivors of a clean exit too (unsandboxed setsid children aside)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
    return Outcome(proc.returncode, timed_out, kept.decode("utf-8", "replace"), time.monotonic() - start)
