"""12 CUDA processes on one GPU of a lab host whose fake driver keeps the measured share per
process outside the listed numbers (unlisted_mib_base=2, unlisted_mib_per_process=6: the real
H200's, docs/real-gpu.md): 74 MiB unattributed, above the 64 MiB tolerance, and nothing
hidden. `status` must not flag it; 200 MiB that no process owns on top must still be flagged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_helpers import assert_no_traceback, home, parse_table, run_gpufleet  # noqa: F401  (fixture)

N = 12


def _unattributed(run: Any, host: str) -> str:
    (row,) = [r for r in parse_table(run.stdout, "HOST") if r["HOST"] == host]
    return row["UNATTR (MiB)"]


def test_many_processes_are_not_hidden_memory(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("many-procs", gpus=1, unlisted_mib_base=2, unlisted_mib_per_process=6)
    pids = [host.spawn_holder(gpus=[0], mib=100, title="w%d" % i, via="exec") for i in range(N)]
    inv = lab.inventory_yaml([host])

    run = run_gpufleet(home, inv, "status", "--json")
    assert_no_traceback(run)
    (gpu,) = run.host(host.name)["gpus"]
    assert sorted(p["pid"] for p in gpu["processes"]) == sorted(pids)
    assert gpu["unattributed_mib"] == 2 + 6 * N
    assert gpu["unexpected_unattributed_mib"] == 0
    text = run_gpufleet(home, inv, "status")
    assert _unattributed(text, host.name) == "74", str(text)  # no "!"

    host.set_config(ghost_mib={"0": 200})
    text = run_gpufleet(home, inv, "status")
    assert _unattributed(text, host.name) == "274 !", str(text)
