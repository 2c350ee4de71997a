"""`clean` plans and acts through ONE agent process per host (a conversation over one exec),
counted where it happens: each lab host's sshd logs (at VERBOSE) every connection ("Accepted
publickey") and every exec ("Starting session: command"). Over OpenSSH the controller runs one
``ssh`` per host and no master; the agent that answered the plan is the one that signalled
(the same pid in the before and after snapshots).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import home, run_gpufleet  # noqa: F401  (home: fixture)

VERBOSE = "LogLevel VERBOSE"  # sshd logs "Starting session: command ..." per exec
FAST = ("--grace", "1", "--timeout", "15")


def log_mark(host: Any) -> int:
    return (host.dir / "sshd.log").stat().st_size


def sessions_since(host: Any, mark: int) -> tuple[int, int]:
    """(connections, execs) the host's sshd logged since ``mark``."""
    with open(host.dir / "sshd.log", "rb") as f:
        f.seek(mark)
        text = f.read().decode(errors="replace")
    return text.count("Accepted publickey"), text.count("Starting session: command")


def our_children(comm: str) -> list[list[str]]:
    """argv of this process's live children named ``comm`` (the controller's ssh processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name == comm and int(rest[1]) == os.getpid() and rest[0] not in ("Z", "X"):
            found.append([a.decode() for a in argv if a])
    return found


def host_agents(host: Any) -> list[int]:
    """In-host pids of agent processes (the bootstrap's text names it gpufleet-agent)."""
    pids = []
    for entry in host.path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"gpufleet-agent" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize("client", ["auto", "paramiko"])
def test_a_clean_of_n_hosts_is_one_connection_and_one_exec_per_host(lab: Any, make_host: Any,
                                                                    home: Path, client: str) -> None:
    hosts = [make_host("conv-%d" % i, gpus=2, sshd_extra=VERBOSE) for i in range(3)]
    jobs = [h.spawn_holder(gpus=[i % 2], mib=900 + i, title="job") for i, h in enumerate(hosts)]
    inv = lab.inventory_yaml(hosts, ssh_client=client)

    marks = {h.name: log_mark(h) for h in hosts}
    dry = run_gpufleet(home, inv, "clean", "--all", "--dry-run", "--json")
    assert dry.rc == 0, str(dry)
    assert {h.name: sessions_since(h, marks[h.name]) for h in hosts} == dict.fromkeys(
        (h.name for h in hosts), (1, 1))

    # the next command: over OpenSSH, through the connection the dry run kept (ssh_persist,
    # on by default: no new connection); paramiko keeps none
    again = (0, 1) if client == "auto" else (1, 1)
    marks = {h.name: log_mark(h) for h in hosts}
    run = run_gpufleet(home, inv, "clean", "--all", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    for h, job in zip(hosts, jobs):
        row = run.host(h.name)
        assert row["verdict"] == "clean", row
        assert [(s["pid"], s["signal"], s["outcome"]) for s in row["signals"]] == [
            (job, "TERM", "sent")]
        assert not h.alive(job)
    # the plan's snapshot and the clean: one exec per host, on one SSH connection
    assert {h.name: sessions_since(h, marks[h.name]) for h in hosts} == dict.fromkeys(
        (h.name for h in hosts), again)
    assert all(host_agents(h) == [] for h in hosts)  # each agent ended after its clean


@pytest.mark.parametrize("persist", [None, 0], ids=["kept-default", "ssh_persist-0"])
def test_over_openssh_one_ssh_process_per_host_no_master_one_agent(lab: Any, make_host: Any,
                                                                  home: Path, monkeypatch: Any,
                                                                  persist: Any) -> None:
    """While the operator is asked (every host planned), the controller holds exactly one
    ``ssh`` per host, none a master (-M), and each host runs exactly one agent: the process
    that then signals (its pid in the plan's snapshot and in the clean's after snapshot).
    With ``ssh_persist`` (the default) each ``ssh`` may start the kept master (ControlMaster
    =auto, its socket in gpufleet's directory): the master is the process it forks off and
    detaches, never the ``ssh`` the conversation runs over; with ``ssh_persist: 0`` none."""
    from gpufleet.config.inventory import load_inventory
    from gpufleet.ops.clean import CleanOptions, run_clean

    monkeypatch.setenv("HOME", str(home))
    hosts = [make_host("solo-%d" % i, gpus=1) for i in range(2)]
    jobs = [h.spawn_holder(gpus=[0], mib=800, title="job") for h in hosts]
    inventory = load_inventory(lab.inventory_yaml(hosts, ssh_persist=persist))
    seen: dict[str, Any] = {}

    def confirm(planned: list) -> bool:
        seen["ssh"] = our_children("ssh")
        seen["agents"] = {h.name: host_agents(h) for h in hosts}
        return True

    run = run_clean([inventory.get(h.name) for h in hosts],
                    CleanOptions(grace_s=1, timeout_s=15, audit_log=str(home / "audit.jsonl")),
                    confirm=confirm)
    assert len(seen["ssh"]) == 2, seen["ssh"]
    assert not any("-M" in argv or "ControlMaster=yes" in argv for argv in seen["ssh"]), seen["ssh"]
    if persist == 0:
        assert all("ControlMaster=no" in argv and "ControlPath=none" in argv for argv in seen["ssh"])
    else:
        kept_dir = os.path.join(os.environ["XDG_RUNTIME_DIR"], "gpufleet-ssh") + "/"
        assert all("ControlMaster=auto" in argv and any(
            a.startswith("ControlPath=" + kept_dir) for a in argv) for argv in seen["ssh"])
    for h, job, row in zip(hosts, jobs, run.results):
        assert row.verdict == "clean", row.error
        (agent,) = seen["agents"][h.name]
        assert row.before is not None and row.before.snapshot is not None and row.after is not None
        assert row.before.snapshot.facts.agent_pid == agent == row.after.facts.agent_pid
        assert [(s["pid"], s["outcome"]) for s in row.agent_doc["signals"]] == [(job, "sent")]
    assert our_children("ssh") == []  # every conversation's ssh ended with it
