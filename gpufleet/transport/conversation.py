"""A conversation: ONE agent process on a host answering several requests over one exec.

Internal to gpufleet.transport (``Session.converse`` starts one). `clean` plans through the
first answer (a snapshot sent with ``"stay": true``) and, once every host is planned and the
operator agreed, acts through the second (the clean request), so a host pays one sshd session
and one agent start for the whole clean, and, over OpenSSH, one ``ssh`` process and no master.
The agent's side is its stay mode (gpufleet/remote/main.py: next requests framed
``<m>\\n<JSON>``, an idle bound, ``stay_end`` documents).

What the clean's failure semantics need from here, exactly: whether a request could have
reached the agent. ``ask`` looks at the stream before it writes: an agent that already ended
(EOF, its idle bound, the connection gone) or said it will not answer gives a reply with
``unsent=True`` (nothing was done on the host), as does a write that failed, or an answer that
is the agent's ``stay_end`` (it decided, under a lock, never to act on the request) or its
refusal of the request (``mode`` null). Only a request written whole and not answered (the
stream ended, the timeout passed) is an unknown outcome (``unsent=False``, ``ok=False``).

``cancel`` (another thread: the operator's second Ctrl-C) writes the ``cancel`` line while the
agent runs the clean request: it sends no further signal and answers at once with what it
sent. Cancelled before the request was written, the request never is (an unsent reply).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Mapping, Optional, Protocol

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport.run import RawRun
from gpufleet.transport.reply import AgentReply, agent_reply, with_deadline
from gpufleet.transport.stream import Stream, transport_error


class Session(Protocol):
    """What a conversation uses of its session (gpufleet.transport.session.Session, which
    imports this module: named here by shape, not imported)."""

    host: Host

    def start_conversation(self, head: bytes, timeout: float) -> tuple[Optional[Stream], RawRun]:
        ...

    def ended_failure(self, raw: RawRun) -> Optional[TransportError]:
        ...


def first_answer(stream: Stream, timeout: float) -> RawRun:
    """The agent's next line as a run's result: RawRun(0, line) when it came; the ended
    command's run (exit status, stdout, stderr) when it ended first; ``timed_out`` after
    ``timeout``. Other stream failures (a line too long, a connection error) raise."""
    try:
        line = stream.readline(timeout)
    except TransportError:
        if not stream.ended:
            raise
        return stream.ended_run()
    if line is None:
        return RawRun(None, b"", b"", timed_out=True)
    return RawRun(0, line, b"")


class Conversation:
    """The first reply (``reply``), then ``ask`` for each next request; ``close`` ends it
    (stdin closed: the agent ends at EOF). Made by ``Session.converse``."""

    def __init__(self, session: Session, stream: Optional[Stream], reply: AgentReply):
        self.session = session
        self.stream = stream
        self.reply = reply
        self._lock = threading.Lock()  # a request and a cancel are never written interleaved
        self._asked = False
        self._cancelled = False
        self.asked_at: Optional[float] = None  # the clean request's wall-clock time
        self.asked_deadline_s: Optional[float] = None  # the agent's own bound from then
        self.cancelled_at: Optional[float] = None  # when the cancel line was written
        if not reply.ok:
            self.close()

    @classmethod
    def start(cls, session: Session, request: Mapping[str, Any], timeout: float) -> "Conversation":
        """The first request answered; the agent's source left out for a host known to have
        it cached (as Session.run_agent), sent in a second start if that cache is gone."""
        from gpufleet.remote import agent_key, needs_agent
        from gpufleet.transport import knownagents

        started = time.monotonic()
        key = agent_key()
        known = knownagents.holds(session.host, key)
        talk = cls._start_once(session, request, timeout, started, with_agent=not known)
        if known and talk.reply.ok and needs_agent(talk.reply.doc):
            talk.close()
            knownagents.forget(session.host)
            known = False
            left = max(1.0, timeout - (time.monotonic() - started))
            talk = cls._start_once(session, request, left, started, with_agent=True)
        if talk.reply.ok:
            knownagents.note(session.host, key, talk.reply.doc, known)
        return talk

    @classmethod
    def _start_once(cls, session: Session, request: Mapping[str, Any], timeout: float,
                    started: float, with_agent: bool) -> "Conversation":
        from gpufleet.remote import encode_request

        req = dict(with_deadline(request, timeout), stay=True)
        try:
            stream, raw = session.start_conversation(encode_request(req, with_agent), timeout)
        except Exception as exc:  # a failed host is a value, whatever broke
            failed = transport_error(exc)  # a TransportError is returned as it is
            return cls(session, None, AgentReply(False, None, str(failed), None,
                                                 time.monotonic() - started,
                                                 error_kind=failed.kind, unsent=True))
        return cls(session, stream, _reply(session, raw, timeout, time.monotonic() - started))

    def ask(self, request: Mapping[str, Any], timeout: float) -> AgentReply:
        """The agent's answer to ``request``; every failure a value (``unsent``: see the
        module docstring)."""
        started = time.monotonic()
        with self._lock:
            unsent = self._send(request, timeout, started)
            stream = self.stream
        if unsent is not None:
            return unsent
        assert stream is not None  # written just now, under the lock
        try:
            raw = first_answer(stream, timeout)
        except TransportError as exc:
            self.close()
            return AgentReply(False, None, str(exc), None, time.monotonic() - started,
                              error_kind=exc.kind)
        reply = _reply(self.session, raw, timeout, time.monotonic() - started, asked=True)
        if not reply.ok or raw.timed_out:
            self.close()
        return reply

    def _send(self, request: Mapping[str, Any], timeout: float, started: float
              ) -> Optional[AgentReply]:
        """Write the request unless the agent already ended or the operator cancelled: None
        once written, else the unsent reply that says why."""
        from gpufleet.remote import encode_next

        if self._cancelled:
            return _unsent("cancelled (Ctrl-C) before the request was sent", errors.INTERRUPTED)
        if self.stream is None:
            return _unsent("the agent's conversation had already ended", errors.AGENT)
        try:
            self.stream.poll()
            early = self.stream.readline(0)
        except TransportError as exc:
            return self._ended_before(exc, started)
        if early is not None:
            self.close()
            return _unsent(_early_text(early), errors.AGENT)
        bounded = with_deadline(request, timeout)
        try:
            self.stream.send(encode_next(bounded))
        except TransportError as exc:
            return self._ended_before(exc, started)
        self._asked = True
        self.asked_at = time.time()
        deadline = bounded.get("deadline_s")
        self.asked_deadline_s = float(deadline) if isinstance(deadline, (int, float)) else None
        return None

    def cancel(self) -> Optional[str]:
        """Tell the agent answering the request to send no further signal (the operator's
        second Ctrl-C; ``ask`` is waiting on another thread). None once the line is written;
        else why it could not be: then the agent goes on as if never told."""
        from gpufleet.remote import CANCEL_LINE

        with self._lock:
            self._cancelled = True
            stream = self.stream
            if not self._asked:
                return "no request had been sent"
            if stream is None:
                return "its conversation had already ended"
            try:
                stream.send(CANCEL_LINE)
            except Exception as exc:  # a closed or lost stream: whatever broke, said
                return f"its conversation ended: {transport_error(exc)}"
            self.cancelled_at = time.time()
            return None

    def _ended_before(self, exc: TransportError, started: float) -> AgentReply:
        """The agent ended before the request was written whole: the reason, unsent."""
        assert self.stream is not None
        if self.stream.ended:
            raw = self.stream.ended_run()
            failure = self.session.ended_failure(raw)
            exc = failure or exc
        self.close()
        return AgentReply(False, None, f"the agent's conversation ended: {exc}", None,
                          time.monotonic() - started, error_kind=exc.kind, unsent=True)

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                stream.close()
            except Exception:
                pass

    def __enter__(self) -> "Conversation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _unsent(message: str, kind: str) -> AgentReply:
    return AgentReply(False, None, message, None, 0.0, error_kind=kind, unsent=True)


def _early_text(line: bytes) -> str:
    """What an agent wrote while it was not asked anything (its stay_end, normally)."""
    try:
        doc = json.loads(line.decode("utf-8", "replace"))
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("mode") == "stay_end":
        return f"the agent ended its conversation: {doc.get('reason')}"
    return "the agent wrote output nobody asked for: its conversation is broken"


def _reply(session: Session, raw: RawRun, timeout: float, seconds: float, asked: bool = False
           ) -> AgentReply:
    """An answer as ``run_agent`` reads a run (the transport's own failure first), plus what
    only a conversation has: ``stay_end`` and (``asked``: a next request) a refused request
    (``mode`` null) did nothing. The first request's refusal reads as run_agent's does."""
    failure = session.ended_failure(raw)
    if failure is not None:
        return AgentReply(False, None, str(failure), raw.exit_code, seconds, raw.stderr,
                          failure.kind)
    reply = agent_reply(raw, session.host, timeout, seconds)
    doc = reply.doc
    if reply.ok and doc is not None and doc.get("mode") == "stay_end":
        return AgentReply(False, None, f"the agent ended its conversation: {doc.get('reason')}",
                          raw.exit_code, seconds, error_kind=errors.AGENT, unsent=True)
    if asked and reply.ok and doc is not None and doc.get("mode") is None and doc.get("error"):
        return AgentReply(False, doc, f"the agent refused the request: {doc['error']}",
                          raw.exit_code, seconds, error_kind=errors.AGENT, unsent=True)
    return reply
