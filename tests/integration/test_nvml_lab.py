"""NVML first, nvidia-smi as the fallback, end to end: the real CLI over real sshd lab hosts.

Every lab host has the fake libnvidia-ml.so.1 by default, so every other lab test runs the NVML
path; this module holds the two paths to the same numbers and keeps the nvidia-smi path's own
cases: a host without the library, a host whose NVML init fails, and the inventory's
`gpu_source` forcing either way.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_helpers import (
    assert_no_traceback,
    assert_one_line_error,
    home,  # noqa: F401  (fixture)
    run_gpufleet,
)

FAST = ("--grace", "1", "--timeout", "15")


def three_hosts(make_host: Any) -> list:
    """The same GPUs and holders (by MiB) on a host with NVML, one without the library and one
    whose NVML init fails."""
    hosts = [make_host("with-nvml", gpus=2), make_host("no-library", gpus=2, nvml=False),
             make_host("broken-nvml", gpus=2, nvml="broken")]
    for h in hosts:
        h.job = h.spawn_holder(gpus=[0, 1], mib=[1500, 700], title="job")
    return hosts


def numbers(host_doc: dict) -> list:
    return [(g["index"], g["memory_used_mib"], g["memory_total_mib"],
             g["memory_reserved_mib"], g["attributed_mib"], g["unattributed_mib"],
             [p["used_mib"] for p in g["processes"]]) for g in host_doc["gpus"]]


def test_nvml_is_used_when_there_and_nvidia_smi_otherwise_with_the_same_numbers(
        lab: Any, make_host: Any, home: Path) -> None:
    hosts = three_hosts(make_host)
    run = run_gpufleet(home, lab.inventory_yaml(hosts), "status", "--json")
    assert run.rc == 0, str(run)
    docs = {h.name: run.host(h.name) for h in hosts}
    facts = {n: (d["facts"]["gpu_source"], d["facts"]["gpu_source_reason"]) for n, d in docs.items()}
    assert facts["with-nvml"] == ("nvml", None)
    assert facts["no-library"][0] == "nvidia-smi"
    assert facts["no-library"][1].startswith("NVML unavailable: ")
    assert "libnvidia-ml.so.1" in facts["no-library"][1]
    assert facts["broken-nvml"][0] == "nvidia-smi"
    assert "nvmlInit" in facts["broken-nvml"][1]
    assert numbers(docs["with-nvml"]) == numbers(docs["no-library"]) == numbers(docs["broken-nvml"])
    assert numbers(docs["with-nvml"])[0][1] >= 1500  # real holders, not an empty fleet
    nv = docs["with-nvml"]["gpus"][0]
    assert nv["persistence_mode"] is True and nv["temperature_c"] is not None
    assert docs["no-library"]["gpus"][0]["persistence_mode"] is True  # --query-gpu has it too
    # the table is the same shape whatever read the GPUs
    table = run_gpufleet(home, lab.inventory_yaml(hosts), "status")
    assert table.rc == 0, str(table)
    rows = [line.split()[:2] for line in table.stdout.splitlines()[2:] if line.strip()]
    assert sorted(r[0] for r in rows if r[1] in ("0", "1")) == sorted(
        [h.name for h in hosts] * 2)


def test_gpu_source_in_the_inventory_forces_either_way(lab: Any, make_host: Any,
                                                      home: Path) -> None:
    with_nvml = make_host("with-nvml", gpus=1)
    without = make_host("no-library", gpus=1, nvml=False)
    inv = lab.inventory_yaml([with_nvml, without], **{"with-nvml": {"gpu_source": "nvidia-smi"},
                                                     "no-library": {"gpu_source": "nvml"}})
    run = run_gpufleet(home, inv, "status", "--json")
    assert run.rc == 1, str(run)
    forced_smi = run.host("with-nvml")
    assert forced_smi["ok"] and forced_smi["facts"]["gpu_source"] == "nvidia-smi"
    assert forced_smi["facts"]["gpu_source_reason"] == "gpu_source is nvidia-smi"
    forced_nvml = run.host("no-library")
    assert not forced_nvml["ok"] and forced_nvml["facts"]["gpu_source"] == "nvml"
    assert "NVML is unavailable" in forced_nvml["error"]
    assert forced_nvml["error_kind"] == "command"


def test_a_bad_gpu_source_is_one_line_and_exit_2(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("with-nvml", gpus=1)
    inv = lab.inventory_yaml([host], gpu_source="cuda")
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 2, str(run)
    assert_one_line_error(run)
    assert "gpu_source" in run.stderr


def test_clean_waits_for_memory_through_either_reader(lab: Any, make_host: Any,
                                                      home: Path) -> None:
    hosts = [make_host("with-nvml", gpus=2), make_host("no-library", gpus=2, nvml=False)]
    for h in hosts:
        h.job = h.spawn_holder(gpus=[1], mib=4000, title="job")
    inv = lab.inventory_yaml(hosts)
    run = run_gpufleet(home, inv, "clean", "--all", "--gpus", "1", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    assert_no_traceback(run)
    for h in hosts:
        doc = run.host(h.name)
        assert (doc["verdict"], [t["pid"] for t in doc["targets"]]) == ("clean", [h.job]), doc
