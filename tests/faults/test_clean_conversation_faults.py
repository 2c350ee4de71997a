"""`clean`'s one conversation per host dying BEFORE the clean request was written: the row says
nothing was signalled (and to run the clean again), never an unknown outcome; the host is
untouched. (Dying AFTER it, mid-sequence: tests/faults/test_network.py
test_sshd_killed_mid_clean_leaves_a_host_record_and_an_unknown_outcome.)

The operator is the ``confirm`` callback of ops.clean.run_clean (what the CLI's prompt is): it
is slow past the agent's idle bound, or the host's sshd session is killed while it is asked.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from faultkit import (
    agent_audit,
    agents_left,
    assert_gone_exactly,
    audit_log,
    census,
    session_processes,
    settle,
    wait_for,
)


def live_ssh_children() -> list:
    """This process's ssh clients still running (the conversations' ``ssh`` processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            rest = stat[stat.rindex(")") + 2:].split()
            if stat[stat.index("(") + 1:stat.rindex(")")] == "ssh" and \
                    int(rest[1]) == os.getpid() and rest[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("client", ["auto", "paramiko"])
def test_operator_slower_than_the_idle_bound_signals_nothing(lab: Any, make_host: Any,
                                                             home: Path, monkeypatch: Any,
                                                             client: str) -> None:
    from gpufleet.config.inventory import load_inventory
    from gpufleet.ops.clean import CleanOptions, run_clean

    monkeypatch.setenv("HOME", str(home))
    host = make_host("slow-op", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=900, title="job")
    settle(host)
    before = census(host)
    inventory = load_inventory(lab.inventory_yaml([host], ssh_client=client))

    def confirm(planned: list) -> bool:
        assert [r.verdict for r in planned] == ["planned"]
        wait_for(lambda: not agents_left(host), 30, "the agent's idle bound")
        return True

    opts = CleanOptions(grace_s=1, timeout_s=15, audit_log=str(home / "audit.jsonl"), idle_s=0.5)
    (row,) = run_clean([inventory.get("slow-op")], opts, confirm=confirm).results
    assert (row.verdict, row.error_kind, row.outcome_unknown) == ("error", "agent", False)
    assert row.error == ("the agent ended its conversation: idle: no request within 0.5s; "
                         "nothing was signalled: run the clean again (`gpufleet clean --host "
                         "slow-op`)"), row.error
    assert row.agent_doc is None
    assert host.alive(job)
    assert agent_audit(host) == [] and audit_log(home) == []
    assert_gone_exactly(host, before, set())


@pytest.mark.parametrize("persist", [None, 0], ids=["kept-default", "ssh_persist-0"])
def test_sshd_session_killed_while_the_operator_is_asked_signals_nothing(
        lab: Any, make_host: Any, home: Path, monkeypatch: Any, persist: Any) -> None:
    """The connection cut while the operator is asked: nothing signalled, kind ``closed``.
    Over a fresh connection ssh says the server closed it; over the kept master (the
    default) the conversation's ssh is that master's client, whose own end says less
    (the master's stderr is /dev/null): "connection lost", or ssh's line when it has one."""
    from gpufleet.config.inventory import load_inventory
    from gpufleet.ops.clean import CleanOptions, run_clean

    monkeypatch.setenv("HOME", str(home))
    host = make_host("cut-op", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=900, title="job")
    settle(host)
    before = census(host)
    inventory = load_inventory(lab.inventory_yaml([host], ssh_persist=persist))

    def confirm(planned: list) -> bool:
        assert [r.verdict for r in planned] == ["planned"] and live_ssh_children()
        for pid in session_processes(host):  # by pid: children of the host's sshd listener
            host.kill(pid, signal.SIGKILL)
        wait_for(lambda: not live_ssh_children(), 30, "the controller's ssh to see it")
        return True

    opts = CleanOptions(grace_s=1, timeout_s=15, audit_log=str(home / "audit.jsonl"))
    (row,) = run_clean([inventory.get("cut-op")], opts, confirm=confirm).results
    assert (row.verdict, row.error_kind, row.outcome_unknown) == ("error", "closed", False), row
    assert row.error.endswith("; nothing was signalled: run the clean again (`gpufleet clean "
                              "--host cut-op`)"), row.error
    said = ("the server closed the connection",) if persist == 0 else (
        "connection lost", "the server closed the connection")
    assert row.error.startswith(tuple(f"the agent's conversation ended: {s};" for s in said)), \
        row.error
    wait_for(lambda: not agents_left(host), 30, "the agent to end at its EOF")
    assert host.alive(job)
    assert agent_audit(host) == [] and audit_log(home) == []
    assert_gone_exactly(host, before, set())
