"""A host's session: THE interface every way of reaching a host implements (run the agent,
run another argv, stream the agent, converse with it), failures as values with a kind.

Ending a hung command: closing an exec channel does not signal the remote process (sshd sends
SIGHUP only through a pty, and its "signal" channel request is refused for root logins), so
each side bounds itself. The agent gets ``deadline_s = timeout - margin`` in its request and
ends itself and everything it started; ``run_argv`` wraps the argv in ``timeout -k 2 T``
(coreutils/busybox) on the host. The controller stops waiting at ``timeout`` in both cases.

A way of reaching a host is one module with one subclass (gpufleet.transport.local,
execprefix, openssh, paramikossh); gpufleet.transport.reach's table picks it per host.
"""
from __future__ import annotations

import math
import shlex
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport.conversation import Conversation, first_answer
from gpufleet.transport.reply import (
    AgentReply,
    ArgvResult,
    agent_command,
    agent_reply,
    with_deadline,
    wrapper_error,
)
from gpufleet.transport.run import RawRun
from gpufleet.transport.stream import Stream, transport_error


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
        """THE one-shot run: the argv's stream read to its end (a way writes only its
        stream; gpufleet.transport.stream.Stream.run_to_end)."""
        started = time.monotonic()
        stream = self._stream(argv, stdin, timeout, as_run=True)
        return stream.run_to_end(timeout - (time.monotonic() - started))

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
            raw = self._run(agent_command(self.host), encode_request(req, with_agent), timeout)
        except Exception as exc:  # a failed host is a value, whatever broke
            failed = transport_error(exc)
            return AgentReply(False, None, str(failed), None, time.monotonic() - started,
                              error_kind=failed.kind)
        return agent_reply(raw, self.host, timeout, time.monotonic() - started)

    def converse(self, request: Mapping[str, Any], timeout: Optional[float] = None
                 ) -> Conversation:
        """Start ONE agent process that answers ``request`` (a snapshot; its reply is the
        conversation's ``reply``) and stays for the next (``Conversation.ask``) over the same
        exec: `clean` plans and acts through one agent start per host. Never raises: a host
        that fails gives a conversation whose reply says why (the same failures as
        ``run_agent``: wrappers, missing or too-old python, ssh's own)."""
        return Conversation.start(self, request, self._timeout(timeout))

    def start_conversation(self, head: bytes, timeout: float) -> tuple[Optional[Stream], RawRun]:
        """Start the resident agent with ``head`` and read its first line: (the stream, or
        None when it never started; the first answer as a RawRun, see ``first_answer``)."""
        streams: list[Stream] = []

        def start() -> RawRun:
            for old in streams:  # a retry (accept-new recorded the key): the first is over
                old.close()
            streams[:] = [self._stream(agent_command(self.host), head, timeout, as_run=True)]
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

        return self._stream(agent_command(self.host), encode_request(dict(request)),
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
            error = wrapper_error(raw, sudo, uses_timeout)
        if error:
            raise TransportError(error, raw.stdout, raw.stderr, kind=errors.COMMAND)
        return ArgvResult(raw.exit_code if raw.exit_code is not None else -1, raw.stdout, raw.stderr)

