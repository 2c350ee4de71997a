"""The agent's watch mode, run the controller's way (the bootstrap, stdin kept open): one
snapshot line per interval, and it ends ITSELF when the controller goes: stdin closed, no
keep-alive, stdout closed, stdout blocked (watchdog). Each process started here is killed at
teardown by its own PID.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import pytest

from gpufleet.core.model import parse_snapshot

from test_agent_run import PYTHONS, end_resident, start_resident  # noqa: E402  (tests/unit on sys.path)


@pytest.fixture
def agents():
    started: list[subprocess.Popen] = []

    def start(python=sys.executable, **request):
        req = {"mode": "watch", "interval_s": 0.2, "keepalive_s": 1.5, "deadline_s": 5.0,
               "nvidia_smi": "/nonexistent/nvidia-smi"}
        req.update(request)
        return start_resident(started, req, python)

    yield start
    end_resident(started)


def read_line(p, timeout=10.0):
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, "no line within %ss" % timeout
    return p.stdout.readline()


@pytest.mark.parametrize("python", PYTHONS)
def test_one_snapshot_line_per_interval_while_keepalives_come(agents, python):
    p = agents(python, keepalive_s=2.0)
    seqs = []
    started = time.monotonic()
    while time.monotonic() - started < 5.0:  # two and a half keep-alive deadlines
        doc = json.loads(read_line(p))
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert doc["mode"] == "snapshot", doc
        snap = parse_snapshot(doc)  # the document of core/model.py, line by line
        assert snap.facts.agent_pid == p.pid
        seqs.append(doc["watch_seq"])
    assert p.poll() is None, "it ended although keep-alives came"
    assert seqs == list(range(len(seqs))) and len(seqs) >= 5  # 0.2 s interval over 5 s


def test_ends_when_stdin_closes(agents):
    p = agents(interval_s=0.5, keepalive_s=60)
    assert json.loads(read_line(p))["watch_seq"] == 0
    p.stdin.close()  # what sshd does when the controller's connection ends
    assert p.wait(timeout=5) == 0
    last = [json.loads(ln) for ln in p.stdout.read().splitlines()][-1]
    assert last["mode"] == "watch_end" and last["reason"] == "stdin closed"


def test_ends_when_keepalives_stop_without_eof(agents):
    """The controller is silent: no EOF ever comes, no keep-alive either (its lines are still
    read here, so only the keep-alive deadline can end it)."""
    p = agents(interval_s=0.2, keepalive_s=2.0)
    started = time.monotonic()
    docs = []
    while True:
        line = read_line(p)
        if not line:
            break
        docs.append(json.loads(line))
        if time.monotonic() - started < 1.0:
            assert p.poll() is None  # not before its keep-alive deadline
    assert p.wait(timeout=10) == 0 and time.monotonic() - started >= 2.0
    assert docs[-1]["mode"] == "watch_end" and docs[-1]["reason"].startswith("no keep-alive")
    assert len(docs) >= 5  # it kept snapshotting until the deadline


def test_ends_when_stdout_closes(agents):
    p = agents(interval_s=0.1, keepalive_s=60)
    read_line(p)
    p.stdout.close()  # the reader went away: the next write fails
    assert p.wait(timeout=5) == 0
    assert p.stdin is not None
    p.stdin.close()


def test_watchdog_ends_an_agent_blocked_on_a_full_pipe(agents):
    """Nobody reads and nobody sends: the loop is stuck in a write; the watchdog ends it."""
    p = agents(interval_s=0.05, keepalive_s=3.0, deadline_s=1.0)
    # 64 KiB of pipe: full after ~10 lines (~0.5 s), long before the 3 s keep-alive deadline
    rc = p.wait(timeout=20)
    assert rc == 3  # os._exit(3): the watchdog, not the loop
    assert b"watch ended by its watchdog" in p.stderr.read()


def test_a_bad_watch_request_is_one_document(agents):
    p = agents(interval_s=0)
    doc = json.loads(read_line(p))
    assert doc["error"].startswith("bad request: interval_s must be a number")
    p.stdin.close()
    assert p.wait(timeout=5) == 0


def no_line_within(p, seconds):
    ready, _, _ = select.select([p.stdout], [], [], seconds)
    return not ready


def test_with_hold_first_the_second_snapshot_waits_for_go(agents):
    """hold_first_s: after its first line the agent takes no snapshot (keep-alives do not end
    the hold) until the controller's ``go``; then its interval goes on as before."""
    p = agents(interval_s=0.1, keepalive_s=5.0, hold_first_s=30.0)
    assert json.loads(read_line(p))["watch_seq"] == 0
    for _ in range(4):  # 0.8 s: eight intervals, keep-alives coming
        p.stdin.write(b"\n")
        p.stdin.flush()
        assert no_line_within(p, 0.2), "a second snapshot before go"
    p.stdin.write(b"go\n")
    p.stdin.flush()
    t0 = time.monotonic()
    assert json.loads(read_line(p, timeout=5))["watch_seq"] == 1
    assert time.monotonic() - t0 < 1.0
    assert json.loads(read_line(p, timeout=5))["watch_seq"] == 2  # the interval again
    assert p.poll() is None


def test_hold_first_ends_by_itself_after_hold_first_s(agents):
    p = agents(interval_s=0.1, keepalive_s=5.0, hold_first_s=0.8)
    assert json.loads(read_line(p))["watch_seq"] == 0
    t0 = time.monotonic()
    assert no_line_within(p, 0.5)
    assert json.loads(read_line(p, timeout=5))["watch_seq"] == 1
    assert 0.6 < time.monotonic() - t0 < 3.0


def test_a_held_agent_still_ends_when_stdin_closes(agents):
    p = agents(interval_s=0.1, keepalive_s=60, hold_first_s=60.0)
    assert json.loads(read_line(p))["watch_seq"] == 0
    p.stdin.close()
    assert p.wait(timeout=5) == 0
    last = [json.loads(ln) for ln in p.stdout.read().splitlines()][-1]
    assert last["mode"] == "watch_end" and last["reason"] == "stdin closed"
