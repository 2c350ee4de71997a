"""A live fleet: one persistent session per host, its agent resident in watch mode.

Each host has a thread that opens the host's session, starts the agent's watch mode
(gpufleet/remote/watch.py: a snapshot line per interval) and keeps it alive with a keep-alive
line; the latest snapshot per host is published as a ``core.live.LiveHost`` value. A session
that drops (EOF, an error, no line for too long) is closed, the host shows stale with the age
of its last snapshot, and it is reconnected with exponential backoff. ``stop()`` closes every
stream: the agents see stdin close and end themselves (and would, by their keep-alive
deadline, if this process died without closing anything). Values only, no UI.

At most ``forks`` hosts connect at a time (the CLI's --forks, as `status` runs its hosts): a
host holds one of those slots from its session's open until its first line (or its failure),
then stays resident without one, so a large fleet starts in waves (ssh processes, handshakes,
a jump host's MaxStartups) as `status` does, instead of all at once. A reconnect takes a
slot too.
"""
from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.core.live import LiveHost, stale_after
from gpufleet.core.results import Failure
from gpufleet.errors import TransportError, first_line, kind_of
from gpufleet.ops.collect import result_from_reply, snapshot_request
from gpufleet.transport import AgentReply, Session, Stream, open_session

if TYPE_CHECKING:  # the model loads with the first snapshot (core.live)
    from gpufleet.core.model import HostResult

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


def watch_request(host: Host, interval_s: float, hold_first_s: float = 0.0) -> dict[str, Any]:
    """The watch-mode request: each snapshot bounded well inside the session's patience,
    and a keep-alive deadline a few intervals long (at least 5 s); ``hold_first_s``: the
    agent waits for ``go`` after its first snapshot (remote/watch.py), at most that long."""
    req = snapshot_request(host)
    deadline = min(float(req["deadline_s"]), max(10.0, 5.0 * interval_s))
    req.update(mode="watch", interval_s=float(interval_s), deadline_s=deadline,
               smi_timeout_s=min(float(req["smi_timeout_s"]), deadline / 2),
               keepalive_s=keepalive_for(interval_s))
    if hold_first_s > 0:
        req["hold_first_s"] = float(hold_first_s)
    return req


def keepalive_for(interval_s: float) -> float:
    return max(5.0, 3.0 * interval_s)


def _every_one_answered(views: Any) -> bool:
    return all(v.result is not None or v.failure is not None for v in views)


class LiveFleet:
    """Hosts' latest snapshots, kept fresh by one session each; a context manager."""

    def __init__(self, hosts: Sequence[Host], interval_s: float,
                 clock: Callable[[], float] = time.monotonic, forks: Optional[int] = None,
                 session_factory: Optional[Callable[[Host], Session]] = None,
                 on_result: Optional[Callable[[HostResult], None]] = None,
                 hold_first_s: float = 0.0):
        self.hosts = list(hosts)
        # > 0: each agent holds its second snapshot until every host has answered (then it is
        # sent ``go``), at most this long: early hosts' refreshes would otherwise compete with
        # the hosts still connecting and delay the first full view
        self.hold_first_s = max(0.0, float(hold_first_s))
        self._all_answered = threading.Event()
        self._go_sent: set[str] = set()  # hosts whose agent was sent ``go`` (this session)
        self.interval_s = float(interval_s)
        self.clock = clock
        self.forks = max(1, int(forks)) if forks else max(1, len(self.hosts))
        self._open_session = session_factory  # None: transport.open_session
        # called in the host's thread with each new snapshot before it is published (the CLI
        # renders the host's part of the next document there, not after the last host)
        self._on_result = on_result
        self._connecting = 0  # hosts between a session's open and its first line
        self._slot_free = threading.Condition()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._views = {h.name: LiveHost(h.name, stale_after_s=stale_after(interval_s))
                       for h in self.hosts}
        self._streams: dict[str, Stream] = {}
        self._threads: list[threading.Thread] = []
        self.generation = 0  # bumped on every change (the screen redraws on it)

    def __enter__(self) -> "LiveFleet":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        for host in self.hosts:
            thread = threading.Thread(target=self._run_host, args=(host,), daemon=True,
                                      name=f"gpufleet-live-{host.name}")
            thread.start()
            self._threads.append(thread)

    def stop(self, wait_s: float = 3.0) -> None:
        """Close every stream (the agents end on EOF); wait a little for the threads."""
        self._stop.set()
        with self._slot_free:
            self._slot_free.notify_all()
        with self._lock:
            streams = list(self._streams.values())
            self._lock.notify_all()
        for stream in streams:
            stream.close()
        end = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    def view(self) -> list[LiveHost]:
        """Every host's latest value, in inventory order."""
        with self._lock:
            return [self._views[h.name] for h in self.hosts]

    def wait_change(self, generation: int, timeout: float) -> int:
        """Block until the generation moves past ``generation`` (or ``timeout``)."""
        with self._lock:
            if self.generation == generation and not self._stop.is_set():
                self._lock.wait(timeout)
            return self.generation

    def answered(self) -> bool:
        """Every host has a snapshot or a failure (the first full screen)."""
        return _every_one_answered(self.view())

    # ------------------------------------------------------------------ per host

    def _publish(self, name: str, **changes: Any) -> None:
        from dataclasses import replace

        held: list[Stream] = []
        with self._lock:
            self._views[name] = replace(self._views[name], **changes)
            self.generation += 1
            if not self._all_answered.is_set() and _every_one_answered(self._views.values()):
                self._all_answered.set()  # the first round is over: every held agent may go
                held = [s for n, s in self._streams.items() if n not in self._go_sent]
                self._go_sent.update(self._streams)
            self._lock.notify_all()
        if self.hold_first_s > 0:
            for stream in held:
                self._send_go(stream)

    @staticmethod
    def _send_go(stream: Stream) -> None:
        try:
            stream.send(b"go\n")  # also a keep-alive; a stream gone is its own thread's news
        except Exception:
            pass

    def _run_host(self, host: Host) -> None:
        backoff = BACKOFF_FIRST_S
        sessions = 0
        while not self._stop.is_set():
            if sessions:
                self._publish(host.name, reconnects=sessions)
            sessions += 1
            got_one = self._one_session(host)
            if self._stop.is_set():
                return
            backoff = BACKOFF_FIRST_S if got_one else min(BACKOFF_MAX_S, backoff * 2)
            self._publish(host.name, retry_at=self.clock() + backoff)
            if self._stop.wait(backoff):
                return

    def _take_slot(self) -> bool:
        """Wait for one of the ``forks`` connect slots; False once stopping."""
        with self._slot_free:
            while self._connecting >= self.forks and not self._stop.is_set():
                self._slot_free.wait()
            if self._stop.is_set():
                return False
            self._connecting += 1
            return True

    def _slot_giver(self) -> Callable[[], None]:
        """Gives the slot taken back, once, however often it is called."""
        held = [True]

        def give() -> None:
            if held[0]:
                held[0] = False
                with self._slot_free:
                    self._connecting -= 1
                    self._slot_free.notify()
        return give

    def _one_session(self, host: Host) -> bool:
        """One session until it drops; True when it gave at least one snapshot. The connect
        slot is held until the first line (or the end)."""
        session: Optional[Session] = None
        got = False
        if not self._take_slot():
            return False
        give_slot = self._slot_giver()
        try:
            session = (self._open_session or open_session)(host)
            if session.error is not None:
                raise TransportError(session.error, kind=session.error_kind or errors.CLOSED)
            got = self._stream_host(host, session, give_slot)
        except Exception as exc:  # a failed host is a value, whatever broke
            if not self._stop.is_set():
                self._publish(host.name, failure=Failure(kind_of(exc), first_line(exc)[:300]))
        finally:
            give_slot()
            with self._lock:
                stream = self._streams.pop(host.name, None)
            if stream is not None:
                stream.close()
            if session is not None:
                session.close()
        return got

    def _stream_host(self, host: Host, session: Session, first_line: Callable[[], None]) -> bool:
        request = watch_request(host, self.interval_s, self.hold_first_s)
        stream = session.stream_agent(request, timeout=float(host.connect_timeout or 10))
        with self._lock:
            if self._stop.is_set():
                stream.close()
                return False
            self._streams[host.name] = stream
            self._go_sent.discard(host.name)  # a new agent: held until its own go
        every = min(self.interval_s, request["keepalive_s"] / 4)
        patience = request["deadline_s"] + self.interval_s + 5.0
        last_line = last_sent = time.monotonic()
        got = False
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_sent >= every:
                stream.send(b"\n")
                last_sent = now
            line = stream.readline(timeout=max(0.05, last_sent + every - now))
            if line is None:
                if time.monotonic() - last_line > patience:
                    raise TransportError(f"no snapshot for {patience:.0f}s", kind=errors.COMMAND)
                continue
            last_line = time.monotonic()
            first_line()  # the connect slot goes to the next host waiting
            self._take_line(host, line)
            if not got and self.hold_first_s > 0:
                self._go_if_round_over(host.name, stream)
            got = True
        return got

    def _go_if_round_over(self, name: str, stream: Stream) -> None:
        """A host's first line after the first round (a late or reconnected host): go now."""
        with self._lock:
            if not self._all_answered.is_set() or name in self._go_sent:
                return
            self._go_sent.add(name)
        self._send_go(stream)

    def _take_line(self, host: Host, line: bytes) -> None:
        try:
            doc = json.loads(line.decode("utf-8", "replace"))
        except ValueError:
            raise TransportError(f"agent output is not JSON: {line[:80]!r}",
                                 kind=errors.AGENT) from None
        if not isinstance(doc, dict):
            raise TransportError("agent output is not a JSON object", kind=errors.AGENT)
        if doc.get("mode") == "watch_end":
            raise TransportError(f"agent ended: {doc.get('reason')}", kind=errors.COMMAND)
        took = doc.get("seconds")
        took = float(took) if isinstance(took, (int, float)) else 0.0
        result = result_from_reply(host, AgentReply(True, doc), time.monotonic() - took)
        if not result.ok:
            self._publish(host.name, failure=result.failure)
            return
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:  # a head start only: the document is made without it too
                pass
        self._publish(host.name, result=result, received_at=self.clock(), failure=None,
                      retry_at=None)
