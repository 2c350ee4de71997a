"""Pre-dialling: every direct SSH host's TCP connect, started at once when a command begins.

Internal to gpufleet.transport (import from there). Commands over many hosts start every
direct host's TCP connect at once, outside the ``--forks`` bound, so an unreachable host is
known within its own connect_timeout from the start of the command; the SSH handshake and the
exec (the CPU-heavy part) stay inside the bound and take the connected socket
(:meth:`gpufleet.transport.connection.HostConnection.hold_predialed`).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import signal
import threading
from typing import TYPE_CHECKING, Any, Iterable, Optional

from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport import sshconfig

if TYPE_CHECKING:  # imported by the dials themselves: a local host never loads the SSH stack
    from gpufleet.transport.connection import HostConnection

    # What a host's worker takes from the pre-dial: a Future of its connection (None: dial here).
    Dialled = cf.Future[Optional[HostConnection]]
else:
    Dialled = cf.Future
PREDIAL_THREADS = 512  # dials in flight at once (each a thread mostly asleep in connect())
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
    """Dial threads leave SIGINT to the main thread (see gpufleet.ops.fanout)."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except (AttributeError, ValueError, OSError):
        pass


class _Dial:
    __slots__ = ("host", "future", "taken", "state", "holds_slot")

    def __init__(self, host: Host):
        self.host = host
        self.future: Dialled = cf.Future()
        self.taken = False
        self.state = "queued"  # -> "dialling" -> "done"
        self.holds_slot = False


class Predial:
    """Every direct SSH host's TCP connect, started at once when a command begins.

    Why: the ``--forks`` bound is for the SSH handshake and the exec (CPU); a connect is only
    waiting, and a blackholed host's wait must not start when a slot frees (late in a large
    fleet) but with the command. Each dial is what :meth:`HostConnection.open` would have done
    (ssh_config applied by :func:`connection_for`, DNS + connect bounded by the host's
    connect_timeout) in a thread of its own; the host's worker then calls :meth:`take` for a
    Future of the connection: a ``HostConnection`` holding the connected socket, ``None`` (build
    one as usual: ssh_config error, or the dial was given up), or the dial's error (the host's
    row error, exactly as if the worker had dialled). Hosts with ProxyJump / ProxyCommand get a
    ``HostConnection`` without a socket: the jump is an SSH session, so it stays in the bound.

    Sockets never taken (Ctrl-C: fanout starts no more hosts) are closed by :meth:`close`
    (use ``with``), also those whose connect completes afterwards. Dial threads are daemons:
    a blackholed connect never holds the exit. At most ``_fd_budget`` sockets are held here at
    once; the further hosts' dials start as sockets are taken.
    """

    def __init__(self, hosts: Iterable[Host], forks: int = 32, threads: int = PREDIAL_THREADS,
                 openssh_too: bool = False):
        self._lock = threading.Lock()
        self._closed = False
        self._dials: dict[str, _Dial] = {}
        for host in hosts:
            if getattr(host, "connection", "ssh") != "ssh":
                continue
            if openssh_too or not sshconfig.openssh_wanted(host):
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
        with _ACTIVE_LOCK:
            _ACTIVE.append(self)
        try:
            for i in range(count):
                threading.Thread(target=self._run, name=f"gpufleet-dial-{i}", daemon=True).start()
        except BaseException:  # Ctrl-C, or no more threads: what started is given up
            self.close()
            raise

    # ---- the host's side

    def take(self, host: Host) -> Optional[Dialled]:
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
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
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
                conn, exc = dial_host(dial.host), None
            except BaseException as error:  # the host's row error; never lost
                conn, exc = None, error
            with self._lock:  # settled under the lock: close() then sees every socket
                dial.state = "done"
                give_up = self._closed and not dial.taken
                if dial.taken or give_up or conn is None or not conn.predialed:
                    self._release(dial)
                if give_up:
                    dial.future.cancel()
                elif exc is not None:
                    dial.future.set_exception(exc)
                else:
                    dial.future.set_result(conn)
            if give_up and conn is not None:
                conn.close()


#: The pre-dials in progress: a session that opens takes its host's dial from them (``pending``),
#: so a command names its hosts once (``with predial(hosts, forks):``) and passes nothing on.
_ACTIVE: list[Predial] = []
_ACTIVE_LOCK = threading.Lock()


def pending(host: Host) -> Optional[Dialled]:
    """This host's dial from a pre-dial in progress, taken (its owner is now the caller); None:
    none was started for it (the caller dials)."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for started in reversed(active):
        dial = started.take(host)
        if dial is not None:
            return dial
    return None


def dial_host(host: Host) -> Optional[HostConnection]:
    """One host's connection with its socket connected (not yet SSH), as open() would dial.

    None when ssh_config cannot be applied: the worker builds it again and reports that.
    """
    from gpufleet.transport.connection import connection_for
    from gpufleet.transport.tcp import dial_tcp

    try:
        conn = connection_for(host)
    except Exception:
        return None
    if conn.gateway:  # ProxyJump / ProxyCommand: dialled by open(), inside the forks bound
        return conn
    try:
        sock = dial_tcp(conn.host, int(conn.port), conn.dial_timeout)
    except BaseException:
        conn.close()
        raise
    conn.hold_predialed(sock)
    return conn


def _discard(future: Dialled) -> None:
    """Close the connection a finished dial holds (nobody will use it)."""
    try:
        conn = future.result(timeout=0)
    except BaseException:
        return
    if conn is not None:
        conn.close()


def predial(hosts: Iterable[Host], forks: int = 32, openssh_too: bool = False) -> Predial:
    """Start every direct SSH host's TCP connect now; ``with predial(hosts, forks) as dials:``
    then each worker calls ``open_session(host, dial=dials.take(host))``.

    Hosts that open_session sends through OpenSSH's client are left out (ssh connects by
    itself; a probe would be a second connection): ``openssh_too`` for paramiko-only users
    of the dial (the key exchange of `gpufleet trust`)."""
    return Predial(hosts, forks, openssh_too=openssh_too)


def connection_from_dial(dial: Optional[Dialled]
                         ) -> Optional[HostConnection]:
    """The connection a :func:`predial` Future holds; None: build one (not pre-dialled, or
    given up); the dial's own failure is raised as the host's error."""
    if dial is None:
        return None
    try:
        return dial.result()  # bounded: the dial has the host's connect_timeout
    except cf.CancelledError:
        return None
    except TransportError:
        raise
    except Exception as exc:
        from gpufleet.transport.connection import transport_error

        raise transport_error(exc) from None
