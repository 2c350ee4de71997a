"""hostkeys: known_hosts reading and the strict / accept-new decisions (no network)."""
from __future__ import annotations

import base64
import hashlib
import subprocess
import threading
from pathlib import Path

import paramiko
import pytest

from gpufleet.transport import hostkeys
from gpufleet.transport.hostkeys import (ACCEPT_NEW, CHANGED, KNOWN, OTHER_TYPE, REVOKED, STRICT, UNKNOWN,
                               HostKeyError, HostKeyPolicy, check, host_key_name)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def newkey() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()  # paramiko cannot generate ed25519 keys


def line(name: str, key: paramiko.PKey) -> str:
    return f"{name} {key.get_name()} {key.get_base64()}\n"


def test_fingerprint_is_openssh_sha256(tmp_path):
    key = paramiko.ECDSAKey.generate()
    pub = tmp_path / "k.pub"
    pub.write_text(f"{key.get_name()} {key.get_base64()} c\n")
    out = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(pub)],
                         capture_output=True, text=True, check=True).stdout
    assert out.split()[1] == hostkeys.fingerprint(key)
    expected = "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    assert hostkeys.fingerprint(key) == expected


def test_host_key_name_brackets_non_22_ports():
    assert host_key_name("gpu1", 22) == "gpu1"
    assert host_key_name("127.0.0.1", 2201) == "[127.0.0.1]:2201"


def test_bracketed_port_entry_matches_only_that_port(tmp_path):
    key = newkey()
    kh = tmp_path / "kh"
    kh.write_text(line("[127.0.0.1]:2201", key))
    blob = key.asbytes()
    assert check("[127.0.0.1]:2201", key.get_name(), blob, [kh]).verdict == KNOWN
    # glob-like brackets must not match single characters or other ports
    assert check("1", key.get_name(), blob, [kh]).verdict == UNKNOWN
    assert check("[127.0.0.1]:2202", key.get_name(), blob, [kh]).verdict == UNKNOWN
    assert check("127.0.0.1", key.get_name(), blob, [kh]).verdict == UNKNOWN


def test_hashed_entries_match(tmp_path):
    key = newkey()
    kh = tmp_path / "kh"
    kh.write_text(line(paramiko.HostKeys.hash_host("[10.0.0.5]:2222"), key))
    assert check("[10.0.0.5]:2222", key.get_name(), key.asbytes(), [kh]).verdict == KNOWN
    assert check("[10.0.0.6]:2222", key.get_name(), key.asbytes(), [kh]).verdict == UNKNOWN


def test_ssh_keygen_hashed_file_matches(tmp_path):
    key = newkey()
    kh = tmp_path / "kh"
    kh.write_text(line("gpu7.example.org", key))
    subprocess.run(["ssh-keygen", "-H", "-f", str(kh)], capture_output=True, check=True)
    assert "gpu7" not in kh.read_text()
    assert check("gpu7.example.org", key.get_name(), key.asbytes(), [kh]).verdict == KNOWN


def test_patterns_and_negation(tmp_path):
    key = newkey()
    kh = tmp_path / "kh"
    kh.write_text(line("*.lab.example,!bad.lab.example", key))
    blob = key.asbytes()
    assert check("gpu1.lab.example", key.get_name(), blob, [kh]).verdict == KNOWN
    assert check("bad.lab.example", key.get_name(), blob, [kh]).verdict == UNKNOWN
    assert check("gpu1.other.example", key.get_name(), blob, [kh]).verdict == UNKNOWN


def test_changed_key_names_file_and_line(tmp_path):
    old, new = newkey(), newkey()
    kh = tmp_path / "kh"
    kh.write_text("# comment\n" + line("other", new) + line("[h]:2200", old))
    v = check("[h]:2200", new.get_name(), new.asbytes(), [kh])
    assert v.verdict == CHANGED
    assert v.entry.where == f"{kh}:3"
    err = hostkeys.refusal("[h]:2200", new.get_name(), new.asbytes(), v)
    text = str(err)
    assert "HOST KEY CHANGED" in text and "man-in-the-middle" in text
    assert f"remove the old key from {kh}:3" in text
    assert hostkeys.fingerprint(new) in text and hostkeys.fingerprint(old) in text


def test_only_other_key_type_known_is_refused_like_a_change(tmp_path):
    rsa, ecdsa = paramiko.RSAKey.generate(1024), newkey()
    kh = tmp_path / "kh"
    kh.write_text(line("h", rsa))
    assert check("h", ecdsa.get_name(), ecdsa.asbytes(), [kh]).verdict == OTHER_TYPE


def test_revoked_key_is_refused_even_if_also_listed(tmp_path):
    key = newkey()
    kh = tmp_path / "kh"
    kh.write_text(line("h", key) + "@revoked " + line("*", key))
    v = check("h", key.get_name(), key.asbytes(), [kh])
    assert v.verdict == REVOKED
    assert hostkeys.known_keys("h", [kh]) == []


def test_strict_policy_refuses_unknown_with_fingerprint_and_advice(tmp_path):
    key = newkey()
    pol = HostKeyPolicy(STRICT, [tmp_path / "missing"], hint="run `gpufleet trust gpu1`")
    with pytest.raises(HostKeyError) as err:
        pol.verify("[127.0.0.1]:2201", key)
    msg = str(err.value)
    assert msg.startswith("unknown host key for [127.0.0.1]:2201 (")
    assert hostkeys.fingerprint(key) in msg and "gpufleet trust gpu1" in msg
    assert err.value.verdict == UNKNOWN
    assert not hostkeys.gpufleet_known_hosts().exists()


def test_accept_new_records_then_strict_reads_it_back(home):
    key = newkey()
    files = hostkeys.default_files()
    HostKeyPolicy(ACCEPT_NEW, files).verify("[h]:2201", key)
    recorded = hostkeys.gpufleet_known_hosts()
    assert recorded == home / ".config" / "gpufleet" / "known_hosts"
    assert recorded.read_text() == line("[h]:2201", key)
    assert oct(recorded.stat().st_mode & 0o777) == "0o600"
    HostKeyPolicy(STRICT, files).verify("[h]:2201", key)  # no raise
    HostKeyPolicy(ACCEPT_NEW, files).verify("[h]:2201", key)
    assert recorded.read_text().count("[h]:2201") == 1  # not recorded twice


def test_accept_new_never_accepts_a_changed_key(home):
    first, second = newkey(), newkey()
    files = hostkeys.default_files()
    HostKeyPolicy(ACCEPT_NEW, files).verify("h", first)
    with pytest.raises(HostKeyError) as err:
        HostKeyPolicy(ACCEPT_NEW, files).verify("h", second)
    assert err.value.verdict == CHANGED
    assert hostkeys.gpufleet_known_hosts().read_text() == line("h", first)


def test_concurrent_accept_new_records_once(home):
    key = newkey()
    files = hostkeys.default_files()
    errors = []

    def go():
        try:
            HostKeyPolicy(ACCEPT_NEW, files).verify("[bastion]:22", key)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert hostkeys.gpufleet_known_hosts().read_text().count("[bastion]:22") == 1


def test_default_files_order_and_ssh_config_override(home, tmp_path):
    files = hostkeys.default_files("~/fleet_kh")
    assert files[0] == home / "fleet_kh"
    assert home / ".ssh" / "known_hosts" in files
    assert hostkeys.gpufleet_known_hosts() in files
    custom = hostkeys.default_files(None, {"userknownhostsfile": "~/a /dev/null"})
    assert home / "a" in custom and home / ".ssh" / "known_hosts" not in custom
    assert Path("/dev/null") not in custom
