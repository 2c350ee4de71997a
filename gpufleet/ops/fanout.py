"""Run one function per host on a bounded thread pool; results come back in host order.

Hosts are independent and mostly wait on the network, so threads suffice; the bound keeps a
large fleet from opening hundreds of SSH connections at once. Failures are values: an
exception in ``fn`` becomes that host's error value and never reaches the caller. Ctrl-C
stops starting new hosts but lets in-flight ones finish (an agent already running a clean
must be allowed to report what it signalled); a second Ctrl-C stops waiting for them, or,
with ``on_cancel`` (clean), cancels what they were still to do and waits for their report of
what they did; then a third stops waiting.
"""
from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

from gpufleet.core.results import Failure
from gpufleet.errors import INTERRUPTED, describe, kind_of

if TYPE_CHECKING:
    from gpufleet.core.model import HostResult

H = TypeVar("H")

NOT_STARTED = "not started (interrupted)"
ABANDONED = "interrupted while running (result unknown)"


def host_name(host: Any) -> str:
    return str(getattr(host, "name", host))


def error_result(host: Any, failure: Failure) -> HostResult:
    """The default error value: a failed HostResult for that host."""
    from gpufleet.core.model import HostResult  # imported when first needed: see cli.prefetch

    return HostResult(host=host_name(host), ok=False, error=failure.message,
                      error_kind=failure.kind)


def _block_sigint() -> None:
    """Workers (and the SSH threads they start) block SIGINT, so the kernel delivers Ctrl-C
    to the main thread and interrupts its wait at once, instead of to a worker (then Python
    would only notice at the main thread's next wake-up, after more hosts had started)."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except (AttributeError, ValueError, OSError):
        pass


def _quiet(callback: Optional[Callable[..., None]], *args: Any) -> None:
    """Call a progress/notice hook, if any; its errors must not change any host's result."""
    if callback is not None:
        try:
            callback(*args)
        except Exception:
            pass


class _Run:
    """One run_hosts call's state. It is kept by the workers under one lock, so a Ctrl-C
    landing anywhere in the main thread (even inside submit) cannot lose track of a host that
    did start."""

    def __init__(self, hosts: list, fn: Callable[[Any], Any],
                 make_error: Callable[[Any, Failure], Any],
                 on_start: Optional[Callable[[Any], None]],
                 on_result: Optional[Callable[[Any, Any], None]]) -> None:
        n = len(hosts)
        self.hosts, self.fn, self.make_error = hosts, fn, make_error
        self.on_start, self.on_result = on_start, on_result
        self.results: list = [None] * n
        self.cond = threading.Condition()
        self.started = [False] * n
        self.done = [False] * n
        self.stop = False
        self.finished = 0
        self.abandoned: list[int] = []

    def call(self, i: int) -> None:
        """A worker: host ``i``'s ``fn``, unless a Ctrl-C came before it started."""
        with self.cond:
            if self.stop:
                return
            self.started[i] = True
        _quiet(self.on_start, self.hosts[i])
        try:
            value = self.fn(self.hosts[i])
        except Exception as exc:  # a failed host is a value
            value = self.make_error(self.hosts[i], Failure(kind_of(exc), describe(exc)[:300]))
        with self.cond:
            if not self.done[i]:  # else abandoned after a second Ctrl-C: that value stands
                self.results[i] = value
                self.done[i] = True
            self.finished += 1
            self.cond.notify_all()
        _quiet(self.on_result, self.hosts[i], value)

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            while not predicate():
                self.cond.wait(0.2)

    def in_flight(self) -> list[int]:
        return [i for i in range(len(self.hosts)) if self.started[i] and not self.done[i]]

    def interrupted(self, on_interrupt: Optional[Callable[[list], None]],
                    on_cancel: Optional[Callable[[list], None]] = None) -> None:
        """First Ctrl-C: start no more hosts, say which are still running, wait for them; a
        second Ctrl-C stops waiting and marks those ABANDONED, or, with ``on_cancel``, has
        it cancel their work and waits again, until they end or a third Ctrl-C comes."""
        with self.cond:
            self.stop = True
            waiting = self.in_flight()
        try:
            _quiet(on_interrupt, [self.hosts[i] for i in waiting])
            self.wait_for(lambda: not self.in_flight())
            return
        except KeyboardInterrupt:
            if on_cancel is None:
                self.abandon()
                return
        try:
            with self.cond:
                waiting = self.in_flight()
            _quiet(on_cancel, [self.hosts[i] for i in waiting])
            self.wait_for(lambda: not self.in_flight())
        except KeyboardInterrupt:
            self.abandon()

    def abandon(self) -> None:
        """Stop waiting: the hosts still running get ABANDONED (their threads end on their
        own timeouts; a value they give later is dropped)."""
        with self.cond:
            self.abandoned = self.in_flight()
            for i in self.abandoned:
                self.results[i] = self.make_error(self.hosts[i], Failure(INTERRUPTED, ABANDONED))
                self.done[i] = True

    def final_results(self) -> list:
        """The results, with NOT_STARTED for every host that never ran."""
        for i in range(len(self.hosts)):
            if not self.done[i]:
                self.results[i] = self.make_error(self.hosts[i], Failure(INTERRUPTED, NOT_STARTED))
        return self.results


def run_hosts(
    hosts: Sequence[H],
    fn: Callable[[H], Any],
    forks: int = 32,
    on_interrupt: Optional[Callable[[list], None]] = None,
    on_result: Optional[Callable[[H, Any], None]] = None,
    make_error: Callable[[H, Failure], Any] = error_result,
    on_start: Optional[Callable[[H], None]] = None,
    on_cancel: Optional[Callable[[list], None]] = None,
) -> list:
    """``[fn(h) for h in hosts]``, at most ``forks`` at a time, in ``hosts`` order.

    ``on_interrupt(in_flight_hosts)`` is called on Ctrl-C (to tell the operator what is still
    being waited for); ``on_start(host)`` as a host's work begins and ``on_result(host,
    value)`` as it finishes (the progress display, gpufleet.cli.progress; their errors are ignored).
    Hosts never started are ``make_error(host, Failure("interrupted", NOT_STARTED))``; after
    a second Ctrl-C, the still-running ones get ABANDONED (their threads end on their own
    timeouts), unless ``on_cancel(in_flight_hosts)`` is given: then the second Ctrl-C calls
    it (it tells them to stop what they were still to do) and their results are waited for
    again, a third Ctrl-C abandoning them. A host whose ``fn`` raised gets the exception's kind
    and one line. Returns the list; never raises for a host's failure.
    """
    hosts = list(hosts)
    n = len(hosts)
    if not n:
        return []
    bound = max(1, min(int(forks), n))
    run = _Run(hosts, fn, make_error, on_start, on_result)
    pool = cf.ThreadPoolExecutor(max_workers=bound, thread_name_prefix="gpufleet-host",
                                 initializer=_block_sigint)
    try:
        try:
            for i in range(n):
                pool.submit(run.call, i)
            run.wait_for(lambda: run.finished == n)
        except KeyboardInterrupt:
            run.interrupted(on_interrupt, on_cancel)
    finally:
        with run.cond:
            run.stop = True
        pool.shutdown(wait=not run.abandoned, cancel_futures=True)
    return run.final_results()
