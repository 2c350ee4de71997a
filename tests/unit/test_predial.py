"""transport.dial.Predial: every host's TCP connect at once; sockets nobody takes are closed.

Real loopback TCP listeners stand in for the hosts (a pre-dial is a plain TCP connect; the
SSH side is tested against the lab's sshd in tests/integration/test_predial_lab.py). Whether
a socket was closed is read where it counts: on the server's end (EOF).
"""
from __future__ import annotations

import select
import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest

from gpufleet.errors import TransportError
from gpufleet.transport import connection, dial as predialling, keyscan
from gpufleet.transport.dial import Predial


@pytest.fixture(autouse=True)
def home(tmp_path: Any, monkeypatch: Any) -> Any:
    """An empty HOME: connection_for reads ~/.ssh/config."""
    (tmp_path / ".ssh").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def host(name: str, port: int, **extra: Any) -> Any:
    fields = dict(name=name, address="127.0.0.1", port=port, user="root",
                  host_key_policy="strict", connect_timeout=10.0, identity_file=None,
                  known_hosts_file=None, explicit=frozenset({"connect_timeout"}),
                  connection="ssh", ssh_client="paramiko")  # pre-dialling is paramiko's
    fields.update(extra)
    return SimpleNamespace(**fields)


@pytest.fixture
def listeners():
    made: list[socket.socket] = []

    def make(n: int, backlog: int = 16) -> list[socket.socket]:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(backlog)
            made.append(s)
        return made[-n:]

    yield make
    for s in made:
        s.close()


def accept(listener: socket.socket, timeout: float = 10.0) -> socket.socket:
    listener.settimeout(timeout)
    conn, _ = listener.accept()
    return conn


def accepted_now(listener: socket.socket) -> bool:
    """A connection is waiting in the accept queue (then accepts it, to keep the count)."""
    return bool(select.select([listener], [], [], 0)[0])


def server_sees_eof(conn: socket.socket, timeout: float = 10.0) -> bool:
    conn.settimeout(timeout)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def still_open(conn: socket.socket) -> bool:
    """Nothing to read on the server's end: the client has not closed it."""
    return not select.select([conn], [], [], 0.3)[0]


def port_of(listener: socket.socket) -> int:
    return listener.getsockname()[1]


@pytest.fixture
def made(monkeypatch):
    """Every connection the dial threads make, kept referenced: a socket dropped without
    close() would otherwise be closed by the garbage collector and hide the leak."""
    conns: list = []
    real = predialling.dial_host

    def keep(h: Any) -> Any:
        conn = real(h)
        conns.append(conn)
        return conn

    monkeypatch.setattr(predialling, "dial_host", keep)
    return conns


def test_untaken_sockets_are_closed_and_the_taken_one_is_left_alone(listeners, made) -> None:
    ls = listeners(3)
    hosts = [host("h%d" % i, port_of(s)) for i, s in enumerate(ls)]
    with Predial(hosts, forks=1) as dials:
        # every host is dialled at once although forks is 1
        servers = [accept(s) for s in ls]
        taken = dials.take(hosts[0])
        conn = taken.result(timeout=10)
        assert conn.predialed
    # close(): the two sockets nobody took are closed, the taken one is the taker's
    assert [server_sees_eof(s) for s in servers[1:]] == [True, True]
    assert still_open(servers[0])
    conn.close()  # the taker's to use; closing its connection closes it
    assert server_sees_eof(servers[0])
    for s in servers:
        s.close()


def test_connection_close_closes_an_unused_predialed_socket(listeners) -> None:
    (ls,) = listeners(1)
    h = host("h0", port_of(ls))
    with Predial([h]) as dials:
        conn = dials.take(h).result(timeout=10)
    server = accept(ls)
    assert still_open(server)
    conn.close()  # never opened (e.g. the worker failed before the handshake)
    assert server_sees_eof(server)
    server.close()


def test_a_connect_that_completes_after_close_is_closed(listeners, made) -> None:
    """A blackholed connect (accept queue full: the kernel drops the SYN) is in flight when
    close() comes; once the queue has room the SYN retry connects, and the dial thread, seeing
    close(), closes that socket at once."""
    (ls,) = listeners(1, backlog=0)
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port_of(ls)))
        except BlockingIOError:
            pass
        fillers.append(c)
    time.sleep(0.1)
    h = host("late", port_of(ls))
    dials = Predial([h])
    time.sleep(0.3)  # the dial is in SYN_SENT
    dials.close()
    assert dials.take(h) is None  # nothing is handed out after close()
    # make room: accept and drop the fillers; the dial's SYN retry (1 s, 3 s) gets through
    ls.settimeout(10)
    late = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        server = accept(ls)
        if server.getpeername()[1] not in {c.getsockname()[1] for c in fillers}:
            late = server
            break
        server.close()
    assert late is not None, "the dial never connected"
    assert server_sees_eof(late), "the dial that ended after close() left its socket open"
    late.close()
    for c in fillers:
        c.close()


def test_a_failed_dial_is_the_hosts_error(listeners) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: refused
    try:
        h = host("dead", dead.getsockname()[1])
        with Predial([h]) as dials:
            exc = dials.take(h).exception(timeout=10)
        assert isinstance(exc, TransportError)
        assert str(exc) == "connection refused by 127.0.0.1:%d" % dead.getsockname()[1]
    finally:
        dead.close()


def test_local_hosts_and_jump_hosts_are_not_dialled(listeners, home) -> None:
    (ls,) = listeners(1)
    # ssh_config is looked up by the address, as `ssh behind` would
    (home / ".ssh" / "config").write_text("Host behind\n  HostName 127.0.0.1\n  ProxyJump jumpbox\n")
    local = host("here", port_of(ls), connection="local")
    jumped = host("behind", port_of(ls), address="behind")
    with Predial([local, jumped]) as dials:
        assert dials.take(local) is None
        conn = dials.take(jumped).result(timeout=10)
        # the jump is an SSH session: it is dialled by open(), inside the forks bound
        assert conn.gateway is not None and not conn.predialed
        conn.close()
    assert not accepted_now(ls)


def test_a_stale_socket_is_dialled_again(listeners, monkeypatch) -> None:
    """One that waited past PREDIAL_FRESH_S for a slot may have been dropped by sshd."""
    (ls,) = listeners(1)
    h = host("h0", port_of(ls))
    with Predial([h]) as dials:
        conn = dials.take(h).result(timeout=10)
    server = accept(ls)
    monkeypatch.setattr(connection, "PREDIAL_FRESH_S", 0.0)
    assert conn.take_predialed() is None
    assert server_sees_eof(server)
    server.close()
    conn.close()


def test_descriptor_budget_bounds_the_sockets_held(listeners, monkeypatch) -> None:
    """With room for 2 sockets, 2 hosts are dialled; each one taken lets the next one dial
    (no deadlock: hosts are dialled in the order workers take them)."""
    monkeypatch.setattr(predialling, "_fd_budget", lambda forks: 2)
    ls = listeners(4)
    hosts = [host("h%d" % i, port_of(s)) for i, s in enumerate(ls)]
    with Predial(hosts, forks=1) as dials:
        servers = [accept(ls[0]), accept(ls[1])]
        time.sleep(0.5)
        assert not accepted_now(ls[2]) and not accepted_now(ls[3])
        conns = []
        for i, h in enumerate(hosts):
            conns.append(dials.take(h).result(timeout=10))
            if i + 2 < len(ls):
                servers.append(accept(ls[i + 2]))
        assert all(c.predialed for c in conns)
    for c in conns:
        c.close()
    assert all(server_sees_eof(s) for s in servers)
    for s in servers:
        s.close()


def test_fetch_host_key_uses_the_predialled_socket(listeners) -> None:
    """`gpufleet trust` hands fetch_host_key its pre-dialled connection: the key exchange
    starts on that socket (the client's SSH banner arrives there) and no second connect is
    made; a server that never answers makes it fail within its own connect_timeout."""
    (ls,) = listeners(1)
    h = host("h0", port_of(ls), connect_timeout=1.0)
    with Predial([h]) as dials:
        server = accept(ls)  # the pre-dial
        dial = dials.take(h)
        with pytest.raises(TransportError):
            keyscan.fetch_host_key(h, dial)
    server.settimeout(5)
    assert server.recv(8) == b"SSH-2.0-"
    assert not accepted_now(ls)
    server.close()


def test_fetch_host_key_reports_the_dial_failure() -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    try:
        h = host("dead", dead.getsockname()[1])
        with Predial([h]) as dials:
            with pytest.raises(TransportError, match="connection refused by 127.0.0.1:%d"
                               % dead.getsockname()[1]):
                keyscan.fetch_host_key(h, dials.take(h))
    finally:
        dead.close()


def test_openssh_hosts_are_left_to_ssh_unless_asked(home: Any) -> None:
    """OpenSSH connects by itself: predial leaves those hosts alone (a probe would be a second
    connection per host); `trust` (paramiko's key exchange) asks for them too."""
    hosts = [host("o%d" % i, 9, ssh_client="openssh") for i in range(2)]
    with predialling.predial(hosts, forks=1) as dials:
        assert all(dials.take(h) is None for h in hosts)
    with predialling.predial(hosts, forks=1, openssh_too=True) as dials:
        assert all(dials.take(h) is not None for h in hosts)


def test_a_session_takes_its_dial_from_the_predial_in_progress(listeners) -> None:
    """Callers name their hosts once (``with predial(...)``) and pass nothing on: the host's
    dial is found by the transport while that predial is open, once, and never after it."""
    (ls,) = listeners(1)
    h = host("h0", port_of(ls))
    other = host("h1", port_of(ls))
    with Predial([h]):
        dial = predialling.pending(h)
        assert dial is not None and dial.result(timeout=10).predialed
        assert predialling.pending(h) is None  # taken once
        assert predialling.pending(other) is None  # not one of its hosts
        dial.result().close()
    with Predial([h]):
        pass
    assert predialling.pending(h) is None  # closed: nothing is handed out
    accept(ls).close()
