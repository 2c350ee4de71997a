"""The agent's stay mode (a conversation: `clean` plans and acts through ONE agent process), run
the controller's way: the bootstrap, the first request, then next requests framed ``<m>\\n<JSON>``
on the stdin it left open. It answers each, and ends after a clean, on EOF, on a bad frame,
on a bad request and after its idle bound, a request that comes after the bound never being
acted on. Each process started here is killed at teardown by its own PID.
"""
from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time

import pytest

from gpufleet.core.model import parse_snapshot
from gpufleet.remote import CANCEL_LINE, encode_next

from test_agent_run import (  # noqa: E402  (tests/unit is on sys.path under pytest)
    PYTHONS,
    Stub,
    agent_env,
    audit_lines,
    children,  # noqa: F401  (fixture)
    clean_request,
    end_resident,
    gpu_app,
    snap_request,
    start_resident,
    starttime,
)


@pytest.fixture
def agents():
    started: list[subprocess.Popen] = []

    def start(request, python=sys.executable, env=None):
        return start_resident(started, request, python, env)

    yield start
    end_resident(started)


def read_doc(p, timeout=20.0):
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, "no document within %ss" % timeout
    line = p.stdout.readline()
    assert line, "stdout ended: %r" % p.stderr.read()
    return json.loads(line)


def send(p, data):
    p.stdin.write(data)
    p.stdin.flush()


def stay_request(stub, **kw):
    return snap_request(stub, stay=True, **kw)


@pytest.mark.parametrize("python", PYTHONS)
def test_one_process_answers_the_plan_then_the_clean(tmp_path, children, agents, python):
    """The snapshot, then (the plan confirmed) the clean: one process, the same pid in both
    documents, the identities still re-checked before the signal; it ends after the clean."""
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    p = agents(stay_request(stub), python=python, env=agent_env(tmp_path))
    first = read_doc(p)
    assert first["mode"] == "snapshot" and first["facts"]["agent_pid"] == p.pid
    assert h.pid in parse_snapshot(first).listed_pids()
    assert p.poll() is None, "it ended after the first document although asked to stay"
    time.sleep(0.3)
    assert h.poll() is None and audit_lines(tmp_path) == []  # nothing done while waiting
    send(p, encode_next(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}])))
    doc = read_doc(p)
    assert doc["mode"] == "clean" and doc["lock"] == "acquired", doc
    assert [(s["pid"], s["signal"], s["outcome"]) for s in doc["signals"]] == [
        (h.pid, "TERM", "sent")]
    assert h.wait(timeout=5) == -signal.SIGTERM
    assert doc["after"]["facts"]["agent_pid"] == p.pid  # the same process
    assert p.wait(timeout=10) == 0  # ends after the clean, stdin still open
    assert p.stdout.read() == b""


def test_a_reused_pid_is_still_refused_in_the_second_answer(tmp_path, children, agents):
    """The clean request carries the identities; the staying agent re-checks them right
    before signalling, as a fresh one does."""
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    p = agents(stay_request(stub), env=agent_env(tmp_path))
    read_doc(p)
    send(p, encode_next(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid) + 1, "wave": 0}])))
    doc = read_doc(p)
    assert [(s["pid"], s["outcome"]) for s in doc["signals"]] == [(h.pid, "pid reused")]
    assert h.poll() is None
    assert p.wait(timeout=10) == 0


@pytest.mark.parametrize("python", PYTHONS)
def test_cancel_in_the_grace_sends_no_kill_and_says_what_was_sent(tmp_path, children, agents,
                                                                  python):
    """The operator's second Ctrl-C: a ``cancel`` line on the conversation's stdin while its
    clean waits out a 30 s grace. The agent answers at once, the KILL it would have sent
    listed as pending and never sent (not in the document, not in its audit file), the TERM
    that was sent reported; the holder lives on."""
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    p = agents(stay_request(stub), python=python, env=agent_env(tmp_path))
    read_doc(p)
    ident = {"pid": h.pid, "starttime": starttime(h.pid)}
    send(p, encode_next(clean_request(tmp_path, stub, [dict(ident, wave=0)], grace_s=30.0,
                                      deadline_s=60, timeout_s=40.0)))
    deadline = time.monotonic() + 10
    while [x["signal"] for x in audit_lines(tmp_path)] != ["TERM"]:
        assert time.monotonic() < deadline, "no TERM"
        time.sleep(0.02)
    cancelled_at = time.monotonic()
    send(p, CANCEL_LINE)
    doc = read_doc(p, timeout=5)
    assert time.monotonic() - cancelled_at < 3, "the agent did not stop at once"
    assert [(s["pid"], s["signal"], s["outcome"]) for s in doc["signals"]] == [
        (h.pid, "TERM", "sent")]
    assert doc["cancelled"]["pending"] == [dict(ident, signal="KILL")], doc
    assert 0 <= doc["cancelled"]["t"] < 5
    assert doc["memory_wait"] is None and doc["after"] is None
    assert [s["pid"] for s in doc["survivors"]] == [h.pid]
    assert p.wait(timeout=10) == 0
    time.sleep(0.3)
    assert h.poll() is None
    assert [x["signal"] for x in audit_lines(tmp_path)] == ["TERM"]


def test_eof_in_the_grace_does_not_cancel(tmp_path, children, agents):
    """A session that drops (stdin closed, no ``cancel``) does not cut the sequence: the
    KILL still comes after the grace."""
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    p = agents(stay_request(stub), env=agent_env(tmp_path))
    read_doc(p)
    send(p, encode_next(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}], grace_s=1.0)))
    p.stdin.close()
    doc = read_doc(p)
    assert [(s["signal"], s["outcome"]) for s in doc["signals"]] == [("TERM", "sent"),
                                                                     ("KILL", "sent")]
    assert "cancelled" not in doc and doc["memory_wait"]["ok"] is True
    assert h.wait(timeout=5) == -signal.SIGKILL


def test_cancel_while_waiting_for_the_lock_signals_nothing(tmp_path, children, agents):
    """Another clean holds the host's lock: a cancel ends the wait at once, and the clean
    that never got the lock signals nothing, its target's TERM listed as pending."""
    import fcntl

    h = children.holder("job")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    lock = tmp_path / "clean.lock"
    lock.touch(mode=0o600)
    with open(lock, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        p = agents(stay_request(stub), env=agent_env(tmp_path))
        read_doc(p)
        ident = {"pid": h.pid, "starttime": starttime(h.pid)}
        send(p, encode_next(clean_request(tmp_path, stub, [dict(ident, wave=0)],
                                          lock_wait_s=30.0, timeout_s=40.0, deadline_s=60)))
        time.sleep(0.5)
        send(p, CANCEL_LINE)
        doc = read_doc(p, timeout=3)
    assert doc["lock"] == "busy" and doc["signals"] == [], doc
    assert doc["cancelled"]["pending"] == [dict(ident, signal="TERM")]
    assert h.poll() is None and audit_lines(tmp_path) == []


def test_eof_after_the_first_document_ends_it(tmp_path, agents):
    p = agents(stay_request(Stub(tmp_path / "stub")))
    assert read_doc(p)["mode"] == "snapshot"
    p.stdin.close()  # the controller closed the conversation (a dry run, declined, Ctrl-C)
    assert p.wait(timeout=5) == 0
    assert p.stdout.read() == b""  # nothing more: nothing was asked


def test_the_idle_bound_ends_it_and_a_late_request_is_never_acted_on(tmp_path, children,
                                                                    agents):
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    p = agents(stay_request(stub, idle_s=0.5), env=agent_env(tmp_path))
    assert read_doc(p)["mode"] == "snapshot"
    started = time.monotonic()
    end = read_doc(p)
    assert 0.4 <= time.monotonic() - started < 5
    assert end == {"agent_version": 1, "mode": "stay_end",
                   "reason": "idle: no request within 0.5s"}
    assert p.wait(timeout=5) == 0
    try:  # the operator confirms too late: the agent is gone, the holder untouched
        send(p, encode_next(clean_request(tmp_path, stub, [
            {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}])))
    except BrokenPipeError:
        pass
    time.sleep(0.3)
    assert h.poll() is None and audit_lines(tmp_path) == []


def test_the_default_idle_bound_is_an_hour(tmp_path):
    from gpufleet.remote import main

    assert main.IDLE_S == 3600.0
    assert main.parse_request(json.dumps({"mode": "snapshot", "stay": True}))["idle_s"] == 3600.0
    with pytest.raises(ValueError, match="idle_s must be a number"):
        main.parse_request(json.dumps({"mode": "snapshot", "stay": True, "idle_s": "soon"}))
    with pytest.raises(ValueError, match="stay must be true or false"):
        main.parse_request(json.dumps({"mode": "snapshot", "stay": "yes"}))


@pytest.mark.parametrize("frame, reason", [
    (b"clean please\n", "bad frame: header b'clean please\\n'"),
    (b"x" * 40, "bad frame: header b'" + "x" * 32 + "'"),
    (b"99999999999\n", "bad frame: 99999999999 bytes is more than 16777216"),
])
def test_a_bad_frame_is_one_document_and_the_end(tmp_path, agents, frame, reason):
    p = agents(stay_request(Stub(tmp_path / "stub")))
    read_doc(p)
    send(p, frame)
    assert read_doc(p) == {"agent_version": 1, "mode": "stay_end", "reason": reason}
    assert p.wait(timeout=5) == 0


def test_a_frame_cut_by_eof_is_a_bad_frame(tmp_path, agents):
    p = agents(stay_request(Stub(tmp_path / "stub")))
    read_doc(p)
    body = b"{\"mode\": \"clean\""
    send(p, b"100\n" + body)
    p.stdin.close()
    assert read_doc(p)["reason"] == "bad frame: stdin ended after %d of 100 bytes" % len(body)
    assert p.wait(timeout=5) == 0


def test_a_bad_next_request_is_refused_and_ends_it(tmp_path, agents):
    p = agents(stay_request(Stub(tmp_path / "stub")))
    read_doc(p)
    body = b'{"mode": "reboot"}'
    send(p, b"%d\n%s" % (len(body), body))
    doc = read_doc(p)
    assert doc["mode"] is None and doc["error"] == "bad request: unknown mode 'reboot'"
    assert p.wait(timeout=5) == 0


def test_watch_cannot_follow_in_a_conversation(tmp_path, agents):
    p = agents(stay_request(Stub(tmp_path / "stub")))
    read_doc(p)
    send(p, encode_next({"mode": "watch"}))
    assert read_doc(p)["reason"] == "bad request: watch mode cannot follow in a conversation"
    assert p.wait(timeout=5) == 0


def test_a_next_snapshot_may_stay_again_and_one_without_stay_ends(tmp_path, agents):
    stub = Stub(tmp_path / "stub")
    p = agents(stay_request(stub))
    pids = [read_doc(p)["facts"]["agent_pid"]]
    send(p, encode_next(stay_request(stub)))
    pids.append(read_doc(p)["facts"]["agent_pid"])
    assert p.poll() is None
    send(p, encode_next(snap_request(stub)))
    pids.append(read_doc(p)["facts"]["agent_pid"])
    assert pids == [p.pid] * 3
    assert p.wait(timeout=5) == 0


def test_without_stay_it_ends_after_one_document(tmp_path, agents):
    """What every other caller (status, runbooks, a dry run) still gets: stdin stays open
    here, yet the agent ends after its one document."""
    p = agents(snap_request(Stub(tmp_path / "stub")))
    assert read_doc(p)["mode"] == "snapshot"
    assert p.wait(timeout=5) == 0
