"""fleet.yaml loading and validation: every mistake is one UsageError line naming file:line."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpufleet.errors import EXIT_USAGE, InventoryError, UsageError
from gpufleet.config.inventory import (
    DEFAULT_KEYS,
    ENV_VAR,
    HOST_KEYS,
    IMPLICIT_HINT,
    Host,
    Inventory,
    find_inventory,
    implicit_inventory,
    load_inventory,
    parse_inventory,
    resolve_inventory,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "fleet.yaml.example"

SPEC = textwrap.dedent("""\
    defaults:                 # applied to every host unless the host sets the key
      user: root
      connect_timeout: 10     # seconds
      command_timeout: 60
    hosts:
      bigmama:
        address: bigmama.local          # a name from ~/.ssh/config works too
        user: joel
        unattributed_mib: 1680          # memory per GPU that no process owns here (WSL2 reservation)
        tags: [wsl2, workstation]
      train-node:
        address: 203.0.113.34
        port: 10978
        protect: ["*train_dflash*"]     # command lines never to signal (glob)
      blackwell:
        address: 198.51.100.174
      workstation:
        connection: local               # run here, without SSH
    groups:
      training: [train-node]
      inference: [blackwell]
    """)


def parse(text: str, **kw) -> Inventory:
    return parse_inventory(textwrap.dedent(text), source="fleet.yaml", **kw)


def error_of(text: str, **kw) -> str:
    with pytest.raises(InventoryError) as info:
        parse(text, **kw)
    message = str(info.value)
    assert info.value.exit_code == EXIT_USAGE
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith("fleet.yaml"), message
    return message


# --------------------------------------------------------------------------- the spec document


def test_spec_document_loads_with_defaults_applied():
    inv = parse(SPEC)
    assert inv.names == ("bigmama", "train-node", "blackwell", "workstation")
    assert not inv.implicit
    big, train, bw, ws = inv.hosts
    assert (big.address, big.user, big.port, big.unattributed_mib) == ("bigmama.local", "joel", None, 1680)
    assert big.tags == ("wsl2", "workstation")
    assert (train.address, train.port, train.user) == ("203.0.113.34", 10978, "root")
    assert train.protect == ("*train_dflash*",)
    assert bw.user == "root" and bw.port is None and bw.identity_file is None
    assert ws.connection == "local" and ws.address is None and ws.is_local
    assert not train.is_local
    for h in inv.hosts:
        assert h.connect_timeout == 10.0 and isinstance(h.connect_timeout, float)
        assert h.command_timeout == 60.0
        assert h.host_key_policy == "strict" and h.python == "python3" and h.sudo is False
        assert h.nvidia_smi is None and h.source == "fleet.yaml"


def test_spec_document_groups_and_lines():
    inv = parse(SPEC)
    assert dict(inv.groups) == {"training": ("train-node",), "inference": ("blackwell",)}
    assert inv.get("train-node").groups == ("training",)
    assert inv.get("blackwell").groups == ("inference",)
    assert inv.get("bigmama").groups == ()
    assert [h.line for h in inv.hosts] == [6, 11, 15, 17]
    assert inv.get("train-node").where == "fleet.yaml:11"
    assert inv.get("nope") is None
    assert inv.tags == ("wsl2", "workstation")
    assert len(inv) == 4 and [h.name for h in inv] == list(inv.names)


def test_explicit_records_keys_set_in_defaults_or_host():
    inv = parse(SPEC)
    assert inv.get("bigmama").explicit == frozenset(
        {"address", "user", "unattributed_mib", "tags", "connect_timeout", "command_timeout"})
    assert "port" in inv.get("train-node").explicit
    assert "port" not in inv.get("blackwell").explicit
    assert "identity_file" not in inv.get("blackwell").explicit
    assert "user" in inv.get("blackwell").explicit  # from defaults: still the inventory's


def test_host_is_frozen_and_hashable():
    h = parse(SPEC).hosts[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.port = 1  # type: ignore[misc]
    assert len({h, parse(SPEC).hosts[0]}) == 1


# --------------------------------------------------------------------------- the example file


DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")]


def test_example_file_is_valid_and_models_the_three_fleets():
    inv = load_inventory(EXAMPLE)
    assert inv.path == EXAMPLE and not inv.implicit
    big = inv.get("bigmama")
    assert big is not None and big.unattributed_mib == 1680 and "wsl2" in big.tags
    training = [inv.get(n) for n in inv.groups["training"]]
    assert len(training) >= 2
    for h in training:
        assert h.port == 10978 and h.user == "root"
        assert h.protect and all("*" in g for g in h.protect)
    inference = [inv.get(n) for n in inv.groups["inference"]]
    assert len(inference) >= 2 and all(h.connection == "ssh" for h in inference)
    assert any(h.connection == "local" for h in inv.hosts)


def test_example_file_uses_only_documentation_addresses():
    for h in load_inventory(EXAMPLE).hosts:
        if h.address is None:
            continue
        try:
            ip = ipaddress.ip_address(h.address)
        except ValueError:
            assert h.address.endswith(".local") or "." not in h.address, h.address
            continue
        assert any(ip in net for net in DOC_NETS), h.address


def test_documentation_example_is_valid():
    doc = (REPO / "docs" / "inventory.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    assert parse_inventory(block).names == ("bigmama", "train-node", "blackwell", "workstation",
                                            "in-a-container")


# --------------------------------------------------------------------------- lookup


def write(path: Path, text: str = "hosts: {h: {connection: local}}\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def dirs(tmp_path):
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    return cwd, home


def test_lookup_order(dirs, tmp_path):
    cwd, home = dirs
    user = write(home / ".config" / "gpufleet" / "fleet.yaml")
    assert find_inventory(None, {}, cwd, home) == user
    local = write(cwd / "fleet.yaml")
    assert find_inventory(None, {}, cwd, home) == local
    from_env = write(tmp_path / "env.yaml")
    assert find_inventory(None, {ENV_VAR: str(from_env)}, cwd, home) == from_env
    flag = write(tmp_path / "flag.yaml")
    assert find_inventory(str(flag), {ENV_VAR: str(from_env)}, cwd, home) == flag


def test_lookup_relative_and_tilde_paths(dirs):
    cwd, home = dirs
    rel = write(cwd / "sub" / "f.yaml")
    assert find_inventory("sub/f.yaml", {}, cwd, home) == rel
    tilde = write(home / "fleets" / "a.yaml")
    assert find_inventory("~/fleets/a.yaml", {}, cwd, home) == tilde
    assert find_inventory(None, {ENV_VAR: "~/fleets/a.yaml"}, str(cwd), str(home)) == tilde


def test_nothing_found_gives_implicit_localhost(dirs):
    cwd, home = dirs
    assert find_inventory(None, {ENV_VAR: ""}, cwd, home) is None
    inv = resolve_inventory(None, {}, cwd, home)
    assert inv.implicit and inv.path is None and inv == implicit_inventory()
    assert inv == load_inventory(None)
    (host,) = inv.hosts
    assert host.name == "localhost" and host.connection == "local" and host.address is None
    assert dict(inv.groups) == {}


def test_implicit_hint_says_how_to_add_hosts():
    assert "fleet.yaml" in IMPLICIT_HINT and "-i" in IMPLICIT_HINT
    assert ENV_VAR in IMPLICIT_HINT and "\n" not in IMPLICIT_HINT


@pytest.mark.parametrize("via", ["flag", "env"])
def test_named_path_that_does_not_exist_is_an_error(dirs, via):
    cwd, home = dirs
    write(cwd / "fleet.yaml")  # must not be used as a fallback
    args = ("missing.yaml", {}) if via == "flag" else (None, {ENV_VAR: "missing.yaml"})
    with pytest.raises(InventoryError) as info:
        find_inventory(args[0], args[1], cwd, home)
    assert info.value.exit_code == 2 and "missing.yaml" in str(info.value)
    assert "not found" in str(info.value)


def test_named_path_that_is_a_directory_is_an_error(dirs):
    cwd, home = dirs
    with pytest.raises(InventoryError, match="not a regular file"):
        find_inventory(str(cwd), {}, cwd, home)


def test_resolve_loads_the_found_file(dirs):
    cwd, home = dirs
    write(cwd / "fleet.yaml", SPEC)
    inv = resolve_inventory(None, {}, cwd, home)
    assert inv.names[0] == "bigmama" and inv.path == cwd / "fleet.yaml"
    assert inv.hosts[0].source == str(cwd / "fleet.yaml")


def test_load_reports_the_display_name(tmp_path):
    p = write(tmp_path / "x.yaml", "hosts:\n  a: {adress: q}\n")
    with pytest.raises(UsageError, match=r"^fleet\.yaml:2: hosts\.a: unknown key 'adress'"):
        load_inventory(p, display="fleet.yaml")


def test_load_unreadable_file_errors(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_inventory(tmp_path / "nope.yaml")
    with pytest.raises(UsageError, match="directory"):
        load_inventory(tmp_path)


def test_load_non_utf8_file(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_bytes(b"hosts:\n  a: {address: \xff\xfe}\n")
    with pytest.raises(UsageError, match=r":2: not valid UTF-8"):
        load_inventory(p)


def test_load_huge_file(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_bytes(b"#" * (2 << 20))
    with pytest.raises(UsageError, match="larger than"):
        load_inventory(p)


def test_load_utf8_bom(tmp_path):
    p = tmp_path / "f.yaml"
    p.write_bytes(b"\xef\xbb\xbfhosts: {a: {connection: local}}\n")
    assert load_inventory(p).names == ("a",)


# --------------------------------------------------------------------------- semantics


def test_host_overrides_defaults_and_defaults_override_builtins():
    inv = parse("""\
        defaults: {port: 2222, python: /opt/py/bin/python3, sudo: true, host_key_policy: accept-new}
        hosts:
          a: {address: a.example}
          b: {address: b.example, port: 22, sudo: false, python: python3.11}
        """)
    a, b = inv.hosts
    assert (a.port, a.python, a.sudo, a.host_key_policy) == (2222, "/opt/py/bin/python3", True, "accept-new")
    assert (b.port, b.python, b.sudo, b.host_key_policy) == (22, "python3.11", False, "accept-new")


def test_protect_adds_to_defaults_tags_replace():
    inv = parse("""\
        defaults: {protect: ["*sshd*"], tags: [fleet]}
        hosts:
          a: {address: a, protect: ["*train*", "*sshd*"], tags: [gpu]}
          b: {address: b}
        """)
    a, b = inv.hosts
    assert a.protect == ("*sshd*", "*train*")
    assert b.protect == ("*sshd*",)
    assert a.tags == ("gpu",) and b.tags == ("fleet",)


def test_null_unsets_a_default_and_is_not_explicit():
    inv = parse("""\
        defaults: {user: root, port: 2200, identity_file: /k}
        hosts:
          a: {address: a, user: null, port: ~, identity_file:}
          b: {address: b}
        """)
    a, b = inv.hosts
    assert (a.user, a.port, a.identity_file) == (None, None, None)
    assert not {"user", "port", "identity_file"} & a.explicit
    assert (b.user, b.port, b.identity_file) == ("root", 2200, "/k")
    assert {"user", "port", "identity_file"} <= b.explicit


def test_key_file_paths_relative_to_inventory_dir(tmp_path):
    text = """\
        hosts:
          a: {address: a, identity_file: keys/id, known_hosts_file: /etc/kh}
          b: {address: b, identity_file: ~/.ssh/id_ed25519, known_hosts_file: kh}
        """
    inv = parse(text, base_dir=tmp_path)
    a, b = inv.hosts
    assert a.identity_file == str(tmp_path / "keys" / "id") and a.known_hosts_file == "/etc/kh"
    assert b.identity_file == "~/.ssh/id_ed25519" and b.known_hosts_file == str(tmp_path / "kh")
    assert parse(text).hosts[0].identity_file == "keys/id"  # no base dir: as written


def test_local_host_needs_no_address_but_ssh_does():
    assert parse("hosts: {w: {connection: local}}").hosts[0].address is None
    assert parse("defaults: {connection: local}\nhosts: {w: }").hosts[0].is_local
    msg = error_of("hosts:\n  w: {user: joel}\n")
    assert msg.startswith("fleet.yaml:2: hosts.w: missing 'address'")
    msg = error_of("defaults: {connection: local}\nhosts:\n  w: {connection: ssh}\n")
    assert msg.startswith("fleet.yaml:3: hosts.w: missing 'address'")


def test_valid_values_accepted():
    inv = parse("""\
        hosts:
          v6: {address: "fe80::1%eth0", user: svc-gpu, port: 65535, connect_timeout: 0.5}
          v6b: {address: "2001:db8::7", user: a.b, port: 1, command_timeout: 86400}
          alias: {address: gpu_box, user: _x, nvidia_smi: /usr/lib/wsl/lib/nvidia-smi}
          "9lives": {address: 192.0.2.9, user: joel9, unattributed_mib: 0, protect: ["[!x]*? $HOME"]}
        """)
    assert inv.names == ("v6", "v6b", "alias", "9lives")
    assert inv.get("v6").connect_timeout == 0.5
    assert inv.get("9lives").protect == ("[!x]*? $HOME",)  # globs are data


def test_names_are_taken_as_written():
    inv = parse("""\
        hosts:
          yes: {connection: local, tags: [on, 2024, "x"]}
          123: {connection: local}
          1.5: {connection: local}
        groups:
          g: [yes, 123, 1.5]
        """)
    assert inv.names == ("yes", "123", "1.5")
    assert inv.groups["g"] == ("yes", "123", "1.5")
    assert inv.hosts[0].tags == ("on", "2024", "x")


def test_duplicates_in_lists_count_once():
    inv = parse("""\
        hosts:
          a: {address: a, tags: [x, y, x], protect: ["*p*", "*p*"]}
        groups:
          g: [a, a]
          empty: []
          nothing:
        """)
    assert inv.hosts[0].tags == ("x", "y") and inv.hosts[0].protect == ("*p*",)
    assert dict(inv.groups) == {"g": ("a",), "empty": (), "nothing": ()}
    assert inv.hosts[0].groups == ("g",)


def test_anchors_and_merge_keys():
    inv = parse("""\
        x-base: &base
          port: 10978
          protect: ["*train*"]
        hosts:
          a: {<<: *base, address: a}
          b:
            <<: *base
            address: b
            port: 22
        """.replace("x-base: &base", "defaults: &base"))
    a, b = inv.hosts
    assert (a.port, b.port) == (10978, 22)
    assert a.protect == ("*train*",)


def test_group_membership_order_follows_groups():
    inv = parse("""\
        hosts: {a: {address: a}, b: {address: b}}
        groups: {z: [b, a], y: [a]}
        """)
    assert inv.get("a").groups == ("z", "y")
    assert list(inv.groups) == ["z", "y"]


# --------------------------------------------------------------------------- errors


BAD = [
    # (document, expected start of the message after "fleet.yaml")
    ("hosts:\n  a:\n    adress: x\n", ":3: hosts.a: unknown key 'adress' (did you mean 'address'?)"),
    ("defaults:\n  usr: root\nhosts: {a: {address: a}}\n", ":2: defaults: unknown key 'usr' (did you mean 'user'?)"),
    ("defaults:\n  address: x\nhosts: {a: {address: a}}\n", ":2: defaults: 'address' cannot be set in defaults"),
    ("host:\n  a: {address: a}\n", ":1: unknown top-level key 'host' (did you mean 'hosts'?)"),
    ("hosts: {a: {address: a}}\nversion: 1\n", ":2: unknown top-level key 'version'"),
    ("hosts:\n  a: {address: a, zzzzzz: 1}\n", ":2: hosts.a: unknown key 'zzzzzz'"),
    ("hosts:\n  a: {address: a, port: 0}\n", ":2: hosts.a.port: expected an integer port 1-65535, got the integer 0"),
    ("hosts:\n  a: {address: a, port: 65536}\n", ":2: hosts.a.port: expected an integer port"),
    ("hosts:\n  a: {address: a, port: '22'}\n", ":2: hosts.a.port: expected an integer port 1-65535, got the string '22'"),
    ("hosts:\n  a: {address: a, port: true}\n", ":2: hosts.a.port: expected an integer port 1-65535, got the boolean true"),
    ("hosts:\n  a: {address: a, port: 22.0}\n", ":2: hosts.a.port: expected an integer port"),
    ("hosts:\n  a: {address: a, connect_timeout: 0}\n", ":2: hosts.a.connect_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, connect_timeout: -1}\n", ":2: hosts.a.connect_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, command_timeout: true}\n", ":2: hosts.a.command_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, command_timeout: '60'}\n", ":2: hosts.a.command_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, command_timeout: .nan}\n", ":2: hosts.a.command_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, command_timeout: .inf}\n", ":2: hosts.a.command_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, command_timeout: 86401}\n", ":2: hosts.a.command_timeout: expected a positive number"),
    ("hosts:\n  a: {address: a, connect_timeout: }\n", ":2: hosts.a.connect_timeout: expected a positive number of seconds (at most 86400), got nothing (null)"),
    ("hosts:\n  a: {address: a, host_key_policy: accept_new}\n", ":2: hosts.a.host_key_policy: invalid value 'accept_new': expected 'strict' or 'accept-new' (did you mean 'accept-new'?)"),
    ("hosts:\n  a: {address: a, host_key_policy: 1}\n", ":2: hosts.a.host_key_policy: expected 'strict' or 'accept-new', got the integer 1"),
    ("hosts:\n  a: {address: a, connection: sssh}\n", ":2: hosts.a.connection: invalid value 'sssh': expected 'ssh' or 'local' or 'exec' (did you mean 'ssh'?)"),
    ("hosts:\n  a: {address: a, sudo: 'true'}\n", ":2: hosts.a.sudo: expected true or false, got the string 'true'"),
    ("hosts:\n  a: {address: a, sudo: 1}\n", ":2: hosts.a.sudo: expected true or false, got the integer 1"),
    ("hosts:\n  a: {address: a, unattributed_mib: -1}\n", ":2: hosts.a.unattributed_mib: expected a whole number of MiB >= 0, got the integer -1"),
    ("hosts:\n  a: {address: a, unattributed_mib: 1.5}\n", ":2: hosts.a.unattributed_mib: expected a whole number"),
    ("hosts:\n  a: {address: a, unattributed_mib: false}\n", ":2: hosts.a.unattributed_mib: expected a whole number"),
    ("hosts:\n  a: {address: a, protect: '*x*'}\n", ":2: hosts.a.protect: expected a list of glob strings"),
    ("hosts:\n  a:\n    address: a\n    protect:\n      - '*x*'\n      - 1\n", ":6: hosts.a.protect[1]: expected a glob pattern string, got the integer 1"),
    ("hosts:\n  a: {address: a, protect: ['']}\n", ":2: hosts.a.protect[0]: expected a glob pattern string, got an empty string"),
    ("hosts:\n  a: {address: a, protect: [\"x\\ny\"]}\n", ":2: hosts.a.protect[0]: control characters"),
    ("hosts:\n  a: {address: a, tags: x}\n", ":2: hosts.a.tags: expected a list of tags"),
    ("hosts:\n  a: {address: a, tags: ['a b']}\n", ":2: hosts.a.tags[0]: invalid tag 'a b'"),
    ("hosts:\n  a: {address: a, tags: [[x]]}\n", ":2: hosts.a.tags[0]: expected tag, got a list"),
    ("hosts:\n  a: {address: a, python: 'python3 -u'}\n", ":2: hosts.a.python: invalid interpreter 'python3 -u'"),
    ("hosts:\n  a: {address: a, python: '$(id)'}\n", ":2: hosts.a.python: invalid interpreter"),
    ("hosts:\n  a: {address: a, python: -c}\n", ":2: hosts.a.python: invalid interpreter"),
    ("hosts:\n  a: {address: a, nvidia_smi: bin/nvidia-smi}\n", ":2: hosts.a.nvidia_smi: expected an absolute path on the host"),
    ("hosts:\n  a: {address: a, identity_file: ''}\n", ":2: hosts.a.identity_file: expected a file path, got an empty string"),
    ("hosts:\n  a: {address: a, identity_file: 3}\n", ":2: hosts.a.identity_file: expected a file path, got the integer 3"),
    ("hosts:\n  a: {address: 'root@h'}\n", ":2: hosts.a.address: address 'root@h' contains '@': put the user in 'user:' instead"),
    ("hosts:\n  a: {address: 'h.example:2222'}\n", ":2: hosts.a.address: address 'h.example:2222' looks like HOST:PORT"),
    ("hosts:\n  a: {address: 192.0.2.1, user: root, port: 22}\n  b: {address: 7}\n", ":3: hosts.b.address: expected a host name, IP address or ~/.ssh/config alias, got the integer 7"),
    ("hosts:\n  a: {address: ''}\n", ":2: hosts.a.address: expected a host name, IP address or ~/.ssh/config alias, got an empty string"),
    ("hosts:\n  a: {address: }\n", ":2: hosts.a: missing 'address'"),
    ("hosts:\n  a: {address: a, user: '-oProxyCommand=x'}\n", ":2: hosts.a.user: invalid user name '-oProxyCommand=x'"),
    ("hosts:\n  a: {address: a, user: '1000'}\n", ":2: hosts.a.user: invalid user name '1000'"),
    ("hosts:\n  a: {address: a, user: 1000}\n", ":2: hosts.a.user: expected a user name, got the integer 1000"),
    ("hosts:\n  a: {address: a, user: 'jo el'}\n", ":2: hosts.a.user: invalid user name"),
    ("hosts:\n  a: {address: a, user: 'jo$'}\n", ":2: hosts.a.user: invalid user name"),
    ("hosts:\n  a:\n    address: a\n  b:\n    address: b\n  a:\n    address: c\n", ":6: hosts: duplicate key 'a' (first on line 2)"),
    ("hosts:\n  a:\n    address: a\n    port: 22\n    port: 23\n", ":5: hosts.a: duplicate key 'port' (first on line 4)"),
    ("hosts: {a: {address: a}}\nhosts: {b: {address: b}}\n", ":2: duplicate key 'hosts' (first on line 1)"),
    ("hosts: {a: {address: a}}\ngroups:\n  g: [a, b]\n", ":3: groups.g[1]: unknown host 'b'"),
    ("hosts: {train-node: {address: a}}\ngroups:\n  g:\n    - train-nod\n", ":4: groups.g[0]: unknown host 'train-nod' (did you mean 'train-node'?)"),
    ("hosts: {a: {address: a}}\ngroups:\n  a: [a]\n", ":3: groups.a: group 'a' has the same name as a host"),
    ("hosts: {a: {address: a}}\ngroups:\n  g: a\n", ":3: groups.g: expected a list of host names, got the string 'a'"),
    ("hosts: {a: {address: a}}\ngroups:\n  'g;x': [a]\n", ":3: groups: invalid group name 'g;x'"),
    ("hosts: {a: {address: a}}\ngroups: [a]\n", ":2: groups: expected a mapping of group name to a list of hosts, got a list"),
    ("hosts: {a: {address: a}}\ndefaults: [a]\n", ":2: defaults: expected a mapping of settings, got a list"),
    ("hosts: [a]\n", ":1: hosts: expected a mapping of host name to settings, got a list"),
    ("hosts:\n", ":1: hosts: no hosts defined"),
    ("hosts: {}\n", ":1: hosts: no hosts defined"),
    ("defaults: {user: root}\n", ": no 'hosts:' section"),
    ("hosts:\n  a: address\n", ":2: hosts.a: expected a mapping of settings, got the string 'address'"),
    ("", ": empty inventory"),
    ("# only a comment\n", ": empty inventory"),
    ("- a\n- b\n", ":1: the inventory must be a mapping with 'hosts:', got a list"),
    ("just text\n", ":1: the inventory must be a mapping with 'hosts:', got the string 'just text'"),
    ("hosts:\n  a: {address: a\n", ":3: YAML syntax error: while parsing a flow mapping, expected ',' or '}'"),
    ("hosts:\n\ta: {address: a}\n", ":2: YAML syntax error"),
    ("hosts: {a: {address: a}}\n---\nhosts: {b: {address: b}}\n", ":2: YAML syntax error: expected a single document in the stream, but found another document"),
    ("hosts:\n  a: {address: 2020-13-45}\n", ": invalid YAML value"),
    ("hosts: !!python/object/apply:os.system ['true']\n", ":1: YAML syntax error: could not determine a constructor"),
    ("hosts:\n  a: {address: a, port: 1\x00}\n", ":2: NUL character"),
    ("hosts:\n  a: {address: a\x07}\n", ":2: YAML syntax error"),
    ("hosts:\n  a: {address: \"a\\tb\"}\n", ":2: hosts.a.address: control characters"),
    ("hosts:\n  a: {address: \"a\\u001b[31m\"}\n", ":2: hosts.a.address: control characters"),
    ("hosts:\n  ? [a, b]\n  : {address: a}\n", ":2: a key must be a plain name"),
    ("defaults: &d {<<: *d}\nhosts: {a: {address: a}}\n", ":1: recursive merge ('<<')"),
]


@pytest.mark.parametrize("text,expected", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_invalid_documents(text, expected):
    message = error_of(text)
    assert message.startswith("fleet.yaml" + expected), message


BAD_HOST_NAMES = ["a b", "a;b", "$x", "`x`", "a|b", "a&b", "'a'", '"a"', "-a", ".a", "a/b",
                  "a$(id)", "a>b", "a*", "é", "a\\b", "x" * 256, "a:b", "a@b"]


@pytest.mark.parametrize("name", BAD_HOST_NAMES)
def test_host_names_must_be_simple(name):
    text = f"hosts:\n  {yaml.safe_dump(name, default_style=chr(34)).strip()}: {{address: a}}\n"
    message = error_of(text)
    assert message.startswith("fleet.yaml:2: hosts: invalid host name"), message


BAD_ADDRESSES = ["a b", "a;b", "$(x)", "`x`", "a|b", "a&b", "-oProxyCommand=x", "'x'", '"x"',
                 "a\tb", "a\nb", "a\x00b", "x/y", "a,b", "[::1]", "a*", "a\\b", "a#b"]


@pytest.mark.parametrize("address", BAD_ADDRESSES)
def test_addresses_must_have_no_shell_characters(address):
    text = f"hosts:\n  h:\n    address: {yaml.safe_dump(address, default_style=chr(34)).strip()}\n"
    message = error_of(text)
    assert message.startswith("fleet.yaml:3: hosts.h.address: "), message
    assert "\n" not in message


def test_error_quotes_odd_values_safely():
    message = error_of('hosts:\n  h: {address: a, python: "\\u001b]0;pwn\\u0007"}\n')
    assert "\x1b" not in message and "\x07" not in message


def test_deep_nesting_is_a_usage_error():
    for text in ("hosts: " + "[" * 5000 + "]" * 5000, "hosts: " + "{a: " * 3000 + "1" + "}" * 3000):
        assert error_of(text) == "fleet.yaml: YAML nested too deeply"


def test_alias_bomb_is_rejected_without_expanding():
    # 9**9 leaves if expanded; aliases are shared references and refused at the first item.
    lines = ["groups:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"  {cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    lines.append("hosts:\n  h: {address: a, tags: *i}")
    message = error_of("\n".join(lines) + "\n")
    # an aliased item is reported where it is written out: the anchor `h` on line 9
    assert message == "fleet.yaml:9: hosts.h.tags[0]: expected tag, got a list"
    message = error_of("defaults: &d\n  protect: [" + ",".join(["*d"] * 9) + "]\n"
                       "hosts: {h: {address: a}}\n")
    assert message == ("fleet.yaml:1: defaults.protect[0]: expected a glob pattern string, "
                       "got a mapping")


def test_every_host_key_is_documented_and_has_a_field():
    doc = (REPO / "docs" / "inventory.md").read_text()
    fields = {f.name for f in dataclasses.fields(Host)}
    for key in HOST_KEYS:
        assert f"| `{key}` |" in doc, key
        assert key in fields, key
    assert set(DEFAULT_KEYS) == set(HOST_KEYS) - {"address"}


# --------------------------------------------------------------------------- fuzz


def check_invariants(inv: Inventory) -> None:
    """What every successfully loaded inventory guarantees to the rest of gpufleet."""
    assert isinstance(inv, Inventory) and inv.hosts and not inv.implicit
    names = [h.name for h in inv.hosts]
    assert len(set(names)) == len(names)
    name_re = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")
    for h in inv.hosts:
        assert isinstance(h, Host) and name_re.match(h.name)
        assert h.connection in ("ssh", "local")
        if h.connection == "ssh":
            assert isinstance(h.address, str) and h.address
        if h.address is not None:
            assert not set(h.address) & set(" \t\n\0;|&$`'\"<>()\\/@*")
        assert h.port is None or (type(h.port) is int and 1 <= h.port <= 65535)
        assert h.user is None or not set(h.user) & set(" \t\n\0;|&$`'\"")
        assert h.host_key_policy in ("strict", "accept-new")
        assert type(h.sudo) is bool
        assert type(h.connect_timeout) is float and 0 < h.connect_timeout
        assert type(h.command_timeout) is float and 0 < h.command_timeout
        assert type(h.unattributed_mib) is int and h.unattributed_mib >= 0
        assert all(isinstance(p, str) and p and "\n" not in p for p in h.protect)
        assert all(name_re.match(t) for t in h.tags)
        assert all(g in inv.groups and h.name in inv.groups[g] for g in h.groups)
        hash(h)
    for members in inv.groups.values():
        assert all(m in names for m in members)


def parse_or_usage_error(text: str):
    try:
        inv = parse_inventory(text, source="fleet.yaml")
    except UsageError as exc:
        message = str(exc)
        assert message.startswith("fleet.yaml") and "\n" not in message
        return None
    check_invariants(inv)
    return inv


KEYS = list(HOST_KEYS) + ["defaults", "hosts", "groups", "adress", "<<", "", "x y"]
SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["local", "ssh", "strict", "accept-new", "a", "203.0.113.5", "root",
                       "*x*", "/usr/bin/nvidia-smi", "python3", "2020-13-45", "~"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5),
    max_leaves=20,
)
# GPUFLEET_FUZZ_EXAMPLES=20000 for a long run; the default keeps the unit suite quick.
FUZZ = settings(max_examples=int(os.environ.get("GPUFLEET_FUZZ_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(VALUES)
def test_fuzz_random_yaml_structures(value):
    parse_or_usage_error(yaml.safe_dump(value, allow_unicode=True))


@FUZZ
@given(st.dictionaries(
    st.sampled_from(["defaults", "hosts", "groups"]),
    st.dictionaries(st.sampled_from(["a", "b", "train-01", "yes"]) | st.sampled_from(KEYS),
                    st.none() | st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6)
                    | st.lists(st.sampled_from(["a", "b", "c"]), max_size=3),
                    max_size=4),
    max_size=3))
def test_fuzz_inventory_shaped_structures(value):
    parse_or_usage_error(yaml.safe_dump(value))


@FUZZ
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
       | st.text(alphabet="{}[]:,-?&*!|>'\"%@`#\n\t abc0123.<=~\\", max_size=200))
def test_fuzz_random_text(text):
    parse_or_usage_error(text)


EXAMPLE_TEXT = EXAMPLE.read_text()
PIECES = ["\n", " ", "  ", ":", "-", "[", "]", "{", "}", "'", '"', "&a", "*a", "<<", "#", "\t",
          "!!binary", "~", "null", "yes", "0", "-1", "99999", "2020-13-45", "?", "|", ">", "%",
          "adress", "hosts", "groups", "defaults", "port: 22", "connection: local", "\x00"]


@st.composite
def mutated_example(draw):
    text = EXAMPLE_TEXT
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["delete", "insert", "replace", "dup_line", "drop_line", "swap"]))
        pos = draw(st.integers(0, len(text)))
        if kind == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 40)):]
        elif kind == "insert":
            text = text[:pos] + draw(st.sampled_from(PIECES) | st.text(max_size=5)) + text[pos:]
        elif kind == "replace":
            text = text[:pos] + draw(st.sampled_from(PIECES)) + text[pos + 1:]
        else:
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            j = draw(st.integers(0, len(lines) - 1))
            if kind == "dup_line":
                lines.insert(j, lines[i])
            elif kind == "drop_line":
                del lines[i]
            else:
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
    return text


@FUZZ
@given(mutated_example())
def test_fuzz_mutations_of_the_example(text):
    parse_or_usage_error(text)


@st.composite
def mutated_example_values(draw):
    """Replace one value somewhere in the example's structure with a random one."""
    doc = yaml.safe_load(EXAMPLE_TEXT)
    section = draw(st.sampled_from(["defaults", "hosts", "groups"]))
    if section == "hosts":
        host = draw(st.sampled_from(sorted(doc["hosts"])))
        key = draw(st.sampled_from(list(HOST_KEYS) + ["bogus"]))
        doc["hosts"][host][key] = draw(VALUES)
    elif section == "defaults":
        doc["defaults"][draw(st.sampled_from(list(HOST_KEYS)))] = draw(VALUES)
    else:
        doc["groups"][draw(st.sampled_from(["training", "new"]))] = draw(VALUES)
    return yaml.safe_dump(doc, sort_keys=False)


@FUZZ
@given(mutated_example_values())
def test_fuzz_value_mutations_of_the_example(text):
    parse_or_usage_error(text)


# A generator of VALID inventories: everything it makes must load, with these exact values.
NAMES = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,12}", fullmatch=True)
ADDRESSES = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True) | st.ip_addresses().map(str)
USERS = st.from_regex(r"[a-z_][a-z0-9_.-]{0,15}", fullmatch=True)


@st.composite
def valid_inventory(draw):
    names = draw(st.lists(NAMES, min_size=1, max_size=6, unique=True))
    hosts = {}
    for name in names:
        body = {}
        if draw(st.booleans()):
            body["connection"] = "local"
        else:
            body["address"] = draw(ADDRESSES)
        if draw(st.booleans()):
            body["port"] = draw(st.integers(1, 65535))
        if draw(st.booleans()):
            body["user"] = draw(USERS)
        if draw(st.booleans()):
            body["connect_timeout"] = draw(st.floats(0.001, 86400) | st.integers(1, 86400))
        if draw(st.booleans()):
            body["unattributed_mib"] = draw(st.integers(0, 100000))
        if draw(st.booleans()):
            body["sudo"] = draw(st.booleans())
        if draw(st.booleans()):
            body["host_key_policy"] = draw(st.sampled_from(["strict", "accept-new"]))
        if draw(st.booleans()):
            body["protect"] = draw(st.lists(st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=8), max_size=3))
        if draw(st.booleans()):
            body["tags"] = draw(st.lists(NAMES, max_size=3))
        hosts[name] = body
    group_names = draw(st.lists(NAMES.filter(lambda n: n not in hosts), max_size=3, unique=True))
    groups = {g: draw(st.lists(st.sampled_from(names), max_size=4)) for g in group_names}
    doc = {"hosts": hosts}
    if groups:
        doc["groups"] = groups
    return doc


@FUZZ
@given(valid_inventory())
def test_fuzz_valid_inventories_load_exactly(doc):
    inv = parse_inventory(yaml.safe_dump(doc, sort_keys=False), source="fleet.yaml")
    check_invariants(inv)
    assert list(inv.names) == list(doc["hosts"])
    for host in inv.hosts:
        body = doc["hosts"][host.name]
        assert host.address == body.get("address")
        assert host.port == body.get("port")
        assert host.user == body.get("user")
        assert host.connection == body.get("connection", "ssh")
        assert host.connect_timeout == float(body.get("connect_timeout", 10))
        assert host.unattributed_mib == body.get("unattributed_mib", 0)
        assert host.sudo == body.get("sudo", False)
        assert host.protect == tuple(dict.fromkeys(body.get("protect", [])))
        assert host.tags == tuple(dict.fromkeys(body.get("tags", [])))
        assert host.explicit == frozenset(body)
        expected_groups = tuple(g for g, m in doc.get("groups", {}).items() if host.name in m)
        assert host.groups == expected_groups


def test_agent_cache_is_on_by_default_and_off_per_host_or_in_defaults() -> None:
    inv = parse("""\
        defaults: {agent_cache: false}
        hosts:
          a: {connection: local}
          b: {connection: local, agent_cache: true}
        """)
    assert [h.agent_cache for h in inv.hosts] == [False, True]
    assert parse("hosts:\n  a: {connection: local}\n").hosts[0].agent_cache is True
    message = error_of("hosts:\n  a: {connection: local, agent_cache: maybe}\n")
    assert "agent_cache" in message and "true or false" in message


def test_ssh_persist_is_60_by_default_and_seconds_where_set() -> None:
    inv = parse("""\
        defaults: {ssh_persist: 60}
        hosts:
          a: {address: 10.0.0.1}
          b: {address: 10.0.0.2, ssh_persist: 0}
          c: {address: 10.0.0.3, ssh_persist: 2.5}
        """)
    assert [h.ssh_persist for h in inv.hosts] == [60.0, 0.0, 2.5]
    assert parse("hosts:\n  a: {address: 10.0.0.1}\n").hosts[0].ssh_persist == 60.0
    for bad in ("yes", "-1", "true", "100000"):
        message = error_of("hosts:\n  a: {address: 10.0.0.1, ssh_persist: %s}\n" % bad)
        assert "ssh_persist" in message and "seconds >= 0" in message, message


def test_the_requests_carry_agent_cache_as_data() -> None:
    from gpufleet.ops.collect import snapshot_request

    inv = parse("hosts:\n  a: {connection: local, agent_cache: false}\n"
                "  b: {connection: local}\n")
    assert [snapshot_request(h)["agent_cache"] for h in inv.hosts] == [False, True]


def test_a_found_inventory_others_could_write_is_refused(tmp_path: Path) -> None:
    """./fleet.yaml is read only when no one else could have written or swapped it."""
    from gpufleet.config.inventory import find_inventory

    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "shared"
    cwd.mkdir()
    fleet = cwd / "fleet.yaml"
    fleet.write_text("hosts: {a: {address: 127.0.0.1}}\n")
    os.chmod(cwd, 0o755)
    assert find_inventory(env={}, cwd=cwd, home=home) == fleet
    os.chmod(fleet, 0o666)
    with pytest.raises(InventoryError, match="writable by group or others"):
        find_inventory(env={}, cwd=cwd, home=home)
    os.chmod(fleet, 0o644)
    os.chmod(cwd, 0o777)
    with pytest.raises(InventoryError, match="directory others can write"):
        find_inventory(env={}, cwd=cwd, home=home)
    os.chmod(cwd, 0o1777)  # sticky, like /tmp: only the owner can replace the file
    assert find_inventory(env={}, cwd=cwd, home=home) == fleet
    os.chown(fleet, 65534, 65534)
    with pytest.raises(InventoryError, match="owned by uid 65534"):
        find_inventory(env={}, cwd=cwd, home=home)
    assert find_inventory(str(fleet), env={}, cwd=cwd, home=home) == fleet  # named: theirs


def test_exec_connection_takes_an_argv_prefix():
    inv = parse("hosts: {c: {connection: exec, exec: [docker, exec, -i, gpu-box]}}")
    host = inv.hosts[0]
    assert (host.connection, host.exec, host.address) == (
        "exec", ("docker", "exec", "-i", "gpu-box"), None)


@pytest.mark.parametrize("body, words", [
    ("{connection: exec}", "goes with 'connection: exec'"),
    ("{address: a, exec: [docker, exec, -i, c]}", "goes with 'connection: exec'"),
    ("{connection: local, exec: [nsenter]}", "goes with 'connection: exec'"),
    ("{connection: exec, exec: []}", "non-empty list of strings"),
    ("{connection: exec, exec: docker}", "non-empty list of strings"),
    ("{connection: exec, exec: [nsenter, -t, 1234]}", "quote it"),
    ("{connection: exec, exec: [docker, '']}", "an empty argument"),
    ("{connection: exec, exec: [\"docker\\x1b\"]}", "a control character"),
])
def test_exec_is_validated(body, words):
    message = error_of(f"hosts: {{c: {body}}}")
    assert words in message, message
