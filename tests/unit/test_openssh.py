"""The OpenSSH transport's pure parts: ssh's own failures (recorded stderr), key files, argv."""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from gpufleet.config.inventory import Host
from gpufleet.transport import openssh
from gpufleet.transport.run import RawRun

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "openssh" / "ssh_stderr.json"
CASES = json.loads(FIXTURES.read_text())["cases"]


def target(**kw) -> openssh.Target:
    base = dict(base=("ssh",), dest=("--", "h"), where="127.0.0.1:2299", key_name="[127.0.0.1]:2299",
                user="root", connect_timeout=2.0, policy="strict", keys=())
    base.update(kw)
    return openssh.Target(**base)


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c["kind"]) + ":" + c["stderr"][:30])
def test_recorded_ssh_failures_get_their_kind(case):
    got = openssh.ssh_failure(RawRun(255, b"", case["stderr"].encode()), target())
    if case["kind"] is None:
        assert got is None
    else:
        assert got is not None and got.kind == case["kind"], got
        assert "\n" not in str(got)
        if "message" in case:
            assert str(got) == case["message"]


@pytest.mark.parametrize("code", [0, 1, 3, 127])
def test_only_exit_255_is_ssh_speaking(code):
    refused = CASES[4]["stderr"].encode()
    assert openssh.ssh_failure(RawRun(code, b"", refused), target()) is None


def test_a_timed_out_run_is_not_classified_here():
    raw = RawRun(None, b"", CASES[4]["stderr"].encode(), timed_out=True)
    assert openssh.ssh_failure(raw, target()) is None


def _keygen(path: Path, passphrase: str = "", fmt: list[str] | None = None) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)]
                   + (fmt or []), check=True)
    return path


def test_key_states_from_real_keys(tmp_path):
    assert openssh._key_state(str(_keygen(tmp_path / "plain"))) == "ok"
    assert openssh._key_state(str(_keygen(tmp_path / "locked", "secret"))) == "locked"
    rsa = tmp_path / "pem"
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-m", "PEM", "-N", "secret",
                    "-f", str(rsa)], check=True)
    assert openssh._key_state(str(rsa)) == "locked"
    assert openssh._key_state(str(tmp_path / "nothing")) == "missing"


def test_auth_message_names_keys_like_the_paramiko_path(tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    good, locked = _keygen(tmp_path / "good"), _keygen(tmp_path / "locked", "pw")
    t = target(keys=((str(good), True), (str(locked), True), (str(tmp_path / "gone"), True),
                     (str(tmp_path / "implicit"), False)))
    got = openssh.ssh_failure(RawRun(255, b"", CASES[3]["stderr"].encode()), t)
    assert str(got) == (
        f"authentication failed for root@[127.0.0.1]:2299 (tried {good}; {locked} is "
        f"passphrase-protected (load it into ssh-agent); {tmp_path / 'gone'} not found); "
        "check user and identity_file")
    none = openssh.ssh_failure(RawRun(255, b"", CASES[3]["stderr"].encode()), target())
    assert "no key to try" in str(none)


def test_argv_is_options_then_alias_never_shell_text(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    key = _keygen(tmp_path / "id")
    host = Host(name="gpu; rm -rf /", address="127.0.0.1", port=2299, user="root",
                identity_file=str(key), connect_timeout=2.5, ssh_persist=0.0,
                explicit=frozenset({"address", "port", "user", "identity_file", "connect_timeout",
                                    "ssh_persist"}))
    t = openssh.target_for(host, "ssh")
    assert t is not None
    argv = list(t.argv)
    assert argv[-2:] == ["--", "127.0.0.1"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    for must in ("BatchMode=yes", "StrictHostKeyChecking=yes", "ControlMaster=no",
                 "ControlPath=none", "PreferredAuthentications=publickey", "ConnectTimeout=3"):
        assert must in opts
    kh = [o for o in opts if o.startswith("UserKnownHostsFile=")][0]
    assert str(tmp_path / ".config" / "gpufleet" / "known_hosts") in kh
    assert argv[argv.index("-i") + 1] == str(key)
    assert argv[argv.index("-p") + 1] == "2299" and argv[argv.index("-l") + 1] == "root"
    assert "gpu; rm -rf /" not in " ".join(argv)
    assert t.where == "127.0.0.1:2299" and t.key_name == "[127.0.0.1]:2299"
    # ssh_persist left unset: kept 60 s (the default), its socket in gpufleet's directory
    kept = openssh.target_for(dataclasses.replace(host, ssh_persist=60.0), "ssh")
    assert kept is not None and kept.kept is not None and kept.persist_s == 60
    opts = [kept.argv[i + 1] for i, a in enumerate(kept.argv) if a == "-o"]
    assert ["ControlMaster=auto", f"ControlPath={kept.kept}", "ControlPersist=60"] == [
        o for o in opts if o.startswith("Control")]
    assert Host(name="h").ssh_persist == 60.0


def test_jump_hosts_keep_the_paramiko_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host behind\n  ProxyJump bastion\n")
    from gpufleet.transport import sshconfig

    sshconfig.clear_cache()
    assert openssh.target_for(Host(name="behind"), "ssh") is None
    forced = Host(name="behind", ssh_client="openssh", explicit=frozenset({"ssh_client"}))
    assert openssh.target_for(forced, "ssh") is not None
    sshconfig.clear_cache()


def test_wanted_follows_the_setting_and_the_client(monkeypatch):
    from gpufleet.transport import sshconfig

    assert not sshconfig.openssh_wanted(Host(name="h", ssh_client="paramiko"))
    monkeypatch.setattr(sshconfig, "ssh_client", lambda: None)
    assert not sshconfig.openssh_wanted(Host(name="h"))
    assert sshconfig.openssh_wanted(Host(name="h", ssh_client="openssh"))


def test_curve25519_first_unless_ssh_config_chooses(tmp_path, monkeypatch):
    """ssh's own default list with curve25519 first; a KexAlgorithms from ssh_config wins."""
    from gpufleet.transport import sshconfig

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    sshconfig.clear_cache()
    t = openssh.target_for(Host(name="127.0.0.1"), "ssh")
    assert t is not None
    kex = [t.base[i + 1] for i, a in enumerate(t.base) if a == "-o" and
           t.base[i + 1].startswith("KexAlgorithms=")]
    defaults = sshconfig._ssh_defaults("ssh")["kexalgorithms"][0].split(",")
    assert kex and kex[0].split("=", 1)[1].split(",")[0] == "curve25519-sha256"
    assert sorted(kex[0].split("=", 1)[1].split(",")) == sorted(defaults)
    (tmp_path / ".ssh" / "config").write_text("Host chosen\n  KexAlgorithms sntrup761x25519-sha512@openssh.com\n")
    sshconfig.clear_cache()
    chosen = openssh.target_for(Host(name="chosen"), "ssh")
    assert chosen is not None and not any(a.startswith("KexAlgorithms=") for a in chosen.base)
    sshconfig.clear_cache()
