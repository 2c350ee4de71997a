"""gpufleet.transport.sshconfig against the real OpenSSH client (`ssh -G`); no host is contacted.

HOME is a temporary directory, so ssh is given `-F $HOME/.ssh/config` (see the module).
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from gpufleet.transport import sshconfig as sshresolve
from gpufleet.transport.sshconfig import SshConfigError, resolve

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    sshresolve.clear_cache()
    yield home
    sshresolve.clear_cache()


def config(home: Path, text: str) -> None:
    (home / ".ssh" / "config").write_text(text)


def test_one_ssh_g_per_alias_port_and_user(home, tmp_path):
    runs = tmp_path / "runs"
    # Match exec runs once per ssh -G: it counts them
    config(home, f'Match exec "echo %n >> {runs}"\n    Port 2222\n')
    for _ in range(3):
        assert resolve("a").values["port"] == "2222"
    resolve("b")
    resolve("a", port=22)
    assert resolve("a", port=22).values["port"] == "22"
    assert runs.read_text().split() == ["a", "b", "a"]


def test_a_hanging_match_exec_is_bounded_and_ended(home, tmp_path, monkeypatch):
    monkeypatch.setattr(sshresolve, "SSH_G_TIMEOUT_S", 1.0)
    pidfile = tmp_path / "pid"
    config(home, f'Match exec "echo $$ > {pidfile}; exec sleep 60"\n    Port 2222\n')
    started = time.monotonic()
    with pytest.raises(SshConfigError) as err:
        resolve("hang")
    assert time.monotonic() - started < 10
    assert str(err.value) == ("ssh -G hang did not finish within 1s "
                              "(a Match exec command that hangs?)")
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{pid}"), "the Match exec command outlived ssh -G"


def test_tokens_in_proxycommand_and_identityfile(home):
    config(home, "Host tok\n    HostName real.example\n    Port 2200\n    User bob\n"
                 "    ProxyCommand nc %h %p %r %n %%\n    IdentityFile ~/.ssh/key_%h_%r\n")
    values = resolve("tok").values
    assert values["proxycommand"] == "nc real.example 2200 bob tok %"
    assert values["identityfile"] == ["~/.ssh/key_real.example_bob"]


def test_ssh_defaults_are_left_to_gpufleet(home):
    config(home, "Host plain\n    Port 2200\n")
    values = resolve("plain").values
    assert "identityfile" not in values and "userknownhostsfile" not in values
    assert values["hostname"] == "plain" and values["port"] == "2200"


def test_strict_host_key_checking_maps_to_a_policy(home):
    config(home, "Host a\n    StrictHostKeyChecking accept-new\nHost n\n    StrictHostKeyChecking no\n"
                 "Host y\n    StrictHostKeyChecking yes\n")
    policy = sshresolve.host_key_policy
    assert policy(resolve("a").values, "strict") == "accept-new"
    assert policy(resolve("n").values, "strict") == "accept-new"
    assert policy(resolve("y").values, "accept-new") == "strict"
    assert policy(resolve("unset").values, "strict") == "strict"  # ssh's default: ask


@pytest.mark.parametrize("bad", ["-oProxyCommand=x", "-", "a b", "a\tb", "a\nb", "u@h", ""])
def test_names_ssh_could_take_as_options_are_refused(bad):
    with pytest.raises(SshConfigError, match="invalid ssh host name"):
        resolve(bad)


def test_a_config_ssh_refuses_is_ssh_own_reason(home):
    config(home, "Host x\n    NoSuchOption 1\n")
    with pytest.raises(SshConfigError) as err:
        resolve("x")
    assert str(err.value).startswith("ssh -G x failed: ")
    assert "line 2: Bad configuration option: nosuchoption" in str(err.value)


def test_ssh_defaults_are_asked_once_when_many_hosts_resolve_at_once(home, tmp_path):
    """The defaults (``ssh -F none -G``) are one run per process, also when 24 hosts' threads
    resolve at the same moment (each used to run its own: a dozen extra ssh -G per 32 hosts)."""
    import threading

    log = tmp_path / "ssh-runs"
    wrapper = tmp_path / "ssh"
    wrapper.write_text('#!/bin/sh\necho "$*" >> %s\nexec %s "$@"\n' % (log, shutil.which("ssh")))
    wrapper.chmod(0o755)
    start = threading.Barrier(24)

    def one(i: int) -> None:
        start.wait()
        sshresolve._from_ssh(str(wrapper), "host%d" % i, None, None)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runs = log.read_text().splitlines()
    assert len(runs) == 25  # one per host, and the defaults once
    assert sum(1 for r in runs if "gpufleet-defaults.invalid" in r) == 1
