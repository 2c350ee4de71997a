"""Run one function per host on a bounded thread pool; results come back in host order.

Hosts are independent and mostly wait on the network, so threads suffice; the bound keeps a
large fleet from opening hundreds of SSH connections at once. Failures are values: an
exception in ``fn`` becomes that host's error value and never reaches the caller. Ctrl-C
stops starting new hosts but lets in-flight ones finish (an agent already running a clean
must be allowed to report what it signalled); a second Ctrl-C stops waiting for them.
"""
from __future__ import annotations

import concurrent.futures as cf
import signal
import threading
from typing import Any, Callable, Optional, Sequence, TypeVar

from gpufleet.core.model import HostResult
from gpufleet.core.results import Failure
from gpufleet.errors import INTERRUPTED, describe, kind_of

H = TypeVar("H")

NOT_STARTED = "not started (interrupted)"
ABANDONED = "interrupted while running (result unknown)"


def host_name(host: Any) -> str:
    return str(getattr(host, "name", host))


def error_result(host: Any, failure: Failure) -> HostResult:
    """The default error value: a failed HostResult for that host."""
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


def run_hosts(
    hosts: Sequence[H],
    fn: Callable[[H], Any],
    forks: int = 32,
    on_interrupt: Optional[Callable[[list], None]] = None,
    on_result: Optional[Callable[[H, Any], None]] = None,
    make_error: Callable[[H, Failure], Any] = error_result,
    on_start: Optional[Callable[[H], None]] = None,
) -> list:
    """``[fn(h) for h in hosts]``, at most ``forks`` at a time, in ``hosts`` order.

    ``on_interrupt(in_flight_hosts)`` is called on Ctrl-C (to tell the operator what is still
    being waited for); ``on_start(host)`` as a host's work begins and ``on_result(host,
    value)`` as it finishes (the progress display, gpufleet.cli.progress; their errors are ignored).
    Hosts never started are ``make_error(host, Failure("interrupted", NOT_STARTED))``; after
    a second Ctrl-C, the still-running ones get ABANDONED (their threads end on their own
    timeouts); a host whose ``fn`` raised gets the exception's kind and one line. Returns the
    list; never raises for a host's failure.
    """
    hosts = list(hosts)
    n = len(hosts)
    results: list = [None] * n
    if not n:
        return results
    bound = max(1, min(int(forks), n))
    # State is kept by the workers under one lock, so a Ctrl-C landing anywhere in the main
    # thread (even inside submit) cannot lose track of a host that did start.
    cond = threading.Condition()
    started = [False] * n
    done = [False] * n
    state = {"stop": False, "finished": 0}

    def call(i: int) -> None:
        with cond:
            if state["stop"]:
                return
            started[i] = True
        if on_start is not None:
            try:
                on_start(hosts[i])
            except Exception:
                pass
        try:
            value = fn(hosts[i])
        except Exception as exc:  # a failed host is a value
            value = make_error(hosts[i], Failure(kind_of(exc), describe(exc)[:300]))
        with cond:
            if not done[i]:  # else abandoned after a second Ctrl-C: that value stands
                results[i] = value
                done[i] = True
            state["finished"] += 1
            cond.notify_all()
        if on_result is not None:
            try:
                on_result(hosts[i], value)
            except Exception:
                pass

    def wait_for(predicate: Callable[[], bool]) -> None:
        with cond:
            while not predicate():
                cond.wait(0.2)

    def in_flight() -> list[int]:
        return [i for i in range(n) if started[i] and not done[i]]

    pool = cf.ThreadPoolExecutor(max_workers=bound, thread_name_prefix="gpufleet-host",
                                 initializer=_block_sigint)
    abandoned: list[int] = []
    try:
        try:
            for i in range(n):
                pool.submit(call, i)
            wait_for(lambda: state["finished"] == n)
        except KeyboardInterrupt:
            with cond:
                state["stop"] = True
                waiting = in_flight()
            if on_interrupt is not None:
                try:
                    on_interrupt([hosts[i] for i in waiting])
                except Exception:
                    pass
            try:
                wait_for(lambda: not in_flight())
            except KeyboardInterrupt:
                with cond:
                    abandoned = in_flight()
                    for i in abandoned:
                        results[i] = make_error(hosts[i], Failure(INTERRUPTED, ABANDONED))
                        done[i] = True
    finally:
        with cond:
            state["stop"] = True
        pool.shutdown(wait=not abandoned, cancel_futures=True)

    for i in range(n):
        if not done[i]:
            results[i] = make_error(hosts[i], Failure(INTERRUPTED, NOT_STARTED))
    return results
