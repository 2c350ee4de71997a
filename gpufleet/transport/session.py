"""Run the agent (or another argv) on one Host: over SSH (fabric/paramiko) or locally.

One ``Session`` per host holds one SSH connection that several runs reuse (a runbook reuses
it across steps); each run is exactly one exec channel: no sftp, no probes. Every failure is
a value: ``run_agent`` returns ``AgentReply(ok=False, error=<one short line>)`` for an
unreachable host, DNS failure, timeout, refused host key, failed auth, missing python3,
sudo wanting a password, or agent output that is not JSON.

Ending a hung command: closing an exec channel does not signal the remote process (sshd sends
SIGHUP only through a pty, and its "signal" channel request is refused for root logins), so
each side bounds itself. The agent gets ``deadline_s = timeout - margin`` in its request and
ends itself and everything it started; ``run_argv`` wraps the argv in ``timeout -k 2 T``
(coreutils/busybox) on the host. The controller stops waiting at ``timeout`` in both cases
and closes the channel. ``connection: local`` runs the same argv through ``subprocess`` (no
shell) in a new session and kills that process group at the timeout.

Building the connection (ssh_config, ProxyJump, host keys, timeouts) is
gpufleet.transport.connection, authentication gpufleet.transport.auth, one raw bounded run
gpufleet.transport.run; other packages import the public names from gpufleet.transport.
The SSH stack (paramiko, fabric) is imported by the first SshSession, never for
``connection: local`` (see gpufleet.transport).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import os
import re
import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport.dial import Dialled
from gpufleet.transport.run import KILL_AFTER_S, RawRun, run_local
from gpufleet.transport.stream import ChannelStream, ProcessStream, Stream, transport_error

log = logging.getLogger("gpufleet.transport")  # -v (gpufleet.cli.enable_verbose)

if TYPE_CHECKING:
    from gpufleet.transport.connection import HostConnection
    from gpufleet.transport.conversation import Conversation


@dataclass(frozen=True)
class AgentReply:
    """What one agent run gave: the parsed document, or why there is none (``error``, and
    its ``error_kind``: gpufleet.errors kinds). Not a per-host row (core.results): it has no
    host; the rows are made from it (ops.collect.result_from_reply)."""

    ok: bool
    doc: Optional[dict] = None
    error: Optional[str] = None
    exit_code: Optional[int] = None
    seconds: float = 0.0
    stderr: bytes = b""
    error_kind: Optional[str] = None
    #: a conversation's request that certainly never reached the agent, or that it said it
    #: did not act on (it had ended, the connection was gone, it ended idle): nothing was done
    unsent: bool = False


class ArgvResult(NamedTuple):
    exit_code: int
    stdout: bytes
    stderr: bytes


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


def _command_error(raw: RawRun, host: Host, what: str, timeout: float) -> Optional[str]:
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


def _too_old(host: Host, what: str) -> str:
    python = getattr(host, "python", None) or "python3"
    return (f"{python} on {getattr(host, 'name', 'host')} is too old ({what}; gpufleet needs "
            "3.6+): set python: in the inventory")


def _wrapper_error(raw: RawRun, sudo: bool, uses_timeout: bool) -> Optional[str]:
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


def with_deadline(request: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """The request with the agent's own deadline: the caller's, if any, within
    ``deadline_for(timeout)``."""
    req = dict(request)
    own = deadline_for(timeout)
    given = req.get("deadline_s")
    req["deadline_s"] = own if given is None else min(float(given), own)
    return req


def _agent_command(host: Host) -> list[str]:
    from gpufleet.remote import bootstrap_command

    return bootstrap_command(getattr(host, "python", None) or "python3", bool(getattr(host, "sudo", False)))


def remote_timeout(argv: list[str], timeout: float) -> list[str]:
    """``argv`` bounded on the host itself (coreutils/busybox ``timeout``): over SSH closing
    the channel does not end the remote process (see the module docstring)."""
    return ["timeout", "-k", str(KILL_AFTER_S), str(max(1, math.ceil(timeout)))] + argv


def agent_reply(raw: RawRun, host: Host, timeout: float, seconds: float) -> AgentReply:
    """One agent run's outcome as a reply: the wrappers' and the interpreter's failures
    (sudo, missing or too-old python, timeout), output that is not one JSON object, or the
    document (run_agent, and each answer of a conversation)."""

    def failed_run(message: str, kind: str, doc: Optional[dict] = None) -> AgentReply:
        return AgentReply(False, doc, message, raw.exit_code, seconds, raw.stderr, kind)

    error = _command_error(raw, host, "agent", timeout)
    if error is not None:
        return failed_run(error, errors.COMMAND)
    text = raw.stdout.decode("utf-8", "replace").strip()
    if not text:
        return failed_run("agent printed nothing", errors.AGENT)
    try:
        doc = json.loads(text)
    except ValueError:
        head = text.splitlines()[0][:80]
        return failed_run(f"agent output is not JSON: {head!r}", errors.AGENT)
    if not isinstance(doc, dict):
        return failed_run("agent output is not a JSON object", errors.AGENT)
    if doc.get("python_too_old"):  # the agent's own version check (3.0 - 3.5)
        return failed_run(_too_old(host, f"Python {doc.get('python')}"), errors.COMMAND, doc)
    return AgentReply(True, doc, None, raw.exit_code, seconds, raw.stderr)


class Session:
    """A host's open connection, reused by several runs; a context manager.

    ``open_session`` never raises for an unreachable host: ``error`` then holds the reason,
    ``error_kind`` its kind, and every run returns it as a failure value (``run_argv`` raises
    TransportError).
    """

    def __init__(self, host: Host):
        self.host = host
        self.error: Optional[str] = None
        self.error_kind: Optional[str] = None
        self.connect_seconds = 0.0

    # subclass interface
    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
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
        """Run the agent with ``request``; every failure comes back as ``ok=False``. The
        agent's source is left out for a host known to have it cached (knownagents); if that
        cache is gone the run is made once more with it."""
        from gpufleet.remote import agent_key, needs_agent
        from gpufleet.transport import knownagents

        started = time.monotonic()
        timeout = self._timeout(timeout)
        key = agent_key()
        known = knownagents.holds(self.host, key)
        reply = self._run_agent_once(request, timeout, started, with_agent=not known)
        if known and reply.ok and needs_agent(reply.doc):
            knownagents.forget(self.host)
            known = False
            left = max(1.0, timeout - (time.monotonic() - started))
            reply = self._run_agent_once(request, left, started, with_agent=True)
        if reply.ok:
            knownagents.note(self.host, key, reply.doc, known)
        return reply

    def _run_agent_once(self, request: Mapping[str, Any], timeout: float, started: float,
                        with_agent: bool) -> AgentReply:
        from gpufleet.remote import encode_request

        req = with_deadline(request, timeout)
        try:
            raw = self._run(_agent_command(self.host), encode_request(req, with_agent), timeout)
        except Exception as exc:  # a failed host is a value, whatever broke
            failed = transport_error(exc)
            return AgentReply(False, None, str(failed), None, time.monotonic() - started,
                              error_kind=failed.kind)
        return agent_reply(raw, self.host, timeout, time.monotonic() - started)

    def converse(self, request: Mapping[str, Any], timeout: Optional[float] = None
                 ) -> "Conversation":
        """Start ONE agent process that answers ``request`` (a snapshot; its reply is the
        conversation's ``reply``) and stays for the next (``Conversation.ask``) over the same
        exec: `clean` plans and acts through one agent start per host. Never raises: a host
        that fails gives a conversation whose reply says why (the same failures as
        ``run_agent``: wrappers, missing or too-old python, ssh's own)."""
        from gpufleet.transport.conversation import Conversation

        return Conversation.start(self, request, self._timeout(timeout))

    def start_conversation(self, head: bytes, timeout: float) -> tuple[Optional[Stream], RawRun]:
        """Start the resident agent with ``head`` and read its first line: (the stream, or
        None when it never started; the first answer as a RawRun, see ``first_answer``)."""
        from gpufleet.transport.conversation import first_answer

        streams: list[Stream] = []

        def start() -> RawRun:
            for old in streams:  # a retry (accept-new recorded the key): the first is over
                old.close()
            streams[:] = [self._stream(_agent_command(self.host), head, timeout, as_run=True)]
            return first_answer(streams[0], timeout)

        try:
            raw = self._first_run(start)
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return (streams[0] if streams else None), raw

    def _first_run(self, start: Callable[[], RawRun]) -> RawRun:
        """A conversation's start as a run (OpenSSH: its own failures and accept-new)."""
        return start()

    def ended_failure(self, raw: RawRun) -> Optional[TransportError]:
        """The transport's own failure in an ended conversation (OpenSSH: exit 255), or None."""
        return None

    def stream_agent(self, request: Mapping[str, Any], timeout: Optional[float] = None) -> Stream:
        """Start the agent resident (watch mode) on this session: its snapshot lines come
        from ``Stream.readline``, keep-alives go through ``Stream.send``; raises
        TransportError (with a kind) when it cannot start. ``timeout`` bounds the start."""
        from gpufleet.remote import encode_request

        return self._stream(_agent_command(self.host), encode_request(dict(request)),
                            self._timeout(timeout))

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        raise NotImplementedError

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
            raise TransportError(error, raw.stdout, raw.stderr, kind=errors.COMMAND)
        return ArgvResult(raw.exit_code if raw.exit_code is not None else -1, raw.stdout, raw.stderr)


class LocalSession(Session):
    """``connection: local``: the same argv through subprocess, no shell, no SSH."""

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
        return run_local(argv, stdin, timeout)

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        return ProcessStream(argv, head, as_run=as_run)

    def _first_run(self, start: Callable[[], RawRun]) -> RawRun:
        try:
            return start()
        except FileNotFoundError:  # as run_local reports it
            return RawRun(127, b"", f"{_agent_command(self.host)[0]}: not found".encode())
        except PermissionError:
            return RawRun(126, b"", f"{_agent_command(self.host)[0]}: Permission denied".encode())


class SshSession(Session):
    """One SSH connection (through any ProxyJump hops), opened once, one exec per run.

    ``dial``: this host's Future from :func:`predial` (its TCP connect started with the
    command); used for the first connect only, a reconnect dials afresh.
    """

    def __init__(self, host: Host, dial: Optional[Dialled] = None):
        super().__init__(host)
        self.conn: Optional[HostConnection] = None
        self._was_open = False
        self._connect(dial)

    def _failed(self, exc: BaseException, prefix: str = "") -> None:
        failed = transport_error(exc)
        self.error, self.error_kind = prefix + str(failed), failed.kind

    def _connect(self, dial: Optional[Dialled] = None) -> None:
        started = time.monotonic()
        conn = None
        if dial is not None:
            try:
                conn = dial.result()  # bounded: the dial has the host's connect_timeout
            except cf.CancelledError:
                conn = None  # given up (interrupted): dial here, as without a pre-dial
            except Exception as exc:  # the dial failed: the same row error as dialling here
                self._failed(exc)
                self.connect_seconds = time.monotonic() - started
                return
        try:
            if conn is None:
                from gpufleet.transport.connection import connection_for

                conn = connection_for(self.host)
        except Exception as exc:
            self._failed(exc, "ssh config: ")
            self.error_kind = errors.SSHCONFIG
            return
        try:
            conn.open()
            self.conn = conn
            self._was_open = True
            self.error = self.error_kind = None
        except Exception as exc:
            try:
                conn.close()
            except Exception:
                pass
            self._failed(exc)
        finally:
            self.connect_seconds = time.monotonic() - started
            log.debug("%s: paramiko connect to %s:%s: %s after %.3fs", self.host.name,
                      getattr(conn, "host", "?"), getattr(conn, "port", "?"),
                      self.error or "connected", self.connect_seconds)

    @property
    def connected(self) -> bool:
        return self.conn is not None and self.conn.is_connected

    def _wrap_timeout(self, argv: list[str], timeout: float) -> list[str]:
        return remote_timeout(argv, timeout)

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
        if not self.connected and self._was_open:  # dropped since (host rebooted): once more
            self.close()
            self._connect()
        transport = self.conn.transport if self.conn is not None else None
        if self.error is not None or transport is None:
            raise TransportError(self.error or "not connected",
                                 kind=self.error_kind or errors.CLOSED)
        import paramiko

        from gpufleet.transport.run import exec_channel

        command = " ".join(shlex.quote(a) for a in argv)
        try:
            return exec_channel(transport, command, stdin, timeout)
        except TransportError:
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise TransportError(f"connection lost: {transport_error(exc)}",
                                 kind=errors.CLOSED) from None

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        transport = self.conn.transport if self.conn is not None else None
        if self.error is not None or transport is None or not self.connected:
            raise TransportError(self.error or "not connected", kind=self.error_kind or errors.CLOSED)
        return ChannelStream(transport, " ".join(shlex.quote(a) for a in argv), head, timeout,
                             as_run=as_run)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
            self.conn = None


def open_session(host: Host, dial: Optional[Dialled] = None, keep: bool = False) -> Session:
    """Open the host's session (connects now for ssh); never raises for host failures.

    ``dial``: the host's pre-dialled connection (``predial(hosts, forks).take(host)``), so its
    TCP connect need not wait for a forks slot; None dials here. An SSH host goes through
    OpenSSH's client (gpufleet.transport.openssh) unless ``ssh_client: paramiko``, no ``ssh``
    on PATH, or a ProxyJump / ProxyCommand; predial never dials those hosts. ``keep``: the
    caller runs several commands on it (OpenSSH then keeps a master for them; a paramiko
    session always keeps its connection).
    """
    if getattr(host, "connection", "ssh") == "local":
        log.debug("%s: connection: local (this machine, no ssh)", host.name)
        return LocalSession(host)
    if dial is None:
        from gpufleet.transport import openssh

        if openssh.wanted(host):
            session = openssh.open_session(host, keep=keep)
            if session is not None:
                if session.error is not None:
                    log.debug("%s: not connected: %s", host.name, session.error)
                return session
    log.debug("%s: paramiko (ssh_client: paramiko, no ssh on PATH, or a ProxyJump/ProxyCommand)",
              host.name)
    return SshSession(host, dial)
