"""`gpufleet trust`: the one-command remedy for the strict host key policy (real sshd)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def gpufleet(args, home, stdin=None):
    env = dict(os.environ, HOME=str(home))
    return subprocess.run([sys.executable, "-m", "gpufleet", *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=120)


@pytest.fixture
def strict_unknown(make_host, lab, tmp_path):
    host = make_host(gpus=1)
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    fleet = lab.inventory_yaml([host], path=tmp_path / "fleet.yaml", known_hosts_file=str(empty))
    return host, fleet, tmp_path / "home"


def test_unknown_key_is_refused_then_trusted_then_accepted(strict_unknown) -> None:
    host, fleet, home = strict_unknown
    before = gpufleet(["-i", str(fleet), "status"], home)
    assert before.returncode == 1
    assert "SHA256:" in before.stdout and "gpufleet trust" in before.stdout

    shown = gpufleet(["-i", str(fleet), "trust", host.name], home)
    assert shown.returncode == 2  # not a terminal and no --yes: shown, not recorded
    assert "SHA256:" in shown.stdout
    assert not (home / ".config" / "gpufleet" / "known_hosts").exists()

    done = gpufleet(["-i", str(fleet), "trust", host.name, "--yes"], home)
    assert done.returncode == 0, done.stderr
    recorded = (home / ".config" / "gpufleet" / "known_hosts").read_text()
    assert f"[127.0.0.1]:{host.port}" in recorded

    after = gpufleet(["-i", str(fleet), "status"], home)
    assert after.returncode == 0, after.stdout + after.stderr
    again = gpufleet(["-i", str(fleet), "trust", host.name, "--yes"], home)
    assert again.returncode == 0 and "already known" in again.stdout


def test_trust_never_overwrites_a_changed_key(make_host, lab, tmp_path) -> None:
    host = make_host(gpus=1)
    home = tmp_path / "home"
    kh = home / ".config" / "gpufleet" / "known_hosts"
    kh.parent.mkdir(parents=True)
    wrong = lab.wrong_host_key_line(host) + "\n"
    kh.write_text(wrong)
    empty = tmp_path / "empty"
    empty.write_text("")
    fleet = lab.inventory_yaml([host], path=tmp_path / "fleet.yaml", known_hosts_file=str(empty))
    res = gpufleet(["-i", str(fleet), "trust", host.name, "--yes"], home)
    assert res.returncode == 1
    assert "CHANGED" in (res.stderr + res.stdout).upper()
    assert kh.read_text() == wrong
