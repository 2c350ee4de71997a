"""What OpenSSH's ``ssh`` is told to reach one host: its argv and what its messages name.

Internal to gpufleet.transport (gpufleet.transport.openssh runs it; gpufleet.transport.kept
names a host's kept connection from it). Where the host is comes from ``ssh -G``
(gpufleet.transport.sshconfig); gpufleet adds only its own rules: never prompt, public keys
only, no pty, escape character or forwarding, host keys checked strictly against the files
gpufleet reads, curve25519 first when ssh_config chooses no key exchange, and, with
``ssh_persist``, the kept master's socket (docs/DESIGN.md "Connections kept between commands").
"""
from __future__ import annotations

import logging
import math
import os
import re
import shlex
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.errors import SshConfigError
from gpufleet.transport import kept, knownfiles, sshconfig


#: Options on every run (command-line -o wins over ssh_config: first value wins).
_OPTIONS = (
    "BatchMode=yes", "PreferredAuthentications=publickey", "StrictHostKeyChecking=yes",
    "HashKnownHosts=no", "CheckHostIP=no", "UpdateHostKeys=no", "ClearAllForwardings=yes", "ForwardAgent=no", "ForwardX11=no",
    "PermitLocalCommand=no", "RequestTTY=no", "LogLevel=ERROR", "ServerAliveInterval=10",
    "ServerAliveCountMax=3",
)
_DEFAULT_KEYS = ("id_rsa", "id_ecdsa", "id_ed25519")  # what the paramiko path tries unconfigured


@dataclass(frozen=True)
class Target:
    """One host as ssh is told to reach it, and what its messages name."""

    @property
    def argv(self) -> tuple[str, ...]:
        """A run on its own connection, or (``kept``) one that starts the kept master there
        when none is up (ControlMaster=auto: ssh joins one that came up meanwhile)."""
        if self.kept is not None:
            return self.base + ("-o", "ControlMaster=auto", "-o", f"ControlPath={self.kept}",
                                "-o", f"ControlPersist={self.persist_s}") + self.dest
        return self.alone

    @property
    def alone(self) -> tuple[str, ...]:
        """A run on its own connection: never starts or joins a multiplexed master."""
        return self.base + ("-o", "ControlMaster=no", "-o", "ControlPath=none") + self.dest

    def via(self, socket_path: str) -> tuple[str, ...]:
        """A run through gpufleet's own master at ``socket_path`` (a fresh connection of its
        own if that master is gone: ssh falls back by itself)."""
        return self.base + ("-o", "ControlMaster=no", "-o", f"ControlPath={socket_path}") + self.dest

    base: tuple[str, ...]  # ssh and its options, without the multiplexing ones
    dest: tuple[str, ...]  # ("--", alias)
    where: str  # host:port, for connect messages
    key_name: str  # known_hosts name ([host]:port or HostKeyAlias)
    user: str
    connect_timeout: float
    policy: str  # gpufleet's host key policy: strict | accept-new
    keys: tuple[tuple[str, bool], ...]  # (identity file, named explicitly): auth messages
    kept: Optional[str] = None  # the kept master's socket (ssh_persist), None: not kept
    persist_s: int = 0  # ControlPersist: how long a kept master stays idle


def _float(value: Any) -> Optional[float]:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _identities(host: Host, values: dict) -> tuple[list[str], list[tuple[str, bool]]]:
    """(-i arguments, (file, named explicitly) for an auth failure's message), in the
    paramiko path's order: the inventory identity_file, ssh_config's IdentityFile, else
    ~/.ssh/id_* of $HOME (ssh itself would expand ~ to the account's home, not $HOME)."""
    own = getattr(host, "identity_file", None)
    named = [os.path.expanduser(own)] if own else []
    configured = [os.path.expanduser(p) for p in values.get("identityfile", []) or []]
    implicit = [] if configured else [os.path.expanduser(f"~/.ssh/{n}") for n in _DEFAULT_KEYS]
    given = named + [p for p in implicit if os.path.isfile(p)]
    keys = [(p, True) for p in named + configured] + [(p, False) for p in implicit]
    seen: dict[str, bool] = {}
    for path, explicit in keys:
        seen.setdefault(path, explicit)
    return given, list(seen.items())


def _known_hosts_option(host: Host, values: dict) -> str:
    """UserKnownHostsFile: the per-user files gpufleet.transport.hostkeys reads (ssh reads
    GlobalKnownHostsFile itself), quoted for ssh's own word splitting."""
    files = knownfiles.user_files(getattr(host, "known_hosts_file", None), values)
    return "UserKnownHostsFile=" + " ".join(
        f'"{f}"' if re.search(r"\s", str(f)) else str(f) for f in files)


#: Key exchanges put first when ssh_config chooses none: what the paramiko path always used.
#: OpenSSH 9's default, the post-quantum hybrid sntrup761x25519, cost ~150 ms of CPU per
#: connection on the 2.1 GHz cores of the GPU machine (docs/real-gpu.md); its defaults stay
#: in the list after these, for servers without curve25519.
_FAST_KEX = ("curve25519-sha256", "curve25519-sha256@libssh.org")


def _kex_option(values: dict) -> Optional[str]:
    """``KexAlgorithms=`` with curve25519 first, unless ssh_config sets KexAlgorithms."""
    if values.get("kexalgorithms") or not values.get("kexalgorithms_default"):
        return None
    listed = str(values["kexalgorithms_default"]).split(",")
    first = [k for k in _FAST_KEX if k in listed]
    if not first:
        return None
    return "KexAlgorithms=" + ",".join(first + [k for k in listed if k not in first])


#: What ssh would not take as plain data in a path it is given: %-tokens, ${ENV}, quotes and
#: backslashes (its own word splitting of UserKnownHostsFile), control characters.
_UNSAFE_PATH = re.compile(r"[%$\"'\\\x00-\x1f\x7f]")


def _paths_plain(host: Host, values: dict) -> bool:
    """Every path gpufleet hands ssh is taken literally by it (else: the paramiko path)."""
    paths = [getattr(host, "identity_file", None), getattr(host, "known_hosts_file", None)]
    paths += list(values.get("identityfile", []) or []) + list(values.get("userknownhostsfile", []) or [])
    return not any(p and _UNSAFE_PATH.search(os.path.expanduser(str(p))) for p in paths)


def _persist_s(host: Host) -> int:
    value = getattr(host, "ssh_persist", 0) or 0
    return int(math.ceil(float(value))) if value > 0 else 0


def _kept_socket(argv: Sequence[str], dest: Sequence[str], where: str, key_name: str,
                 user: str, quiet_long: bool = False) -> Optional[str]:
    """The kept master's socket for this exact connection (None: not kept in this run)."""
    path = kept.socket_for([*argv, *dest, where, key_name, user], quiet_long)
    if path is not None and _UNSAFE_PATH.search(path):
        kept.warn_off(f"{os.path.dirname(path)} holds characters ssh would expand")
        return None
    return path


def _log_target(host: Host, argv: list[str], where: str, key_name: str, policy: str,
                socket_path: Optional[str]) -> None:
    """-v: the ssh command line this host's runs start from (gpufleet.cli.enable_verbose)."""
    log = sshconfig.log
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: ssh to %s (host key %s, %s): %s%s", host.name, where, key_name, policy,
                  shlex.join(argv), f"; kept master {socket_path}" if socket_path else "")


def target_for(host: Host, ssh: str) -> Optional[Target]:
    """How ssh reaches ``host``; None: it needs the paramiko path (ProxyJump/ProxyCommand
    under ``ssh_client: auto``). Raises SshConfigError as ``ssh -G`` does."""
    port = int(host.port) if host.port else None
    user = getattr(host, "user", None) or None
    alias = sshconfig.ssh_alias(host)
    resolved = sshconfig.resolve(alias, port=port, user=user)
    values = resolved.values
    hop = values.get("proxyjump") or values.get("proxycommand")
    auto = (getattr(host, "ssh_client", "auto") or "auto") == "auto"
    plain = _paths_plain(host, values)
    if auto and (hop or not plain):
        return None
    if not plain:
        raise SshConfigError("a path in this host's settings holds characters ssh would expand "
                             "(%, $, quotes, backslash): use ssh_client: auto or paramiko")
    explicit: frozenset[str] = getattr(host, "explicit", frozenset())
    policy = host.host_key_policy
    if "host_key_policy" not in explicit:
        policy = sshconfig.host_key_policy(values, policy)
    ct = float(sshconfig.settings_value(host, "connect_timeout", _float(values.get("connecttimeout")), 10.0))
    argv = [ssh]
    cfg = sshconfig._config_arg()
    if cfg is not None:
        argv += ["-F", cfg]
    argv += ["-T", "-e", "none", "-x", "-a"]
    options = [*_OPTIONS, _known_hosts_option(host, values), f"ConnectTimeout={max(1, math.ceil(ct))}"]
    kex = _kex_option(values)
    if kex:
        options.append(kex)
    for opt in options:
        argv += ["-o", opt]
    if port:
        argv += ["-p", str(port)]
    if user:
        argv += ["-l", sshconfig.check_alias(user)]
    given, keys = _identities(host, values)
    for path in given:
        argv += ["-i", path]
    hostname = str(values.get("hostname", alias))
    real_port = int(values.get("port", 22) or 22)
    where = f"{hostname}:{real_port}" if ":" not in hostname else f"[{hostname}]:{real_port}"
    key_name = str(values.get("hostkeyalias") or knownfiles.host_key_name(hostname, real_port))
    dest = ("--", resolved.alias)
    login = str(values.get("user") or user or "")
    persist = _persist_s(host)
    quiet = "ssh_persist" not in getattr(host, "explicit", frozenset())  # the default's
    socket_path = _kept_socket(argv, dest, where, key_name, login, quiet) if persist else None
    if socket_path is not None:
        kept.write_label(socket_path, f"{host.name} ({login + '@' if login else ''}{where})")
    _log_target(host, argv + list(dest), where, key_name, policy, socket_path)
    return Target(tuple(argv), dest, where, key_name, login, ct, policy, tuple(keys),
                  kept=socket_path, persist_s=persist if socket_path else 0)
