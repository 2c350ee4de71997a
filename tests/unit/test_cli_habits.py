"""How operators type commands: the inventory and -v after the command, hosts as plain
arguments, and click's own usage errors as gpufleet's one line.

The CLI runs in a fresh interpreter against `connection: local` hosts (this machine: no GPUs
needed, nothing is signalled) and, for -v, an SSH host on a port where nothing listens (ssh
is refused at once: the argv, `ssh -G` and the run's timing are still logged).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FLEET = ("hosts:\n  here:\n    connection: local\n    command_timeout: 60\n"
         "  there:\n    connection: local\n    command_timeout: 60\n")
REPORT = "steps:\n  - name: look\n    kind: report\n"


def gpufleet(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUFLEET_INVENTORY", "SSH_AUTH_SOCK")}
    env.update(HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "gpufleet", *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    (tmp_path / "look.yaml").write_text(REPORT)
    return path


def _leaves(group: click.Group, ctx: click.Context, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        if isinstance(cmd, click.Group):
            out += _leaves(cmd, click.Context(cmd, parent=ctx), f"{prefix}{name} ")
        else:
            out.append((prefix + name, cmd))
    return out


def test_every_command_takes_the_inventory_and_verbose_after_it() -> None:
    from gpufleet.cli import cli

    leaves = _leaves(cli, click.Context(cli))
    assert len(leaves) >= 14  # every command, slurm's three included
    for name, cmd in leaves:
        opts = {o for p in cmd.params for o in getattr(p, "opts", ())}
        assert {"-i", "--inventory", "-v", "--verbose"} <= opts, name


def test_the_inventory_after_the_command_is_read(tmp_path: Path, fleet: Path) -> None:
    res = gpufleet(tmp_path, "hosts", "-i", str(fleet), "--json")
    assert res.returncode == 0, res.stderr
    assert [h["name"] for h in json.loads(res.stdout)["hosts"]] == ["here", "there"]
    res = gpufleet(tmp_path, "status", "--json", "-i", str(fleet), "--host", "there")
    assert [h["host"] for h in json.loads(res.stdout)["hosts"]] == ["there"], res.stderr


def test_two_different_inventories_are_one_line_and_exit_2(tmp_path: Path, fleet: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text(FLEET)
    res = gpufleet(tmp_path, "-i", str(other), "hosts", "-i", str(fleet))
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"gpufleet: error: two inventories: -i {other} before the command and -i {fleet} "
        "after it (see gpufleet hosts --help)"]
    assert res.stdout == ""
    res = gpufleet(tmp_path, "-i", str(fleet), "hosts", "-i", str(fleet), "--json")  # the same: fine
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("args", [
    ["hosts", "--json", "there"],
    ["status", "--json", "there"],
    ["health", "--json", "there"],
    ["fit", "--weights-gib", "1", "--json", "there"],
    ["clean", "--dry-run", "--json", "there"],
    ["run", "look.yaml", "there", "--json"],
], ids=lambda a: a[0])
def test_hosts_given_as_arguments_are_the_selection(tmp_path: Path, fleet: Path,
                                                    args: list[str]) -> None:
    """`gpufleet status train-node` is `--host train-node`: only that host is worked on."""
    res = gpufleet(tmp_path, "-i", str(fleet), *args)
    assert "Traceback" not in res.stderr and "error: Got unexpected" not in res.stderr, res.stderr
    doc = json.loads(res.stdout)
    entries = doc["hosts"]
    names = [h.get("host", h.get("name")) for h in entries]
    assert names == ["there"], res.stdout


def test_argument_hosts_add_to_host_options_and_a_typo_is_still_refused(tmp_path: Path,
                                                                         fleet: Path) -> None:
    res = gpufleet(tmp_path, "-i", str(fleet), "hosts", "--json", "there", "--host", "here")
    assert [h["name"] for h in json.loads(res.stdout)["hosts"]] == ["here", "there"]
    res = gpufleet(tmp_path, "-i", str(fleet), "hosts", "thre")
    assert res.returncode == 2
    assert res.stderr.splitlines() == ["gpufleet: error: no host matches 'thre' (did you mean 'there'?)"]


@pytest.mark.parametrize("args,message", [
    (["status", "--nope"], "No such option '--nope'"),
    (["run"], "Missing argument 'RUNBOOK'"),
    (["fit", "--tp", "x"], "Invalid value for '--tp': 'x' is not a valid integer"),
    (["stat"], "No such command 'stat'. Did you mean 'status'?"),
    (["slurm", "undrain", "--forks", "3"], "No such option '--forks'"),
    (["--forks", "0", "hosts"], "Invalid value for '--forks'"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_click_usage_errors_are_one_line_and_exit_2(tmp_path: Path, args: list[str],
                                                   message: str) -> None:
    res = gpufleet(tmp_path, *args)
    assert res.returncode == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: "), res.stderr
    assert message in lines[0] and "--help)" in lines[0]
    assert res.stdout == ""


def test_no_command_still_shows_the_help(tmp_path: Path) -> None:
    res = gpufleet(tmp_path)
    assert res.returncode == 2 and "Commands:" in res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")
@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_shows_each_hosts_connection_on_stderr(tmp_path: Path, where: str) -> None:
    """The ssh argv, what `ssh -G` answered and the run's time, one line each, on stderr;
    stdout is the same table as without -v."""
    path = tmp_path / "fleet.yaml"
    path.write_text("hosts:\n  refused:\n    address: 127.0.0.1\n    port: 1\n"
                    "    connect_timeout: 3\n  here:\n    connection: local\n")
    argv = ["-v", "status"] if where == "before" else ["status", "-v"]
    res = gpufleet(tmp_path, "-i", str(path), *argv)
    plain = gpufleet(tmp_path, "-i", str(path), "status")
    assert res.returncode == 1
    err = res.stderr.splitlines()
    assert any(" -G " in ln and "answered in " in ln and "hostname 127.0.0.1" in ln
               and "port 1" in ln for ln in err), res.stderr
    assert any(ln.startswith("gpufleet: refused: ssh to 127.0.0.1:1 ") and " -p 1 -- 127.0.0.1" in ln
               for ln in err), res.stderr
    assert any(ln.startswith("gpufleet: refused: run with an ssh process that becomes the kept "
                             "master ") and ": exit 255 after " in ln
               for ln in err), res.stderr  # connections are kept by default
    assert "gpufleet: here: connection: local (this machine, no ssh)" in err
    assert res.stdout == plain.stdout
    assert "ssh -G" not in plain.stderr and "answered in" not in plain.stderr
