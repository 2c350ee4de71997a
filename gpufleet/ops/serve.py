"""`gpufleet serve`: /metrics from a cached fleet snapshot, refreshed in the background over
persistent per-host sessions.

Each host keeps one SSH connection (transport.Session) for as long as serve runs; a refresh
re-runs the one-shot agent on it (one exec), so neither a refresh nor a scrape pays for
handshakes. A session whose host could not be reached, or whose connection was lost, is
closed and opened afresh on the next refresh (every such host's TCP connect starts at once,
transport.predial). After each refresh the exposition text is rendered once; a scrape only
copies those bytes, so it never waits for a host. No endpoint changes anything: GET and HEAD
of /metrics, /healthz and / only.
"""
from __future__ import annotations

import json
import socket
import threading
import time
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
from gpufleet.transport import Dialled, Session, open_session, predial

DEFAULT_LISTEN = "127.0.0.1:9835"
DEFAULT_MAX_AGE_S = 15.0  # Prometheus's usual scrape interval
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


def parse_max_age(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"--max-age {text!r}: not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise UsageError(f"--max-age {text!r}: must be a positive number of seconds")
    return value


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

    def _snapshot(self, host: Host, dial: Optional[Dialled]) -> tuple[HostResult, float]:
        taken = time.time()
        started = time.monotonic()
        try:
            if self._needs_session(host):
                self.drop(host.name)
                session = open_session(host, dial, keep=True)
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
        with predial(need, self.forks) as dials:
            def one(host: Host) -> HostResult:
                result, taken[host.name] = self._snapshot(host, dials.take(host))
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


def _handler(exporter: Exporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "gpufleet"
        protocol_version = "HTTP/1.1"

        def _answer(self, head_only: bool) -> None:
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

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a scrape every few seconds is not news

    return Handler


def bind(listen: str, exporter: Exporter) -> ThreadingHTTPServer:
    """The HTTP server bound to ``listen`` (UsageError when it cannot be: in use, no such
    address); nothing has been contacted yet."""
    host, port = parse_listen(listen)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--listen {listen}: {exc.strerror or exc}") from None
    family, address = infos[0][0], (str(infos[0][4][0]), int(infos[0][4][1]))

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        allow_reuse_address = True

    try:
        return Server(address, _handler(exporter))
    except OSError as exc:
        raise UsageError(f"--listen {listen}: {exc.strerror or exc}") from None
