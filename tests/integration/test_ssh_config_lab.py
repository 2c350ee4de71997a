"""ssh_config exactly as OpenSSH reads it: gpufleet goes where `ssh ALIAS` goes (a guess could reach another machine).

Two lab hosts on different ports with different GPU counts (`near`: 1 GPU, `far`: 3 GPUs):
each tricky config names one of them; the test checks that gpufleet's resolution equals the
real `ssh -G`, that the real `ssh ALIAS hostname` and gpufleet reach the same host (by its
hostname and its GPU count), and a real agent run over it.

HOME is a temporary directory. The ssh client reads the account's ~/.ssh/config, not
$HOME's, so gpufleet hands it `-F $HOME/.ssh/config` (see gpufleet/transport/sshconfig.py); for the
same reason the paths inside these configs (Include, IdentityFile) are absolute: ssh expands
`~` to the account's home.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Optional

import pytest

from cli_helpers import assert_no_traceback, run_gpufleet
from gpufleet.transport import sshconfig as sshresolve
from gpufleet.config.inventory import Host
from gpufleet.transport.connection import connection_for
from gpufleet.transport import close_kept, kept_connections, open_session

SNAPSHOT = {"mode": "snapshot", "nvidia_smi": None, "smi_timeout_s": 10.0}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    sshresolve.clear_cache()
    yield home
    sshresolve.clear_cache()


@pytest.fixture(scope="module")
def pair(lab):
    near, far = lab.add_host("sc-near", gpus=1), lab.add_host("sc-far", gpus=3)
    yield near, far
    near.stop()
    far.stop()


def tail(lab) -> str:
    """The `Host *` block every config ends with (first value wins: earlier blocks decide)."""
    return f"""
Host *
    HostName 127.0.0.1
    User root
    IdentityFile {lab.client_key}
    UserKnownHostsFile {lab.known_hosts_path}
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
"""


def write_config(home: Path, text: str) -> Path:
    path = home / ".ssh" / "config"
    path.write_text(text)
    return path


def ssh_g(home: Path, alias: str, *opts: str) -> dict[str, list[str]]:
    """The real `ssh -G` for this config."""
    res = subprocess.run(["ssh", "-G", "-F", str(home / ".ssh" / "config"), *opts, "--", alias],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, check=True)
    out: dict[str, list[str]] = {}
    for line in res.stdout.splitlines():
        key, _s, value = line.partition(" ")
        out.setdefault(key, []).append(value)
    return out


def real_ssh_hostname(home: Path, alias: str, *opts: str) -> str:
    """Where the real `ssh ALIAS` lands: the lab host's hostname (its UTS name)."""
    res = subprocess.run(["ssh", "-F", str(home / ".ssh" / "config"), *opts, "--", alias,
                          "hostname"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def inv(alias: str, **keys: Any) -> Host:
    """An inventory host whose address is the ssh_config alias (docs/inventory.md's example)."""
    return Host(name="inv-" + alias.replace("%", "p"), address=alias,
                explicit=frozenset({"address", *keys}), **keys)


def agent(host: Host):
    with open_session(host) as session:
        return session.run_agent(SNAPSHOT, timeout=30)


def check_alias(home: Path, alias: str, expect, *opts: str, **keys: Any) -> dict:
    """gpufleet resolves `alias` as ssh -G does, and reaches `expect` as the real ssh does."""
    want = ssh_g(home, alias, *opts)
    host = inv(alias, **keys)
    conn = connection_for(host)
    try:
        assert conn.host == want["hostname"][0]
        assert int(conn.port) == int(want["port"][0]) == expect.port
        assert conn.user == want["user"][0]
        assert conn.ssh_config.get("proxyjump") == (want.get("proxyjump") or [None])[0]
    finally:
        conn.close()
    assert real_ssh_hostname(home, alias, *opts) == expect.name
    reply = agent(host)
    assert reply.ok, reply.error
    assert reply.doc["facts"]["hostname"] == expect.name
    assert len(reply.doc["gpus"]) == expect.gpus
    return reply.doc


# --------------------------------------------------------------------------- alias forms


def test_wildcard_block(lab, pair, home):
    near, far = pair
    write_config(home, f"Host gpu-*\n    Port {far.port}\n" + tail(lab))
    check_alias(home, "gpu-07", far)


def test_negated_pattern(lab, pair, home):
    near, far = pair
    write_config(home, f"Host gpu-* !gpu-spare\n    Port {far.port}\n"
                       f"Host gpu-spare\n    Port {near.port}\n" + tail(lab))
    check_alias(home, "gpu-spare", near)
    check_alias(home, "gpu-main", far)


def test_percent_h_token_in_hostname(lab, pair, home):
    near, far = pair
    # `ssh 1` goes to 127.0.0.%h = 127.0.0.1
    write_config(home, f"Host 1\n    HostName 127.0.0.%h\n    Port {far.port}\n" + tail(lab))
    check_alias(home, "1", far)


def test_match_host_and_originalhost(lab, pair, home):
    near, far = pair
    # Match host sees the HostName set so far; originalhost the name given to ssh
    write_config(home, f"""
Match originalhost mh-far
    HostName 127.0.0.1
Match host 127.0.0.1 originalhost mh-far
    Port {far.port}
Match host mh-near
    Port {near.port}
""" + tail(lab))
    check_alias(home, "mh-far", far)
    assert ssh_g(home, "mh-near")["port"] == [str(near.port)]
    check_alias(home, "mh-near", near)


def test_match_user_sees_the_inventory_user_as_ssh_l(lab, pair, home):
    near, far = pair
    write_config(home, f"Match user {lab.user}\n    Port {far.port}\n"
                       f"Host mu\n    Port {near.port}\n" + tail(lab))
    doc = check_alias(home, "mu", far, "-l", lab.user, user=lab.user)
    assert doc["facts"]["user"] == lab.user
    check_alias(home, "mu", near)  # no inventory user: root, the other block


def test_match_exec_runs_as_ssh_runs_it(lab, pair, home, tmp_path):
    near, far = pair
    flag = tmp_path / "flag"
    write_config(home, f'Match originalhost mx exec "test -e {flag}"\n    Port {far.port}\n'
                       f"Host mx\n    Port {near.port}\n" + tail(lab))
    check_alias(home, "mx", near)
    flag.write_text("")
    sshresolve.clear_cache()  # one resolution per alias per run: a new run sees the flag
    check_alias(home, "mx", far)


def test_include_of_config_d_sets_the_port_of_the_right_host(lab, pair, home):
    near, far = pair
    confd = home / ".ssh" / "config.d"
    confd.mkdir()
    (confd / "10-far.conf").write_text(f"Host inc-far\n    Port {far.port}\n")
    write_config(home, f"Include {confd}/*\n\nHost inc-*\n    Port {near.port}\n" + tail(lab))
    check_alias(home, "inc-far", far)
    check_alias(home, "inc-other", near)
    # a host with no address is `ssh NAME`: the included Port, not the wildcard's (paramiko
    # without Include reached `near` here: the wrong host)
    reply = agent(Host(name="inc-far"))
    assert reply.ok, reply.error
    assert reply.doc["facts"]["hostname"] == far.name and len(reply.doc["gpus"]) == 3


def test_first_value_wins(lab, pair, home):
    near, far = pair
    write_config(home, f"Host fvw\n    Port {far.port}\n    HostName 127.0.0.1\n"
                       f"Host fvw\n    Port {near.port}\n    HostName 127.0.0.2\n"
                       f"Host f*\n    Port {near.port}\n" + tail(lab))
    check_alias(home, "fvw", far)


def test_inventory_port_and_user_act_like_ssh_p_and_l(lab, pair, home):
    near, far = pair
    write_config(home, f"Host prec\n    Port {near.port}\n    User nosuchuser\n" + tail(lab))
    check_alias(home, "prec", far, "-p", str(far.port), "-l", "root", port=far.port, user="root")


def test_every_identity_file_in_order(lab, pair, home, tmp_path):
    near, far = pair
    wrong = tmp_path / "wrong_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)], check=True)
    missing = tmp_path / "missing_key"
    write_config(home, f"Host ids\n    Port {far.port}\n    IdentityFile {missing}\n"
                       f"    IdentityFile {wrong}\n" + tail(lab))
    want = ssh_g(home, "ids")["identityfile"]
    assert want == [str(missing), str(wrong), str(lab.client_key)]
    assert sshresolve.resolve("ids").values["identityfile"] == want
    check_alias(home, "ids", far)


def test_ssh_defaults_are_not_configured_identities(lab, pair, home):
    """ssh -G prints ~/.ssh/id_* when nothing is configured: missing ones are skipped silently."""
    near, far = pair
    text = tail(lab).replace(f"    IdentityFile {lab.client_key}\n", "")
    write_config(home, f"Host noid\n    Port {far.port}\n" + text)
    assert "identityfile" not in sshresolve.resolve("noid").values
    reply = agent(inv("noid"))
    assert not reply.ok
    assert "no key to try" in reply.error and "id_rsa" not in reply.error
    (home / ".ssh" / "id_ed25519").write_bytes(lab.client_key.read_bytes())
    (home / ".ssh" / "id_ed25519").chmod(0o600)
    reply = agent(inv("noid"))
    assert reply.ok, reply.error


def test_proxyjump_hops_are_aliases_too(lab, pair, home):
    near, far = pair
    before = (near.dir / "sshd.log").read_text().count("Accepted publickey")
    write_config(home, f"""
Host bastion-*
    Port {near.port}
Host behind-far
    Port {far.port}
    ProxyJump bastion-1
Host behind-spec
    Port {far.port}
    ProxyJump root@jumpname:{near.port}
""" + tail(lab))
    check_alias(home, "behind-far", far)
    check_alias(home, "behind-spec", far)
    after = (near.dir / "sshd.log").read_text().count("Accepted publickey")
    assert after - before == 4  # two real ssh runs and two gpufleet runs went through `near`


def test_ssh_config_timeout_and_host_key_settings(lab, pair, home, tmp_path):
    near, far = pair
    hole = lab.blackholed_host("sc-hole")
    write_config(home, f"Host slow\n    Port {hole.port}\n    ConnectTimeout 2\n"
                       f"Host newkey\n    Port {far.port}\n    UserKnownHostsFile {tmp_path}/kh\n"
                       "    StrictHostKeyChecking accept-new\n" + tail(lab))
    reply = agent(inv("slow"))
    assert reply.error == f"connect to 127.0.0.1:{hole.port} timed out after 2s"
    # accept-new from ssh_config (the inventory sets no policy): recorded by gpufleet, as
    # ssh would record it; the inventory's own policy, when set, wins
    reply = agent(inv("newkey", host_key_policy="strict"))
    assert not reply.ok and reply.error.startswith("unknown host key")
    reply = agent(inv("newkey"))
    assert reply.ok, reply.error
    recorded = (home / ".config" / "gpufleet" / "known_hosts").read_text()
    assert f"[127.0.0.1]:{far.port} " in recorded


# --------------------------------------------------------------------------- errors


def test_config_ssh_refuses_is_a_one_line_row_error(lab, pair, home):
    near, far = pair
    write_config(home, f"Host broken\n    Port {far.port}\n    Bogusoption yes\n" + tail(lab))
    reply = agent(inv("broken"))
    assert not reply.ok
    assert reply.error.startswith("ssh config: ssh -G broken failed: ")
    assert "Bad configuration option: bogusoption" in reply.error
    assert "\n" not in reply.error


def test_alias_that_looks_like_an_option_is_refused():
    for bad in ("-oProxyCommand=touch x", "a b", "user@host", ""):
        with pytest.raises(sshresolve.SshConfigError) as err:
            sshresolve.resolve(bad)
        assert "invalid ssh host name" in str(err.value)


def fleet(path: Path, **aliases: Optional[str]) -> Path:
    """A fleet.yaml of hosts name -> address alias, nothing else set (ssh_config decides)."""
    path.write_text(json.dumps({"defaults": {"connect_timeout": 5},
                                "hosts": {n: {"address": a} for n, a in aliases.items()}}))
    return path


def test_cli_status_over_aliases_and_errors(lab, pair, home, tmp_path):
    near, far = pair
    confd = home / ".ssh" / "config.d"
    confd.mkdir()
    (confd / "far.conf").write_text(f"Host cli-far\n    Port {far.port}\n")
    text = (f"Include {confd}/*.conf\n"
            f"Host cli-jump\n    Port {far.port}\n    ProxyJump cli-bastion\n"
            f"Host cli-*\n    Port {near.port}\n"
            + tail(lab).replace("Host *\n    HostName", "Host * !*.invalid\n    HostName"))
    write_config(home, text)
    inventory = fleet(tmp_path / "fleet.yaml", a="cli-far", b="cli-near", c="cli-jump",
                      e="no-such-alias.invalid")
    run = run_gpufleet(home, inventory, "status", "--json")
    assert_no_traceback(run)
    assert run.rc == 1, str(run)  # documented: some host failed
    hosts = {h["host"]: h for h in run.json()["hosts"]}
    for name, where, gpus in (("a", far, 3), ("b", near, 1), ("c", far, 3)):
        assert hosts[name]["ok"], hosts[name]["error"]
        assert hosts[name]["facts"]["hostname"] == where.name
        assert len(hosts[name]["gpus"]) == gpus
    assert hosts["e"]["error"].startswith(("cannot resolve no-such-alias.invalid",
                                           "DNS lookup of no-such-alias.invalid timed out"))
    # a config ssh refuses: `ssh cli-far` fails too, so every host gets ssh's reason
    write_config(home, text + "    Bogusoption yes\n")
    run = run_gpufleet(home, inventory, "status", "--json")
    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    for h in run.json()["hosts"]:
        assert h["error"].startswith("ssh config: ssh -G "), h
        assert "Bad configuration option: bogusoption" in h["error"], h
        assert "\n" not in h["error"]
    table = run_gpufleet(home, inventory, "status")
    assert table.rc == 1 and "ERROR: ssh config: ssh -G cli-far failed: " in table.stdout, str(table)


# --------------------------------------------------------------------------- no ssh client


def test_without_ssh_paramiko_resolves_and_warns_once(lab, pair, home, tmp_path, monkeypatch,
                                                      capsys):
    near, far = pair
    confd = home / ".ssh" / "config.d"
    confd.mkdir()
    (confd / "x.conf").write_text(f"Host fb-inc\n    Port {far.port}\n")
    cfg = write_config(home, f"Include {confd}/*\nHost fb\n    Port {far.port}\n"
                             f"Match originalhost fb-m\n    Port {far.port}\n" + tail(lab))
    nossh = tmp_path / "bin"
    nossh.mkdir()
    monkeypatch.setenv("PATH", str(nossh))
    assert sshresolve.ssh_client() is None
    reply = agent(inv("fb"))
    assert reply.ok, reply.error
    assert reply.doc["facts"]["hostname"] == far.name
    assert agent(inv("fb")).ok
    warned = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert warned == [
        "gpufleet: warning: no `ssh` client on PATH: ssh_config is read by paramiko, which "
        f"cannot honour Include ({cfg}:1), Match ({cfg}:4) as OpenSSH does; hosts may resolve "
        "other than `ssh ALIAS`; install the OpenSSH client"]
    assert sshresolve.resolve("fb").via == "paramiko"


def test_without_ssh_cli_warns_once_for_many_hosts(lab, pair, home, tmp_path, monkeypatch):
    near, far = pair
    cfg = write_config(home, f"Include {home}/.ssh/none.d/*\nHost nf-*\n    Port {far.port}\n"
                       + tail(lab))
    inventory = fleet(tmp_path / "fleet.yaml", a="nf-1", b="nf-2")
    nossh = tmp_path / "bin"
    nossh.mkdir()
    monkeypatch.setenv("PATH", str(nossh))  # run_gpufleet passes os.environ on
    run = run_gpufleet(home, inventory, "status", "--json")
    assert run.rc == 0, str(run)
    assert all(h["facts"]["hostname"] == far.name for h in run.json()["hosts"])
    warned = [ln for ln in run.stderr.splitlines() if "warning: no `ssh` client" in ln]
    assert len(warned) == 1 and f"Include ({cfg}:1)" in warned[0], run.stderr


def test_host_key_alias_names_the_known_hosts_entry(lab, pair, home, tmp_path):
    near, far = pair
    kh = tmp_path / "kh"
    _name, keytype, b64 = far.host_key_line.split()
    kh.write_text(f"far-key {keytype} {b64}\n")  # filed under the alias, no port, as ssh does
    write_config(home, f"Host hka\n    Port {far.port}\n    HostKeyAlias far-key\n"
                       f"    UserKnownHostsFile {kh}\n" + tail(lab))
    check_alias(home, "hka", far)
    kh.write_text(lab.wrong_host_key_line(far).replace(f"[127.0.0.1]:{far.port}", "far-key") + "\n")
    sshresolve.clear_cache()
    # the connection kept from the check above (ssh_persist, on by default) was verified when
    # it was made and would carry on: close it (`gpufleet disconnect`) so the key is read again
    for found in kept_connections():
        close_kept(found.path)
    reply = agent(inv("hka"))
    assert not reply.ok and reply.error.startswith("HOST KEY CHANGED for far-key")
