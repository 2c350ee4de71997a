"""Operator mistakes: Ctrl-C during a multi-host clean, two operators cleaning one host at
once, --gpus naming a GPU that does not exist.

As everywhere in this suite, each case proves exactly which processes are alive afterwards.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from faultkit import (
    agent_audit,
    agents_left,
    assert_gone_exactly,
    assert_no_traceback,
    audit_log,
    census,
    finish_cli,
    run_cli,
    settle,
    signals,
    start_cli,
    wait_for,
)

SLACK_S = 25


def test_ctrl_c_during_a_multi_host_clean(lab: Any, make_host: Any, home: Path) -> None:
    """--forks 1: host A is mid-sequence (TERM sent, grace running) when Ctrl-C comes. A
    finishes its sequence (KILL after the grace, memory verified) and is reported and audited;
    B and C are never started; the exit code says interrupted."""
    a, b, c = make_host("int-a", gpus=1), make_host("int-b", gpus=1), make_host("int-c", gpus=1)
    a_job = a.spawn_holder(gpus=[0], mib=900, title="stubborn", ignore_term=True)
    b_job = b.spawn_holder(gpus=[0], mib=900, title="job")
    c_job = c.spawn_holder(gpus=[0], mib=900, title="job")
    befores = {}
    for h in (a, b, c):
        settle(h)
        befores[h.name] = census(h)
    inv = lab.inventory_yaml([a, b, c])
    proc = start_cli(home, inv, "--forks", "1", "clean", "--yes", "--grace", "3")
    wait_for(lambda: signals(agent_audit(a)) == [(a_job, "TERM", "sent")], 60, "A's TERM")
    os.kill(proc.pid, signal.SIGINT)  # the CLI this test started, by its pid
    run = finish_cli(proc, timeout=60)
    assert_no_traceback(run)
    assert run.seconds < 3 + SLACK_S, str(run)
    rows = {ln.split()[0]: ln for ln in run.stdout.splitlines() if ln.startswith("int-")}
    assert rows["int-a"].split()[6] == "clean", str(run)
    for name in ("int-b", "int-c"):
        assert rows[name].split()[6] == "interrupted", str(run)
        assert "%s: not started (interrupted); nothing signalled" % name in run.stdout, str(run)
    assert signals(audit_log(home)) == [(a_job, "TERM", "sent"), (a_job, "KILL", "sent")]
    assert agent_audit(b) == [] and agent_audit(c) == []
    assert run.rc == 130, str(run)
    assert "gpufleet: interrupted: waiting for 1 host(s) already running (int-a)" in run.stderr
    assert_gone_exactly(a, befores["int-a"], {a_job})
    assert_gone_exactly(b, befores["int-b"], set())
    assert_gone_exactly(c, befores["int-c"], set())


def test_ctrl_c_while_planning_signals_nothing_anywhere(lab: Any, make_host: Any,
                                                        home: Path) -> None:
    """Ctrl-C while one host is still being planned (its driver hangs): the host already
    planned must not be acted on afterwards -- the operator said stop before any signal."""
    slow = make_host("plan-slow", gpus=1, driver="hang")
    ready = make_host("plan-ready", gpus=1)
    job = ready.spawn_holder(gpus=[0], mib=900, title="job")
    befores = {}
    for h in (slow, ready):
        settle(h)
        befores[h.name] = census(h)
    inv = lab.inventory_yaml([slow, ready], command_timeout=5)
    proc = start_cli(home, inv, "clean", "--yes")
    wait_for(lambda: agents_left(slow), 30, "the slow host's planning agent")
    wait_for(lambda: "Accepted publickey" in (ready.dir / "sshd.log").read_text()
             and not agents_left(ready), 30, "the ready host's plan")
    os.kill(proc.pid, signal.SIGINT)
    run = finish_cli(proc, timeout=60)
    assert_no_traceback(run)
    assert run.rc == 130, str(run)
    assert "gpufleet: interrupted while planning: nothing signalled on any host" in run.stderr
    assert audit_log(home) == [] and agent_audit(ready) == []
    assert_gone_exactly(ready, befores["plan-ready"], set())
    assert_gone_exactly(slow, befores["plan-slow"], set())
