"""The agent and the wait_http probe start isolated (`PYTHON -S -E -s`): a host whose Python
environment runs code at start-up cannot break them.

A lab host (real sshd) gets the traps a real login can carry, each of which writes a mark and
prints junk on stdout when it runs:

* the SSH session's environment (``~/.ssh/environment``, ``PermitUserEnvironment yes``):
  ``PYTHONPATH`` = a directory with a ``sitecustomize.py``, and a ``json.py`` and a
  ``ctypes.py`` that shadow the standard library's (and raise: the loader, the agent and the
  wait_http probe import json, the agent ctypes for NVML), ``PYTHONSTARTUP`` = a file
  (interactive sessions only: it cannot fire under ``-c`` either way, so it is set but not
  claimed);
* the system site directory (``/usr/lib/python3/dist-packages``, an overlay inside the host):
  a ``.pth`` line that runs code;
* root's user site (``~/.local/lib/python3.X/site-packages``, the host's private /root): a
  ``usercustomize.py``.

Under ``sudo -n`` (granted to the lab user inside one host: a tmpfs over its /etc/sudoers.d)
sudo's env_reset already drops PYTHONPATH, but the site directory's and root's user site's
traps still ran before; they must not now.

The command gpufleet sent before (``python3 -c BOOTSTRAP``, no flags) is run first over the
same SSH and must be broken by them (so the traps are real), then the real CLI must get a
clean document (status, clean, and a runbook's wait_http step), and no trap may have run.
"""
from __future__ import annotations

import http.server
import json
import pwd
import shlex
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_helpers import home, run_gpufleet  # noqa: F401  (fixture)
from gpufleet.remote import BOOTSTRAP, PYTHON_FLAGS, bootstrap_command, encode_request
from gpufleet.runbook.steps import wait_http_source

TRAP_DIR = "/tmp/gftrap"  # the host's private /tmp
MARKS = TRAP_DIR + "/marks"
SYSTEM_SITE = "/usr/lib/python3/dist-packages"


def _mark(name: str) -> str:
    """Python that records that trap ``name`` ran, then spoils stdout (the JSON document)."""
    return ("import sys; open(%r, 'a').write(%r + '\\n'); sys.stdout.write('TRAPPED-%s\\n')"
            % (MARKS, name, name))


def install_traps(host: Any) -> None:
    """Every trap of the module docstring, inside the host only (private /tmp, /root, an
    overlay in its own mount namespace; nothing of the machine changes)."""
    user_site = host.ssh(["python3", "-c", "import site; print(site.getusersitepackages())"],
                         check=True).stdout.strip()
    root_home = pwd.getpwnam("root").pw_dir  # the host's private copy of it (tests/lab)
    assert user_site.startswith(root_home + "/"), user_site
    files = {
        TRAP_DIR + "/sitecustomize.py": _mark("sitecustomize") + "\n",
        TRAP_DIR + "/json.py": _mark("json") + "\nraise ImportError('gpufleet trap: shadowed json')\n",
        TRAP_DIR + "/ctypes.py": (_mark("ctypes")
                                     + "\nraise ImportError('gpufleet trap: shadowed ctypes')\n"),
        TRAP_DIR + "/startup.py": _mark("startup") + "\n",
        user_site + "/usercustomize.py": _mark("usercustomize") + "\n",
        "/run/gftrap-site/upper/gftrap.pth": _mark("pth") + "\n",
        root_home + "/.ssh/environment": "PYTHONPATH=%s\nPYTHONSTARTUP=%s/startup.py\n" % (TRAP_DIR, TRAP_DIR),
    }
    script = ["set -e", "mkdir -p /run/gftrap-site/upper /run/gftrap-site/work"]
    for path, text in files.items():
        script += ["mkdir -p %s" % shlex.quote(str(Path(path).parent)),
                   "printf %%s %s > %s" % (shlex.quote(text), shlex.quote(path))]
    script.append("mount -t overlay gftrap -o lowerdir=%s,upperdir=/run/gftrap-site/upper,"
                  "workdir=/run/gftrap-site/work %s" % (SYSTEM_SITE, SYSTEM_SITE))
    res = host.exec(["sh", "-c", "\n".join(script)])
    assert res.returncode == 0, res.stderr


def allow_sudo(host: Any, user: str) -> None:
    """``user`` may run anything through ``sudo -n`` in this host only (its mount namespace)."""
    if shutil.which("sudo") is None:
        from conftest import require

        require("sudo", "no sudo binary on this machine (apt-get install sudo)")
    script = ("set -e; mount -t tmpfs -o mode=755 gfsudo /etc/sudoers.d; "
              "printf '%%s\\n' %s > /etc/sudoers.d/gflab; chmod 0440 /etc/sudoers.d/gflab"
              % shlex.quote("%s ALL=(ALL) NOPASSWD: ALL" % user))
    res = host.exec(["sh", "-c", script])
    assert res.returncode == 0, res.stderr
    check = host.ssh(["sudo", "-n", "id", "-u"], user=user)
    assert check.returncode == 0 and check.stdout.strip() == "0", check


def marks(host: Any) -> list[str]:
    path = host.path(MARKS)
    return path.read_text().split() if path.exists() else []


def clear_marks(host: Any) -> None:
    host.exec(["rm", "-f", MARKS], check=True)


def ssh_bytes(host: Any, argv: list[str], data: bytes, user: str = "root") -> subprocess.CompletedProcess:
    return subprocess.run(host.ssh_argv(user) + ["--", shlex.join(argv)], input=data,
                          capture_output=True, timeout=120)


@pytest.fixture
def trapped(make_host: Any) -> Any:
    host = make_host(sshd_extra="PermitUserEnvironment yes")
    host.holder = host.spawn_holder(gpus=[0], mib=900, title="VLLM::Worker")  # before the traps
    install_traps(host)
    return host


@pytest.fixture
def health() -> Iterator[str]:
    """An HTTP server on loopback (the lab's hosts share it) answering 200."""
    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "http://127.0.0.1:%d/health" % server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_traps_broke_the_unflagged_command(trapped: Any) -> None:
    """Before: the command without the flags runs every trap and prints no JSON document."""
    old = ["python3", "-c", BOOTSTRAP]
    assert bootstrap_command("python3") != old and bootstrap_command("python3")[1:4] == list(PYTHON_FLAGS)
    res = ssh_bytes(trapped, old, encode_request({"mode": "snapshot"}))
    out = res.stdout.decode("utf-8", "replace")
    assert "TRAPPED-" in out, (res.returncode, out, res.stderr)
    assert res.returncode != 0 and "shadowed json" in res.stderr.decode(), res.stderr
    assert {"pth", "sitecustomize", "usercustomize", "json"} <= set(marks(trapped))
    assert "startup" not in marks(trapped)  # PYTHONSTARTUP is for interactive sessions only


def test_status_and_clean_are_not_affected(trapped: Any, lab: Any, home: Path) -> None:
    clear_marks(trapped)
    fleet = lab.inventory_yaml([trapped], path=home / "fleet.yaml")
    status = run_gpufleet(home, fleet, "status", "--json")
    assert status.rc == 0, str(status)
    doc = status.host(trapped.name)
    assert doc["ok"] and [p["pid"] for p in doc["gpus"][0]["processes"]] == [trapped.holder]
    clean = run_gpufleet(home, fleet, "clean", "--all", "--gpus", "0", "--yes", "--json")
    assert clean.rc == 0, str(clean)
    assert not trapped.alive(trapped.holder)
    assert marks(trapped) == []
    assert "TRAPPED" not in status.output + clean.output


def test_the_wait_http_probe_is_not_affected(trapped: Any, lab: Any, home: Path, health: str) -> None:
    request = json.dumps({"url": health, "status": 200, "interval": 0.2, "attempt_s": 2,
                          "wait_s": 5}).encode()
    before = ssh_bytes(trapped, ["python3", "-c", wait_http_source()], request)
    assert b"TRAPPED-" in before.stdout and before.returncode != 0, before
    clear_marks(trapped)
    book = home / "probe.yaml"
    book.write_text("steps:\n  - name: healthy\n    kind: wait_http\n    url: %s\n"
                    "    timeout: 20\n" % health)
    fleet = lab.inventory_yaml([trapped], path=home / "fleet.yaml")
    run = run_gpufleet(home, fleet, "run", str(book), "--json")
    assert run.rc == 0, str(run)
    assert "answered HTTP 200" in run.stdout, run.stdout
    assert marks(trapped) == []


def test_under_sudo_neither(trapped: Any, lab: Any, home: Path) -> None:
    allow_sudo(trapped, lab.user)
    before = ssh_bytes(trapped, ["sudo", "-n", "python3", "-c", BOOTSTRAP],
                       encode_request({"mode": "snapshot"}), user=lab.user)
    assert b"TRAPPED-" in before.stdout, before
    assert {"pth", "usercustomize"} <= set(marks(trapped))  # root's, through sudo
    clear_marks(trapped)
    fleet = lab.inventory_yaml([trapped], path=home / "fleet.yaml",
                               **{trapped.name: {"user": lab.user, "sudo": True}})
    status = run_gpufleet(home, fleet, "status", "--json")
    assert status.rc == 0, str(status)
    doc = status.host(trapped.name)
    assert doc["ok"] and doc["facts"]["is_root"] is True, doc["facts"]
    assert [p["pid"] for p in doc["gpus"][0]["processes"]] == [trapped.holder]
    assert marks(trapped) == []
