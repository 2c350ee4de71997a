"""Run one function per host on a bounded thread pool; results come back in host order.

Hosts are independent and mostly wait on the network, so threads suffice; the bound keeps a
large fleet from opening hundreds of SSH connections at once. Failures are values: an
exception in ``fn`` becomes that host's error value and never reaches the caller. Ctrl-C
stops starting new hosts but lets in-flight ones finish (an agent already running a clean
must be allowed to report what it signalled); a second Ctrl-C stops waiting for them.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable, Optional, Sequence, TypeVar

from .model import HostResult

H = TypeVar("H")

NOT_STARTED = "not started (interrupted)"
ABANDONED = "interrupted while running (result unknown)"


def host_name(host: Any) -> str:
    return str(getattr(host, "name", host))


def error_result(host: Any, message: str) -> HostResult:
    """The default error value: a failed HostResult for that host."""
    return HostResult(host=host_name(host), ok=False, error=message)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:300] if first else type(exc).__name__


def run_hosts(
    hosts: Sequence[H],
    fn: Callable[[H], Any],
    forks: int = 32,
    on_interrupt: Optional[Callable[[list], None]] = None,
    on_result: Optional[Callable[[H, Any], None]] = None,
    make_error: Callable[[H, str], Any] = error_result,
) -> list:
    """``[fn(h) for h in hosts]``, at most ``forks`` at a time, in ``hosts`` order.

    ``on_interrupt(in_flight_hosts)`` is called on Ctrl-C (to tell the operator what is still
    being waited for); ``on_result(host, value)`` as each host finishes (progress display).
    Hosts never started are ``make_error(host, NOT_STARTED)``; after a second Ctrl-C, the
    still-running ones are ``make_error(host, ABANDONED)`` (their threads end on their own
    timeouts). Returns the list; never raises for a host's failure.
    """
    hosts = list(hosts)
    results: list = [None] * len(hosts)
    done_flags = [False] * len(hosts)
    if not hosts:
        return results
    bound = max(1, min(int(forks), len(hosts)))

    def call(i: int) -> Any:
        try:
            return fn(hosts[i])
        except Exception as exc:  # a failed host is a value
            return make_error(hosts[i], _describe(exc))

    pool = cf.ThreadPoolExecutor(max_workers=bound, thread_name_prefix="gpufleet-host")
    running: dict[cf.Future, int] = {}
    next_i = 0
    interrupted = False

    def finish(fut: cf.Future) -> None:
        i = running.pop(fut)
        try:
            value = fut.result()
        except BaseException as exc:  # only if make_error itself failed
            value = HostResult(host=host_name(hosts[i]), ok=False, error=_describe(exc))
        results[i] = value
        done_flags[i] = True
        if on_result is not None:
            try:
                on_result(hosts[i], value)
            except Exception:
                pass

    try:
        try:
            while next_i < len(hosts) or running:
                while next_i < len(hosts) and len(running) < bound:
                    running[pool.submit(call, next_i)] = next_i
                    next_i += 1
                done, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    finish(fut)
        except KeyboardInterrupt:
            interrupted = True
            if on_interrupt is not None:
                try:
                    on_interrupt([hosts[i] for i in sorted(running.values())])
                except Exception:
                    pass
            try:
                while running:
                    done, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                    for fut in done:
                        finish(fut)
            except KeyboardInterrupt:
                for fut, i in list(running.items()):
                    results[i] = make_error(hosts[i], ABANDONED)
                    done_flags[i] = True
    finally:
        pool.shutdown(wait=not interrupted or not running, cancel_futures=True)

    for i, flag in enumerate(done_flags):
        if not flag:
            results[i] = make_error(hosts[i], NOT_STARTED)
    return results
