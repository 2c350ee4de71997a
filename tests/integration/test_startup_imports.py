"""The controller starts without the SSH stack unless a host is reached over SSH, and ends
without the interpreter's teardown once its output is written.

paramiko, fabric and invoke take about 0.3 s to import (bench/startup.py): `gpufleet --help`,
`hosts`, `fit`, and every command whose selected hosts are all `connection: local` must not
load them; a run with an SSH host must, and must still work. Each command runs the real CLI in
a fresh interpreter through a wrapper that writes, at exit, which of the three are in
sys.modules. Nothing here is timed (bench/startup.py prints the numbers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import REPO_ROOT

WATCHED = ("paramiko", "fabric", "invoke")
# At exit (also through sys.exit and click's own exits), write which watched packages were loaded.
WRAPPER = (
    "import atexit, json, os, sys\n"
    "def _seen():\n"
    "    with open(os.environ['GF_MODULES_OUT'], 'w') as f:\n"
    "        json.dump(sorted(m for m in sys.modules if m.split('.')[0] in %r), f)\n"
    "atexit.register(_seen)\n"
    "from gpufleet.cli import main\n"
    "main(sys.argv[1:])\n" % (WATCHED,)
)

LOCAL_YAML = "hosts:\n  here:\n    connection: local\n    command_timeout: 60\n"
RUNBOOK_YAML = "steps:\n  - name: look\n    kind: report\n"


def loaded(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `gpufleet ARGS` (this checkout) in a fresh interpreter; what it ran, what it loaded."""
    out = tmp_path / "modules.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPUFLEET_INVENTORY", "SSH_AUTH_SOCK", "GPUFLEET_AUDIT_LOG")}
    env.update(GF_MODULES_OUT=str(out), HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", WRAPPER, *args], cwd=str(tmp_path), env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.exists(), "the wrapper wrote nothing: %s %s" % (res.stdout, res.stderr)
    return res, {m.split(".")[0] for m in json.loads(out.read_text())}


@pytest.fixture
def local_fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(LOCAL_YAML)
    (tmp_path / "look.yaml").write_text(RUNBOOK_YAML)
    return path


@pytest.mark.parametrize("args", [
    ["--help"],
    ["status", "--help"],
    ["hosts"],
    ["hosts", "--json"],
    ["fit", "--weights-gib", "10"],
    ["fit", "--weights-gib", "10", "--json"],
    ["status"],
    ["status", "--json"],
    ["clean", "--all", "--gpus", "0", "--dry-run"],
    ["run", "look.yaml"],
], ids=lambda a: " ".join(a))
def test_local_commands_do_not_import_the_ssh_stack(tmp_path: Path, local_fleet: Path,
                                                    args: list[str]) -> None:
    argv = args if args[0] == "--help" else ["-i", str(local_fleet), *args]
    res, mods = loaded(tmp_path, *argv)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode in (0, 1), (res.returncode, res.stdout, res.stderr)  # 1: no GPU here
    if args[0] in ("status", "fit", "clean", "run") and "--help" not in args:
        assert "here" in res.stdout + res.stderr, res.stdout  # it did reach the local host
    assert mods.isdisjoint(WATCHED), "imported %s for `gpufleet %s`" % (
        sorted(mods & set(WATCHED)), " ".join(args))


@pytest.mark.parametrize("client", ["openssh", "paramiko"])
def test_an_ssh_host_is_reached_and_only_paramiko_loads_the_ssh_stack(
        tmp_path: Path, lab: Any, lab_host: Any, client: str) -> None:
    """The lazy transport still reaches an SSH host (a real sshd of the lab). Through OpenSSH's
    client (the default) paramiko/fabric are never imported; through paramiko they are, and
    the wrapper sees it (so the tests above can fail)."""
    fleet = lab.inventory_yaml([lab_host], path=tmp_path / "ssh.yaml", ssh_client=client)
    res, mods = loaded(tmp_path, "-i", str(fleet), "status", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert [h["ok"] for h in doc["hosts"]] == [True]
    assert len(doc["hosts"][0]["gpus"]) == lab_host.gpus
    if client == "paramiko":
        assert set(WATCHED) <= mods
    else:
        assert not set(WATCHED) & mods, mods


def test_the_transport_names_are_the_same_objects(tmp_path: Path) -> None:
    """Lazy names resolve to their modules' objects, submodules still import, unknown names
    are an AttributeError (not a silent None)."""
    code = (
        "import gpufleet.transport as t, sys\n"
        "assert 'paramiko' not in sys.modules\n"
        "from gpufleet.transport import open_session, LocalSession, predial, AgentReply\n"
        "from gpufleet.transport import reach, dial, session\n"
        "assert open_session is reach.open_session and predial is dial.predial\n"
        "assert 'paramiko' not in sys.modules, 'reach/session/dial imported paramiko'\n"
        "from gpufleet.transport import transport_error, hostkeys\n"
        "assert 'paramiko' in sys.modules\n"
        "try:\n"
        "    t.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('no AttributeError')\n"
        "assert set(t.__all__) == set(t._HOME) | {'TransportError'} and set(t.__all__) <= set(dir(t))\n"
        "assert all(getattr(t, n) is not None for n in t.__all__)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


# As the `gpufleet` program runs (main() without argv); an atexit handler marks a teardown.
PROGRAM = (
    "import atexit, os, sys\n"
    "atexit.register(lambda: open(os.environ['GF_TEARDOWN_MARK'], 'w').close())\n"
    "from gpufleet.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize("args,rc", [(["hosts", "--json"], 0), (["status", "--json"], 1)],
                         ids=["hosts-exit-0", "status-exit-1"])
def test_the_program_exits_without_teardown_and_keeps_output_and_code(
        tmp_path: Path, local_fleet: Path, args: list[str], rc: int) -> None:
    """Run as the program, a finished command flushes its output (a pipe: block-buffered, so
    nothing would arrive without the flush) and ends with its exit code at once: no atexit
    handler runs, i.e. no interpreter teardown (25-60 ms here, bench/clean_tail.py)."""
    mark = tmp_path / "teardown"
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_INVENTORY"}
    env.update(GF_TEARDOWN_MARK=str(mark), HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", PROGRAM, "-i", str(local_fleet), *args],
                         cwd=str(tmp_path), env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == rc, res.stdout + res.stderr
    doc = json.loads(res.stdout)  # complete: the flush happened
    assert doc["hosts"][0]["host" if args[0] == "status" else "name"] == "here"
    assert not mark.exists(), "the interpreter tore down (atexit ran)"


def test_main_called_in_process_still_raises_systemexit() -> None:
    """Callers of main(argv) (tests, wrappers) get SystemExit and keep their process."""
    from gpufleet.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0


# The controller's start (every ms of it is paid by every command): what one command needs, and nothing another one does.
ALL_MODULES_WRAPPER = (
    "import atexit, json, os, sys\n"
    "def _seen():\n"
    "    with open(os.environ['GF_MODULES_OUT'], 'w') as f:\n"
    "        json.dump(sorted(sys.modules), f)\n"
    "atexit.register(_seen)\n"
    "from gpufleet.cli import main\n"
    "main(sys.argv[1:])\n"
)
NOT_FOR_STATUS = ("gpufleet.core.metrics", "gpufleet.core.slurm",
                  "gpufleet.core.plan", "gpufleet.core.fit", "gpufleet.render.clean",
                  "gpufleet.cli.clean_cmd", "gpufleet.cli.fit_cmd", "gpufleet.cli.slurm_cmd",
                  "gpufleet.cli.export_cmd", "gpufleet.cli.run_cmd", "gpufleet.cli.top")


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["hosts"], ["--help"]],
                         ids=lambda a: " ".join(a))
def test_a_local_status_imports_only_what_status_needs(tmp_path: Path, local_fleet: Path,
                                                       args: list[str]) -> None:
    """No other command's modules, no metrics, Slurm, clean plan or fit arithmetic; tabulate only
    where a table is drawn (never for --json or --help); the table and JSON are still complete."""
    out = tmp_path / "modules.json"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUFLEET_INVENTORY", "SSH_AUTH_SOCK")}
    env.update(GF_MODULES_OUT=str(out), HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p))
    argv = args if args[0] == "--help" else ["-i", str(local_fleet), *args]
    res = subprocess.run([sys.executable, "-c", ALL_MODULES_WRAPPER, *argv], cwd=str(tmp_path),
                         env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    mods = set(json.loads(out.read_text()))
    unwanted = sorted(m for m in mods if any(m == n or m.startswith(n + ".") for n in NOT_FOR_STATUS))
    assert unwanted == [], "gpufleet %s imported %s" % (" ".join(args), unwanted)
    draws_a_table = args in (["status"], ["hosts"])
    assert ("tabulate" in mods) == draws_a_table, "gpufleet %s and tabulate" % " ".join(args)
    if args == ["status"]:
        assert res.stdout.splitlines()[0].split() == ["HOST", "GPU", "NAME", "MEMORY", "(MiB)",
                                                      "UTIL", "UNATTR", "(MiB)", "HEALTH",
                                                      "HOLDERS"]
        assert res.stdout.splitlines()[2].startswith("here ")
        assert "gpufleet.render.status" in mods and "gpufleet.core.health" in mods
    if args == ["status", "--json"]:
        assert json.loads(res.stdout)["hosts"][0]["host"] == "here"
