"""The metric model (gpufleet.core.metrics): HostResult values in, families out, no server.

Inputs are the scenario and status fixtures (agent documents built from recorded output); each
expectation is computed from the document's own numbers, so a wrong join, unit or label fails.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from gpufleet.core.metrics import (FAMILIES, MIB, ExportOptions, LastClean, RefreshStats,
                                   fleet_families, gpu_labels)
from gpufleet.core.model import HostResult, parse_snapshot
from gpufleet.render.prometheus import exposition

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def doc(name: str) -> dict:
    for sub in ("scenarios", "status"):
        path = FIX / sub / f"{name}.json"
        if path.exists():
            return json.loads(path.read_text())
    raise FileNotFoundError(name)


def ok(host: str, name: str, seconds: float = 0.25) -> HostResult:
    return HostResult(host=host, ok=True, snapshot=parse_snapshot(doc(name)), seconds=seconds)


def series(families, name: str) -> dict[tuple, float]:
    """{label dict as sorted items: value} of one family."""
    fam = next((f for f in families if f.name == name), None)
    if fam is None:
        return {}
    return {tuple(sorted(zip(fam.labels, values))): value for values, value in fam.samples}


def pick(found: dict[tuple, float], **labels: str) -> dict[tuple, float]:
    return {k: v for k, v in found.items() if all(dict(k).get(n) == x for n, x in labels.items())}


def one(found: dict[tuple, float], **labels: str) -> float:
    hits = pick(found, **labels)
    assert len(hits) == 1, (labels, found)
    return next(iter(hits.values()))


def test_gpu_series_carry_dcgm_exporter_labels_and_base_units() -> None:
    raw = doc("train-node")
    fams = fleet_families([ok("train", "train-node")], {"train": 0})
    used = series(fams, "gpufleet_gpu_memory_used_bytes")
    assert len(used) == len(raw["gpus"])
    for g in raw["gpus"]:
        labels = dict(next(k for k in used if dict(k)["gpu"] == str(g["index"])))
        assert labels == {"host": "train", "Hostname": raw["facts"]["hostname"],
                          "gpu": str(g["index"]), "UUID": g["uuid"], "model_name": g["name"],
                          "pci_bus_id": g["pci_bus_id"]}
        assert labels["UUID"].startswith("GPU-")
        assert one(used, gpu=str(g["index"])) == g["memory_used_mib"] * MIB
        total = series(fams, "gpufleet_gpu_memory_total_bytes")
        assert one(total, gpu=str(g["index"])) == g["memory_total_mib"] * MIB
        util = series(fams, "gpufleet_gpu_utilization_ratio")
        assert one(util, gpu=str(g["index"])) == pytest.approx(g["utilization_pct"] / 100)


def test_unattributed_is_used_minus_listed_memory_and_holders_are_counted_per_gpu() -> None:
    raw = doc("train-node")
    fams = fleet_families([ok("train", "train-node")], {"train": 0})
    unattr = series(fams, "gpufleet_gpu_unattributed_memory_bytes")
    holders = series(fams, "gpufleet_gpu_holders")
    for g in raw["gpus"]:
        apps = [a for a in raw["compute_apps"] if a["gpu_uuid"] == g["uuid"]]
        expected = g["memory_used_mib"] - sum(a["used_mib"] for a in apps)
        assert one(unattr, gpu=str(g["index"])) == expected * MIB
        assert one(holders, gpu=str(g["index"]), source="listed") == len({a["pid"] for a in apps})
        # nvidia-persistenced and nv-hostengine hold every device file: GPU clients, not holders
        assert one(holders, gpu=str(g["index"]), source="device_file") == 0


def test_device_file_holders_nvidia_smi_does_not_list_are_counted() -> None:
    raw = doc("hidden-pids")  # a container: nvidia-smi lists nothing, the fds show the vLLM family
    fams = fleet_families([ok("pod", "hidden-pids")], {})
    holders = series(fams, "gpufleet_gpu_holders")
    unlisted = {h["pid"] for h in raw["holders"]} - {a["pid"] for a in raw["compute_apps"]}
    assert unlisted and len(raw["gpus"]) == 2
    for g in raw["gpus"]:
        assert one(holders, gpu=str(g["index"]), source="listed") == 0
        assert one(holders, gpu=str(g["index"]), source="device_file") == len(unlisted)
    # every one of them runs in a container: none is "unmanaged"
    assert one(series(fams, "gpufleet_unmanaged_holders"), host="pod") == 0


def test_expected_unattributed_and_not_available_per_process_memory() -> None:
    """WSL2 (per-process memory n/a): the expected 1680 MiB is exported; what cannot be
    known (unattributed with a process of unknown memory) is no sample, never a zero."""
    fams = fleet_families([ok("bigmama", "na_fields"), ok("busy", "na_fields_busy")],
                          {"bigmama": 1680, "busy": 1680}, opts=ExportOptions(per_process=True))
    expected = series(fams, "gpufleet_gpu_expected_unattributed_memory_bytes")
    assert one(expected, host="bigmama") == 1680 * MIB
    unattr = series(fams, "gpufleet_gpu_unattributed_memory_bytes")
    assert one(unattr, host="bigmama") == doc("na_fields")["gpus"][0]["memory_used_mib"] * MIB
    assert pick(unattr, host="busy") == {}
    unexpected = series(fams, "gpufleet_gpu_unexpected_unattributed_memory_bytes")
    assert one(unexpected, host="bigmama") == 0
    assert series(fams, "gpufleet_process_memory_used_bytes") == {}


def test_unexpected_unattributed_leaves_out_the_expected_amount_and_the_drivers_share() -> None:
    raw = doc("basic")
    g = raw["gpus"][0]
    apps = [a for a in raw["compute_apps"] if a["gpu_uuid"] == g["uuid"]]
    unattr = g["memory_used_mib"] - sum(a["used_mib"] for a in apps)
    for expected in (0, 5, unattr + 10):
        fams = fleet_families([ok("vm", "basic")], {"vm": expected})
        driver = 3 + 6 * len({a["pid"] for a in apps})
        want = max(0, unattr - expected - driver)
        assert one(series(fams, "gpufleet_gpu_unexpected_unattributed_memory_bytes"),
                   host="vm") == want * MIB


def test_a_failed_host_is_up_0_with_its_kind_and_the_others_are_unaffected() -> None:
    good = ok("train", "train-node")
    dead = HostResult(host="dead", ok=False, error="connection refused", error_kind="refused")
    garbage = HostResult(host="garbled", ok=False, error="agent output is not JSON",
                         error_kind="agent")
    alone = fleet_families([good], {})
    fams = fleet_families([dead, good, garbage], {})
    up = series(fams, "gpufleet_up")
    assert one(up, host="dead") == 0 and dict(next(iter(pick(up, host="dead"))))["reason"] == "refused"
    assert dict(next(iter(pick(up, host="garbled"))))["reason"] == "agent"
    assert one(up, host="train", reason="") == 1
    for fam in alone:
        if fam.name != "gpufleet_up" and fam.name != "gpufleet_agent_seconds":
            assert series(fams, fam.name) == series(alone, fam.name), fam.name
    assert pick(series(fams, "gpufleet_gpu_memory_used_bytes"), host="dead") == {}


def test_nvidia_smi_failing_is_up_0_reason_command() -> None:
    fams = fleet_families([ok("broken", "broken_driver")], {})
    up = series(fams, "gpufleet_up")
    assert one(up, host="broken", reason="command") == 0
    assert series(fams, "gpufleet_gpu_memory_used_bytes") == {}


def test_unmanaged_holders_leave_out_systemd_services() -> None:
    unit = fleet_families([ok("svc", "unit-vllm")], {})
    assert one(series(unit, "gpufleet_unmanaged_holders"), host="svc") == 0  # vllm-minimax.service
    raw = doc("train-node")  # everything in alice's session scope: none is a service
    fams = fleet_families([ok("train", "train-node")], {})
    listed = {a["pid"] for a in raw["compute_apps"]}
    assert one(series(fams, "gpufleet_unmanaged_holders"), host="train") == len(listed)


def test_per_process_memory_is_opt_in_bounded_and_summed_over_chosen_labels() -> None:
    raw = doc("train-node")
    assert series(fleet_families([ok("train", "train-node")], {}),
                  "gpufleet_process_memory_used_bytes") == {}
    everything = fleet_families([ok("train", "train-node")], {},
                                opts=ExportOptions(per_process=True, max_processes=1000))
    procs = series(everything, "gpufleet_process_memory_used_bytes")
    assert len(procs) == len(raw["compute_apps"])
    worker = next(a for a in raw["compute_apps"] if a["used_mib"] == 44136)
    gpu = next(g for g in raw["gpus"] if g["uuid"] == worker["gpu_uuid"])
    labels = dict(next(iter(pick(procs, pid=str(worker["pid"])))))
    assert (labels["gpu"], labels["name"], labels["user"]) == (str(gpu["index"]), "VLLM::Worker", "alice")
    assert set(labels) == set(gpu_labels()) | {"pid", "name", "user"}

    bounded = fleet_families([ok("train", "train-node")], {},
                             opts=ExportOptions(per_process=True, max_processes=3))
    top = series(bounded, "gpufleet_process_memory_used_bytes")
    biggest = sorted((a["used_mib"] for a in raw["compute_apps"]), reverse=True)[:3]
    assert sorted(top.values(), reverse=True) == [m * MIB for m in biggest]
    assert one(series(bounded, "gpufleet_process_series_dropped"), host="train") == \
        len(raw["compute_apps"]) - 3

    by_name = fleet_families([ok("train", "train-node")], {},
                             opts=ExportOptions(per_process=True, process_labels=("name",)))
    named = series(by_name, "gpufleet_process_memory_used_bytes")
    gpu0 = raw["gpus"][0]
    apps0 = [a for a in raw["compute_apps"] if a["gpu_uuid"] == gpu0["uuid"]]
    assert sum(pick(named, gpu="0").values()) == sum(a["used_mib"] for a in apps0) * MIB
    assert all("pid" not in dict(k) for k in named)


def test_model_label_choice_renames_only_that_label() -> None:
    fams = fleet_families([ok("vm", "basic")], {}, opts=ExportOptions(model_label="modelName"))
    labels = dict(next(iter(series(fams, "gpufleet_gpu_memory_used_bytes"))))
    assert labels["modelName"] == doc("basic")["gpus"][0]["name"] and "model_name" not in labels


def test_last_clean_per_host_and_counts() -> None:
    cleans = {"vm": LastClean("dirty", 1_800_000_000.5, {"clean": 3, "dirty": 1}),
              "gone": LastClean("clean", 1.0, {"clean": 1})}  # not selected: not exported
    fams = fleet_families([ok("vm", "basic")], {}, last_cleans=cleans)
    assert series(fams, "gpufleet_last_clean_timestamp_seconds") == {(("host", "vm"),): 1_800_000_000.5}
    assert series(fams, "gpufleet_last_clean_verdict") == {(("host", "vm"), ("verdict", "dirty")): 1}
    assert series(fams, "gpufleet_cleans_total") == {
        (("host", "vm"), ("verdict", "clean")): 3, (("host", "vm"), ("verdict", "dirty")): 1}


@dataclass(frozen=True)
class Finding:
    host: str
    gpu: Optional[int]
    code: str
    severity: str


def test_health_findings_become_one_series_each() -> None:
    found = [Finding("vm", 0, "xid_79", "critical"), Finding("vm", 0, "xid_79", "critical"),
             Finding("vm", None, "gpu_count", "warn")]
    fams = fleet_families([ok("vm", "basic")], {}, findings=found)
    assert series(fams, "gpufleet_health_finding") == {
        (("code", "xid_79"), ("gpu", "0"), ("host", "vm"), ("severity", "critical")): 1,
        (("code", "gpu_count"), ("gpu", ""), ("host", "vm"), ("severity", "warn")): 1}


def test_every_family_is_named_by_the_conventions() -> None:
    units = ("_bytes", "_seconds", "_ratio", "_total")
    unitless = {"gpufleet_up", "gpufleet_gpus", "gpufleet_unmanaged_holders",
                "gpufleet_gpu_holders", "gpufleet_process_series_dropped",
                "gpufleet_last_clean_verdict", "gpufleet_health_finding"}
    for name, (kind, text, _, _) in FAMILIES.items():
        assert name.startswith("gpufleet_") and text
        assert name.endswith(units) or name in unitless, name
        assert (kind == "counter") == name.endswith("_total"), name


def test_exposition_text_round_trips_through_the_prometheus_parser() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    stats = RefreshStats(seconds=0.5, ended_at=1_800_000_000.0, ok=4, failed=1)
    fams = fleet_families([ok("train", "train-node"), HostResult(host="dead", ok=False,
                           error="refused", error_kind="refused")], {},
                          opts=ExportOptions(per_process=True), refresh=stats)
    text = exposition(fams).decode()
    parsed = {m.name: m for m in text_string_to_metric_families(text)}
    assert parsed["gpufleet_refreshes"].type == "counter"
    assert {s.labels["result"]: s.value for s in parsed["gpufleet_refreshes"].samples} == {
        "ok": 4, "failed": 1}
    for fam in fams:
        base = fam.name[:-len("_total")] if fam.kind == "counter" else fam.name
        assert len(parsed[base].samples) == len(fam.samples), fam.name
    worker = doc("train-node")["compute_apps"][1]
    assert any(s.labels.get("pid") == str(worker["pid"]) and s.value == worker["used_mib"] * MIB
               for s in parsed["gpufleet_process_memory_used_bytes"].samples)


def test_a_failed_host_keeps_its_last_known_hostname_when_given() -> None:
    dead = HostResult(host="train", ok=False, error="connection refused", error_kind="refused")
    assert one(series(fleet_families([dead], {}), "gpufleet_up"), host="train", Hostname="") == 0
    fams = fleet_families([dead], {}, hostnames={"train": "train-node"})
    assert one(series(fams, "gpufleet_up"), host="train", Hostname="train-node") == 0


def test_export_carries_the_health_findings_of_gpufleet_health() -> None:
    """Health in the exporter: the same judgement as `gpufleet health` (core/health.assess),
    one gpufleet_health_finding series per finding; a healthy host has none."""
    from gpufleet.config.inventory import Host
    from gpufleet.ops.export import families_for

    sick = doc("basic")
    sick["gpus"][0]["ecc_uncorrected_volatile"] = 3
    results = [HostResult(host="sick", ok=True, snapshot=parse_snapshot(sick), seconds=0.1),
               ok("well", "basic")]
    hosts = [Host(name="sick", gpus=len(sick["gpus"]) + 1), Host(name="well")]
    fams = families_for(hosts, results, {"sick": 0.0, "well": 0.0}, ExportOptions(), None)
    found = series(fams, "gpufleet_health_finding")
    gpu0 = str(sick["gpus"][0]["index"])
    assert (("code", "ecc_uncorrected"), ("gpu", gpu0), ("host", "sick"),
            ("severity", "CRITICAL")) in found
    assert any(dict(k)["host"] == "sick" and dict(k)["gpu"] == "" for k in found)  # GPU count
    assert not any(dict(k)["host"] == "well" for k in found)
