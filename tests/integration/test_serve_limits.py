"""`gpufleet serve` does not let idle or slow HTTP clients hold its threads.

Each connection is a thread; without bounds, 400 half-sent requests held 400 threads for good.
Against the real server on a loopback port (the server class in this process, where its
threads can be counted, and the `gpufleet serve` command): clients that connect and send
nothing, clients that send part of a request and stall or dribble it a byte at a time, and a
kept-alive client that goes idle are all disconnected within the request timeout (short here:
the suite stays fast; the bounds have seconds of slack), connections past the cap are refused
at once with a 503, the thread count stays bounded, and a normal scrape is answered.
Network traffic: 127.0.0.1 only. Every socket is closed, every loop bounded in time and count.
"""
from __future__ import annotations

import re
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from cli_helpers import assert_one_line_error, home, run_gpufleet, wait_for  # noqa: F401
from gpufleet.core.metrics import ExportOptions
from gpufleet.ops import serve
from test_prometheus_lab import get, start_serve

SLACK_S = 4.0  # on top of the configured timeout: a loaded 2-core runner is slow, never this slow


class Clients:
    """The sockets a test opened, all closed at its end."""

    def __init__(self, port: int):
        self.port, self.socks = port, []  # type: int, list[socket.socket]

    def open(self, first: bytes = b"") -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        self.socks.append(sock)
        if first:
            sock.sendall(first)
        return sock

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def wait_closed(socks: list[socket.socket], bound_s: float, dribble: Optional[list] = None
                ) -> tuple[dict[socket.socket, float], dict[socket.socket, bytes]]:
    """Seconds until the server closed each socket (EOF or reset; missing: still open after
    bound_s) and what it sent first. Sockets in `dribble` send one more header byte every
    0.25 s meanwhile: a per-read timeout alone would never cut them."""
    started, closed, got = time.monotonic(), {}, {s: b"" for s in socks}
    next_drip = started
    for _ in range(int(bound_s / 0.05) + 100):
        now = time.monotonic()
        if len(closed) == len(socks) or now - started > bound_s:
            break
        if dribble and now >= next_drip:
            next_drip = now + 0.25
            for sock in [s for s in dribble if s not in closed]:
                try:
                    sock.send(b"a")
                except OSError:
                    closed[sock] = time.monotonic() - started
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.05)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            got[sock] += data
            if not data:
                closed[sock] = time.monotonic() - started
    return closed, got


def request(sock: socket.socket, path: str = "/metrics") -> tuple[int, dict[str, str], bytes]:
    """One keep-alive GET on an open connection: (status, headers lowercased, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    buf = b""
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in buf and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        assert chunk, f"closed before the answer's head: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (x.partition(":") for x in lines[1:]))
    while len(body) < int(headers["content-length"]) and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        assert chunk, "closed inside the body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
def server() -> Iterator[Any]:
    """start(**limits) -> the real serve HTTP server on 127.0.0.1:0 over a fleet of no hosts
    (one refresh done: /metrics is 200), serving in a thread; shut down and closed after."""
    started: list[tuple[Any, threading.Thread]] = []

    def start(**limits: Any) -> Any:
        exporter = serve.Exporter(serve.Fleet([]), ExportOptions(), None)
        exporter.refresh_once()
        srv = serve.bind("127.0.0.1:0", exporter, serve.Limits(**limits))
        thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                                  daemon=True)
        thread.start()
        started.append((srv, thread))
        return srv

    yield start
    for srv, thread in started:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def port_of(srv: Any) -> int:
    return int(srv.server_address[1])


def scrape(srv: Any) -> tuple[int, bytes]:
    return get(f"http://127.0.0.1:{port_of(srv)}/metrics", timeout=5)


def test_idle_clients_past_the_cap_are_refused_at_once_and_the_rest_time_out(server: Any) -> None:
    srv = server(request_timeout_s=3.0, max_connections=8)
    base = threading.active_count()
    clients = Clients(port_of(srv))
    try:
        idle = [clients.open() for _ in range(7)]
        wait_for(lambda: threading.active_count() >= base + 7, 10, "7 connection threads")
        assert scrape(srv) == (200, srv.exporter.metrics()[1])  # 7 idle ones do not block it
        idle.append(clients.open())  # the cap's worth: 8
        wait_for(lambda: threading.active_count() >= base + 8, 10, "8 connection threads")
        extra = [clients.open() for _ in range(8)]
        closed, got = wait_closed(extra, 2.0)  # well inside the 3 s request timeout
        assert len(closed) == len(extra), f"{len(extra) - len(closed)} of 8 past the cap still open"
        assert all(got[s].startswith(b"HTTP/1.1 503 ") for s in extra), list(got.values())
        assert threading.active_count() <= base + 8, threading.active_count() - base
        closed, _ = wait_closed(idle, 3.0 + SLACK_S)
        assert len(closed) == len(idle), f"{len(idle) - len(closed)} of 8 idle clients kept"
        assert scrape(srv) == (200, srv.exporter.metrics()[1])  # the slots are free again
        wait_for(lambda: threading.active_count() <= base, 10, "the connection threads' end")
    finally:
        clients.close()


def test_many_idle_clients_hold_at_most_the_cap_of_threads(server: Any) -> None:
    """The review's case at a small scale: 48 connections that never send a byte."""
    srv = server(request_timeout_s=1.0, max_connections=8)
    base = threading.active_count()
    clients = Clients(port_of(srv))
    try:
        socks = [clients.open() for _ in range(48)]
        peak, deadline = 0, time.monotonic() + 1.0 + SLACK_S
        closed: dict[socket.socket, float] = {}
        while len(closed) < len(socks) and time.monotonic() < deadline:
            peak = max(peak, threading.active_count() - base)
            closed.update(wait_closed([s for s in socks if s not in closed], 0.1)[0])
        assert len(closed) == len(socks), f"{len(socks) - len(closed)} of 48 idle clients kept"
        assert peak <= 8, f"{peak} connection threads for a cap of 8"
        assert scrape(srv)[0] == 200
    finally:
        clients.close()


def test_slow_clients_are_cut_at_the_request_timeout_even_while_they_dribble(server: Any
                                                                             ) -> None:
    srv = server(request_timeout_s=1.0, max_connections=16)
    base = threading.active_count()
    clients = Clients(port_of(srv))
    try:
        stalled = [clients.open(b"GET /metr") for _ in range(3)]  # half a request line
        headers = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
        dribbling = [clients.open(headers) for _ in range(3)]  # a byte every 0.25 s, forever
        closed, _ = wait_closed(stalled + dribbling, 1.0 + SLACK_S, dribble=dribbling)
        assert set(closed) == set(stalled + dribbling), (
            f"{len(stalled) - len([s for s in stalled if s in closed])} stalled and "
            f"{len(dribbling) - len([s for s in dribbling if s in closed])} dribbling kept")
        assert scrape(srv) == (200, srv.exporter.metrics()[1])
        wait_for(lambda: threading.active_count() <= base, 10, "the connection threads' end")
    finally:
        clients.close()


def test_an_idle_kept_alive_connection_is_closed_and_its_requests_are_bounded(server: Any
                                                                              ) -> None:
    srv = server(request_timeout_s=1.0, max_requests=3)
    clients = Clients(port_of(srv))
    try:
        sock = clients.open()
        for _ in range(2):  # kept alive: the second request on the same connection is answered
            code, headers, body = request(sock)
            assert (code, headers.get("connection"), body) == (200, None, srv.exporter.metrics()[1])
        closed, _ = wait_closed([sock], 1.0 + SLACK_S)  # then idle: closed
        assert sock in closed, "an idle kept-alive connection stayed open"
        sock = clients.open()
        answers = [request(sock, "/healthz") for _ in range(3)]
        assert [(code, h.get("connection")) for code, h, _ in answers] == [
            (200, None), (200, None), (200, "close")]  # the third says it is the last
        assert sock in wait_closed([sock], SLACK_S)[0], "open after its last request"
    finally:
        clients.close()


def test_a_client_that_never_reads_its_answer_is_cut_at_the_write_timeout(server: Any) -> None:
    """A 32 MiB answer to a client with a small receive buffer that reads nothing: the write
    blocks once the buffers are full, until the write timeout ends it and frees the thread."""
    srv = server(write_timeout_s=1.0)
    srv.exporter.body = b"x" * (32 << 20)
    base = threading.active_count()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port_of(srv)))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        wait_for(lambda: threading.active_count() > base, 10, "the connection's thread")
        wait_for(lambda: threading.active_count() <= base, 1.0 + SLACK_S, "the write timeout")


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


@pytest.fixture
def refused_inventory(tmp_path: Path) -> Iterator[Path]:
    """A one-host inventory whose port refuses at once (bound, never listened on)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        inv = tmp_path / "fleet.yaml"
        inv.write_text("hosts:\n  gone:\n    address: 127.0.0.1\n    port: %d\n"
                       "    connect_timeout: 2\n" % taken.getsockname()[1])
        yield inv


def test_gpufleet_serve_refuses_past_its_cap_and_drops_idle_clients(home: Path,
                                                                    refused_inventory: Path
                                                                    ) -> None:
    started, base_url = start_serve(home, refused_inventory, "--max-age", "3600",
                                    "--request-timeout", "1", "--max-connections", "4")
    clients = Clients(int(base_url.rsplit(":", 1)[1]))
    try:
        wait_for(lambda: get(base_url + "/metrics")[0] == 200, 60, "the first refresh")
        time.sleep(0.5)  # the refresh's own threads have ended
        base = threads_of(started.pid)
        idle = [clients.open() for _ in range(4)]
        wait_for(lambda: threads_of(started.pid) >= base + 4, 10, "4 connection threads")
        extra = [clients.open() for _ in range(6)]
        closed, got = wait_closed(extra, 1.0 + SLACK_S)
        assert all(got[s].startswith(b"HTTP/1.1 503 ") for s in extra), list(got.values())
        assert threads_of(started.pid) <= base + 4, threads_of(started.pid) - base
        closed, _ = wait_closed(idle, 1.0 + SLACK_S)
        assert len(closed) == len(idle), f"{len(idle) - len(closed)} of 4 idle clients kept"
        code, body = get(base_url + "/metrics")
        assert code == 200 and b'gpufleet_up{Hostname="",host="gone",reason="refused"} 0' in body
    finally:
        clients.close()
        assert started.stop() == 0


@pytest.mark.parametrize("args, fragment", [
    (["--request-timeout", "0"], "--request-timeout '0': must be a positive number"),
    (["--request-timeout", "soon"], "--request-timeout 'soon': not a number"),
    (["--max-connections", "0"], "--max-connections '0': expected a whole number"),
    (["--max-connections", "many"], "--max-connections 'many': expected a whole number"),
])
def test_bad_limits_are_one_line_and_exit_2(home: Path, refused_inventory: Path, args: list,
                                            fragment: str) -> None:
    run = run_gpufleet(home, refused_inventory, "serve", "--listen", "127.0.0.1:0", *args,
                       timeout=60)
    assert_one_line_error(run, fragment)


def test_the_commands_defaults_are_the_documented_limits() -> None:
    """--request-timeout 5 and --max-connections 64 (click's defaults, kept as text so the
    command's module loads without ops.serve) are ops.serve's Limits()."""
    from gpufleet.cli.export_cmd import serve as command

    defaults = {p.name: p.default for p in command.params}
    limits = serve.parse_limits(defaults["request_timeout"], defaults["max_connections"])
    assert limits == serve.Limits() == serve.Limits(5.0, 64, 100, 30.0)
