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
* ssh_config: the inventory ``address`` (else the name) is what ``ssh ADDRESS`` would be given,
  resolved by OpenSSH itself (gpufleet.transport.sshconfig: ``ssh -G``, the inventory port/user as
  ``-p``/``-l``); fabric gets those values instead of parsing ssh_config again. Every ProxyJump
  hop is resolved the same way (``ssh -G [-l USER] [-p PORT] HOP``, as OpenSSH's own jump).
* Auth: gpufleet.sshauth (public keys only, never a prompt).
* Pre-dialling (:func:`predial`): commands over many hosts start every direct host's TCP
  connect at once, outside the ``--forks`` bound, so an unreachable host is known within its
  own connect_timeout from the start of the command; the SSH handshake and the exec (the
  CPU-heavy part) stay inside the bound and take the connected socket.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import paramiko
from fabric import Config, Connection

from gpufleet.errors import GpufleetError
from gpufleet.transport import hostkeys, sshconfig
from gpufleet.transport.auth import _AuthFailed, _BatchAuth

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
    _predialed: Optional[tuple] = None  # (connected socket, monotonic time of the connect)

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
            hostkeys.HostKeyPolicy(gf.policy, self._files, hint=hint,
                                   name=self.ssh_config.get("hostkeyalias") or None))

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
        jump = self.ssh_config.get("proxyjump")
        if jump is None:
            return super().get_gateway()  # ProxyCommand string, or none
        if jump.strip().lower() == "none":
            return None
        if self._depth >= MAX_HOPS:
            raise TransportError(f"ProxyJump chain longer than {MAX_HOPS} (a loop in ssh_config?)")
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
            prev = _Connection(name, gf=self._gf, depth=self._depth + 1, hop=True, **kwargs)
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
        # (filed under paramiko's own name for the server, which ignores HostKeyAlias)
        server_name = hostkeys.host_key_name(self.host, self.port)
        for entry in hostkeys.known_keys(name, self._files):
            pkey = entry.pkey()
            if pkey is not None:
                host_keys.add(server_name, entry.keytype, pkey)
        sock = None
        try:
            if not self.gateway:
                sock = self._take_predialed()
                if sock is None:
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

    def _take_predialed(self) -> Optional[socket.socket]:
        """The socket :class:`Predial` connected for us, unless it waited so long for a forks
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
            held, self._predialed = self._predialed, None
            if held is not None:  # connected for us, never used
                held[0].close()
            if isinstance(self.gateway, Connection):
                self.gateway.close()


def _reason(exc: BaseException) -> str:
    """One short line for a connect-time failure."""
    if isinstance(exc, (TransportError, hostkeys.HostKeyError, sshconfig.SshConfigError)):
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
    config.authentication.strategy_class = _BatchAuth
    if identities:
        config.authentication.identities = list(identities)
    return config


def ssh_alias(host: Any) -> str:
    """The name ``ssh`` is given for this host: its inventory ``address``, else its name."""
    return str(getattr(host, "address", None) or host.name)


def connection_for(host: Any) -> _Connection:
    """The fabric Connection (not yet opened) for an inventory Host, ssh_config applied.

    ``address`` is resolved as ``ssh [-p PORT] [-l USER] ADDRESS`` resolves it (the inventory
    port/user, when set, act as ssh's -p/-l: they win over ssh_config, first value wins);
    the inventory identity_file is tried before ssh_config's IdentityFile, like ``-i``.
    Raises sshconfig.SshConfigError when OpenSSH cannot resolve it.
    """
    port = int(host.port) if getattr(host, "port", None) else None
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
    gf = _Settings(
        policy=policy,
        known_hosts_file=getattr(host, "known_hosts_file", None),
        connect_timeout=float(_settings_value(host, "connect_timeout", ct, 10.0)),
        target=host.name,
    )
    identity = getattr(host, "identity_file", None)
    config = _fabric_config(resolved, [os.path.expanduser(identity)] if identity else [])
    return _Connection(resolved.alias, gf=gf, config=config)


# --------------------------------------------------------------------------- pre-dialling

PREDIAL_THREADS = 512  # dials in flight at once (each a thread mostly asleep in connect())
# A pre-dialled socket older than this when its host gets a forks slot is dialled again: sshd
# drops a connection that has not authenticated within LoginGraceTime (120 s by default, 30 s
# in hardened configs), counted from the accept.
PREDIAL_FRESH_S = 20.0
_FD_RESERVE = 64  # descriptors left for everything else (files, pipes, DNS, paramiko)
_FD_PER_FORK = 4  # a working host's socket, a jump host's, a local run's pipes


def _fd_budget(forks: int) -> int:
    """How many pre-dialled sockets may be held at once without running out of descriptors
    (RLIMIT_NOFILE is 256 by default on macOS): hosts beyond it are dialled as slots free."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1 << 30
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return int(soft) - _FD_RESERVE - _FD_PER_FORK * max(1, int(forks))


def _quiet_sigint() -> None:
    """Dial threads leave SIGINT to the main thread (see gpufleet.fanout._block_sigint)."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except (AttributeError, ValueError, OSError):
        pass


class _Dial:
    __slots__ = ("host", "future", "taken", "state", "holds_slot")

    def __init__(self, host: Any):
        self.host = host
        self.future: cf.Future = cf.Future()
        self.taken = False
        self.state = "queued"  # -> "dialling" -> "done"
        self.holds_slot = False


class Predial:
    """Every direct SSH host's TCP connect, started at once when a command begins.

    Why: the ``--forks`` bound is for the SSH handshake and the exec (CPU); a connect is only
    waiting, and a blackholed host's wait must not start when a slot frees (late in a large
    fleet) but with the command. Each dial is what :meth:`_Connection.open` would have done
    (ssh_config applied by :func:`connection_for`, DNS + connect bounded by the host's
    connect_timeout) in a thread of its own; the host's worker then calls :meth:`take` for a
    Future of the connection: a ``_Connection`` holding the connected socket, ``None`` (build
    one as usual: ssh_config error, or the dial was given up), or the dial's error (the host's
    row error, exactly as if the worker had dialled). Hosts with ProxyJump / ProxyCommand get a
    ``_Connection`` without a socket: the jump is an SSH session, so it stays in the bound.

    Sockets never taken (Ctrl-C: fanout starts no more hosts) are closed by :meth:`close`
    (use ``with``), also those whose connect completes afterwards. Dial threads are daemons:
    a blackholed connect never holds the exit. At most ``_fd_budget`` sockets are held here at
    once; the further hosts' dials start as sockets are taken.
    """

    def __init__(self, hosts: Iterable[Any], forks: int = 32, threads: int = PREDIAL_THREADS):
        self._lock = threading.Lock()
        self._closed = False
        self._dials: dict[str, _Dial] = {}
        for host in hosts:
            if getattr(host, "connection", "ssh") != "local":
                self._dials.setdefault(str(host.name), _Dial(host))
        self._queue = collections.deque(self._dials.values())
        n = len(self._queue)
        budget = _fd_budget(forks)
        self._slots: Optional[threading.Semaphore] = (
            threading.Semaphore(max(0, budget)) if budget < n else None)
        count = self._threads = min(n, max(int(forks), int(threads)), max(0, budget))
        if count <= 0:  # no descriptors to spare: every host dials in its worker, as before
            self._queue.clear()
            self._dials.clear()
        try:
            for i in range(count):
                threading.Thread(target=self._run, name=f"gpufleet-dial-{i}", daemon=True).start()
        except BaseException:  # Ctrl-C, or no more threads: what started is given up
            self.close()
            raise

    # ---- the host's side

    def take(self, host: Any) -> Optional[cf.Future]:
        """The Future of this host's connection (ownership passes to the caller), or None:
        not pre-dialled (local host, unknown, already taken, or after :meth:`close`)."""
        with self._lock:
            dial = self._dials.pop(str(getattr(host, "name", host)), None)
            if dial is None or self._closed:
                return None
            dial.taken = True
            if dial.state == "done":
                self._release(dial)
        return dial.future

    def close(self) -> None:
        """Give up every dial nobody took: queued ones never start, done ones are closed,
        running ones close their socket when they end. Never blocks."""
        with self._lock:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            untaken = list(self._dials.values())
            self._dials.clear()
        for dial in queued:
            if dial.taken:  # its worker waits: it dials itself
                dial.future.set_result(None)
            else:
                dial.future.cancel()
        for dial in untaken:
            if dial.state == "done":
                _discard(dial.future)
                with self._lock:
                    self._release(dial)
        # wake dial threads waiting for a descriptor slot, so they see _closed and end
        if self._slots is not None:
            for _ in range(self._threads):
                self._slots.release()

    def __enter__(self) -> "Predial":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- the dial threads

    def _release(self, dial: _Dial) -> None:
        """(lock held) The socket left our hands: its descriptor slot is free again."""
        if dial.holds_slot:
            dial.holds_slot = False
            if self._slots is not None:
                self._slots.release()

    def _run(self) -> None:
        _quiet_sigint()
        while True:
            if self._slots is not None:
                self._slots.acquire()
            with self._lock:
                if self._closed or not self._queue:
                    if self._slots is not None:
                        self._slots.release()
                    return
                dial = self._queue.popleft()
                dial.state = "dialling"
                dial.holds_slot = True
            try:
                conn, exc = _dial_host(dial.host), None
            except BaseException as error:  # the host's row error; never lost
                conn, exc = None, error
            with self._lock:  # settled under the lock: close() then sees every socket
                dial.state = "done"
                give_up = self._closed and not dial.taken
                if dial.taken or give_up or conn is None or conn._predialed is None:
                    self._release(dial)
                if give_up:
                    dial.future.cancel()
                elif exc is not None:
                    dial.future.set_exception(exc)
                else:
                    dial.future.set_result(conn)
            if give_up and conn is not None:
                conn.close()


def _dial_host(host: Any) -> Optional[_Connection]:
    """One host's connection with its socket connected (not yet SSH), as open() would dial.

    None when ssh_config cannot be applied: the worker builds it again and reports that.
    """
    try:
        conn = connection_for(host)
    except Exception:
        return None
    if conn.gateway:  # ProxyJump / ProxyCommand: dialled by open(), inside the forks bound
        return conn
    try:
        sock = _dial(conn.host, int(conn.port), conn._gf.connect_timeout)
    except BaseException:
        conn.close()
        raise
    conn._predialed = (sock, time.monotonic())
    return conn


def _discard(future: cf.Future) -> None:
    """Close the connection a finished dial holds (nobody will use it)."""
    try:
        conn = future.result(timeout=0)
    except BaseException:
        return
    if conn is not None:
        conn.close()


def predial(hosts: Iterable[Any], forks: int = 32) -> Predial:
    """Start every direct SSH host's TCP connect now; ``with predial(hosts, forks) as dials:``
    then each worker calls ``open_session(host, dial=dials.take(host))``."""
    return Predial(hosts, forks)


# --------------------------------------------------------------------------- host keys


def _from_dial(dial: Optional[cf.Future]) -> Optional[_Connection]:
    """The connection a :func:`predial` Future holds; None: build one (not pre-dialled, or
    given up); the dial's own failure is raised as the host's error."""
    if dial is None:
        return None
    try:
        return dial.result()  # bounded: the dial has the host's connect_timeout
    except cf.CancelledError:
        return None
    except (TransportError, hostkeys.HostKeyError):
        raise
    except Exception as exc:
        raise TransportError(_reason(exc)) from None


def fetch_host_key(host: Any, dial: Optional[cf.Future] = None) -> tuple[str, str, paramiko.PKey]:
    """(keytype, SHA256 fingerprint, key) the host presents, for `gpufleet trust`.

    Uses the same route as a real connection (ssh_config, ProxyJump: jump hops must pass the
    host key policy); only the key exchange is done, no authentication. Known key types for
    the name are asked for first. ``dial``: the host's :func:`predial` Future (its TCP
    connect started with the command). Raises TransportError / HostKeyError.
    """
    if getattr(host, "connection", "ssh") == "local":
        raise TransportError(f"{host.name} uses connection: local; it has no SSH host key")
    conn = _from_dial(dial) or connection_for(host)
    sock = None
    transport = None
    try:
        try:
            if conn.gateway:
                sock = conn.open_gateway()
            else:
                sock = conn._take_predialed() or _dial(conn.host, int(conn.port),
                                                       conn._gf.connect_timeout)
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


def trust(host: Any, path: Optional[os.PathLike] = None,
          fetched: Optional[tuple[str, str, paramiko.PKey]] = None) -> TrustResult:
    """Record the key ``host`` presents now in ``path`` (default ~/.config/gpufleet/known_hosts).

    ``fetched``: what :func:`fetch_host_key` returned (the key the operator was shown); None
    fetches it here. Refuses (HostKeyError) when a different key is already recorded for it
    anywhere: a changed key is never overwritten; the operator removes the old line first.
    """
    target = Path(path) if path else hostkeys.gpufleet_known_hosts()
    keytype, fp, key = fetched if fetched is not None else fetch_host_key(host)
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
