#!/usr/bin/env python3
"""Stand up a JupyterHub for a labkit class, and take it down: one OS user per student, nbgrader's exchange.

    sudo python3 classroom/classroom.py up --students 30    # or --roster names.txt
    sudo python3 classroom/classroom.py down                # stop the hub, its proxy and every server
    sudo python3 classroom/classroom.py down --remove       # and delete the class's users, homes, files

``up`` builds the class's Python (ROOT/venv, from the system's python3: students' servers must be
able to read it), creates the users (homes under ROOT/home, mode 0700; PAM passwords in
ROOT/hub/passwords.csv), the instructor's nbgrader course folder (~instructor/course, with
labkit's problem sets in source/) and the exchange (ROOT/exchange), then runs the hub in the
foreground with ``classroom/jupyterhub_config.py``. Run it again to restart the hub: what exists
is kept. Only Python's standard library: it runs before the class's venv exists.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_ROOT = Path("/srv/labkit-class")
TAG = "labkit-class "  # + ROOT: the GECOS comment of every user up creates, and how down finds them
ENV = "LABKIT_CLASS"  # = ROOT in the environment of the hub, its proxy, every server and kernel
NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# what the students' servers must import; checked as a student before the hub starts
IMPORTS = "import jupyterhub.singleuser, jupyterlab, nbgrader, labkit.grading"


class ClassError(RuntimeError):
    """Something up or down cannot do; the message says how to fix it."""


# ---------------------------------------------------------------- the pieces


def closed_folder(path: Path) -> Path | None:
    """Return the first folder on the way to ``path`` that other users cannot enter, or None.

    >>> closed_folder(Path("/usr/bin/env")) is None
    True
    """
    for folder in [*reversed(path.resolve().parents), path.resolve()]:
        if folder.is_dir() and not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def free_port(ip: str = "127.0.0.1") -> int:
    """Return a TCP port on ``ip`` that nothing listens on now."""
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def assignments(folder: Path = REPO / "notebooks" / "exercises") -> dict[str, Path]:
    """Return the problem sets to put in the course, by assignment id: ``ps1_clipping.ipynb`` is ``ps1``.

    >>> sorted(assignments())[:1]
    ['ps1']
    """
    return {p.name.split("_", 1)[0]: p for p in sorted(folder.glob("ps*.ipynb"))}


def class_users(root: Path) -> list[pwd.struct_passwd]:
    """Return the OS users that ``up`` created for the class in ``root``."""
    return [u for u in pwd.getpwall() if u.pw_gecos == TAG + str(root)]


def ensure_user(name: str, root: Path) -> bool:
    """Create user ``name`` with a private home under ``root/home``; False if the class already has it."""
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        user = None
    if user is not None:
        if user.pw_gecos != TAG + str(root):
            raise ClassError(f"the user {name!r} exists and is not one this class created (its comment is "
                             f"{user.pw_gecos!r}): pick other names (--prefix, --roster) or another --root.")
        return False
    home = root / "home" / name
    run(["useradd", "--create-home", "--home-dir", str(home), "--shell", "/bin/bash", "--user-group",
         "--comment", TAG + str(root), name])
    home.chmod(0o700)  # Debian's useradd leaves homes readable by all: no student reads another's work
    return True


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """Run a system command (useradd, chpasswd...); raise ClassError with its message if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise ClassError(f"{' '.join(argv[:3])} ... failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout)[-1500:]}")
    return done


def as_user(name: str, argv: list[str]) -> list[str]:
    """Return ``argv`` run as user ``name`` (its uid, gid and groups, nothing of root's)."""
    gid = pwd.getpwnam(name).pw_gid
    return ["setpriv", f"--reuid={name}", f"--regid={gid}", "--init-groups", "--", *argv]


def build_venv(venv: Path, python: str) -> None:
    """Make the class's Python: a venv from ``python`` with the lab, nbgrader, the hub and labkit (a copy)."""
    blocked = closed_folder(Path(python))
    if blocked is not None:
        raise ClassError(f"{python} is under {blocked}, which other users cannot enter: students' servers "
                         "could not run it. Pass --python /usr/bin/python3 (the system's) or another Python "
                         "all users can read.")
    print(f"building the class's Python in {venv} (a few minutes the first time)", flush=True)
    run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "-r", "requirements.txt", "-r", "requirements-nbgrader.txt", "-r",
                    "classroom/requirements.txt"], cwd=REPO, check=True)
    # labkit itself as a copy, not editable from this checkout: the checkout may be private, and editing
    # it does not change what a running class imports
    subprocess.run([*pip, "--no-deps", "--force-reinstall", "."], cwd=REPO, check=True)


def check_readable(venv: Path, student: str) -> None:
    """Fail unless ``student`` can run the class's Python and import what a server needs."""
    python = venv / "bin" / "python"
    done = subprocess.run(as_user(student, [str(python), "-c", IMPORTS]), capture_output=True, text=True,
                          cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/"}, timeout=120)
    if done.returncode != 0:
        blocked = closed_folder(python)
        closed = f" ({blocked} is closed to them)" if blocked else ""
        raise ClassError(f"the students cannot run {python}{closed}: {done.stderr.strip()[-800:]}\nIts "
                         "interpreter and packages must be readable by every user: build the class's Python "
                         "from the system's python3 (the default, without --venv).")


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` for every user to read (the servers' config, class.json)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    path.chmod(0o644)


def server_config(root: Path) -> None:
    """Write the Jupyter config of the students' and the instructor's servers (ROOT/etc/<role>)."""
    for role in ("student", "instructor"):
        etc = root / "etc" / role
        # a login shell's /etc/profile resets PATH, and `nbgrader` would not be found in a terminal
        server = {"ServerApp": {"terminado_settings": {"shell_command": ["/bin/bash"]}}}
        if role == "student":  # the formgrader and the assignment creator are the instructor's tools
            server["ServerApp"]["jpserver_extensions"] = {"nbgrader.server_extensions.formgrader": False}
            write_json(etc / "labconfig" / "page_config.json", {"disabledExtensions": {
                "@jupyter/nbgrader:formgrader": True, "@jupyter/nbgrader:create-assignment": True}})
        write_json(etc / "jupyter_server_config.json", server)
        shutil.copyfile(HERE / "nbgrader_config.py", etc / "nbgrader_config.py")
        for path in [etc, *etc.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)


def course(root: Path, instructor: str) -> Path:
    """Make the instructor's nbgrader course folder, with labkit's problem sets in source/; return it."""
    user = pwd.getpwnam(instructor)
    folder = Path(user.pw_dir) / "course"
    new = [folder, folder / "source"]
    targets = {}
    for ident, notebook in assignments().items():
        new.append(folder / "source" / ident)
        targets[folder / "source" / ident / notebook.name] = notebook
    for path in new:
        path.mkdir(exist_ok=True)
    for target, notebook in targets.items():
        if not target.exists():  # never overwrite the instructor's edits
            shutil.copyfile(notebook, target)
    shutil.copyfile(HERE / "nbgrader_config.py", folder / "nbgrader_config.py")
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, user.pw_uid, user.pw_gid)
    exchange = root / "exchange"
    exchange.mkdir(exist_ok=True)
    exchange.chmod(0o1777)  # all write here (nbgrader keeps them apart); sticky: none deletes another's
    return folder


def set_passwords(root: Path, names: list[str]) -> None:
    """Give each new user a random password (PAM checks it); add it to ROOT/hub/passwords.csv (root only)."""
    if not names:
        return
    passwords = {name: secrets.token_urlsafe(9) for name in names}
    run(["chpasswd"], input="".join(f"{n}:{p}\n" for n, p in passwords.items()))
    path = root / "hub" / "passwords.csv"
    new = not path.exists()
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["user", "password"])
        writer.writerows(passwords.items())


def tagged(root: Path) -> list[int]:
    """Return the pids of the processes of the class in ``root``: the hub, its proxy, servers, kernels."""
    mark = f"{ENV}={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                pass
    return found


def owned_by(uids: set[int]) -> list[int]:
    """Return the pids of the processes of these users."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid in uids:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def kill(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``pids`` that still runs."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


# ---------------------------------------------------------------- the commands


def require_root() -> None:
    """Raise ClassError unless this runs as root."""
    if os.geteuid() != 0:
        raise ClassError("run it as root (sudo): it creates users and starts their servers as them.")


def up(args: argparse.Namespace) -> list[str]:
    """Prepare the class in ``args.root`` and return the hub's command line (``main`` runs it)."""
    require_root()
    root = Path(args.root).resolve()
    if any(ch in str(root) for ch in ":,\n"):
        raise ClassError(f"--root {root} holds ':' or ',': pick a plain path (it goes in /etc/passwd).")
    if args.authenticator == "dummy" and args.ip != "127.0.0.1":
        raise ClassError("the dummy authenticator lets anyone in as anyone: only with --ip 127.0.0.1. For a "
                         "class use pam (the default) or an OAuth authenticator (README: Run your class).")
    if args.roster:
        students = [line.strip() for line in Path(args.roster).read_text(encoding="utf-8").splitlines()
                    if line.strip() and not line.startswith("#")]
    else:
        students = [f"{args.prefix}{i:0{len(str(args.students))}d}" for i in range(1, args.students + 1)]
    bad = [n for n in [args.instructor, *students] if not NAME.fullmatch(n)]
    if bad or not students or len(set(students)) != len(students) or args.instructor in students:
        raise ClassError(f"bad user names {bad or students}: students need distinct names of lowercase "
                         "letters, digits, '_' and '-' (32 at most, not starting with a digit), the "
                         "instructor another one.")
    blocked = closed_folder(root)
    if blocked is not None:
        raise ClassError(f"{blocked} is closed to other users: the students' homes under {root} would be "
                         "unreachable. Pick a --root all users can enter (chmod o+x), e.g. "
                         "/srv/labkit-class.")
    root.mkdir(parents=True, exist_ok=True)
    (root / "home").mkdir(exist_ok=True)
    (root / "hub").mkdir(mode=0o700, exist_ok=True)
    venv = Path(args.venv).resolve() if args.venv else root / "venv"
    if not (venv / "bin" / "python").exists():
        if args.venv:
            raise ClassError(f"--venv {venv} has no bin/python.")
        build_venv(venv, args.python)
    settings = {"root": str(root), "venv": str(venv), "course_id": args.course_id, "ip": args.ip,
                "port": args.port, "hub_port": free_port(), "proxy_api_port": free_port(),
                "authenticator": args.authenticator, "instructor": args.instructor, "students": students}
    write_json(root / "class.json", settings)
    created = [name for name in [args.instructor, *students] if ensure_user(name, root)]
    if args.authenticator == "pam":
        set_passwords(root, created)
    check_readable(venv, students[0])
    server_config(root)
    folder = course(root, args.instructor)
    passwords = f"; passwords in {root / 'hub' / 'passwords.csv'}" if args.authenticator == "pam" else ""
    print(f"class {args.course_id}: {len(students)} students, instructor {args.instructor} (course: "
          f"{folder}); hub on http://{args.ip}:{args.port}{passwords}", flush=True)
    return [str(venv / "bin" / "python"), "-m", "jupyterhub", "-f", str(HERE / "jupyterhub_config.py")]


def down(root: Path, remove: bool = False, timeout: float = 30.0) -> list[str]:
    """Stop the class in ``root``: the hub (which stops the servers and proxy), then anything left of it.

    With ``remove``, also delete its users (and their homes) and ``root`` itself. Safe to run on a
    class that is not running, or half made (a killed run's leftovers). Return what it did.
    """
    require_root()
    root = root.resolve()
    done = []
    pid_file = root / "hub" / "jupyterhub.pid"
    hub = int(pid_file.read_text()) if pid_file.exists() and pid_file.read_text().strip().isdigit() else None
    pids = tagged(root)
    if hub in pids:  # the hub stops its servers and the proxy itself, each server saving what it can
        kill([hub], signal.SIGTERM)
        wait_gone([hub], timeout)
        done.append(f"stopped the hub ({hub})")
    left = tagged(root)
    users = class_users(root) if remove else []
    if remove:
        left += owned_by({u.pw_uid for u in users})
    if left:
        kill(left)
        wait_gone(left, 10)
        done.append(f"killed {len(left)} processes left")
    for user in users:
        run(["userdel", "--remove", user.pw_name])
        done.append(f"removed user {user.pw_name}")
    if remove and root.exists():
        shutil.rmtree(root)
        done.append(f"removed {root}")
    return done or [f"nothing of the class in {root} was running"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="classroom.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    u = commands.add_parser("up", help="create the class (what is missing) and run its hub in the foreground")
    who = u.add_mutually_exclusive_group(required=True)
    who.add_argument("--students", type=int, help="this many students, named PREFIX01, PREFIX02, ...")
    who.add_argument("--roster", type=Path, help="a file of student user names, one a line")
    u.add_argument("--prefix", default="student", help="the students' name prefix with --students")
    u.add_argument("--instructor", default="instructor", help="the instructor's user (admin, course owner)")
    u.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"where the class lives ({DEFAULT_ROOT})")
    u.add_argument("--course-id", default="labkit", help="nbgrader's course id (default labkit)")
    u.add_argument("--ip", default="0.0.0.0", help="the address students connect to (default: all)")
    u.add_argument("--port", type=int, default=8000, help="its port (default 8000)")
    u.add_argument("--authenticator", choices=["pam", "dummy"], default="pam",
                   help="pam: the users' passwords (default); dummy: any password, only on 127.0.0.1")
    u.add_argument("--python", default="/usr/bin/python3", help="the Python the class's venv is built from")
    u.add_argument("--venv", type=Path, help="use this environment instead of building ROOT/venv (students "
                   "must be able to read it)")
    d = commands.add_parser("down", help="stop the hub, its proxy and every server of the class")
    d.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"the class's folder ({DEFAULT_ROOT})")
    d.add_argument("--remove", action="store_true", help="also delete the class's users, homes and folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "down":
            for line in down(args.root, args.remove):
                print(line)
            return 0
        argv = up(args)
    except ClassError as e:
        print(f"classroom: {e}", file=sys.stderr)
        return 1
    os.chdir(Path(args.root).resolve() / "hub")
    os.execve(argv[0], argv, {**os.environ, ENV: str(Path(args.root).resolve())})


if __name__ == "__main__":
    sys.exit(main())
