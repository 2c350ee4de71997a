"""More hosts than --forks, some unreachable: every host's TCP connect starts at once, outside
the forks bound (gpufleet.transport.connection.Predial), so the unreachable hosts cost one
connect_timeout in all, not one per round of --forks (bench/README.md, "Targets missed" 3).

The timing bound is structural, not a performance goal: the hosts are ordered so that the
old behaviour (connect inside the forks bound) must run the blackholed connects in
``ceil(blackholed / forks) = 2`` rounds one after the other, each waiting its whole
connect_timeout, so it cannot finish in under 2 x connect_timeout; with every connect started
at once they all end together, once, while the live hosts are served (expected ~3.5 s against
the 6 s bound: seconds of headroom for a loaded machine).
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
    inv = lab.inventory_yaml(hosts, connect_timeout=CONNECT_TIMEOUT)

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
