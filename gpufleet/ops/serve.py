"""`gpufleet serve`: /metrics from a cached fleet snapshot, refreshed in the background over
persistent per-host sessions.

Each host keeps one SSH connection (transport.Session) for as long as serve runs; a refresh
re-runs the one-shot agent on it (one exec), so neither a refresh nor a scrape pays for
handshakes. A session whose host could not be reached, or whose connection was lost, is
closed and opened afresh on the next refresh (every such host's TCP connect starts at once,
transport.predial). After each refresh the exposition text is rendered once; a scrape only
copies those bytes, so it never waits for a host. No endpoint changes anything: GET and HEAD
of /metrics, /healthz and / only. Each HTTP connection is a thread, bounded by Limits (a
request timeout, a connection cap, requests per connection, a write timeout), so idle or slow
clients cannot hold threads for good.
"""
from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.core.metrics import ExportOptions, RefreshStats
from gpufleet.core.model import HostResult
from gpufleet.errors import UsageError, first_line, kind_of
from gpufleet.ops.collect import result_from_reply, snapshot_request
from gpufleet.ops.export import families_for
from gpufleet.ops.fanout import run_hosts
from gpufleet.render.prometheus import CONTENT_TYPE, exposition
from gpufleet.transport import Session, open_session, predial

DEFAULT_LISTEN = "127.0.0.1:9835"
DEFAULT_MAX_AGE_S = 15.0  # Prometheus's usual scrape interval
# What one HTTP client may hold of serve, where each connection is a thread (Limits).
DEFAULT_REQUEST_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 64
MAX_REQUESTS_PER_CONNECTION = 100
WRITE_TIMEOUT_S = 30.0
_BUSY_BODY = b"gpufleet: too many connections; try again\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
        % (len(_BUSY_BODY), _BUSY_BODY))
# kinds after which the connection is not worth keeping: open a new one next time
RECONNECT_KINDS = errors.UNREACHABLE_KINDS | {errors.BANNER, errors.HANDSHAKE, errors.SSH,
                                              errors.HOSTKEY, errors.AUTH, errors.SSHCONFIG}


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` (port 0: any free port) -> (host, port); UsageError."""
    value = (text or "").strip()
    head, sep, port_text = value.rpartition(":")
    if value.startswith("["):
        host = head[1:-1] if head.endswith("]") else ""
    else:
        host = head if ":" not in head else ""
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--listen {text!r}: expected HOST:PORT (e.g. {DEFAULT_LISTEN}, "
                         "[::1]:9835)")
    return host, int(port_text)


def _seconds(option: str, text: str) -> float:
    """A positive, finite number of seconds; UsageError (one line) naming the option."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"{option} {text!r}: not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{option} {text!r}: must be a positive number of seconds")
    return value


def parse_max_age(text: str) -> float:
    return _seconds("--max-age", text)


def parse_limits(request_timeout: str, max_connections: str) -> Limits:
    """--request-timeout and --max-connections, checked before anything is bound or contacted."""
    timeout = _seconds("--request-timeout", request_timeout)
    text = (max_connections or "").strip()
    if not text.isdigit() or not 0 < int(text) <= 10000:
        raise UsageError(f"--max-connections {max_connections!r}: expected a whole number from 1 "
                         "to 10000")
    return Limits(request_timeout_s=timeout, max_connections=int(text))


@dataclass(frozen=True)
class Limits:
    """What one HTTP client may hold of serve. Each connection is a thread: unbounded, clients
    that connect and never finish a request held a thread each for good (400 half-sent
    requests held 400 threads).

    request_timeout_s: a request's line and headers arrive whole within this, counted from the
    connection's start or from the previous answer, so it is also how long a kept-alive
    connection may sit idle. 5 s: a scraper sends its few hundred bytes at once, so 5 s is a
    slow network's round trip many times over, and a stalled client holds a thread no longer.
    max_connections: connections at once; one more gets a 503 and is closed at once, never
    queued. 64: Prometheus holds one per target (two for an HA pair), which leaves room for
    people's curls, while 64 threads are small next to the refresh's own (--forks).
    max_requests: answers per kept-alive connection (the last says `Connection: close`), so
    no connection is held for good by a client that keeps asking.
    write_timeout_s: an answer's whole write; 30 s is thrice Prometheus's default
    scrape_timeout: a client that reads slower has given up already.
    """

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_requests: int = MAX_REQUESTS_PER_CONNECTION
    write_timeout_s: float = WRITE_TIMEOUT_S


class Fleet:
    """The hosts' persistent sessions (one each, reopened when lost) and their last Hostname."""

    def __init__(self, hosts: Sequence[Host], forks: int = 32):
        self.hosts = list(hosts)
        self.forks = forks
        self.sessions: dict[str, Session] = {}
        self.opened = 0  # sessions opened so far (one per host, unless dropped)
        self.hostnames: dict[str, str] = {}  # last Hostname each host reported
        self._lock = threading.Lock()

    def _needs_session(self, host: Host) -> bool:
        session = self.sessions.get(host.name)
        return session is None or session.error is not None

    def _snapshot(self, host: Host) -> tuple[HostResult, float]:
        taken = time.time()
        started = time.monotonic()
        try:
            if self._needs_session(host):
                self.drop(host.name)
                session = open_session(host, keep=True)
                with self._lock:
                    self.sessions[host.name] = session
                    self.opened += 1
            session = self.sessions[host.name]
            reply = session.run_agent(snapshot_request(host), timeout=float(host.command_timeout))
        except Exception as exc:  # a failed host is a value, whatever broke
            self.drop(host.name)
            return HostResult(host=host.name, ok=False, error=first_line(exc)[:300],
                              seconds=time.monotonic() - started, error_kind=kind_of(exc)), taken
        if not reply.ok and reply.error_kind in RECONNECT_KINDS:
            self.drop(host.name)
        return result_from_reply(host, reply, started), taken

    def drop(self, name: str) -> None:
        with self._lock:
            session = self.sessions.pop(name, None)
        if session is not None:
            session.close()

    def refresh(self) -> tuple[list[HostResult], dict[str, float]]:
        """One snapshot of every host over its held session (one exec each)."""
        need = [h for h in self.hosts if self._needs_session(h)]
        taken: dict[str, float] = {}
        with predial(need, self.forks):
            def one(host: Host) -> HostResult:
                result, taken[host.name] = self._snapshot(host)
                return result
            out = run_hosts(self.hosts, one, forks=self.forks)
        results = [r if isinstance(r, HostResult) else HostResult(
            host=h.name, ok=False, error=str(r), error_kind=errors.INTERNAL)
            for h, r in zip(self.hosts, out)]
        for r in results:
            if r.snapshot is not None and r.snapshot.facts.hostname:
                self.hostnames[r.host] = r.snapshot.facts.hostname
        return results, taken

    def close(self) -> None:
        for name in list(self.sessions):
            self.drop(name)


class Exporter:
    """The refresh loop and what the endpoints answer (thread-safe: one lock, immutable bytes)."""

    def __init__(self, fleet: Fleet, opts: ExportOptions, audit_log: Optional[str],
                 max_age_s: float = DEFAULT_MAX_AGE_S):
        self.fleet, self.opts, self.audit_log, self.max_age_s = fleet, opts, audit_log, max_age_s
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.body: Optional[bytes] = None
        self.health: dict[str, Any] = {"ok": False, "error": "first refresh still running"}
        self.refreshed_at: Optional[float] = None  # time.time() at the last refresh's start
        self.counts = {"ok": 0, "failed": 0}

    def refresh_once(self) -> float:
        """One refresh: snapshots, then the rendered text; returns its duration."""
        started, began = time.monotonic(), time.time()
        try:
            results, taken = self.fleet.refresh()
            up = sum(1 for r in results if r.ok and r.snapshot is not None)
            ok = up > 0 or not results
            seconds = time.monotonic() - started
            self.counts["ok" if ok else "failed"] += 1
            stats = RefreshStats(seconds, time.time(), self.counts["ok"], self.counts["failed"])
            body = exposition(families_for(self.fleet.hosts, results, taken, self.opts,
                                           self.audit_log, stats, self.fleet.hostnames))
            health = {"ok": ok, "error": None if ok else "no host answered",
                      "hosts": len(results), "hosts_up": up, "refresh_seconds": round(seconds, 3)}
        except Exception as exc:  # never the loop's end: the next refresh tries again
            self.counts["failed"] += 1
            with self.lock:
                self.health = dict(self.health, ok=False, error=f"refresh failed: {first_line(exc)}")
            return time.monotonic() - started
        with self.lock:
            self.body, self.health, self.refreshed_at = body, health, began
        return seconds

    def run(self) -> None:
        """Refresh so that the snapshot served is never older than max_age: the next refresh
        starts early enough to end (at the last one's pace) before the current one ages out."""
        while not self.stop.is_set():
            began = time.monotonic()
            seconds = self.refresh_once()
            wait = self.max_age_s - 1.25 * seconds - (time.monotonic() - began - seconds)
            self.stop.wait(max(0.0, wait))

    def metrics(self) -> tuple[int, bytes]:
        with self.lock:
            body = self.body
        if body is None:
            return 503, b"gpufleet: the first refresh is still running\n"
        return 200, body

    def healthz(self) -> tuple[int, bytes]:
        """200 when the last refresh succeeded and its snapshot is within max-age (plus the
        time a refresh takes), else 503; the body says which, as JSON."""
        with self.lock:
            doc = dict(self.health)
            at = self.refreshed_at
        age = None if at is None else max(0.0, time.time() - at)
        doc["age_seconds"] = None if age is None else round(age, 3)
        doc["max_age_seconds"] = self.max_age_s
        if doc.get("ok") and age is not None and age > 2 * self.max_age_s:
            doc["ok"], doc["error"] = False, "snapshot older than twice --max-age: refresh is stuck"
        return (200 if doc.get("ok") else 503), (json.dumps(doc, sort_keys=True) + "\n").encode()


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each given the time left until the deadline as its timeout: a
    timeout per read alone lets a client that sends a byte every few seconds hold on forever."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline = 0.0  # time.monotonic() by which the request's head must have arrived

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("no whole request within the request timeout")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class BoundedHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive within the server's Limits: each request's line and headers arrive
    within request_timeout_s of the connection's start or of the previous answer, at most
    max_requests answers per connection, each answer written within write_timeout_s."""

    protocol_version = "HTTP/1.1"
    server: BoundedServer

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own buffered file: replaced by one with a deadline
        self.reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)
        self.last = False  # the connection's last request: its answer says so

    def handle(self) -> None:
        """Requests until a timeout, the client or max_requests ends the connection."""
        limits = self.server.limits
        for number in range(1, limits.max_requests + 1):
            self.last = number == limits.max_requests
            self.reader.deadline = time.monotonic() + limits.request_timeout_s
            self.handle_one_request()  # a timeout, the client's EOF or its wish: close_connection
            if self.close_connection:
                return

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the headers have been read: now the answer is written
        self.connection.settimeout(self.server.limits.write_timeout_s)
        return ok

    def end_headers(self) -> None:
        if self.last and not self.close_connection:
            self.send_header("Connection", "close")  # the client learns this was the last
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds, or a client cut at its timeout, is not news


class _Handler(BoundedHandler):
    """What serve answers: GET and HEAD of /metrics, /healthz and /; nothing changes anything."""

    server_version = "gpufleet"

    def _answer(self, head_only: bool) -> None:
        exporter = self.server.exporter
        path = self.path.split("?", 1)[0]
        ctype = "text/plain; charset=utf-8"
        if path == "/metrics":
            code, body = exporter.metrics()
            ctype = CONTENT_TYPE if code == 200 else ctype
        elif path == "/healthz":
            (code, body), ctype = exporter.healthz(), "application/json"
        elif path == "/":
            code, body = 200, b"gpufleet exporter: /metrics, /healthz\n"
        else:
            code, body = 404, b"not found: /metrics, /healthz\n"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head_only:
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._answer(False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(True)

    def _refuse(self) -> None:
        body = b"read-only: GET or HEAD only\n"
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815


def _turn_away(request: socket.socket) -> None:
    """A 503 to a connection past the cap, if its send buffer takes it at once (it always has
    room for these few bytes unless the client is gone); never waits."""
    try:
        request.setblocking(False)
        request.send(BUSY)
    except OSError:
        pass


class BoundedServer(ThreadingHTTPServer):
    """One thread per connection, at most limits.max_connections of them: one more is answered
    503 and closed at once by the accepting thread, never queued behind those holding the
    threads (whom the request timeout ends soon)."""

    daemon_threads = True
    allow_reuse_address = True
    # accepted at once (served or turned away), so a burst waits a moment in the kernel's queue
    # instead of having its connects dropped and retried a second later
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], exporter: Exporter, limits: Limits):
        self.exporter, self.limits = exporter, limits
        self.connections = 0  # open now, a thread each
        self.refused = 0  # turned away at the cap so far
        self._count_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count_lock:
            full = self.connections >= self.limits.max_connections
            self.connections += 0 if full else 1
            self.refused += 1 if full else 0
        if full:
            _turn_away(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread was started: its slot is free again
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count_lock:
            self.connections -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up or was cut is not news; anything else is one line on stderr,
        never a traceback per connection."""
        exc = sys.exc_info()[1]
        if exc is not None and not isinstance(exc, OSError):
            sys.stderr.write(f"gpufleet: serve: answering {client_address[0]}: "
                             f"{first_line(exc)}\n")


def bind(listen: str, exporter: Exporter, limits: Limits = Limits()) -> BoundedServer:
    """The HTTP server bound to ``listen`` (UsageError when it cannot be: in use, no such
    address); nothing has been contacted yet."""
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--listen {listen}: {exc.strerror or exc}") from None
    family, address = infos[0][0], (str(infos[0][4][0]), int(infos[0][4][1]))

    class Server(BoundedServer):
        address_family = family

    try:
        return Server(address, exporter, limits)
    except OSError as exc:
        raise UsageError(f"--listen {listen}: {exc.strerror or exc}") from None
