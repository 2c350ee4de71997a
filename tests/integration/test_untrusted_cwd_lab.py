"""A root gpufleet run from a directory another user can write: nothing there steers it.

The attacker is an unprivileged user (uid 65534, through ``setpriv``) who drops Python modules
named like the standard library ones the agent and its loader import (zlib, _json, ctypes,
fcntl, select, re, ...) and a ``fleet.yaml`` into a world-writable directory. The operator then
runs gpufleet as root from there: ``status``, ``clean``, ``export`` and ``top`` on this machine
(no inventory: the implicit localhost, run without SSH), and the Slurm epilog inside a lab host
(run as slurmd runs it). Each trap module, if imported, writes a mark file and fails the
import; no mark may ever appear. The controller itself starts as its console script does
(``python3 SCRIPT``: the script's own directory first on its path, never the working one).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_helpers import REPO_ROOT

pytestmark = pytest.mark.lab

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
#: Modules the agent, its loader and the probes import; each becomes a trap in the cwd.
TRAPPED = ("zlib", "_json", "json", "re", "ctypes", "fcntl", "select", "signal", "threading",
           "struct", "subprocess", "socket", "selectors", "binascii", "pwd", "grp", "marshal",
           "errno", "time", "stat", "datetime", "hashlib", "base64", "platform", "shlex")
#: What a trap does when imported: leave a mark naming the module and the uid, then fail.
TRAP = ("import os\n"
        "_d = os.path.dirname(os.path.abspath(__file__))\n"
        "with open(os.path.join(_d, 'RAN-' + __name__), 'w') as _f:\n"
        "    _f.write(str(os.getuid()))\n"
        "raise ImportError('trap module ' + __name__)\n")
PLANT = ("import sys, os\n"
         "d, body = sys.argv[1], sys.argv[2]\n"
         "for name in sys.argv[3:]:\n"
         "    with open(os.path.join(d, name + '.py'), 'w') as f:\n"
         "        f.write(body)\n"
         "with open(os.path.join(d, 'fleet.yaml'), 'w') as f:\n"
         "    f.write('hosts:\\n  evil: {connection: local, python: ' + d + '/evil.sh}\\n')\n")


def plant(run_as_nobody: Any, directory: str) -> None:
    """The attacker, as uid 65534, writes the traps and a fleet.yaml into the shared directory."""
    res = run_as_nobody(NOBODY + ["/usr/bin/python3", "-c", PLANT, directory, TRAP, *TRAPPED])
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""


def marks(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("RAN-"))


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A world-writable (sticky) directory, like /tmp or a team's scratch folder."""
    d = Path(tempfile.mkdtemp(prefix="gpufleet-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def entry(tmp_path: Path) -> Path:
    """gpufleet started as its console script is: a script in a root-owned directory."""
    bindir = tmp_path / "bin"
    bindir.mkdir(mode=0o755)
    script = bindir / "gpufleet"
    script.write_text("import sys\nfrom gpufleet.cli import main\nsys.exit(main())\n")
    return script


def operator_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO_ROOT), NO_COLOR="1")
    return env


def as_nobody(argv: list[str]) -> Any:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def run_from(directory: Path, entry: Path, home: Path, *args: str) -> Any:
    return subprocess.run([sys.executable, str(entry), *args], cwd=str(directory),
                          env=operator_env(home), capture_output=True, text=True, timeout=120)


def test_a_fleet_yaml_someone_else_wrote_is_refused(shared_dir: Path, entry: Path,
                                                    tmp_path: Path) -> None:
    plant(as_nobody, str(shared_dir))
    res = run_from(shared_dir, entry, tmp_path, "status")
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "fleet.yaml" in lines[0] and "65534" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert marks(shared_dir) == []


@pytest.mark.parametrize("args", [("status",), ("status", "--json"), ("export",),
                                  ("clean", "--all", "--yes", "--grace", "1", "--timeout", "5")],
                         ids=["status", "status-json", "export", "clean"])
def test_trap_modules_in_the_cwd_never_run(shared_dir: Path, entry: Path, tmp_path: Path,
                                           args: tuple[str, ...]) -> None:
    plant(as_nobody, str(shared_dir))
    (shared_dir / "fleet.yaml").unlink()  # refused on its own (above); here: the modules
    res = run_from(shared_dir, entry, tmp_path, *args)
    assert "Traceback" not in res.stderr, res.stderr
    assert "localhost" in res.stdout + res.stderr, res  # the agent ran and answered
    assert marks(shared_dir) == [], (marks(shared_dir), res.stdout, res.stderr)


def test_top_started_in_the_shared_directory_imports_nothing_from_it(
        shared_dir: Path, entry: Path, tmp_path: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("!!! tmux not installed")
    plant(as_nobody, str(shared_dir))
    (shared_dir / "fleet.yaml").unlink()
    name = "gf-cwd-%s" % uuid.uuid4().hex[:8]
    env = operator_env(tmp_path)
    command = " ".join(["exec", sys.executable, str(entry), "top", "-n", "0.5"])
    tmux = ["tmux", "-L", name]
    subprocess.run(tmux + ["-f", "/dev/null", "new-session", "-d", "-s", "top", "-x", "160",
                           "-y", "40", "-c", str(shared_dir), command],
                   env=env, check=True, timeout=30)
    try:
        deadline = time.monotonic() + 30
        screen = ""
        while time.monotonic() < deadline and "localhost" not in screen:
            time.sleep(0.2)
            screen = subprocess.run(tmux + ["capture-pane", "-p", "-t", "top"],
                                    capture_output=True, text=True, timeout=10).stdout
        assert "localhost" in screen, screen
        time.sleep(1.5)  # a few refreshes of the resident agent
        subprocess.run(tmux + ["send-keys", "-t", "top", "q"], timeout=10)
        time.sleep(0.5)
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True, timeout=30)
    assert marks(shared_dir) == []


def test_slurm_epilog_run_from_a_shared_directory_imports_nothing_from_it(
        make_host: Any) -> None:
    """slurmd starts the epilog in its own working directory; a node's shared scratch there
    must not matter either. The epilog runs inside a lab host with Slurm's variables only."""
    node = make_host(gpus=2)
    d = "/tmp/scratch-%s" % uuid.uuid4().hex[:8]
    assert node.exec(["install", "-d", "-m", "1777", d]).returncode == 0
    plant(node.exec, d)
    node.exec(["rm", "-f", d + "/fleet.yaml"])
    script = "import sys; sys.path[:0] = [%r]; from gpufleet.cli import main; sys.exit(main())" \
        % str(REPO_ROOT)
    env = ["SLURM_JOB_ID=77", "SLURM_JOB_UID=0", "SLURM_JOB_GPUS=0", "SLURMD_NODENAME=n",
           "SLURM_SCRIPT_CONTEXT=epilog_slurmd", "PATH=/usr/local/bin:/usr/bin:/bin"]
    # the controller's own path is set by the script; the working directory is the shared one
    res = node.exec(["env", "-i", "-C", d, *env, sys.executable, "-I", "-c", script,
                     "slurm", "epilog"], timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 0, (res.stdout, res.stderr)
    left = node.exec(["find", d, "-name", "RAN-*"]).stdout.split()
    assert left == []
