"""Network and SSH faults during `gpufleet clean` (status is covered by
tests/integration/test_status_lab.py, the mechanics by test_transport.py).

Every case proves which processes are alive afterwards (faultkit.assert_gone_exactly) and
that nothing waits past its bound. Bounds are generous: they catch a hang (the kernel's SYN
retries last ~2 minutes), not slowness.
"""
from __future__ import annotations

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
    session_processes,
    settle,
    signals,
    start_cli,
    wait_for,
)

CONNECT_TIMEOUT = 2
SLACK_S = 25


def test_clean_with_dead_and_blackholed_hosts_cleans_the_rest(lab: Any, make_host: Any,
                                                            home: Path) -> None:
    host = make_host("net-ok", gpus=2)
    job = host.spawn_holder(gpus=[0], mib=1500, title="job")
    dead, black = lab.dead_host("net-dead"), lab.blackholed_host("net-black")
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([dead, black, host], connect_timeout=CONNECT_TIMEOUT)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--grace", "2")
    assert run.rc == 1, str(run)
    assert_no_traceback(run)
    assert run.seconds < CONNECT_TIMEOUT + SLACK_S, str(run)
    d, b, ok = run.host("net-dead"), run.host("net-black"), run.host("net-ok")
    assert (d["verdict"], d["error"]) == (
        "unreachable", "connection refused by 127.0.0.1:%d" % dead.port), d
    assert (b["verdict"], b["error"]) == (
        "unreachable", "connect to 127.0.0.1:%d timed out after %ds" % (black.port,
                                                                        CONNECT_TIMEOUT)), b
    assert d["signals"] == [] and b["signals"] == []
    assert ok["verdict"] == "clean", ok
    assert signals(ok["signals"]) == [(job, "TERM", "sent")]
    assert_gone_exactly(host, before, {job})
    assert signals(audit_log(home)) == [(job, "TERM", "sent")]


def test_sshd_killed_mid_clean_leaves_a_host_record_and_an_unknown_outcome(
        lab: Any, make_host: Any, home: Path) -> None:
    """The session dies after TERM, during the grace: the row says the outcome is unknown and
    to re-run status; on the host the agent still finishes (KILL after the grace, memory
    wait, lock released) and every signal is in the host-side audit."""
    host = make_host("net-sever", gpus=2)
    stubborn = host.spawn_holder(gpus=[0], mib=2000, title="stubborn", ignore_term=True)
    _other = host.spawn_holder(gpus=[1], mib=700, title="other-gpu")
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host])
    proc = start_cli(home, inv, "clean", "--all", "--yes", "--gpus", "0", "--grace", "3")
    wait_for(lambda: signals(agent_audit(host)) == [(stubborn, "TERM", "sent")], 60,
             "the agent's TERM")
    sshds = session_processes(host)
    assert sshds, "no sshd session process serves gpufleet"
    for pid in sshds:  # by pid, found as children of the host's sshd listener
        host.kill(pid, signal.SIGKILL)
    run = finish_cli(proc, timeout=60)
    print(run)
    assert run.rc == 1, str(run)
    assert_no_traceback(run)
    assert run.seconds < 3 + SLACK_S, str(run)
    assert ("the outcome on the host is unknown: run `gpufleet status --host net-sever`"
            in run.stdout), str(run)
    row = [ln for ln in run.stdout.splitlines() if ln.startswith("net-sever ")]
    assert len(row) == 1 and row[0].split()[6] == "error", str(run)
    assert row[0].split()[2] == "?", str(run)  # SIGNALLED: unknown, not 0
    # the remote sequence went on without its session, and recorded every signal
    wait_for(lambda: not agents_left(host), 30, "the orphaned agent to finish")
    assert signals(agent_audit(host)) == [(stubborn, "TERM", "sent"), (stubborn, "KILL", "sent")]
    assert all(r["host"] == "net-sever" and r["starttime"] == stubborn.starttime
               for r in agent_audit(host))
    assert audit_log(home) == []  # the controller never got the report: nothing invented
    assert_gone_exactly(host, before, {stubborn})
    # as the row says: status shows the outcome; and the host's clean lock was released
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    gpus = status.host("net-sever")["gpus"]
    assert [g["memory_used_mib"] for g in gpus] == [0, 700]
    again = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--gpus", "0")
    assert again.rc == 0 and again.host("net-sever")["verdict"] == "clean", str(again)
    assert_gone_exactly(host, before, {stubborn})


def test_wrong_user_and_wrong_key_signal_nothing(lab: Any, make_host: Any, home: Path,
                                                tmp_path: Path) -> None:
    host = make_host("net-auth", gpus=1)
    _job = host.spawn_holder(gpus=[0], mib=900, title="job")
    settle(host)
    before = census(host)
    stray = tmp_path / "stray_ed25519"
    lab._keygen(stray, "not-authorized")
    inv = tmp_path / "fleet.yaml"
    doc = {"hosts": {
        "as-nobody": lab.host_entry(host, user="nosuchuser"),
        "other-key": lab.host_entry(host, identity_file=str(stray)),
    }, "defaults": {"connect_timeout": CONNECT_TIMEOUT}}
    import yaml

    inv.write_text(yaml.safe_dump(doc))
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    assert_no_traceback(run)
    name = "[127.0.0.1]:%d" % host.port
    nobody, other = run.host("as-nobody"), run.host("other-key")
    assert nobody["error"].startswith("authentication failed for nosuchuser@%s (tried %s)"
                                      % (name, lab.client_key)), nobody
    assert other["error"].startswith("authentication failed for root@%s (tried %s)"
                                     % (name, stray)), other
    assert nobody["signals"] == other["signals"] == []
    assert run.seconds < SLACK_S, str(run)
    assert_gone_exactly(host, before, set())
    assert audit_log(home) == []


def test_host_keys_under_each_policy(lab: Any, make_host: Any, home: Path) -> None:
    """Unknown key: refused under strict, learnt under accept-new; changed key: refused under
    both. Only the host reached under a key gpufleet accepts is cleaned."""
    hosts = {name: make_host(name, gpus=1) for name in
             ("unknown-strict", "unknown-acceptnew", "changed-strict", "changed-acceptnew")}
    jobs = {name: h.spawn_holder(gpus=[0], mib=800, title="job") for name, h in hosts.items()}
    befores = {}
    for name, h in hosts.items():
        settle(h)
        befores[name] = census(h)
    empty = home / "empty_known_hosts"
    empty.write_text("")
    wrong = {}
    overrides = {}
    for name, h in hosts.items():
        if name.startswith("changed"):
            wrong[name] = home / ("wrong-%s" % name)
            wrong[name].write_text(lab.wrong_host_key_line(h) + "\n")
            path = wrong[name]
        else:
            path = empty
        overrides[name] = {"known_hosts_file": str(path),
                           "host_key_policy": "strict" if name.endswith("strict") else "accept-new"}
    inv = lab.inventory_yaml(list(hosts.values()), **overrides)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    assert_no_traceback(run)
    assert run.host("unknown-strict")["error"].startswith("unknown host key for [127.0.0.1]:%d"
                                                          % hosts["unknown-strict"].port)
    assert "gpufleet trust unknown-strict" in run.host("unknown-strict")["error"]
    for name in ("changed-strict", "changed-acceptnew"):
        assert run.host(name)["error"].startswith("HOST KEY CHANGED for [127.0.0.1]:%d"
                                                  % hosts[name].port), run.host(name)
        assert hosts[name].host_key_line.split()[2] not in wrong[name].read_text()
    learnt = run.host("unknown-acceptnew")
    assert learnt["verdict"] == "clean", learnt
    assert signals(learnt["signals"]) == [(jobs["unknown-acceptnew"], "TERM", "sent")]
    recorded = (home / ".config" / "gpufleet" / "known_hosts").read_text()
    keys = [h.host_key_line.split()[2] for h in hosts.values()]
    assert [k in recorded for k in keys] == [False, True, False, False]
    for name, h in hosts.items():
        assert_gone_exactly(h, befores[name], {jobs[name]} if name == "unknown-acceptnew" else ())
    assert empty.read_text() == ""


def test_proxyjump_clean_acts_on_the_target_never_on_the_jump_host(lab: Any, make_host: Any,
                                                                 home: Path) -> None:
    jump = make_host("jumpbox", gpus=1)
    target = make_host("behind", gpus=2)
    _jump_job = jump.spawn_holder(gpus=[0], mib=600, title="job")
    target_job = target.spawn_holder(gpus=[0], mib=600, title="job")
    for h in (jump, target):
        settle(h)
    before_jump, before_target = census(jump), census(target)
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "config").write_text(
        "Host jumpbox\n    HostName 127.0.0.1\n    Port %d\n    User root\n"
        "    IdentityFile %s\nHost behind\n    HostName 127.0.0.1\n    ProxyJump jumpbox\n"
        % (jump.port, lab.client_key))
    inv = lab.inventory_yaml([target], address="behind")  # reached as `ssh behind` would be
    logins = (jump.dir / "sshd.log").read_text().count("Accepted publickey")
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    assert status.host("behind")["facts"]["hostname"] == "behind"
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 0, str(run)
    assert signals(run.host("behind")["signals"]) == [(target_job, "TERM", "sent")]
    assert (jump.dir / "sshd.log").read_text().count("Accepted publickey") == logins + 2
    assert_gone_exactly(target, before_target, {target_job})
    assert_gone_exactly(jump, before_jump, set())
    jump.stop()  # the route is gone: the row says so, the target is not reached otherwise
    again = run_cli(home, inv, "status", "--json")
    assert again.rc == 1 and again.host("behind")["error"].startswith("via jump host jumpbox")
