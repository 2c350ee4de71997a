"""fanout.run_hosts: host order, the forks bound, exceptions as values, Ctrl-C."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gpufleet.ops.fanout import ABANDONED, NOT_STARTED, run_hosts
from gpufleet.core.model import HostResult


class H:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def hosts(n: int) -> list[H]:
    return [H("h%02d" % i) for i in range(n)]


@pytest.fixture
def sigint_raises():
    """Make SIGINT raise KeyboardInterrupt in the main thread, whatever pytest installed."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_results_come_back_in_host_order_not_completion_order():
    hs = hosts(8)
    # earlier hosts finish later
    out = run_hosts(hs, lambda h: (time.sleep(0.02 * (8 - int(h.name[1:]))), h.name)[1], forks=8)
    assert out == [h.name for h in hs]


def test_empty_host_list():
    assert run_hosts([], lambda h: 1) == []


def test_at_most_forks_run_at_once_and_they_do_run_in_parallel():
    lock = threading.Lock()
    running = 0
    peak = 0
    barrier = threading.Barrier(3, timeout=10)  # breaks (fails the test) unless 3 run together

    def fn(h: H) -> str:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        try:
            if int(h.name[1:]) < 3:
                barrier.wait()
            time.sleep(0.02)
            return h.name
        finally:
            with lock:
                running -= 1

    out = run_hosts(hosts(12), fn, forks=3)
    assert out == [h.name for h in hosts(12)]
    assert peak == 3


def test_forks_one_is_sequential():
    order = []
    run_hosts(hosts(5), lambda h: order.append(h.name), forks=1)
    assert order == [h.name for h in hosts(5)]


def test_exception_in_fn_is_that_hosts_error_value():
    def fn(h: H) -> HostResult:
        if h.name == "h02":
            raise RuntimeError("boom on purpose\nsecond line")
        return HostResult(host=h.name, ok=True)

    out = run_hosts(hosts(4), fn, forks=2)
    assert [r.ok for r in out] == [True, True, False, True]
    assert out[2].host == "h02"
    assert out[2].error == "RuntimeError: boom on purpose"


def test_custom_error_values_and_progress_callback():
    seen = []

    def fn(h: H) -> int:
        if h.name == "h01":
            raise ValueError("nope")
        return 7

    out = run_hosts(hosts(3), fn, forks=2, make_error=lambda h, failure: ("ERR", h.name, failure.message),
                    on_result=lambda h, v: seen.append(h.name))
    assert out == [7, ("ERR", "h01", "ValueError: nope"), 7]
    assert sorted(seen) == ["h00", "h01", "h02"]


def test_ctrl_c_stops_starting_hosts_and_lets_in_flight_ones_finish(sigint_raises):
    second_started = threading.Event()
    finished = []
    interrupted_with = []

    def fn(h: H) -> str:
        if h.name == "h00":
            assert second_started.wait(10)
            os.kill(os.getpid(), signal.SIGINT)  # the operator presses Ctrl-C
            time.sleep(0.3)  # still running when the interrupt arrives
        elif h.name == "h01":
            second_started.set()
            time.sleep(0.3)
        finished.append(h.name)
        return "done " + h.name

    out = run_hosts(hosts(6), fn, forks=2,
                    on_interrupt=lambda inflight: interrupted_with.append([h.name for h in inflight]))
    assert out[0] == "done h00" and out[1] == "done h01"
    assert sorted(finished) == ["h00", "h01"]
    for r in out[2:]:
        assert isinstance(r, HostResult) and not r.ok and r.error == NOT_STARTED
    assert interrupted_with == [["h00", "h01"]]


def test_second_ctrl_c_stops_waiting(sigint_raises):
    release = threading.Event()
    quick_done = threading.Event()
    quick_started = threading.Event()
    interrupt_seen = threading.Event()

    def fn(h: H) -> str:
        if h.name == "h01":
            quick_started.set()
            assert interrupt_seen.wait(10)  # finishes while the pool is draining
            quick_done.set()
            return "quick"
        assert quick_started.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
        assert quick_done.wait(10)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # pressed again: stop waiting
        release.wait(20)  # a host that would keep us waiting
        return "slow"

    started = time.monotonic()
    try:
        out = run_hosts(hosts(3), fn, forks=2, on_interrupt=lambda inflight: interrupt_seen.set())
    finally:
        release.set()
    assert time.monotonic() - started < 10
    assert out[0].error == ABANDONED
    assert out[1] == "quick"
    assert out[2].error == NOT_STARTED


def test_with_on_cancel_the_second_ctrl_c_cancels_and_waits_for_the_report(sigint_raises):
    """A clean's hosts: the second Ctrl-C has in-flight hosts told to stop (on_cancel) and
    their results, the report of what they did, are still waited for; a third stops waiting."""
    cancel = threading.Event()
    release = threading.Event()
    second_started = threading.Event()
    told: list[list[str]] = []

    def fn(h: H) -> str:
        if h.name == "h01":  # a host whose report never comes
            second_started.set()
            release.wait(20)
            return "late"
        assert second_started.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # pressed again: cancel
        assert cancel.wait(10)
        return "cancelled " + h.name

    def on_cancel(inflight: list) -> None:
        told.append([h.name for h in inflight])
        cancel.set()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # a third one

    started = time.monotonic()
    try:
        out = run_hosts(hosts(3), fn, forks=2, on_cancel=on_cancel)
    finally:
        release.set()
    assert time.monotonic() - started < 10
    assert told == [["h00", "h01"]]
    assert out[0] == "cancelled h00"  # its report was waited for after the cancel
    assert out[1].error == ABANDONED  # the third Ctrl-C stopped waiting for it
    assert out[2].error == NOT_STARTED
