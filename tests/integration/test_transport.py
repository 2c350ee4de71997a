"""transport + hostkeys against the lab: real sshd hosts, real host keys, real timeouts.

HOME is a temporary directory in every test (nothing touches the real ~/.ssh or
~/.config/gpufleet) and SSH_AUTH_SOCK is unset, so only the keys a test names are tried.
Time bounds here are generous upper bounds (a dead host must not hang), never speed goals.
Every test runs twice: through OpenSSH's client (the default) and through paramiko (the
fallback), with the same expectations: both paths must give the same kinds and messages.
"""
from __future__ import annotations

import base64
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.transport import hostkeys
from gpufleet.ops.fanout import run_hosts
from gpufleet.config.inventory import Host
from gpufleet.transport import TransportError, fetch_host_key, open_session, trust

SLACK = 8.0
SNAPSHOT = {"mode": "snapshot", "nvidia_smi": None, "smi_timeout_s": 10.0}


CLIENT = {"name": "openssh"}


@pytest.fixture(autouse=True, params=["openssh", "paramiko"])
def client(request):
    """Which SSH client the inventory hosts of this test use (``ssh_client``)."""
    CLIENT["name"] = request.param
    yield request.param
    CLIENT["name"] = "openssh"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


@pytest.fixture(scope="module")
def shared(lab):
    """One two-GPU host for the tests that only read."""
    host = lab.add_host("tr-shared", gpus=2)
    yield host
    host.stop()


def inv(lab, endpoint, name=None, **overrides) -> Host:
    """An inventory Host for a lab host/endpoint, every key set explicitly (as fleet.yaml would)."""
    overrides.setdefault("ssh_client", CLIENT["name"])
    entry = lab.host_entry(endpoint, **overrides)
    return Host(name=name or endpoint.name, explicit=frozenset(entry), **entry)


def key_of(lab_host) -> tuple[str, str, str]:
    """(keytype, base64, SHA256 fingerprint) from the lab's known_hosts line."""
    _name, keytype, b64 = lab_host.host_key_line.split()
    return keytype, b64, hostkeys.fingerprint_blob(base64.b64decode(b64))


def agent(host: Host, timeout: float = 30.0):
    with open_session(host) as session:
        return session.run_agent(SNAPSHOT, timeout=timeout)


def accepted_logins(lab_host) -> int:
    return (lab_host.dir / "sshd.log").read_text().count("Accepted publickey")


def empty_file(tmp_path) -> Path:
    p = tmp_path / "empty_known_hosts"
    p.write_text("")
    return p


# --------------------------------------------------------------------------- running


def test_agent_runs_under_strict_with_the_lab_known_hosts(lab, shared, client):
    before = accepted_logins(shared)
    with open_session(inv(lab, shared)) as session:
        assert session.error is None
        first = session.run_agent(SNAPSHOT, timeout=30)
        assert first.ok, first.error
        assert first.exit_code == 0
        assert first.doc["agent_version"] == 1
        assert first.doc["facts"]["hostname"] == shared.name
        assert len(first.doc["gpus"]) == 2
        transport = session.conn.transport if client == "paramiko" else None
        echo = session.run_argv(
            ["python3", "-c", "import sys; sys.stdout.write(sys.stdin.read()[::-1])"],
            stdin=b"abc", timeout=20)
        assert echo.exit_code == 0 and echo.stdout == b"cba"
        second = session.run_agent(SNAPSHOT, timeout=30)
        assert second.ok, second.error
        if client == "paramiko":
            assert session.conn.transport is transport
    # three runs, one SSH connection: paramiko's one transport; OpenSSH's first ssh, which
    # became the kept master (ssh_persist, on by default) the two others ran through
    assert accepted_logins(shared) - before == 1


def test_without_ssh_persist_each_openssh_run_is_a_login(lab, shared, client):
    """``ssh_persist: 0``: one ssh process, one login, per run (paramiko: one transport)."""
    before = accepted_logins(shared)
    with open_session(inv(lab, shared, ssh_persist=0.0)) as session:
        for _ in range(3):
            reply = session.run_agent(SNAPSHOT, timeout=30)
            assert reply.ok, reply.error
    assert accepted_logins(shared) - before == (1 if client == "paramiko" else 3)


def test_argv_travels_quoted_never_as_shell_text(lab, shared):
    with open_session(inv(lab, shared)) as session:
        res = session.run_argv(["printf", "%s|", "a b", "$(id)", "'q'", "*;x"], timeout=20)
    assert res.exit_code == 0
    assert res.stdout == b"a b|$(id)|'q'|*;x|"


def test_non_root_user(lab, shared):
    reply = agent(inv(lab, shared, user=lab.user))
    assert reply.ok, reply.error
    assert reply.doc["facts"]["user"] == lab.user


# --------------------------------------------------------------------------- host keys


def test_strict_refuses_an_unknown_key_and_shows_its_fingerprint(lab, shared, tmp_path, home):
    host = inv(lab, shared, known_hosts_file=str(empty_file(tmp_path)))
    reply = agent(host)
    keytype, _b64, fp = key_of(shared)
    assert not reply.ok
    assert reply.error.startswith(f"unknown host key for [127.0.0.1]:{shared.port} ({keytype} {fp})")
    assert f"gpufleet trust {shared.name}" in reply.error
    assert "accept-new" in reply.error
    assert not (home / ".config" / "gpufleet" / "known_hosts").exists()


def test_accept_new_records_the_key_and_reads_it_back(lab, shared, tmp_path, home):
    empty = empty_file(tmp_path)
    reply = agent(inv(lab, shared, known_hosts_file=str(empty), host_key_policy="accept-new"))
    assert reply.ok, reply.error
    keytype, b64, _fp = key_of(shared)
    recorded = home / ".config" / "gpufleet" / "known_hosts"
    assert recorded.read_text() == f"[127.0.0.1]:{shared.port} {keytype} {b64}\n"
    # now known: strict accepts it from gpufleet's file
    reply = agent(inv(lab, shared, known_hosts_file=str(empty)))
    assert reply.ok, reply.error
    assert empty.read_text() == ""


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_changed_key_is_refused_whatever_the_policy(lab, shared, tmp_path, home, policy):
    kh = tmp_path / "kh"
    kh.write_text("# fleet keys\n" + lab.wrong_host_key_line(shared) + "\n")
    reply = agent(inv(lab, shared, known_hosts_file=str(kh), host_key_policy=policy))
    _t, _b, fp = key_of(shared)
    assert not reply.ok
    assert reply.error.startswith(f"HOST KEY CHANGED for [127.0.0.1]:{shared.port}")
    assert fp in reply.error and "man-in-the-middle" in reply.error
    assert f"remove the old key from {kh}:2" in reply.error
    assert not (home / ".config" / "gpufleet" / "known_hosts").exists()


def test_changed_key_in_gpufleets_own_file_is_refused(lab, shared, tmp_path, home):
    recorded = home / ".config" / "gpufleet" / "known_hosts"
    recorded.parent.mkdir(parents=True)
    recorded.write_text(lab.wrong_host_key_line(shared) + "\n")
    reply = agent(inv(lab, shared, known_hosts_file=str(empty_file(tmp_path)),
                      host_key_policy="accept-new"))
    assert not reply.ok
    assert "HOST KEY CHANGED" in reply.error and f"{recorded}:1" in reply.error


def test_hashed_known_hosts_entries(lab, shared, tmp_path):
    kh = tmp_path / "hashed"
    kh.write_text(shared.host_key_line + "\n")
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], capture_output=True, check=True)
    assert "127.0.0.1" not in kh.read_text()
    reply = agent(inv(lab, shared, known_hosts_file=str(kh)))
    assert reply.ok, reply.error


def test_user_known_hosts_is_read(lab, shared, home):
    (home / ".ssh").mkdir()
    (home / ".ssh" / "known_hosts").write_text(shared.host_key_line + "\n")
    reply = agent(inv(lab, shared, known_hosts_file=None))
    assert reply.ok, reply.error


def test_fetch_and_trust(lab, make_host, tmp_path, home):
    gpu = make_host(gpus=1)
    host = inv(lab, gpu, known_hosts_file=str(empty_file(tmp_path)))
    keytype, b64, fp = key_of(gpu)
    got_type, got_fp, key = fetch_host_key(host)
    assert (got_type, got_fp, key.get_base64()) == (keytype, fp, b64)
    first = trust(host)
    assert first.added and first.fingerprint == fp
    assert first.path == str(home / ".config" / "gpufleet" / "known_hosts")
    assert agent(host).ok
    assert trust(host).added is False
    # a different key already on record is never overwritten
    Path(first.path).unlink()
    wrong = tmp_path / "wrong"
    wrong.write_text(lab.wrong_host_key_line(gpu) + "\n")
    with pytest.raises(hostkeys.HostKeyError) as err:
        trust(inv(lab, gpu, known_hosts_file=str(wrong)))
    assert "HOST KEY CHANGED" in str(err.value)


# --------------------------------------------------------------------------- failures


def test_dead_host_is_refused_at_once(lab):
    dead = lab.dead_host("tr-dead")
    started = time.monotonic()
    reply = agent(inv(lab, dead, connect_timeout=5))
    assert not reply.ok
    assert reply.error == f"connection refused by 127.0.0.1:{dead.port}"
    assert time.monotonic() - started < 5


def test_blackholed_host_times_out_within_connect_timeout(lab):
    hole = lab.blackholed_host("tr-hole")
    started = time.monotonic()
    reply = agent(inv(lab, hole, connect_timeout=2))
    assert not reply.ok
    assert reply.error == f"connect to 127.0.0.1:{hole.port} timed out after 2s"
    assert time.monotonic() - started < 2 + SLACK


def test_mute_host_times_out_waiting_for_the_banner(lab):
    mute = lab.mute_host("tr-mute")
    started = time.monotonic()
    reply = agent(inv(lab, mute, connect_timeout=2))
    assert not reply.ok
    assert "no SSH banner" in reply.error
    assert time.monotonic() - started < 2 + SLACK


def test_dns_failure(lab, shared):
    reply = agent(inv(lab, shared, address="no-such-host.invalid", connect_timeout=3))
    assert not reply.ok
    assert reply.error.startswith(("cannot resolve no-such-host.invalid",
                                   "DNS lookup of no-such-host.invalid timed out"))


def test_wrong_user_is_an_auth_failure(lab, shared):
    reply = agent(inv(lab, shared, user="nosuchuser"))
    assert not reply.ok
    assert reply.error.startswith(f"authentication failed for nosuchuser@[127.0.0.1]:{shared.port}")


def test_wrong_key_is_an_auth_failure(lab, shared, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    reply = agent(inv(lab, shared, identity_file=str(other)))
    assert not reply.ok
    assert reply.error.startswith("authentication failed for root@")
    assert str(other) in reply.error


def test_default_identity_in_home_ssh_is_found(lab, shared, home):
    (home / ".ssh").mkdir()
    shutil.copy(lab.client_key, home / ".ssh" / "id_ed25519")
    os.chmod(home / ".ssh" / "id_ed25519", 0o600)
    reply = agent(inv(lab, shared, identity_file=None))
    assert reply.ok, reply.error


def test_ssh_agent_key_is_used(lab, shared, tmp_path, monkeypatch):
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        env = dict(os.environ, SSH_AUTH_SOCK=str(sock))
        subprocess.run(["ssh-add", str(lab.client_key)], env=env, capture_output=True, check=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        reply = agent(inv(lab, shared, identity_file=None))
        assert reply.ok, reply.error
    finally:
        proc.terminate()  # the agent this test started, by its pid
        proc.wait(timeout=10)


def test_no_key_at_all_is_an_auth_failure_not_a_prompt(lab, shared):
    reply = agent(inv(lab, shared, identity_file=None))
    assert not reply.ok
    assert "no key to try" in reply.error


def test_passphrase_key_is_skipped_never_prompted(lab, shared, tmp_path):
    locked = tmp_path / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(locked)], check=True)
    reply = agent(inv(lab, shared, identity_file=str(locked)))
    assert not reply.ok
    assert "passphrase-protected" in reply.error


def test_missing_python(lab, make_host):
    gpu = make_host(gpus=1, python3=False)
    reply = agent(inv(lab, gpu))
    assert not reply.ok
    assert reply.error == "python3 not found on host (set python: in the inventory)"
    assert reply.exit_code == 127


def test_python_path_that_does_not_exist(lab, shared):
    reply = agent(inv(lab, shared, python="/opt/nowhere/python3"))
    assert reply.error == "/opt/nowhere/python3 not found on host (set python: in the inventory)"


def test_sudo_never_prompts(lab, shared):
    reply = agent(inv(lab, shared, user=lab.user, sudo=True))
    assert not reply.ok  # the lab user has no sudo rights, or there is no sudo at all
    if shutil.which("sudo"):
        assert reply.error.startswith(("sudo needs a password", "sudo refused"))
    else:
        assert reply.error == "sudo not found on host (set sudo: false in the inventory)"


def test_agent_output_that_is_not_json(lab, shared):
    reply = agent(inv(lab, shared, python="/bin/echo"))
    assert not reply.ok
    assert reply.error.startswith("agent output is not JSON: '-S -E -s -c import sys")


# --------------------------------------------------------------------------- timeouts


def test_command_timeout_ends_the_remote_process(lab, shared):
    with open_session(inv(lab, shared)) as session:
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            session.run_argv(["sh", "-c", "echo $$; exec sleep 100"], timeout=2)
        assert time.monotonic() - started < 2 + SLACK
        assert str(err.value) == "sh timed out after 2s"
        pid = int(err.value.stdout.decode().strip())
        assert shared.wait_gone(pid, timeout=10), "the remote sleep outlived the timeout"
        # the session is still usable
        assert session.run_argv(["true"], timeout=10).exit_code == 0


def test_agent_timeout_is_a_value(lab, make_host):
    gpu = make_host(gpus=1)
    gpu.exec(["sh", "-c", "printf '#!/bin/sh\\nexec sleep 100\\n' > /tmp/slowpy; chmod +x /tmp/slowpy"],
             check=True)
    started = time.monotonic()
    reply = agent(inv(lab, gpu, python="/tmp/slowpy"), timeout=2)
    assert not reply.ok
    assert reply.error == "agent timed out after 2s"
    assert reply.exit_code is None
    assert time.monotonic() - started < 2 + SLACK


def test_dead_hosts_delay_nothing_but_themselves(lab, shared):
    hole = lab.blackholed_host("tr-hole2")
    dead = lab.dead_host("tr-dead2")
    fleet = [inv(lab, shared, name="a"), inv(lab, hole, connect_timeout=3),
             inv(lab, dead), inv(lab, shared, name="b")]
    started = time.monotonic()
    replies = run_hosts(fleet, agent, forks=4)
    assert time.monotonic() - started < 3 + SLACK
    assert [r.ok for r in replies] == [True, False, False, True]
    assert "timed out" in replies[1].error and "refused" in replies[2].error


# --------------------------------------------------------------------------- ssh_config


def write_ssh_config(home: Path, text: str) -> None:
    (home / ".ssh").mkdir(exist_ok=True)
    (home / ".ssh" / "config").write_text(text)


def test_ssh_config_supplies_what_the_inventory_leaves_out(lab, shared, home):
    write_ssh_config(home, f"""
Host viaconfig
    HostName 127.0.0.1
    Port {shared.port}
    User {lab.user}
    IdentityFile {lab.client_key}
""")
    host = Host(name="viaconfig", known_hosts_file=str(lab.known_hosts_path),
                explicit=frozenset({"known_hosts_file"}))
    reply = agent(host)
    assert reply.ok, reply.error
    assert reply.doc["facts"]["user"] == lab.user


def test_inventory_keys_win_over_ssh_config(lab, shared, home):
    dead = lab.dead_host("tr-dead3")
    write_ssh_config(home, f"""
Host {shared.name}
    HostName 127.0.0.2
    Port {dead.port}
    User nosuchuser
    IdentityFile /nonexistent/key
""")
    reply = agent(inv(lab, shared))  # address, port, user, identity_file all explicit
    assert reply.ok, reply.error
    assert reply.doc["facts"]["user"] == "root"


def jump_config(home, lab, jump, target) -> None:
    write_ssh_config(home, f"""
Host jumpbox
    HostName 127.0.0.1
    Port {jump.port}
    User root
    IdentityFile {lab.client_key}
Host behind
    HostName 127.0.0.1
    Port {target.port}
    User root
    IdentityFile {lab.client_key}
    ProxyJump jumpbox
""")


def behind(known_hosts_file, policy="strict") -> Host:
    return Host(name="behind", known_hosts_file=str(known_hosts_file), host_key_policy=policy,
                connect_timeout=5, explicit=frozenset({"known_hosts_file", "host_key_policy"}))


def test_proxyjump_reaches_the_target_through_the_jump_host(lab, make_host, home):
    jump, target = make_host(gpus=1), make_host(gpus=3)
    jump_config(home, lab, jump, target)
    jump_logins = accepted_logins(jump)
    reply = agent(behind(lab.known_hosts_path))
    assert reply.ok, reply.error
    assert reply.doc["facts"]["hostname"] == target.name
    assert len(reply.doc["gpus"]) == 3
    assert accepted_logins(jump) == jump_logins + 1
    jump.stop()
    reply = agent(behind(lab.known_hosts_path))
    assert not reply.ok
    assert reply.error.startswith("via jump host jumpbox")


def test_proxyjump_enforces_the_policy_on_the_jump_hop(lab, make_host, home, tmp_path):
    jump, target = make_host(gpus=1), make_host(gpus=1)
    jump_config(home, lab, jump, target)
    only_target = lab.known_hosts([target], tmp_path / "only_target")
    reply = agent(behind(only_target))
    _t, _b, jump_fp = key_of(jump)
    assert not reply.ok
    assert reply.error.startswith("via jump host jumpbox")
    assert f"unknown host key for [127.0.0.1]:{jump.port}" in reply.error and jump_fp in reply.error

    changed = tmp_path / "changed_jump"
    changed.write_text(target.host_key_line + "\n" + lab.wrong_host_key_line(jump) + "\n")
    for policy in ("strict", "accept-new"):
        reply = agent(behind(changed, policy))
        assert not reply.ok
        assert "HOST KEY CHANGED" in reply.error and f"{changed}:2" in reply.error

    # accept-new records both hops
    reply = agent(behind(empty_file(tmp_path), "accept-new"))
    assert reply.ok, reply.error
    recorded = (home / ".config" / "gpufleet" / "known_hosts").read_text()
    assert f"[127.0.0.1]:{jump.port} " in recorded and f"[127.0.0.1]:{target.port} " in recorded


def test_proxyjump_target_key_checked_too(lab, make_host, home, tmp_path):
    jump, target = make_host(gpus=1), make_host(gpus=1)
    jump_config(home, lab, jump, target)
    only_jump = lab.known_hosts([jump], tmp_path / "only_jump")
    reply = agent(behind(only_jump))
    assert not reply.ok
    assert reply.error.startswith(f"unknown host key for [127.0.0.1]:{target.port}")
    assert "gpufleet trust behind" in reply.error


# --------------------------------------------------------------------------- local


def test_local_connection_runs_the_same_agent():
    host = Host(name="here", connection="local")
    reply = agent(host)
    assert reply.ok, reply.error
    assert reply.doc["facts"]["hostname"] == socket.gethostname()
    assert reply.doc["facts"]["agent_pid"] != os.getpid()


def test_local_timeout_ends_the_process_group():
    with open_session(Host(name="here", connection="local")) as session:
        started = time.monotonic()
        with pytest.raises(TransportError) as err:
            session.run_argv(["sh", "-c", "sleep 100 & echo $!; wait"], timeout=1)
        assert time.monotonic() - started < 1 + SLACK
        child = int(err.value.stdout.decode().strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the local sleep outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_local_missing_python():
    reply = agent(Host(name="here", connection="local", python="/nonexistent/python3"))
    assert not reply.ok
    assert reply.error == "/nonexistent/python3 not found on host (set python: in the inventory)"


# --------------------------------------------------------------------------- failure kinds


def test_each_connect_failure_has_its_kind(lab, shared, tmp_path, client):
    """The row's message stays as it was; the kind says what happened, for verdicts."""
    dead, hole = lab.dead_host("tr-kind-dead"), lab.blackholed_host("tr-kind-hole")
    kh = tmp_path / "kh"
    kh.write_text(lab.wrong_host_key_line(shared) + "\n")
    nxdomain = Host(name="tr-kind-dns", address="nonexistent.invalid", port=22,
                    connect_timeout=5, explicit=frozenset({"connect_timeout"}))
    cases = {
        "refused": inv(lab, dead, connect_timeout=5),
        "timeout": inv(lab, hole, connect_timeout=2),
        "dns": nxdomain,
        "hostkey": inv(lab, shared, name="tr-kind-key", known_hosts_file=str(kh)),
    }
    got = {}
    for kind, host in cases.items():
        reply = agent(host)
        assert not reply.ok
        got[kind] = reply.error_kind
    assert got == {k: k for k in cases}
    with open_session(cases["refused"]) as session:
        if client == "openssh":  # ssh connects on a run: the first one finds it refused
            assert session.error is None
            assert agent(cases["refused"]).error_kind == "refused"
            session.run_agent(SNAPSHOT, timeout=10)
        assert session.error == f"connection refused by 127.0.0.1:{dead.port}"
        assert session.error_kind == "refused"
        with pytest.raises(TransportError) as err:
            session.run_argv(["true"])
    assert err.value.kind == "refused"


def test_kept_openssh_session_logs_in_once_and_ends_its_master(lab, shared, client):
    """keep=True (runbooks, serve) with ``ssh_persist: 0``: OpenSSH gets a master of
    gpufleet's own, opened on open_session, its runs are channels on it (one login for three
    runs), and close() ends that master (the PID gpufleet started) and removes its socket
    directory. (With ssh_persist, the default, the kept master serves instead:
    test_kept_connections_lab.py's runbook test.)"""
    before = accepted_logins(shared)
    with open_session(inv(lab, shared, ssh_persist=0.0), keep=True) as session:
        assert session.error is None
        for _ in range(3):
            reply = session.run_agent(SNAPSHOT, timeout=30)
            assert reply.ok, reply.error
        if client == "openssh":
            master = session._master
            assert master is not None and master.up
            pid, where = master.proc.pid, master.dir
            assert os.stat(where).st_mode & 0o077 == 0  # nobody else may join it
    assert accepted_logins(shared) - before == 1
    if client == "openssh":
        assert not os.path.exists(where)
        with pytest.raises(ProcessLookupError):
            for _ in range(100):  # reaped by close(): the PID is gone
                os.kill(pid, 0)
                time.sleep(0.02)


@pytest.mark.parametrize("persist", [None, 0.0], ids=["kept-default", "ssh_persist-0"])
def test_kept_session_to_a_dead_host_fails_on_open(lab, client, persist):
    """keep=True connects on open: a dead host is the session's error at once, whether
    OpenSSH opens gpufleet's own master (``ssh_persist: 0``) or the kept one (the default,
    started by a first run when no socket is there)."""
    dead = lab.dead_host("tr-keep-dead-%s" % ("kept" if persist is None else "0"))
    with open_session(inv(lab, dead, connect_timeout=5, ssh_persist=persist), keep=True) as session:
        assert session.error == f"connection refused by 127.0.0.1:{dead.port}"
        assert session.error_kind == "refused"
