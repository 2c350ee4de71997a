"""``Session.converse`` on a ``connection: local`` host (the real agent, a stub nvidia-smi, real
child processes): one agent process answers the snapshot and then the clean; it fails as
``run_agent`` fails (missing or too-old python); and what the clean's rows rest on, exactly:
a conversation gone BEFORE its next request was written gives ``unsent`` (nothing was done),
one that dies AFTER it was written does not (the outcome is unknown). The same paths over
real SSH: tests/integration/test_clean_conversation_lab.py, tests/faults/test_clean_conversation_faults.py.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.transport import LocalSession

from test_agent_run import (  # noqa: E402  (tests/unit is on sys.path under pytest)
    Stub,
    audit_lines,
    children,  # noqa: F401  (fixture)
    clean_request,
    gpu_app,
    snap_request,
    starttime,
)


def local(stub: Stub, **kw) -> LocalSession:
    return LocalSession(Host(name="here", connection="local", nvidia_smi=str(stub.path), **kw))


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Exited, every thread too: a zombie leader's other threads may still hold its files
    (its pipes) for a moment, and until they let go the agent's end is not yet visible."""
    try:
        state = Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]
        threads = len(list(Path("/proc/%d/task" % pid).iterdir()))
    except OSError:
        return True
    return state in ("Z", "X") and threads <= 1


def test_one_agent_answers_the_snapshot_then_the_clean(tmp_path, children, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(snap_request(stub), timeout=30)
    assert conv.reply.ok, conv.reply.error
    agent = conv.reply.doc["facts"]["agent_pid"]
    reply = conv.ask(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}]), timeout=30)
    conv.close()
    assert reply.ok and not reply.unsent, reply.error
    assert [(s["pid"], s["outcome"]) for s in reply.doc["signals"]] == [(h.pid, "sent")]
    assert reply.doc["after"]["facts"]["agent_pid"] == agent
    assert h.wait(timeout=5) == -signal.SIGTERM
    assert gone(agent)


def test_a_missing_or_too_old_python_fails_as_run_agent_does(tmp_path):
    stub = Stub(tmp_path / "stub")
    py2 = tmp_path / "python2"
    py2.write_text("#!/bin/sh\necho \"AttributeError: 'file' object has no attribute 'buffer'\" >&2\n"
                   "exit 1\n")
    py2.chmod(0o755)
    for python in (str(tmp_path / "no-such-python"), str(py2)):
        session = local(stub, python=python)
        once = session.run_agent(snap_request(stub), timeout=20)
        conv = session.converse(snap_request(stub), timeout=20)
        assert not once.ok and not conv.reply.ok
        assert (conv.reply.error, conv.reply.error_kind) == (once.error, once.error_kind)
        assert conv.reply.error_kind == errors.COMMAND
        assert conv.ask(snap_request(stub), timeout=5).unsent  # nothing more to ask


def test_the_idle_bound_passed_before_the_request_nothing_is_done(tmp_path, children,
                                                                 monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(dict(snap_request(stub), idle_s=0.3), timeout=30)
    agent = conv.reply.doc["facts"]["agent_pid"]
    wait_for(lambda: gone(agent))  # the operator was slower than the idle bound
    reply = conv.ask(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}]), timeout=30)
    assert (reply.ok, reply.unsent, reply.error_kind) == (False, True, errors.AGENT)
    assert reply.error == "the agent ended its conversation: idle: no request within 0.3s"
    assert h.poll() is None and audit_lines(tmp_path) == []


def test_an_agent_gone_before_the_request_is_unsent(tmp_path, children, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(snap_request(stub), timeout=30)
    agent = conv.reply.doc["facts"]["agent_pid"]
    os.kill(agent, signal.SIGKILL)  # the process this test's session started (its own pid)
    wait_for(lambda: gone(agent))
    reply = conv.ask(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}]), timeout=30)
    assert (reply.ok, reply.unsent) == (False, True), reply
    assert reply.error.startswith("the agent's conversation ended: agent ended (exit -9)"), reply
    assert h.poll() is None and audit_lines(tmp_path) == []


def test_an_agent_that_dies_after_the_request_is_an_unknown_outcome(tmp_path, children,
                                                                   monkeypatch):
    """Killed during the grace, after its TERM: not ``unsent`` (it did act)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(snap_request(stub), timeout=30)
    agent = conv.reply.doc["facts"]["agent_pid"]
    req = clean_request(tmp_path, stub, [{"pid": h.pid, "starttime": starttime(h.pid),
                                          "wave": 0}], grace_s=20.0, timeout_s=25.0)
    box = []
    asker = threading.Thread(target=lambda: box.append(conv.ask(req, timeout=40)))
    asker.start()
    wait_for(lambda: [x["signal"] for x in audit_lines(tmp_path)] == ["TERM"])
    os.kill(agent, signal.SIGKILL)
    asker.join(30)
    (reply,) = box
    assert (reply.ok, reply.unsent, reply.doc) == (False, False, None)
    assert (reply.error, reply.error_kind) == ("agent exited -9", errors.COMMAND)
    assert h.poll() is None  # TERM ignored, the KILL never came: the row must not say clean


def test_cancel_while_the_clean_runs_stops_its_signals_and_its_answer_says_so(
        tmp_path, children, monkeypatch):
    """The operator's second Ctrl-C: ``cancel`` from another thread while ``ask`` waits out a
    20 s grace. The answer comes at once with the TERM sent and the KILL not sent; the
    holder lives on."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(snap_request(stub), timeout=30)
    req = clean_request(tmp_path, stub, [{"pid": h.pid, "starttime": starttime(h.pid),
                                          "wave": 0}], grace_s=20.0, timeout_s=25.0)
    box = []
    asker = threading.Thread(target=lambda: box.append(conv.ask(req, timeout=40)))
    asker.start()
    wait_for(lambda: [x["signal"] for x in audit_lines(tmp_path)] == ["TERM"])
    assert conv.asked_at is not None and conv.asked_deadline_s is not None
    assert conv.cancel() is None and conv.cancelled_at is not None
    asker.join(5)
    assert not asker.is_alive(), "no answer after the cancel"
    (reply,) = box
    assert reply.ok, reply.error
    assert [(s["signal"], s["outcome"]) for s in reply.doc["signals"]] == [("TERM", "sent")]
    assert [p["signal"] for p in reply.doc["cancelled"]["pending"]] == ["KILL"]
    assert h.poll() is None and [x["signal"] for x in audit_lines(tmp_path)] == ["TERM"]
    conv.close()


def test_cancel_before_the_request_means_it_is_never_sent(tmp_path, children, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(snap_request(stub), timeout=30)
    assert conv.cancel() == "no request had been sent"
    reply = conv.ask(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}]), timeout=30)
    conv.close()
    assert (reply.ok, reply.unsent, reply.error_kind) == (False, True, errors.INTERRUPTED)
    assert h.poll() is None and audit_lines(tmp_path) == []


def test_cancel_after_the_conversation_ended_says_why_not(tmp_path, children, monkeypatch):
    """The agent is gone (the connection dropped): the cancel cannot reach it, and says so."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    conv = local(stub).converse(snap_request(stub), timeout=30)
    agent = conv.reply.doc["facts"]["agent_pid"]
    req = clean_request(tmp_path, stub, [{"pid": h.pid, "starttime": starttime(h.pid),
                                          "wave": 0}], grace_s=20.0, timeout_s=25.0)
    box = []
    asker = threading.Thread(target=lambda: box.append(conv.ask(req, timeout=40)))
    asker.start()
    wait_for(lambda: [x["signal"] for x in audit_lines(tmp_path)] == ["TERM"])
    os.kill(agent, signal.SIGKILL)  # the process this test's session started (its own pid)
    asker.join(30)
    why = conv.cancel()
    assert why is not None and why.startswith("its conversation"), why
    assert box[0].unsent is False and h.poll() is None
