"""The health gate end to end: `gpufleet health` / `status` / a runbook's `health` step, the real
CLI over real sshd lab hosts whose fake NVML and fake nvidia-smi carry the health readings and
whose /dev/kmsg holds real Xid lines (tests/fixtures/xid/lines.json says where each is from).

The sick host's GPUs sit on the real lines' PCI bus ids, in PCI order as NVML numbers them:
GPU 0 (01:00) uncorrected ECC errors and an Xid 94; GPU 1 (03:00) a pending row remap; GPU 2
(44:00) lost, with its Xid 79; GPU 3 (c6:00) hardware thermal slowdown on a x8 link, and a
record crafted to look like an Xid for GPU 0. The inventory expects 5 GPUs: one is missing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cli_helpers import assert_no_traceback, home, parse_table, run_gpufleet  # noqa: F401
from lab import kmsg_record

XID = json.loads((Path(__file__).parents[1] / "fixtures" / "xid" / "lines.json").read_text())
BUSES = ["00000000:01:00.0", "00000000:03:00.0", "00000000:44:00.0", "00000000:C6:00.0"]
FORGED = ("NVRM: Xid (PCI:0000:c6:00): 13, pid=4242, name=x, NVRM: Xid (PCI:0000:01:00): 79, "
          "\x1b[2J, Graphics SM Warp Exception")
SICK = dict(gpus=4, bus_ids=BUSES, ecc_volatile={"0": 2}, ecc_aggregate={"0": 2},
            remapped_pending=[1], clocks_event_reasons={"3": 0x40}, pcie_width={"3": 8},
            kmsg=[kmsg_record(XID["xid94_mig"]["line"], 1, 50.0),
                  kmsg_record(XID["xid79_bare"]["line"], 2, 60.0),
                  kmsg_record(FORGED, 3, 70.0, raw=True),
                  # written by a process (facility user): not the kernel's, not an Xid
                  kmsg_record(XID["xid79_bare"]["line"].replace("44:00", "03:00"), 4, 71.0,
                              facility=1)])


def reset_action(host_doc: dict) -> str:
    """A reset where gpufleet may reset (root, not in a container); this machine may itself be
    a container, and then the lab's hosts say so and the action is a drain and reboot."""
    blocker = host_doc["reset_blocker"]
    assert blocker is None or "container" in blocker, blocker
    return "reset_gpu" if blocker is None else "drain_reboot"


def codes(gpu_doc: dict) -> dict[str, tuple[str, str]]:
    return {f["code"]: (f["severity"], f["action"]) for f in gpu_doc["findings"]}


def test_health_finds_each_fault_with_its_action_over_nvml(lab: Any, make_host: Any,
                                                           home: Path) -> None:
    sick = make_host("sick", lost=[2], **SICK)
    inv = lab.inventory_yaml([sick], **{"sick": {"gpus": 5}})
    run = run_gpufleet(home, inv, "health", "--json")
    assert run.rc == 1, str(run)  # CRITICAL findings
    (host,) = run.json()["hosts"]
    assert host["ok"] and host["severity"] == "CRITICAL"
    reset = reset_action(host)
    gpus = {g["index"]: g for g in host["gpus"]}
    assert codes(gpus[0]) == {"ecc_uncorrected": ("CRITICAL", reset),
                              "xid_94": ("WARN", "restart_app")}
    assert codes(gpus[1]) == {"remap_pending": ("CRITICAL", reset)}
    assert codes(gpus[2]) == {"gpu_lost": ("CRITICAL", "drain_reboot"),
                              "xid_79": ("CRITICAL", "drain_reboot")}
    assert gpus[2]["pci"] == "0000:44:00"
    assert codes(gpus[3]) == {"hw_slowdown": ("WARN", "inspect"), "pcie_width": ("WARN", "inspect"),
                              "xid_13": ("WARN", "restart_app")}  # the forged line: its own GPU
    assert [(f["code"], f["severity"]) for f in host["findings"]] == [("gpu_count", "CRITICAL")]
    assert "4 GPU(s) found, the inventory expects 5" in host["findings"][0]["message"]
    table = run_gpufleet(home, inv, "health")
    assert table.rc == 1 and "\x1b" not in table.stdout and "\\x1b[2J" in table.stdout, str(table)
    rows = parse_table(table.stdout, "HOST")
    assert [(r["GPU"], r["HEALTH"]) for r in rows if r["HOST"] == "sick"] == [
        ("0", "CRITICAL"), ("1", "CRITICAL"), ("2", "CRITICAL"), ("3", "WARN"),
        ("host", "CRITICAL")]
    assert "drain and reboot the node" in table.stdout
    assert_no_traceback(table)


def test_the_nvidia_smi_path_reads_the_same_faults(lab: Any, make_host: Any, home: Path) -> None:
    """nvml=False: --query-gpu's fields (no remapped rows there: None, named as not read); a
    lost GPU makes nvidia-smi exit 15, read as the host's gpu_lost with the Xid 79 on its own
    row."""
    smi = make_host("smi", nvml=False, persistence={"1": False}, **SICK)
    lost = make_host("smi-lost", nvml=False, gpus=2, bus_ids=BUSES[1:3], lost=[1],
                     kmsg=[kmsg_record(XID["xid79_bare"]["line"], 1, 60.0)])
    run = run_gpufleet(home, lab.inventory_yaml([smi, lost]), "health", "--json")
    assert run.rc == 1, str(run)
    doc = {h["host"]: h for h in run.json()["hosts"]}
    gpus = {g["index"]: g for g in doc["smi"]["gpus"]}
    unread = {"readings_missing": ("OK", "none")}
    assert codes(gpus[0]) == {"ecc_uncorrected": ("CRITICAL", reset_action(doc["smi"])),
                              "xid_94": ("WARN", "restart_app"), **unread}
    assert codes(gpus[1]) == {"persistence_off": ("WARN", "configure"), **unread}
    assert gpus[1]["unknown"] == ["row_remapping"]
    assert codes(gpus[3])["hw_slowdown"] == ("WARN", "inspect")
    assert codes(gpus[3])["pcie_width"] == ("WARN", "inspect")
    assert [f["code"] for f in doc["smi-lost"]["findings"]] == ["gpu_lost"]
    (orphan,) = doc["smi-lost"]["gpus"]
    assert orphan["index"] is None and orphan["pci"] == "0000:44:00"
    assert codes(orphan) == {"xid_79": ("CRITICAL", "drain_reboot")}


def test_a_sound_host_is_ok_and_strict_fails_on_warn(lab: Any, make_host: Any,
                                                     home: Path) -> None:
    good = make_host("good", gpus=2)
    warm = make_host("warm", gpus=1, clocks_event_reasons={"0": 0x20})
    inv = lab.inventory_yaml([good, warm], **{"good": {"gpus": 2}})
    run = run_gpufleet(home, inv, "health", "--host", "good")
    assert run.rc == 0 and run.stdout.splitlines()[-1].endswith(
        "GPUs: 2 OK, 0 UNKNOWN, 0 WARN, 0 CRITICAL; host findings: 0 WARN, 0 CRITICAL"), str(run)
    assert [r["HEALTH"] for r in parse_table(run.stdout, "HOST")] == ["OK", "OK"]
    assert run_gpufleet(home, inv, "health").rc == 0  # WARN alone passes
    strict = run_gpufleet(home, inv, "health", "--strict", "--json")
    assert strict.rc == 1, str(strict)
    warm_doc = strict.host("warm")
    assert warm_doc["gpus"][0]["findings"][0]["code"] == "thermal_slowdown"
    assert run_gpufleet(home, inv, "health", "--stric").rc == 2


def test_status_has_a_health_column(lab: Any, make_host: Any, home: Path) -> None:
    sick = make_host("sick-status", gpus=2, bus_ids=BUSES[:2], remapped_failure=[1])
    run = run_gpufleet(home, lab.inventory_yaml([sick]), "status")
    assert run.rc == 0, str(run)
    rows = parse_table(run.stdout, "HOST")
    assert [(r["GPU"], r["HEALTH"]) for r in rows] == [("0", "OK"),
                                                       ("1", "CRITICAL remap_failure")]
    doc = run_gpufleet(home, lab.inventory_yaml([sick]), "status", "--json").host("sick-status")
    assert doc["gpus"][1]["health"]["code"] == "remap_failure"
    assert doc["gpus"][1]["remapped_rows_failure"] is True  # the reading itself, added
    assert doc["gpus"][0]["pcie_width_max"] == 16
    assert doc["health"]["severity"] == "CRITICAL"


def test_runbook_health_step_stops_the_run_before_anything_is_done(
        lab: Any, make_host: Any, home: Path, tmp_path: Path) -> None:
    sick = make_host("rb-sick", gpus=2, bus_ids=BUSES[:2], ecc_volatile={"1": 1})
    good = make_host("rb-good", gpus=2)
    holder = sick.spawn_holder(gpus=[0], mib=700, title="job")
    book = tmp_path / "gate.yaml"
    book.write_text("name: gate\nsteps:\n"
                    "  - {name: sound, kind: health}\n"
                    "  - {name: free, kind: clean, grace: 1, timeout: 20}\n")
    inv = lab.inventory_yaml([sick, good])
    run = run_gpufleet(home, inv, "run", str(book), "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    runs = {r["host"]: r for r in run.json()["hosts"]}
    sick_steps = [(s["name"], s["outcome"]) for s in runs["rb-sick"]["steps"]]
    assert sick_steps == [("sound", "failed"), ("free", "skipped")]
    assert "GPU 1: CRITICAL ecc_uncorrected" in runs["rb-sick"]["steps"][0]["detail"]
    assert [s["outcome"] for s in runs["rb-good"]["steps"]] == ["ok", "ok"]
    assert sick.alive(holder)  # the failed gate signalled nothing
    warn_only = tmp_path / "warn.yaml"
    warn_only.write_text("name: w\nsteps:\n  - {name: sound, kind: health, fail_on: never}\n")
    run = run_gpufleet(home, inv, "run", str(warn_only), "--host", "rb-sick", "--yes")
    assert run.rc == 0, str(run)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: b\nsteps:\n  - {name: sound, kind: health, fail_on: sometimes}\n")
    run = run_gpufleet(home, inv, "run", str(bad), "--yes")
    assert run.rc == 2 and "fail_on" in run.stderr and "Traceback" not in run.stderr


def test_driver_not_loaded_is_critical_on_both_paths(lab: Any, make_host: Any,
                                                     home: Path) -> None:
    """The lab's broken driver: nvmlInit returns DRIVER_NOT_LOADED (9) and nvidia-smi exits 9
    with its recorded "couldn't communicate" text."""
    hosts = [make_host("nodrv", gpus=2, driver="fail"),
             make_host("nodrv-smi", gpus=2, driver="fail", nvml=False)]
    run = run_gpufleet(home, lab.inventory_yaml(hosts), "health", "--json")
    assert run.rc == 1, str(run)
    for h in hosts:
        doc = run.host(h.name)
        assert [(f["code"], f["severity"], f["action"]) for f in doc["findings"]] == [
            ("driver_not_loaded", "CRITICAL", "drain_reboot")], doc
    status = run_gpufleet(home, lab.inventory_yaml(hosts), "status")
    assert "CRITICAL driver_not_loaded" in status.stdout, str(status)
    assert status.rc == 1 and "host findings: 2 CRITICAL" in status.stdout, str(status)


def test_status_shows_the_hosts_own_findings_and_fails_on_a_critical_one(
        lab: Any, make_host: Any, home: Path) -> None:
    """The inventory expects 2 GPUs, the host has 1: its GPU row is OK, so a `host` row says
    so, every summary line counts it and `status` exits 1 (`--json` always had it)."""
    short = make_host("short", gpus=1)
    inv = lab.inventory_yaml([short], **{"short": {"gpus": 2}})
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 1, str(run)
    rows = parse_table(run.stdout, "HOST")
    assert [(r["GPU"], r["HEALTH"]) for r in rows] == [("0", "OK"), ("host", "CRITICAL gpu_count")]
    assert "1 GPU(s) found, the inventory expects 2" in rows[1]["HOLDERS"]
    assert run.stdout.splitlines()[-1].endswith("; health: 1 OK; host findings: 1 CRITICAL")
    health = run_gpufleet(home, inv, "health")
    assert health.rc == 1 and health.stdout.splitlines()[-1].endswith(
        "GPUs: 1 OK, 0 UNKNOWN, 0 WARN, 0 CRITICAL; host findings: 0 WARN, 1 CRITICAL"), str(health)
    assert run_gpufleet(home, lab.inventory_yaml([short], **{"short": {"gpus": 1}}),
                        "status").rc == 0


HEALTH_FIELDS = ["persistence_mode", "pcie.link.gen.current", "pcie.link.gen.max",
                 "pcie.link.width.current", "pcie.link.width.max", "clocks_event_reasons.active",
                 "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
                 "retired_pages.pending"]


def test_a_gpu_nothing_could_be_read_of_is_unknown_not_ok(lab: Any, make_host: Any,
                                                          home: Path) -> None:
    """The nvidia-smi path of a driver that rejects every health field (an older driver): no
    ECC, remapped-row, PCIe or clocks reading. Nothing found is not OK: UNKNOWN, counted, and
    --strict fails on it; the default gate still passes (nothing is known to be wrong)."""
    blind = make_host("blind", gpus=1, nvml=False, invalid_fields=HEALTH_FIELDS)
    partial = make_host("partial", gpus=1, nvml=False)  # --query-gpu has no remapped rows
    inv = lab.inventory_yaml([blind, partial])
    run = run_gpufleet(home, inv, "health", "--json")
    assert run.rc == 0, str(run)
    (gpu,) = run.host("blind")["gpus"]
    assert gpu["severity"] == "UNKNOWN" and gpu["unknown"] == [
        "ecc", "row_remapping", "pcie_link", "clocks_events"], gpu
    assert [f["code"] for f in gpu["findings"]] == ["no_readings"]
    (gpu,) = run.host("partial")["gpus"]
    assert gpu["severity"] == "OK" and gpu["unknown"] == ["row_remapping"]
    table = run_gpufleet(home, inv, "health")
    rows = {r["HOST"]: r for r in parse_table(table.stdout, "HOST")}
    assert rows["blind"]["HEALTH"] == "UNKNOWN", str(table)
    assert "readings_missing: not read: row remapping" in rows["partial"]["FINDINGS"]
    assert table.stdout.splitlines()[-1] == (
        "hosts: 2 ok, 0 failed; GPUs: 1 OK, 1 UNKNOWN, 0 WARN, 0 CRITICAL; "
        "host findings: 0 WARN, 0 CRITICAL"), str(table)
    strict = run_gpufleet(home, inv, "health", "--strict")
    assert strict.rc == 1, str(strict)
    assert run_gpufleet(home, inv, "health", "--strict", "--host", "partial").rc == 0
