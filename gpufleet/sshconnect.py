"""SSH connections for gpufleet: ssh_config, ProxyJump, host key policy, dialling, timeouts.

Internal to gpufleet.transport (import from there). ``connection_for`` builds the fabric
Connection (not yet opened) for an inventory Host; gpufleet.transport opens it and runs
commands on it; ``fetch_host_key`` and ``trust`` only do the key exchange (`gpufleet trust`).

What gpufleet changes in fabric's defaults, and why:

* Host keys: fabric puts AutoAddPolicy on its client and on every ProxyJump hop; here each of
  them gets :class:`gpufleet.hostkeys.HostKeyPolicy` (strict / accept-new, CHANGED always
  refused), with the known keys preloaded so the server offers a key type we know.
* ProxyJump: hops are built here in OpenSSH order (the first hop is dialled directly; fabric
  3 reverses the list), each one with the same host key policy and timeouts.
* Timeouts: connect_timeout bounds DNS + TCP connect (a worker thread bounds getaddrinfo),
  the SSH banner, each auth reply and channel opens (also through a jump host).
* ``~/.ssh/config`` is honoured (HostName, Port, User, IdentityFile, ProxyJump, ConnectTimeout,
  UserKnownHostsFile); a key the inventory sets (``Host.explicit``) wins. ssh_config is looked
  up by the inventory name; an inventory ``address`` overrides HostName.
* Auth: gpufleet.sshauth (public keys only, never a prompt).
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import paramiko
from fabric import Config, Connection

from . import hostkeys
from .errors import GpufleetError
from .sshauth import _AuthFailed, _BatchAuth

# paramiko logs connect failures with tracebacks from its own threads; they are values here.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

MAX_HOPS = 8


class TransportError(GpufleetError):
    """A host could not run the command; the message is one short line for the host's row."""

    def __init__(self, message: str, stdout: bytes = b"", stderr: bytes = b""):
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


# --------------------------------------------------------------------------- dialling


def _resolve(host: str, port: int, timeout: float) -> list:
    """getaddrinfo bounded by ``timeout`` (it has no timeout of its own)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except ValueError:
        pass
    box: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except BaseException as exc:
            box["exc"] = exc
        done.set()

    threading.Thread(target=work, name="gpufleet-dns", daemon=True).start()
    if not done.wait(timeout):
        raise TransportError(f"DNS lookup of {host} timed out after {timeout:g}s")
    if "exc" in box:
        exc = box["exc"]
        reason = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
        raise TransportError(f"cannot resolve {host}: {reason}")
    return box["infos"]


def _dial(host: str, port: int, timeout: float) -> socket.socket:
    """TCP connect to every address of ``host`` in turn, all within ``timeout``."""
    deadline = time.monotonic() + timeout
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    infos = _resolve(host, port, timeout)
    last: Optional[BaseException] = None
    for family, socktype, proto, _name, addr in infos:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sock = socket.socket(family, socktype, proto)
        sock.settimeout(remaining)
        try:
            sock.connect(addr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    if last is None or isinstance(last, socket.timeout):
        raise TransportError(f"connect to {where} timed out after {timeout:g}s")
    if isinstance(last, ConnectionRefusedError):
        raise TransportError(f"connection refused by {where}")
    reason = last.strerror or str(last)
    raise TransportError(f"cannot connect to {where}: {reason}")

# --------------------------------------------------------------------------- connection


@dataclass(frozen=True)
class _Settings:
    """What every connection of one host's chain (target and hops) shares."""

    policy: str
    known_hosts_file: Optional[str]
    connect_timeout: float
    target: str  # inventory host name, for hints


class _Connection(Connection):
    """fabric Connection with gpufleet's host key policy, timeouts and ProxyJump order."""

    # class attributes, so invoke's DataProxy treats them as real attributes
    _gf: Optional[_Settings] = None
    _depth = 0
    _hop = False
    _files: Sequence[Path] = ()

    def __init__(self, host: str, gf: _Settings, depth: int = 0, hop: bool = False, **kwargs):
        self._gf = gf
        self._depth = depth
        self._hop = hop
        super().__init__(host, **kwargs)
        self._configure()

    def _configure(self) -> None:
        """(Re)apply timeouts and host key policy; call again after changing host/port."""
        gf = self._gf
        timeout = gf.connect_timeout
        self.connect_timeout = None  # fabric int()s it; paramiko gets the float below
        kw = self.connect_kwargs
        for key in ("banner_timeout", "auth_timeout", "channel_timeout"):
            kw[key] = timeout
        # We always hand paramiko a connected socket, so its "timeout" only bounds the key
        # exchange; it starts with the banner wait, so give it more than banner_timeout
        # (were it equal, paramiko could give up silently first: "No existing session").
        kw["timeout"] = 2 * timeout
        self._files = hostkeys.default_files(gf.known_hosts_file, dict(self.ssh_config))
        if self._hop:
            hint = (f"add it to ~/.ssh/known_hosts (jump host for {gf.target}) "
                    "or set host_key_policy: accept-new")
        else:
            hint = f"run `gpufleet trust {gf.target}` or set host_key_policy: accept-new"
        self.client.set_missing_host_key_policy(
            hostkeys.HostKeyPolicy(gf.policy, self._files, hint=hint))

    @property
    def key_name(self) -> str:
        return hostkeys.host_key_name(self.host, self.port)

    @property
    def label(self) -> str:
        return self.original_host if self.original_host == self.host else (
            f"{self.original_host} ({self.key_name})")

    def get_gateway(self):
        jump = self.ssh_config.get("proxyjump")
        if jump is None:
            return super().get_gateway()  # ProxyCommand string, or none
        if jump.strip().lower() == "none":
            return None
        if self._depth >= MAX_HOPS:
            raise TransportError(f"ProxyJump chain longer than {MAX_HOPS} (a loop in ssh_config?)")
        hops = [h.strip() for h in jump.split(",") if h.strip()]
        prev = None
        for hop in hops:
            if hop.startswith("ssh://"):
                hop = hop[len("ssh://"):]
            if prev is None and self.derive_shorthand(hop)["host"] in (self.host, self.original_host):
                return None  # `Host *` ProxyJump matching the jump host itself
            kwargs: dict[str, Any] = {"config": self.config.clone()}
            if prev is not None:
                kwargs["gateway"] = prev  # OpenSSH order: hop N goes through hop N-1
            prev = _Connection(hop, gf=self._gf, depth=self._depth + 1, hop=True, **kwargs)
        return prev

    def open_gateway(self):
        if not isinstance(self.gateway, _Connection):
            return super().open_gateway()
        gw = self.gateway
        try:
            gw.open()
        except (TransportError, hostkeys.HostKeyError, paramiko.SSHException, OSError,
                EOFError) as exc:
            raise TransportError(f"via jump host {gw.label}: {_reason(exc)}") from None
        try:
            return gw.transport.open_channel(
                "direct-tcpip", (self.host, int(self.port)), ("", 0),
                timeout=self._gf.connect_timeout)
        except paramiko.ChannelException as exc:
            raise TransportError(
                f"jump host {gw.label} could not connect to {self.host}:{self.port}: {exc.text}"
            ) from None
        except paramiko.SSHException as exc:
            raise TransportError(
                f"jump host {gw.label}: no channel to {self.host}:{self.port} "
                f"within {self._gf.connect_timeout:g}s ({_reason(exc)})") from None

    def open(self):
        if self.is_connected:
            return None
        name = self.key_name
        # Preload what we know, so paramiko asks the server for a known key type first.
        host_keys = self.client.get_host_keys()
        for entry in hostkeys.known_keys(name, self._files):
            pkey = entry.pkey()
            if pkey is not None:
                host_keys.add(name, entry.keytype, pkey)
        sock = None
        try:
            if not self.gateway:
                sock = _dial(self.host, int(self.port), self._gf.connect_timeout)
                self.connect_kwargs["sock"] = sock
            return super().open()
        except _AuthFailed as exc:
            self._abort(sock)
            raise TransportError(
                f"authentication failed for {self.user}@{name} ({exc}); check user and identity_file"
            ) from None
        except paramiko.BadHostKeyException as exc:
            key = exc.key
            verdict = hostkeys.check(name, key.get_name(), key.asbytes(), self._files)
            if verdict.verdict == hostkeys.KNOWN:  # recorded meanwhile by another thread
                verdict = hostkeys.Verdict(hostkeys.OTHER_TYPE, hostkeys.lookup(name, self._files)[0])
            self._abort(sock)
            raise hostkeys.refusal(name, key.get_name(), key.asbytes(), verdict) from None
        except BaseException:
            self._abort(sock)
            raise
        finally:
            self.connect_kwargs.pop("sock", None)

    def _abort(self, sock) -> None:
        try:
            self.client.close()
        except Exception:
            pass
        if sock is not None:
            sock.close()
        self.transport = None

    def close(self):
        try:
            super().close()
            self.client.close()
        finally:
            self.transport = None
            if isinstance(self.gateway, Connection):
                self.gateway.close()


def _reason(exc: BaseException) -> str:
    """One short line for a connect-time failure."""
    if isinstance(exc, (TransportError, hostkeys.HostKeyError)):
        return str(exc)
    if isinstance(exc, paramiko.AuthenticationException):
        return f"authentication failed ({exc})"
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "protocol banner" in text:
            return "no SSH banner (not an SSH server, or overloaded)"
        if "No existing session" in text:
            return "SSH handshake did not complete"
        if "Channel closed" in text:
            return "the server closed the connection"
        return text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, EOFError):
        return "the server closed the connection"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc) or type(exc).__name__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _settings_value(host: Any, key: str, ssh_value: Any, default: Any) -> Any:
    if key in getattr(host, "explicit", frozenset()) and getattr(host, key, None) is not None:
        return getattr(host, key)
    if ssh_value is not None:
        return ssh_value
    value = getattr(host, key, None)
    return default if value is None else value


def connection_for(host: Any) -> _Connection:
    """The fabric Connection (not yet opened) for an inventory Host, ssh_config applied."""
    config = Config()  # reads ~/.ssh/config and /etc/ssh/ssh_config now (HOME may differ)
    config.authentication.strategy_class = _BatchAuth
    if getattr(host, "identity_file", None):
        config.authentication.identities = [os.path.expanduser(host.identity_file)]
    ssh_cfg = config.base_ssh_config.lookup(host.name)
    ct = ssh_cfg.get("connecttimeout")
    try:
        ct = float(ct) if ct is not None else None
    except ValueError:
        ct = None
    gf = _Settings(
        policy=host.host_key_policy,
        known_hosts_file=getattr(host, "known_hosts_file", None),
        connect_timeout=float(_settings_value(host, "connect_timeout", ct, 10.0)),
        target=host.name,
    )
    conn = _Connection(
        host.name, gf=gf, config=config,
        user=getattr(host, "user", None) or None,
        port=int(host.port) if getattr(host, "port", None) else None,
    )
    if getattr(host, "address", None):
        conn.host = host.address
    conn._configure()
    return conn


# --------------------------------------------------------------------------- host keys


def fetch_host_key(host: Any) -> tuple[str, str, paramiko.PKey]:
    """(keytype, SHA256 fingerprint, key) the host presents, for `gpufleet trust`.

    Uses the same route as a real connection (ssh_config, ProxyJump: jump hops must pass the
    host key policy); only the key exchange is done, no authentication. Known key types for
    the name are asked for first. Raises TransportError / HostKeyError.
    """
    if getattr(host, "connection", "ssh") == "local":
        raise TransportError(f"{host.name} uses connection: local; it has no SSH host key")
    conn = connection_for(host)
    sock = None
    transport = None
    try:
        try:
            if conn.gateway:
                sock = conn.open_gateway()
            else:
                sock = _dial(conn.host, int(conn.port), conn._gf.connect_timeout)
            transport = paramiko.Transport(sock)
            transport.banner_timeout = conn._gf.connect_timeout
            known = [e.keytype for e in hostkeys.known_keys(conn.key_name, conn._files)]
            if known:
                opts = transport.get_security_options()
                want = []
                for kt in known:
                    want += ["rsa-sha2-512", "rsa-sha2-256", kt] if kt == "ssh-rsa" else [kt]
                first = [t for t in dict.fromkeys(want) if t in opts.key_types]
                opts.key_types = first + [t for t in opts.key_types if t not in first]
            transport.start_client(timeout=conn._gf.connect_timeout)
            key = transport.get_remote_server_key()
        except (TransportError, hostkeys.HostKeyError):
            raise
        except Exception as exc:
            raise TransportError(_reason(exc)) from None
        return key.get_name(), hostkeys.fingerprint(key), key
    finally:
        if transport is not None:
            transport.close()
        elif sock is not None:
            sock.close()
        conn.close()


@dataclass(frozen=True)
class TrustResult:
    name: str  # the known_hosts name: host or [host]:port
    keytype: str
    fingerprint: str
    path: str
    added: bool  # False: it was already known


def trust(host: Any, path: Optional[os.PathLike] = None) -> TrustResult:
    """Record the key ``host`` presents now in ``path`` (default ~/.config/gpufleet/known_hosts).

    Refuses (HostKeyError) when a different key is already recorded for it anywhere: a
    changed key is never overwritten; the operator removes the old line first.
    """
    target = Path(path) if path else hostkeys.gpufleet_known_hosts()
    keytype, fp, key = fetch_host_key(host)
    conn = connection_for(host)
    name = conn.key_name
    files = list(dict.fromkeys([*conn._files, target]))
    conn.close()
    verdict = hostkeys.check(name, keytype, key.asbytes(), files)
    if verdict.verdict == hostkeys.KNOWN:
        return TrustResult(name, keytype, fp, verdict.entry.path if verdict.entry else str(target), False)
    if verdict.verdict != hostkeys.UNKNOWN:
        raise hostkeys.refusal(name, keytype, key.asbytes(), verdict)
    verdict = hostkeys.record(name, key, target, files)
    if verdict.verdict != hostkeys.KNOWN:
        raise hostkeys.refusal(name, keytype, key.asbytes(), verdict)
    return TrustResult(name, keytype, fp, str(target), True)
