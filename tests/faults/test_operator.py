"""Operator mistakes: Ctrl-C during a multi-host clean, two operators cleaning one host at
once, --gpus naming a GPU that does not exist.

As everywhere in this suite, each case proves exactly which processes are alive afterwards.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from faultkit import (
    agent_audit,
    agents_left,
    agents_waiting,
    assert_gone_exactly,
    assert_no_traceback,
    audit_log,
    audit_verdicts,
    census,
    finish_cli,
    run_cli,
    settle,
    signals,
    start_cli,
    TtyCli,
    wait_for,
)

SLACK_S = 25


def test_ctrl_c_during_a_multi_host_clean(lab: Any, make_host: Any, home: Path) -> None:
    """--forks 1: host A is mid-sequence (TERM sent, grace running) when Ctrl-C comes. A
    finishes its sequence (KILL after the grace, memory verified) and is reported and audited;
    B and C are never started; the exit code says interrupted."""
    a, b, c = make_host("int-a", gpus=1), make_host("int-b", gpus=1), make_host("int-c", gpus=1)
    a_job = a.spawn_holder(gpus=[0], mib=900, title="stubborn", ignore_term=True)
    _b_job = b.spawn_holder(gpus=[0], mib=900, title="job")
    _c_job = c.spawn_holder(gpus=[0], mib=900, title="job")
    befores = {}
    for h in (a, b, c):
        settle(h)
        befores[h.name] = census(h)
    inv = lab.inventory_yaml([a, b, c])
    proc = start_cli(home, inv, "--forks", "1", "clean", "--all", "--yes", "--grace", "3")
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


@pytest.mark.slow
def test_ctrl_c_twice_cancels_the_pending_kill_and_reports_what_was_sent(
        lab: Any, make_host: Any, home: Path) -> None:
    """Ctrl-C twice at the terminal while a TERM-ignoring holder is in its grace: the second
    Ctrl-C cancels what the host's agent had still to do (the KILL after the grace). The CLI
    says so and lists what had been sent; long after the grace the holder is still alive, and
    the operator's audit log holds every signal the host sent (its own record compared)."""
    grace = 10  # room for a slow machine: the two Ctrl-Cs must land inside it
    host = make_host("int-twice", gpus=1)
    stubborn = host.spawn_holder(gpus=[0], mib=5000, title="stubborn", ignore_term=True)
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host])
    cli = TtyCli(home, inv, "clean", "--all", "--yes", "--gpus", "0", "--grace", grace)
    wait_for(lambda: signals(agent_audit(host)) == [(stubborn, "TERM", "sent")], 60, "TERM")
    termed_at = time.monotonic()
    cli.ctrl_c()  # typed at the CLI's terminal: SIGINT to its foreground process group
    cli.wait_text("waiting for 1 host(s) already running (int-twice)")
    cli.ctrl_c()
    run = cli.finish(timeout=grace + SLACK_S)
    assert_no_traceback(run)
    assert run.rc == 130, str(run)
    assert time.monotonic() - termed_at < grace, str(run)  # it did not wait out the grace
    row = [ln.split() for ln in run.stdout.splitlines() if ln.startswith("int-twice ")]
    assert len(row) == 1 and row[0][2] == "1" and row[0][6] == "cancelled", str(run)
    assert ("int-twice: pending signals cancelled: sent SIGTERM to PID %d (stubborn); "
            "not sent: SIGKILL to PID %d" % (stubborn, stubborn)) in run.stdout, str(run)
    assert "result unknown" not in run.stdout, str(run)
    # long after the grace: the cancelled KILL never came
    time.sleep(max(0.0, termed_at + grace + 3 - time.monotonic()))
    assert host.alive(stubborn), "the holder was killed after the CLI said it would not be"
    wait_for(lambda: not agents_left(host), 30, "the host's agent to end")
    sent_on_host = signals(agent_audit(host))
    assert sent_on_host == [(stubborn, "TERM", "sent")], sent_on_host
    assert signals(audit_log(home)) == sent_on_host
    assert audit_verdicts(home) == [("int-twice", "cancelled")]
    assert_gone_exactly(host, before, set())
    host.kill(stubborn)  # the holder this test started, by its pid


def test_ctrl_c_while_planning_signals_nothing_anywhere(lab: Any, make_host: Any,
                                                        home: Path) -> None:
    """Ctrl-C while one host is still being planned (its driver hangs): the host already
    planned must not be acted on afterwards -- the operator said stop before any signal."""
    slow = make_host("plan-slow", gpus=1, driver="hang")
    ready = make_host("plan-ready", gpus=1)
    _job = ready.spawn_holder(gpus=[0], mib=900, title="job")
    befores = {}
    for h in (slow, ready):
        settle(h)
        befores[h.name] = census(h)
    inv = lab.inventory_yaml([slow, ready], command_timeout=5)

    def logins() -> int:
        return (ready.dir / "sshd.log").read_text().count("Accepted publickey")

    before_logins = logins()
    proc = start_cli(home, inv, "clean", "--all", "--yes")
    wait_for(lambda: agents_left(slow), 30, "the slow host's planning agent")
    # the ready host's plan is made: its agent answered and waits for the clean request
    wait_for(lambda: logins() > before_logins and agents_waiting(ready), 30,
             "the ready host's plan")
    os.kill(proc.pid, signal.SIGINT)
    run = finish_cli(proc, timeout=60)
    assert_no_traceback(run)
    assert run.rc == 130, str(run)
    assert "gpufleet: interrupted while planning: nothing signalled on any host" in run.stderr
    rows = {ln.split()[0]: ln.split() for ln in run.stdout.splitlines() if ln.startswith("plan-")}
    assert rows["plan-ready"][2:3] + rows["plan-ready"][6:7] == ["(1)", "planned"], str(run)
    assert audit_log(home) == [] and agent_audit(ready) == []
    wait_for(lambda: not agents_left(ready), 30, "the ready host's agent to end at its EOF")
    assert_gone_exactly(ready, befores["plan-ready"], set())
    assert_gone_exactly(slow, befores["plan-slow"], set())


def test_three_operators_clean_one_host_at_once(lab: Any, make_host: Any, home: Path,
                                                tmp_path: Path) -> None:
    """Operator 1 is mid-sequence (TERM sent, grace running). Operator 2 (timeout 1 s) finds
    the host's clean lock taken: nothing signalled, said so, and by whom (operator 1's agent,
    not operator 3's, which only waits for it). Operator 3 waits for the lock,
    then finds its target already gone: reported 'gone', never signalled twice."""
    host = make_host("shared-host", gpus=1)
    stubborn = host.spawn_holder(gpus=[0], mib=1500, title="stubborn", ignore_term=True)
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host])
    homes = []
    for n in (1, 2, 3):
        homes.append(tmp_path / ("operator%d" % n))
        homes[-1].mkdir()
    op1 = start_cli(homes[0], inv, "clean", "--all", "--yes", "--json", "--grace", "5")
    wait_for(lambda: signals(agent_audit(host)) == [(stubborn, "TERM", "sent")], 60, "op1 TERM")
    op2 = start_cli(homes[1], inv, "clean", "--all", "--yes", "--json", "--grace", "0.5", "--timeout", "1")
    op3 = start_cli(homes[2], inv, "clean", "--all", "--yes", "--json", "--grace", "1")
    r1, r2, r3 = (finish_cli(p, timeout=90) for p in (op1, op2, op3))
    for r in (r1, r2, r3):
        assert_no_traceback(r)
    one, two, three = (r.host("shared-host") for r in (r1, r2, r3))
    assert r1.rc == 0 and one["verdict"] == "clean", str(r1)
    assert signals(one["signals"]) == [(stubborn, "TERM", "sent"), (stubborn, "KILL", "sent")]
    assert r2.rc == 1 and two["verdict"] == "busy", str(r2)
    # who holds it: operator 1's agent (its bootstrap's command line), by PID and user
    assert two["error"].startswith("another gpufleet clean holds this host's lock: PID "), two
    assert ", user root, command \"python3 -S -E -s -c import sys;" in two["error"], two
    assert two["error"].endswith("; nothing was signalled") and "\n" not in two["error"]
    assert two["signals"] == []
    assert [t["pid"] for t in two["targets"]] == [stubborn]  # it had planned to, then stood back
    assert r3.rc == 0 and three["verdict"] == "clean", str(r3)
    assert signals(three["signals"]) == [(stubborn, "TERM", "gone")]
    assert signals(audit_log(homes[0])) == signals(one["signals"])
    assert audit_log(homes[1]) == []
    assert signals(audit_log(homes[2])) == [(stubborn, "TERM", "gone")]
    # each clean's verdict line: what the exporter reads back as the host's last clean
    assert [audit_verdicts(h) for h in homes] == [[("shared-host", v)] for v in ("clean", "busy", "clean")]
    sent = [s for s in signals(agent_audit(host)) if s[2] == "sent"]
    assert sent == [(stubborn, "TERM", "sent"), (stubborn, "KILL", "sent")]  # once each
    assert_gone_exactly(host, before, {stubborn})


def test_a_clean_that_waited_for_the_lock_reports_only_what_it_freed(
        lab: Any, make_host: Any, tmp_path: Path) -> None:
    """Operator 2 plans while operator 1's TERM-ignoring target still holds 5000 MiB, then
    waits for the host's lock while operator 1 kills it. Operator 2's "before" is what the
    GPU held once it had the lock: it reports FREED 0, never operator 1's 5000 MiB."""
    host = make_host("lock-freed", gpus=1)
    stubborn = host.spawn_holder(gpus=[0], mib=5000, title="stubborn", ignore_term=True)
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host])
    homes = []
    for n in (1, 2):
        homes.append(tmp_path / ("operator%d" % n))
        homes[-1].mkdir()
    op1 = start_cli(homes[0], inv, "clean", "--all", "--yes", "--json", "--grace", "5")
    wait_for(lambda: signals(agent_audit(host)) == [(stubborn, "TERM", "sent")], 60, "op1 TERM")
    op2 = start_cli(homes[1], inv, "clean", "--all", "--yes", "--json", "--grace", "1")
    r1, r2 = (finish_cli(p, timeout=90) for p in (op1, op2))
    for r in (r1, r2):
        assert_no_traceback(r)
    one, two = r1.host("lock-freed"), r2.host("lock-freed")
    assert one["verdict"] == "clean" and one["freed_mib"] == 5000, str(r1)
    # operator 2 planned while the holder still held its memory (it meant to signal it) ...
    assert [t["pid"] for t in two["targets"]] == [stubborn], str(r2)
    assert [t["used_mib"] for t in two["targets"]] == [5000], str(r2)
    # ... and found it gone once it held the lock: it freed nothing itself
    assert signals(two["signals"]) == [(stubborn, "TERM", "gone")], str(r2)
    assert two["verdict"] == "clean" and two["freed_mib"] == 0, str(r2)
    assert two["before"] == [{"index": 0, "memory_used_mib": 0}], str(r2)
    assert_gone_exactly(host, before, {stubborn})


def test_gpus_naming_a_gpu_that_does_not_exist(lab: Any, make_host: Any, home: Path) -> None:
    """--gpus 2-3 on a fleet where one host has 4 GPUs and one has 2: a usage error on one host
    means nothing is signalled anywhere (exit 2, one line per problem); an index beyond any
    possible GPU is refused before connecting."""
    big, small = make_host("four-gpus", gpus=4), make_host("two-gpus", gpus=2)
    _big_job = big.spawn_holder(gpus=[2, 3], mib=700, title="job")
    _small_job = small.spawn_holder(gpus=[1], mib=700, title="job")
    befores = {}
    for h in (big, small):
        settle(h)
        befores[h.name] = census(h)
    inv = lab.inventory_yaml([big, small])
    run = run_cli(home, inv, "clean", "--all", "--yes", "--gpus", "2-3")
    assert run.rc == 2, str(run)
    assert run.stderr.splitlines() == [
        "gpufleet: error: GPU 2 does not exist on two-gpus (has 0-1)",
        "gpufleet: nothing signalled on any host"], str(run)
    assert run.stdout == ""
    logins = [(h.dir / "sshd.log").read_text().count("Accepted publickey") for h in (big, small)]
    huge = run_cli(home, inv, "clean", "--all", "--yes", "--gpus", "0-99999")
    assert huge.rc == 2 and huge.stderr.strip() == (
        "gpufleet: error: --gpus: GPU index 99999 is too large (at most 1023)"), str(huge)
    assert [(h.dir / "sshd.log").read_text().count("Accepted publickey")
            for h in (big, small)] == logins  # refused before any connection
    assert audit_log(home) == []
    assert_gone_exactly(big, befores["four-gpus"], set())
    assert_gone_exactly(small, befores["two-gpus"], set())


def test_ctrl_c_during_status_prints_what_was_gathered_and_exits_130(
        lab: Any, make_host: Any, home: Path) -> None:
    """--forks 1: the first host hangs in connect (blackholed) when Ctrl-C comes; a second
    Ctrl-C stops waiting for it. The other host is never started; exit 130, no traceback."""
    slow = lab.blackholed_host("int-slow")
    later = make_host("int-later", gpus=1)
    inv = lab.inventory_yaml([slow, later], connect_timeout=30)
    proc = start_cli(home, inv, "--forks", "1", "status")
    time.sleep(1.5)  # the CLI is inside the blackholed connect (bounded by its 30 s timeout)
    os.kill(proc.pid, signal.SIGINT)  # the CLI this test started, by its pid
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    run = finish_cli(proc, timeout=60)
    assert_no_traceback(run)
    assert run.rc == 130, str(run)
    assert run.seconds < 30, str(run)  # did not wait out the connect timeout
    rows = {ln.split()[0]: ln for ln in run.stdout.splitlines() if ln.startswith("int-")}
    assert "not started (interrupted)" in rows["int-later"], str(run)
    assert "gpufleet: interrupted" in run.stderr, str(run)
