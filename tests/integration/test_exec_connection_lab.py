"""``connection: exec`` against a real lab host: the same agent, reached through nsenter into
the host's namespaces instead of sshd, gives the same holders and the same clean verdict as
over SSH (the lab host is both at once: its sshd, and its namespaces' init)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cli_helpers import home, run_gpufleet  # noqa: F401  (home: fixture)

FAST = ("--grace", "1", "--timeout", "15")


def exec_inventory(lab: Any, host: Any, path: Path) -> Path:
    """The host reached through ``nsenter`` into its namespaces: no address, no SSH."""
    entry = {"connection": "exec",
             "exec": ["nsenter", "-t", str(host.root_pid), "-m", "-u", "-p", "-w"]}
    doc = {"defaults": {"connect_timeout": 5, "command_timeout": 60},
           "hosts": {host.name: entry}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def holders(doc: dict) -> list[tuple[int, int, str]]:
    """(GPU, pid, name) of every process the snapshot saw on a GPU."""
    return sorted((int(g["index"]), int(p["pid"]), str(p.get("name")))
                  for g in doc["gpus"] for p in g.get("processes") or [])


def test_status_and_clean_over_exec_match_ssh(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host(gpus=2)
    kept = host.spawn_holder(gpus=[1], mib=900, title="trainer")
    over_ssh = lab.inventory_yaml([host])
    over_exec = exec_inventory(lab, host, home / "exec.yaml")

    ssh_status = run_gpufleet(home, over_ssh, "status", "--json")
    exec_status = run_gpufleet(home, over_exec, "status", "--json")
    assert ssh_status.rc == 0 and exec_status.rc == 0, (str(ssh_status), str(exec_status))
    seen = holders(ssh_status.host(host.name))
    assert seen and seen == holders(exec_status.host(host.name))

    verdicts = []
    for inv in (over_exec, over_ssh):  # exec frees GPU 0 first; ssh then finds it clean
        pid = host.spawn_holder(gpus=[0], mib=716, title="VLLM::Worker")
        run = run_gpufleet(home, inv, "clean", "--host", host.name, "--gpus", "0", "--yes",
                           "--json", *FAST)
        assert run.rc == 0, str(run)
        doc = run.host(host.name)
        verdicts.append((doc["ok"], doc["verdict"], [t["pid"] for t in doc["targets"]] == [pid]))
        assert not host.alive(pid)
    assert verdicts == [(True, "clean", True)] * 2
    assert host.alive(kept)
