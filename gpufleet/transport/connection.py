"""SSH connections for gpufleet: ssh_config, ProxyJump, host key policy, dialling, timeouts.

Internal to gpufleet.transport (import from there). ``connection_for`` builds the fabric
Connection (not yet opened) for an inventory Host; gpufleet.transport opens it and runs
commands on it. ``transport_error`` turns anything a connect raised into a TransportError
with its kind and its one-line message. Pre-dialling is gpufleet.transport.dial; the key
exchange alone (`gpufleet trust`) is gpufleet.transport.keyscan.

What gpufleet changes in fabric's defaults, and why:

* Host keys: fabric puts AutoAddPolicy on its client and on every ProxyJump hop; here each of
  them gets :class:`gpufleet.transport.hostkeys.HostKeyPolicy` (strict / accept-new, CHANGED always
  refused), with the known keys preloaded so the server offers a key type we know.
* ProxyJump: hops are built here in OpenSSH order (the first hop is dialled directly; fabric
  3 reverses the list), each one with the same host key policy and timeouts.
* Timeouts: connect_timeout bounds DNS + TCP connect (a worker thread bounds getaddrinfo),
  the SSH banner, each auth reply and channel opens (also through a jump host).
* ssh_config: the inventory ``address`` (else the name) is what ``ssh ADDRESS`` would be given,
  resolved by OpenSSH itself (gpufleet.transport.sshconfig: ``ssh -G``, the inventory port/user as
  ``-p``/``-l``); fabric gets those values instead of parsing ssh_config again. Every ProxyJump
  hop is resolved the same way (``ssh -G [-l USER] [-p PORT] HOP``, as OpenSSH's own jump).
* Auth: gpufleet.transport.auth (public keys only, never a prompt).
* A connection may be handed a socket already connected (:meth:`HostConnection.hold_predialed`,
  gpufleet.transport.dial): :meth:`HostConnection.open` uses it instead of dialling.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import paramiko
from fabric import Config, Connection

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import AuthFailed, TransportError, first_line
from gpufleet.transport import hostkeys, sshconfig
from gpufleet.transport.sshconfig import settings_value as _settings_value
from gpufleet.transport.sshconfig import ssh_alias
from gpufleet.transport.auth import BatchAuth
from gpufleet.transport.tcp import dial_tcp

# paramiko logs connect failures with tracebacks from its own threads; they are values here.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

MAX_HOPS = 8
# A pre-dialled socket older than this when its host gets a forks slot is dialled again: sshd
# drops a connection that has not authenticated within LoginGraceTime (120 s by default, 30 s
# in hardened configs), counted from the accept.
PREDIAL_FRESH_S = 20.0


# --------------------------------------------------------------------------- connection


@dataclass(frozen=True)
class ChainSettings:
    """What every connection of one host's chain (target and hops) shares."""

    policy: str
    known_hosts_file: Optional[str]
    connect_timeout: float
    target: str  # inventory host name, for hints


class HostConnection(Connection):
    """fabric Connection with gpufleet's host key policy, timeouts and ProxyJump order."""

    # class attributes, so invoke's DataProxy treats them as real attributes
    _gf = ChainSettings("strict", None, 10.0, "")  # replaced in __init__
    _depth = 0
    _hop = False
    _files: Sequence[Path] = ()
    _predialed: Optional[tuple[socket.socket, float]] = None  # (socket, monotonic connect time)

    def __init__(self, host: str, gf: ChainSettings, depth: int = 0, hop: bool = False,
                 **kwargs: Any):
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
            hostkeys.HostKeyPolicy(gf.policy, self._files, hint=hint,
                                   name=self.ssh_config.get("hostkeyalias") or None))

    @property
    def dial_timeout(self) -> float:
        """The host's connect_timeout: bounds DNS + connect, the banner, each auth reply."""
        return self._gf.connect_timeout

    @property
    def known_hosts_files(self) -> Sequence[Path]:
        """The known_hosts files read for this connection (hostkeys.default_files)."""
        return self._files

    @property
    def predialed(self) -> bool:
        """It holds a socket connected for it (and not yet used)."""
        return self._predialed is not None

    def hold_predialed(self, sock: socket.socket) -> None:
        """Keep ``sock`` (connected now, by gpufleet.transport.dial) for :meth:`open`."""
        self._predialed = (sock, time.monotonic())

    @property
    def key_name(self) -> str:
        """The known_hosts name: ssh_config HostKeyAlias as it stands (OpenSSH adds no port
        to it), else ``host`` / ``[host]:port``."""
        alias = self.ssh_config.get("hostkeyalias")
        if alias:
            return str(alias)
        return hostkeys.host_key_name(self.host, self.port)

    @property
    def label(self) -> str:
        return self.original_host if self.original_host == self.host else (
            f"{self.original_host} ({self.key_name})")

    def get_gateway(self):
        # Why fabric's own is overridden: it builds hops in reverse of OpenSSH's order, gives
        # each AutoAddPolicy, and parses ssh_config itself; each hop here is resolved by
        # ``ssh -G`` and held to the target's host key policy and timeouts.
        jump = self.ssh_config.get("proxyjump")
        if jump is None:
            return super().get_gateway()  # ProxyCommand string, or none
        if jump.strip().lower() == "none":
            return None
        if self._depth >= MAX_HOPS:
            raise TransportError(f"ProxyJump chain longer than {MAX_HOPS} (a loop in ssh_config?)",
                                 kind=errors.SSHCONFIG)
        hops = [h.strip() for h in jump.split(",") if h.strip()]
        identities = list(self.config.authentication.identities or [])
        prev = None
        for hop in hops:
            if hop.startswith("ssh://"):
                hop = hop[len("ssh://"):]
            spec = self.derive_shorthand(hop)
            name = str(spec["host"])
            if prev is None and name in (self.host, self.original_host):
                return None  # `Host *` ProxyJump matching the jump host itself
            # each hop is an alias of its own, resolved as OpenSSH's jump does:
            # ssh -G [-l USER] [-p PORT] HOP (a first hop's own ProxyJump applies)
            resolved = sshconfig.resolve(
                name, port=int(spec["port"]) if spec["port"] else None, user=spec["user"] or None)
            kwargs: dict[str, Any] = {"config": _fabric_config(resolved, identities)}
            if prev is not None:
                kwargs["gateway"] = prev  # OpenSSH order: hop N goes through hop N-1
            prev = HostConnection(name, gf=self._gf, depth=self._depth + 1, hop=True, **kwargs)
        return prev

    def open_gateway(self):
        # Why: fabric's opens the direct-tcpip channel with no timeout (paramiko's hour) and
        # lets a hop's failure out as the target's; here it is bounded and named "via jump
        # host H" with its own kind.
        if not isinstance(self.gateway, HostConnection):
            return super().open_gateway()
        gw = self.gateway
        try:
            gw.open()
        except (TransportError, paramiko.SSHException, OSError, EOFError) as exc:
            inner = transport_error(exc)  # the jump host's own failure: its kind stands
            raise TransportError(f"via jump host {gw.label}: {inner}", kind=inner.kind) from None
        try:
            return gw.transport.open_channel(
                "direct-tcpip", (self.host, int(self.port)), ("", 0),
                timeout=self._gf.connect_timeout)
        except paramiko.ChannelException as exc:
            raise TransportError(
                f"jump host {gw.label} could not connect to {self.host}:{self.port}: {exc.text}",
                kind=errors.PROXY) from None
        except paramiko.SSHException as exc:
            raise TransportError(
                f"jump host {gw.label}: no channel to {self.host}:{self.port} "
                f"within {self._gf.connect_timeout:g}s ({transport_error(exc)})",
                kind=errors.PROXY) from None

    def open(self):
        # Why: fabric dials with no bound on DNS and no pre-dialled socket, and lets paramiko's
        # host key and auth exceptions out; here the known keys are preloaded (the server
        # offers a known type), the socket is the pre-dial's or dial_tcp's (DNS + connect
        # bounded), and a refused key or auth is gpufleet's one-line failure with its kind.
        if self.is_connected:
            return None
        name = self.key_name
        # Preload what we know, so paramiko asks the server for a known key type first.
        host_keys = self.client.get_host_keys()
        # (filed under paramiko's own name for the server, which ignores HostKeyAlias)
        server_name = hostkeys.host_key_name(self.host, self.port)
        for entry in hostkeys.known_keys(name, self._files):
            pkey = entry.pkey()
            if pkey is not None:
                host_keys.add(server_name, entry.keytype, pkey)
        sock = None
        try:
            if not self.gateway:
                sock = self.take_predialed()
                if sock is None:
                    sock = dial_tcp(self.host, int(self.port), self._gf.connect_timeout)
                self.connect_kwargs["sock"] = sock
            return super().open()
        except AuthFailed as exc:
            self._abort(sock)
            raise AuthFailed(
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

    def take_predialed(self) -> Optional[socket.socket]:
        """The socket gpufleet.transport.dial connected for us, unless it waited so long for a forks
        slot that sshd may have dropped it (LoginGraceTime runs from the accept): then it is
        closed and the caller dials again (the host answered moments ago)."""
        held, self._predialed = self._predialed, None
        if held is None:
            return None
        sock, connected_at = held
        if time.monotonic() - connected_at > PREDIAL_FRESH_S:
            sock.close()
            return None
        return sock

    def _abort(self, sock: Optional[socket.socket]) -> None:
        try:
            self.client.close()
        except Exception:
            pass
        if sock is not None:
            sock.close()
        self.transport = None

    def close(self):
        # Why: a pre-dialled socket never used and the hops' connections are ours to close.
        try:
            super().close()
            self.client.close()
        finally:
            self.transport = None
            held, self._predialed = self._predialed, None
            if held is not None:  # connected for us, never used
                held[0].close()
            if isinstance(self.gateway, Connection):
                self.gateway.close()


def transport_error(exc: BaseException) -> TransportError:
    """What a connect-time (or mid-run) failure is: ``exc`` itself when it is one already,
    else a TransportError with its kind and one short line."""
    if isinstance(exc, TransportError):
        return exc
    kind, text = _classify(exc)
    return TransportError(text, kind=kind)


def _classify(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, paramiko.AuthenticationException):
        return errors.AUTH, f"authentication failed ({exc})"
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "protocol banner" in text:  # paramiko's own wording: the only way it tells us
            return errors.BANNER, "no SSH banner (not an SSH server, or overloaded)"
        if "No existing session" in text:
            return errors.HANDSHAKE, "SSH handshake did not complete"
        if "Channel closed" in text:
            return errors.CLOSED, "the server closed the connection"
        return errors.SSH, first_line(exc)
    if isinstance(exc, socket.timeout):
        return errors.TIMEOUT, "timed out"
    if isinstance(exc, (EOFError, ConnectionResetError, BrokenPipeError)):
        return errors.CLOSED, ("the server closed the connection" if isinstance(exc, EOFError)
                               else exc.strerror or str(exc) or type(exc).__name__)
    if isinstance(exc, ConnectionRefusedError):
        return errors.REFUSED, exc.strerror or str(exc) or type(exc).__name__
    if isinstance(exc, OSError):
        return errors.NETWORK, exc.strerror or str(exc) or type(exc).__name__
    return errors.INTERNAL, errors.describe(exc)


class _ResolvedConfig(paramiko.SSHConfig):
    """What fabric looks ssh_config up in: the values OpenSSH resolved, for any name asked."""

    def __init__(self, values: dict):
        super().__init__()
        self._values = dict(values)

    def lookup(self, hostname: str) -> paramiko.SSHConfigDict:
        return paramiko.SSHConfigDict(self._values)


def _fabric_config(resolved: sshconfig.Resolved, identities: Sequence[str] = ()) -> Config:
    """A fabric Config that reads no ssh_config file: ``resolved`` is the answer."""
    config = Config(ssh_config=_ResolvedConfig(resolved.values))
    config.authentication.strategy_class = BatchAuth
    if identities:
        config.authentication.identities = list(identities)
    return config


def connection_for(host: Host) -> HostConnection:
    """The fabric Connection (not yet opened) for an inventory Host, ssh_config applied.

    ``address`` is resolved as ``ssh [-p PORT] [-l USER] ADDRESS`` resolves it (the inventory
    port/user, when set, act as ssh's -p/-l: they win over ssh_config, first value wins);
    the inventory identity_file is tried before ssh_config's IdentityFile, like ``-i``.
    Raises SshConfigError when OpenSSH cannot resolve it.
    """
    port = int(host.port) if host.port else None
    resolved = sshconfig.resolve(ssh_alias(host), port=port,
                                  user=getattr(host, "user", None) or None)
    ct = resolved.values.get("connecttimeout")
    try:
        ct = float(ct) if ct is not None else None
    except ValueError:
        ct = None
    explicit: frozenset[str] = getattr(host, "explicit", frozenset())
    policy = host.host_key_policy
    if "host_key_policy" not in explicit:
        policy = sshconfig.host_key_policy(resolved.values, policy)
    gf = ChainSettings(
        policy=policy,
        known_hosts_file=getattr(host, "known_hosts_file", None),
        connect_timeout=float(_settings_value(host, "connect_timeout", ct, 10.0)),
        target=host.name,
    )
    identity = getattr(host, "identity_file", None)
    config = _fabric_config(resolved, [os.path.expanduser(identity)] if identity else [])
    return HostConnection(resolved.alias, gf=gf, config=config)
