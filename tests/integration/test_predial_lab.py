"""More hosts than --forks, some unreachable: every host's TCP connect starts at once, outside
the forks bound (gpufleet.transport.dial.Predial), so the unreachable hosts cost one
connect_timeout in all, not one per round of --forks (bench/README.md, "Targets missed" 3).

The timing bound is structural, not a performance goal: the hosts are ordered so that the
old behaviour (connect inside the forks bound) must run the blackholed connects in
``ceil(blackholed / forks) = 2`` rounds one after the other, each waiting its whole
connect_timeout, so it cannot finish in under 2 x connect_timeout; with every connect started
at once they all end together, once, while the live hosts are served (expected ~3.5 s against
the 6 s bound: seconds of headroom for a loaded machine).

Pre-dialling is the paramiko path's (``ssh_client: paramiko``; `gpufleet trust` always uses
it): the OpenSSH client makes its own connection, and a TCP probe before it would be a second
connection per host that sshd logs as a failed pre-auth one (docs/inventory.md, ssh_client).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import assert_no_traceback, home, run_gpufleet  # noqa: F401  (fixture)

CONNECT_TIMEOUT = 3
MIB = 1234


@pytest.mark.parametrize("forks,blackholed", [(1, 2), (2, 4)])
def test_unreachable_hosts_cost_one_connect_timeout_whatever_forks(
        lab: Any, make_host: Any, home: Path, forks: int, blackholed: int) -> None:
    tag = "pd%d" % forks
    live = [make_host("%s-live%d" % (tag, i), gpus=1) for i in range(3)]
    holders = [h.spawn_holder(gpus=[0], mib=MIB, title="job%d" % i) for i, h in enumerate(live)]
    dead = lab.dead_host("%s-dead" % tag)
    black = [lab.blackholed_host("%s-black%d" % (tag, i)) for i in range(blackholed)]
    # Live and dead hosts first: the old code reached the blackholed ones only after them.
    hosts = live + [dead] + black
    inv = lab.inventory_yaml(hosts, connect_timeout=CONNECT_TIMEOUT, ssh_client="paramiko")

    run = run_gpufleet(home, inv, "--forks", str(forks), "status", "--json")

    assert_no_traceback(run)
    assert run.rc == 1, str(run)  # some hosts failed
    assert [h["host"] for h in run.json()["hosts"]] == [h.name for h in hosts], "inventory order"
    for host, pid in zip(live, holders):
        row = run.host(host.name)
        assert row["ok"] is True and row["error"] is None, str(run)
        (gpu,) = row["gpus"]
        assert gpu["memory_used_mib"] == MIB, str(run)
        assert [p["pid"] for p in gpu["processes"]] == [pid], str(run)
    d = run.host(dead.name)
    assert (d["ok"], d["error"]) == (False, "connection refused by 127.0.0.1:%d" % dead.port), d
    for ep in black:
        b = run.host(ep.name)
        assert (b["ok"], b["error"]) == (
            False, "connect to 127.0.0.1:%d timed out after %ds" % (ep.port, CONNECT_TIMEOUT)), b
        assert b["gpus"] == [] and b["holders"] == []

    rounds = math.ceil(blackholed / forks)
    assert rounds == 2
    assert run.seconds < rounds * CONNECT_TIMEOUT, str(run)


def _mixed_fleet(lab: Any, make_host: Any, tag: str) -> tuple[list, list, Any, list]:
    live = [make_host("%s-live%d" % (tag, i), gpus=1) for i in range(2)]
    holders = [h.spawn_holder(gpus=[0], mib=MIB, title="job%d" % i) for i, h in enumerate(live)]
    dead = lab.dead_host("%s-dead" % tag)
    black = [lab.blackholed_host("%s-black%d" % (tag, i)) for i in range(2)]
    return live, holders, dead, black


def test_clean_dry_run_is_predialled(lab: Any, make_host: Any, home: Path) -> None:
    """`clean --dry-run` with --forks 1: the two blackholed hosts' connects run at once, so
    the run ends within one connect_timeout (+ the live plans), not two in a row."""
    live, holders, dead, black = _mixed_fleet(lab, make_host, "pdc")
    hosts = black + live + [dead]  # the old code waited for each blackholed host in turn
    inv = lab.inventory_yaml(hosts, connect_timeout=CONNECT_TIMEOUT, ssh_client="paramiko")

    run = run_gpufleet(home, inv, "--forks", "1", "clean", "--all", "--dry-run", "--json")

    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    assert [h["host"] for h in run.json()["hosts"]] == [h.name for h in hosts]
    for host, pid in zip(live, holders):
        row = run.host(host.name)
        assert row["verdict"] == "planned", str(run)
        assert [t["pid"] for t in row["targets"]] == [pid], str(run)
    for ep in black:
        assert run.host(ep.name)["error"] == "connect to 127.0.0.1:%d timed out after %ds" % (
            ep.port, CONNECT_TIMEOUT), str(run)
    assert "refused" in run.host(dead.name)["error"]
    assert run.seconds < 2 * CONNECT_TIMEOUT, str(run)


def test_trust_is_predialled(lab: Any, make_host: Any, home: Path) -> None:
    """`trust` asks host after host; their connects all start at once, so two blackholed
    hosts before the live ones cost one connect_timeout in all."""
    live, _holders, dead, black = _mixed_fleet(lab, make_host, "pdt")
    hosts = black + [dead] + live
    inv = lab.inventory_yaml(hosts, connect_timeout=CONNECT_TIMEOUT, known_hosts_file=None)
    known = home / "trusted"

    run = run_gpufleet(home, inv, "--forks", "1", "trust", *[h.name for h in hosts], "--yes",
                       "--known-hosts", str(known))

    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    for ep in black:
        assert "%s: connect to 127.0.0.1:%d timed out after %ds" % (
            ep.name, ep.port, CONNECT_TIMEOUT) in run.stderr, str(run)
    assert "%s: connection refused" % dead.name in run.stderr, str(run)
    for host in live:
        assert "%s: [127.0.0.1]:%d ssh-ed25519 SHA256:" % (host.name, host.port) in run.stdout, str(run)
        assert "recorded in %s" % known in run.stdout, str(run)
    assert sorted(line.split()[0] for line in known.read_text().splitlines()) == sorted(
        "[127.0.0.1]:%d" % h.port for h in live)
    assert run.seconds < 2 * CONNECT_TIMEOUT, str(run)
