"""JupyterHub for a labkit class: one OS user per student, each server run as that user.

``classroom.py up`` writes ROOT/class.json (who, where, which ports) and starts the hub with this
file and LABKIT_CLASS=ROOT in its environment. Edit here what a course changes: the
authenticator (see docs/classroom.md for OAuth), timeouts, limits.
"""

import json
import os
from pathlib import Path

c = get_config()  # noqa: F821 (JupyterHub defines it)
root = Path(os.environ["LABKIT_CLASS"])
settings = json.loads((root / "class.json").read_text(encoding="utf-8"))
venv = Path(settings["venv"])

# Where: students reach the proxy; the hub's and the proxy's own APIs stay on loopback
c.JupyterHub.bind_url = f"http://{settings['ip']}:{settings['port']}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = settings["hub_port"]
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{settings['proxy_api_port']}"
# the Python configurable-http-proxy (classroom/requirements.txt); npm's is a drop-in: name its path here.
# Its wait for a server's answer defaults to tornado's 20 s, and nbgrader's Validate runs the whole
# notebook before it answers: on a busy machine the student got a 503. Ten minutes, as a cell may take.
c.ConfigurableHTTPProxy.command = [str(venv / "bin" / "configurable-http-proxy"), "--proxy-timeout=600000"]
c.ConfigurableHTTPProxy.pid_file = str(root / "hub" / "proxy.pid")
c.JupyterHub.pid_file = str(root / "hub" / "jupyterhub.pid")
c.JupyterHub.db_url = f"sqlite:///{root / 'hub' / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(root / "hub" / "jupyterhub_cookie_secret")

# Who: "pam" checks the OS users' passwords (classroom.py up sets them, ROOT/hub/passwords.csv);
# "dummy" takes any password (loopback only). For your institution's logins use an OAuthenticator
# whose user names are the OS users' (docs/classroom.md).
c.JupyterHub.authenticator_class = settings["authenticator"]
c.Authenticator.allowed_users = set(settings["students"])
c.Authenticator.admin_users = {settings["instructor"]}

# How: each server is a process of its own user. Not SimpleLocalProcessSpawner: it runs every server as
# the hub's user, and nbgrader names every submission after that user (collect keeps one and loses the rest).
c.JupyterHub.spawner_class = "localprocess"
c.Spawner.cmd = [str(venv / "bin" / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.start_timeout = 120  # a server imports JupyterLab and nbgrader: seconds, more on a busy machine
c.Spawner.http_timeout = 120
c.Spawner.environment = {
    "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",  # terminals find python, nbgrader, jupyter
    "LABKIT_CLASS": str(root),  # how `classroom.py down` finds every process of the class
}


def role_config(spawner):
    """Students get their config (no formgrader); the instructor gets the instructor's."""
    role = "instructor" if spawner.user.name == settings["instructor"] else "student"
    spawner.environment = {**spawner.environment, "JUPYTER_CONFIG_PATH": str(root / "etc" / role)}


c.Spawner.pre_spawn_hook = role_config
