"""Run the agent (or another argv) on one Host: over SSH (fabric/paramiko) or locally.

One ``Session`` per host holds one SSH connection that several runs reuse (a runbook reuses
it across steps); each run is exactly one exec channel: no sftp, no probes. Every failure is
a value: ``run_agent`` returns ``AgentReply(ok=False, error=<one short line>)`` for an
unreachable host, DNS failure, timeout, refused host key, failed auth, missing python3,
sudo wanting a password, or agent output that is not JSON.

What gpufleet changes in fabric's defaults, and why:

* Host keys: fabric puts AutoAddPolicy on its client and on every ProxyJump hop; here each of
  them gets :class:`gpufleet.hostkeys.HostKeyPolicy` (strict / accept-new, CHANGED always
  refused), with the known keys preloaded so the server offers a key type we know.
* ProxyJump: hops are built here in OpenSSH order (the first hop is dialled directly; fabric
  3 reverses the list), each one with the same host key policy and timeouts.
* Auth is BatchMode-like: inventory identity_file, ssh_config IdentityFile, ssh-agent, then
  ~/.ssh/id_* (only when no IdentityFile is configured, as OpenSSH does); passphrase-protected
  keys not in the agent are skipped; never a password or keyboard-interactive prompt.
* Timeouts: connect_timeout bounds DNS + TCP connect (a worker thread bounds getaddrinfo),
  the SSH banner, each auth reply and channel opens (also through a jump host).
* ``~/.ssh/config`` is honoured (HostName, Port, User, IdentityFile, ProxyJump, ConnectTimeout,
  UserKnownHostsFile); a key the inventory sets (``Host.explicit``) wins. ssh_config is looked
  up by the inventory name; an inventory ``address`` overrides HostName.

Ending a hung command: closing an exec channel does not signal the remote process (sshd sends
SIGHUP only through a pty, and its "signal" channel request is refused for root logins), so
each side bounds itself. The agent gets ``deadline_s = timeout - margin`` in its request and
ends itself and everything it started; ``run_argv`` wraps the argv in ``timeout -k 2 T``
(coreutils/busybox) on the host. The controller stops waiting at ``timeout`` in both cases
and closes the channel. ``connection: local`` runs the same argv through ``subprocess`` (no
shell) in a new session and kills that process group at the timeout.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import logging
import math
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import paramiko
from fabric import Config, Connection
from paramiko.auth_strategy import AuthStrategy, InMemoryPrivateKey, OnDiskPrivateKey

from . import hostkeys
from .errors import GpufleetError

# paramiko logs connect failures with tracebacks from its own threads; they are values here.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

MAX_HOPS = 8
KILL_AFTER_S = 2  # `timeout -k`: SIGKILL this long after SIGTERM
STDERR_KEEP = 64 * 1024
INLINE_STDIN = 1 << 20  # below the SSH window: sendall cannot block on a remote not reading


class TransportError(GpufleetError):
    """A host could not run the command; the message is one short line for the host's row."""

    def __init__(self, message: str, stdout: bytes = b"", stderr: bytes = b""):
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


@dataclass(frozen=True)
class AgentReply:
    """What one agent run gave: the parsed document, or why there is none."""

    ok: bool
    doc: Optional[dict] = None
    error: Optional[str] = None
    exit_code: Optional[int] = None
    seconds: float = 0.0
    stderr: bytes = b""


class ArgvResult(NamedTuple):
    exit_code: int
    stdout: bytes
    stderr: bytes


@dataclass
class _Raw:
    exit_code: Optional[int]
    stdout: bytes
    stderr: bytes
    timed_out: bool = False


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


# --------------------------------------------------------------------------- auth


def _pub_blob(path: str) -> Optional[bytes]:
    try:
        with open(path + ".pub", "r", encoding="ascii", errors="replace") as fh:
            return base64.b64decode(fh.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


class _AuthFailed(Exception):
    """No key was accepted; the connection adds user@host to ``detail``."""


class _BatchAuth(AuthStrategy):
    """Public-key auth only, never a prompt (OpenSSH BatchMode): see the module docstring."""

    def __init__(self, ssh_config, fabric_config, username):
        super().__init__(ssh_config=ssh_config)
        self.username = username
        self.config = fabric_config
        self.notes: list[str] = []
        self.tried: list[str] = []
        try:
            self.agent: Optional[paramiko.Agent] = paramiko.Agent()
        except Exception:
            self.agent = None

    def _load(self, path: str, where: str):
        try:
            key = paramiko.PKey.from_path(path)
        except FileNotFoundError:
            if where != "implicit-home":
                self.notes.append(f"{path} not found")
            return None
        except paramiko.PasswordRequiredException:
            self.notes.append(f"{path} is passphrase-protected (load it into ssh-agent)")
            return None
        except TypeError as exc:  # cryptography: "Password was not given but ... encrypted"
            text = str(exc).lower()
            if "password" in text or "encrypted" in text:
                self.notes.append(f"{path} is passphrase-protected (load it into ssh-agent)")
            else:
                self.notes.append(f"{path} unreadable (TypeError)")
            return None
        except Exception as exc:
            self.notes.append(f"{path} unreadable ({type(exc).__name__})")
            return None
        return OnDiskPrivateKey(username=self.username, source=where, path=Path(path), pkey=key)

    def get_sources(self):
        seen: set[bytes] = set()
        explicit = list(self.config.authentication.identities or [])
        configured = list(self.ssh_config.get("identityfile", []) or [])
        # paramiko only knows these source labels: inventory keys are "python-config"
        files = [(p, "python-config") for p in explicit] + [(p, "ssh-config") for p in configured]
        agent_keys = []
        if self.agent is not None:
            try:
                agent_keys = list(self.agent.get_keys())
            except Exception:
                agent_keys = []
        agent_blobs = {k.asbytes() for k in agent_keys}
        if str(self.ssh_config.get("identitiesonly", "no")).lower() == "yes":
            # only agent keys whose public half is a configured identity (IdentityFile.pub)
            wanted = {_pub_blob(os.path.expanduser(p)) for p, _w in files} - {None}
            agent_keys = [k for k in agent_keys if k.asbytes() in wanted]
        for path, where in files:
            src = self._load(os.path.expanduser(path), where)
            if src is not None and src.pkey.asbytes() not in seen:
                seen.add(src.pkey.asbytes())
                self.tried.append(path)
                yield src
        for key in agent_keys:
            if key.asbytes() not in seen:
                seen.add(key.asbytes())
                self.tried.append("agent key")
                yield InMemoryPrivateKey(username=self.username, pkey=key)
        if not configured:
            for name in ("id_rsa", "id_ecdsa", "id_ed25519"):
                path = os.path.expanduser(f"~/.ssh/{name}")
                src = self._load(path, "implicit-home")
                if src is not None and src.pkey.asbytes() not in seen | agent_blobs:
                    seen.add(src.pkey.asbytes())
                    self.tried.append(f"~/.ssh/{name}")
                    yield src

    def authenticate(self, transport):
        try:
            return super().authenticate(transport)
        except paramiko.AuthenticationException as exc:
            if self.tried:
                names = sorted(set(self.tried), key=self.tried.index)
                parts = ["tried " + ", ".join(names)] + self.notes
            elif self.notes:
                parts = ["no usable key"] + self.notes
            else:
                parts = ["no key to try: no identity_file, ssh-agent key or ~/.ssh/id_*"]
            if "partial" in repr(getattr(exc, "result", "")).lower():
                parts.append("the server wants a second factor; gpufleet never prompts")
            raise _AuthFailed("; ".join(parts)) from None
        finally:
            if self.agent is not None:
                try:
                    self.agent.close()
                except Exception:
                    pass


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


# --------------------------------------------------------------------------- exec


def _exec(transport: paramiko.Transport, command: str, stdin: bytes, timeout: float) -> _Raw:
    """One exec channel: send stdin, read stdout/stderr until exit status or ``timeout``."""
    deadline = time.monotonic() + timeout
    chan = transport.open_session(timeout=max(0.1, timeout))
    watchdog = threading.Timer(timeout + 0.5, chan.close)  # backstop for exec_command's wait
    watchdog.daemon = True
    watchdog.start()
    out: list[bytes] = []
    err = bytearray()
    feeder: Optional[threading.Thread] = None
    try:
        try:
            chan.exec_command(command)
        except paramiko.SSHException as exc:
            if time.monotonic() >= deadline:
                return _Raw(None, b"", b"", timed_out=True)
            raise TransportError(f"exec refused: {_reason(exc)}") from None

        def feed() -> None:
            try:
                chan.sendall(stdin)
                chan.shutdown_write()
            except Exception:
                pass  # the remote stopped reading; its exit status tells the rest

        if len(stdin) <= INLINE_STDIN:
            chan.settimeout(max(0.1, deadline - time.monotonic()))
            feed()
            chan.settimeout(None)
        else:
            feeder = threading.Thread(target=feed, name="gpufleet-stdin", daemon=True)
            feeder.start()
        fd = chan.fileno()
        while True:
            while chan.recv_ready():
                out.append(chan.recv(65536))
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                if len(err) > 2 * STDERR_KEEP:
                    del err[: len(err) - STDERR_KEEP]
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                break
            if chan.closed:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return _Raw(None, b"".join(out), bytes(err[-STDERR_KEEP:]), timed_out=True)
            if chan.eof_received:
                chan.status_event.wait(remaining)  # no more data; only the status to come
            else:
                select.select([fd], [], [], remaining)
        while chan.recv_ready():
            out.append(chan.recv(65536))
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        code = chan.recv_exit_status() if chan.exit_status_ready() else -1
        return _Raw(code, b"".join(out), bytes(err[-STDERR_KEEP:]))
    finally:
        watchdog.cancel()
        chan.close()


def _run_local(argv: Sequence[str], stdin: bytes, timeout: float) -> _Raw:
    """The same argv without SSH: no shell; the process group is ended at the timeout."""
    try:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True)
    except FileNotFoundError:
        return _Raw(127, b"", f"{argv[0]}: not found".encode())
    except PermissionError:
        return _Raw(126, b"", f"{argv[0]}: Permission denied".encode())
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        return _Raw(proc.returncode, out, err[-STDERR_KEEP:])
    except subprocess.TimeoutExpired:
        pass
    for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, KILL_AFTER_S)):
        try:
            os.killpg(proc.pid, sig)  # the group of the process we started (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            out, err = proc.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            out, err = b"", b""
    else:  # something left the group and holds our pipes: stop reading them
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
        proc.wait(timeout=KILL_AFTER_S)
    return _Raw(None, out or b"", (err or b"")[-STDERR_KEEP:], timed_out=True)


# --------------------------------------------------------------------------- sessions

_MISSING = (
    re.compile(r"command not found: (\S+)"),
    re.compile(r"(?:^|: )([^\s:]+): (?:command )?not found"),
    re.compile(r"(?:^|: )([^\s:]+): No such file or directory"),
)


def _missing_command(stderr: str) -> Optional[str]:
    for line in stderr.splitlines():
        for pattern in _MISSING:
            m = pattern.search(line)
            if m:
                return m.group(1)
    return None


def _last_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _command_error(raw: _Raw, host: Any, what: str, timeout: float) -> Optional[str]:
    """Why a run failed as one line, or None if it exited 0."""
    if raw.timed_out:
        return f"{what} timed out after {timeout:g}s"
    code = raw.exit_code
    if code == 0:
        return None
    text = raw.stderr.decode("utf-8", "replace")
    python = getattr(host, "python", "python3") or "python3"
    if "a password is required" in text or "a terminal is required" in text:
        user = getattr(host, "user", None) or "the login user"
        return (f"sudo needs a password for {user} on this host (gpufleet runs sudo -n and never "
                "prompts): allow it without a password or set sudo: false")
    if "sudoers" in text or "not allowed to execute" in text:
        return f"sudo refused: {_last_line(raw.stderr)}"
    if code == 1 and _PY2_STDIN in text:  # the bootstrap's sys.stdin.buffer under Python 2
        return _too_old(host, "Python 2")
    if code in (1, 126, 127):
        missing = _missing_command(text)
        if missing:
            base = os.path.basename(missing)
            if base == os.path.basename(python):
                return f"{python} not found on host (set python: in the inventory)"
            if base == "sudo":
                return "sudo not found on host (set sudo: false in the inventory)"
            if code == 127:
                return f"{missing} not found on host"
    if code == -1:
        return f"{what} ended without an exit status (killed by a signal, or connection lost)"
    tail = _last_line(raw.stderr)
    return f"{what} exited {code}" + (f": {tail}" if tail else "")


_PY2_STDIN = "'file' object has no attribute 'buffer'"


def _too_old(host: Any, what: str) -> str:
    python = getattr(host, "python", None) or "python3"
    return (f"{python} on {getattr(host, 'name', 'host')} is too old ({what}; gpufleet needs "
            "3.6+): set python: in the inventory")


def _wrapper_error(raw: _Raw, sudo: bool, uses_timeout: bool) -> Optional[str]:
    text = raw.stderr.decode("utf-8", "replace")
    if sudo and ("a password is required" in text or "a terminal is required" in text):
        return ("sudo needs a password on this host (gpufleet runs sudo -n and never prompts)")
    if sudo and ("sudoers" in text or "not allowed to execute" in text):
        return f"sudo refused: {_last_line(raw.stderr)}"
    if raw.exit_code in (1, 126, 127):
        missing = os.path.basename(_missing_command(text) or "")
        if sudo and missing == "sudo":
            return "sudo not found on host"
        if uses_timeout and missing == "timeout":
            return "`timeout` (coreutils) not found on host"
    return None


def deadline_for(timeout: float) -> float:
    """The agent's own deadline: a little inside the controller's timeout, so it reports first."""
    margin = min(2.0, max(0.2, 0.1 * timeout))
    return max(0.1, timeout - margin)


def _agent_command(host: Any) -> list[str]:
    from .remote import bootstrap_command

    return bootstrap_command(getattr(host, "python", None) or "python3", bool(getattr(host, "sudo", False)))


class Session:
    """A host's open connection, reused by several runs; a context manager.

    ``open_session`` never raises for an unreachable host: ``error`` then holds the reason
    and every run returns it as a failure value (``run_argv`` raises TransportError).
    """

    def __init__(self, host: Any):
        self.host = host
        self.error: Optional[str] = None
        self.connect_seconds = 0.0

    # subclass interface
    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> _Raw:
        raise NotImplementedError

    def _wrap_timeout(self, argv: list[str], timeout: float) -> list[str]:
        return argv

    def close(self) -> None:
        pass

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _timeout(self, timeout: Optional[float]) -> float:
        return float(timeout if timeout is not None else getattr(self.host, "command_timeout", 60.0))

    def run_agent(self, request: Mapping[str, Any], timeout: Optional[float] = None) -> AgentReply:
        """Run the agent with ``request``; every failure comes back as ``ok=False``."""
        from .remote import encode_request

        started = time.monotonic()
        timeout = self._timeout(timeout)
        req = dict(request)
        own = deadline_for(timeout)
        given = req.get("deadline_s")
        req["deadline_s"] = own if given is None else min(float(given), own)
        try:
            raw = self._run(_agent_command(self.host), encode_request(req), timeout)
        except TransportError as exc:
            return AgentReply(False, None, str(exc), None, time.monotonic() - started)
        except Exception as exc:  # a failed host is a value, whatever broke
            return AgentReply(False, None, _reason(exc), None, time.monotonic() - started)
        seconds = time.monotonic() - started
        error = _command_error(raw, self.host, "agent", timeout)
        if error is not None:
            return AgentReply(False, None, error, raw.exit_code, seconds, raw.stderr)
        text = raw.stdout.decode("utf-8", "replace").strip()
        if not text:
            return AgentReply(False, None, "agent printed nothing", raw.exit_code, seconds, raw.stderr)
        try:
            doc = json.loads(text)
        except ValueError:
            head = text.splitlines()[0][:80]
            return AgentReply(False, None, f"agent output is not JSON: {head!r}", raw.exit_code,
                              seconds, raw.stderr)
        if not isinstance(doc, dict):
            return AgentReply(False, None, "agent output is not a JSON object", raw.exit_code,
                              seconds, raw.stderr)
        if doc.get("python_too_old"):  # the agent's own version check (3.0 - 3.5)
            return AgentReply(False, doc, _too_old(self.host, f"Python {doc.get('python')}"),
                              raw.exit_code, seconds, raw.stderr)
        return AgentReply(True, doc, None, raw.exit_code, seconds, raw.stderr)

    def run_argv(self, argv: Sequence[str], stdin: bytes = b"", timeout: Optional[float] = None,
                 sudo: bool = False, remote_timeout: bool = True) -> ArgvResult:
        """Run another argv (shlex-quoted, never raw shell) -> (exit, stdout, stderr).

        Raises TransportError if it could not run or ran past ``timeout``; over SSH the argv
        is wrapped in ``timeout`` on the host (``remote_timeout``) so it ends there too.
        """
        if not argv:
            raise ValueError("empty argv")
        timeout = self._timeout(timeout)
        full = [str(a) for a in argv]
        wrapped = self._wrap_timeout(full, timeout) if remote_timeout else full
        if sudo:
            wrapped = ["sudo", "-n"] + wrapped
        started = time.monotonic()
        raw = self._run(wrapped, stdin, timeout)
        uses_timeout = wrapped is not full
        ended_there = uses_timeout and raw.exit_code in (124, 137) and (
            time.monotonic() - started >= math.floor(timeout) - 0.5)
        error = None
        if raw.timed_out or ended_there:
            error = f"{shlex.quote(full[0])} timed out after {timeout:g}s"
        elif raw.exit_code != 0 and (sudo or uses_timeout):
            # failures of the wrappers (not of the command) are the transport's
            error = _wrapper_error(raw, sudo, uses_timeout)
        if error:
            raise TransportError(error, raw.stdout, raw.stderr)
        return ArgvResult(raw.exit_code if raw.exit_code is not None else -1, raw.stdout, raw.stderr)


class LocalSession(Session):
    """``connection: local``: the same argv through subprocess, no shell, no SSH."""

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> _Raw:
        return _run_local(argv, stdin, timeout)


class SshSession(Session):
    """One SSH connection (through any ProxyJump hops), opened once, one exec per run."""

    def __init__(self, host: Any):
        super().__init__(host)
        self.conn: Optional[_Connection] = None
        self._was_open = False
        self._connect()

    def _connect(self) -> None:
        started = time.monotonic()
        try:
            conn = connection_for(self.host)
        except Exception as exc:
            self.error = f"ssh config: {_reason(exc)}"
            return
        try:
            conn.open()
            self.conn = conn
            self._was_open = True
            self.error = None
        except Exception as exc:
            try:
                conn.close()
            except Exception:
                pass
            self.error = _reason(exc)
        finally:
            self.connect_seconds = time.monotonic() - started

    @property
    def connected(self) -> bool:
        return self.conn is not None and self.conn.is_connected

    def _wrap_timeout(self, argv: list[str], timeout: float) -> list[str]:
        return ["timeout", "-k", str(KILL_AFTER_S), str(max(1, math.ceil(timeout)))] + argv

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> _Raw:
        if not self.connected and self._was_open:  # dropped since (host rebooted): once more
            self.close()
            self._connect()
        if self.error is not None or self.conn is None:
            raise TransportError(self.error or "not connected")
        command = " ".join(shlex.quote(a) for a in argv)
        try:
            return _exec(self.conn.transport, command, stdin, timeout)
        except TransportError:
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise TransportError(f"connection lost: {_reason(exc)}") from None

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
            self.conn = None


def open_session(host: Any) -> Session:
    """Open the host's session (connects now for ssh); never raises for host failures."""
    if getattr(host, "connection", "ssh") == "local":
        return LocalSession(host)
    return SshSession(host)


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
