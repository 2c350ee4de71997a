"""The health gate (`gpufleet health`): the agent's readers (kernel log, nvidia-smi fields), the pure
core (readings -> findings and actions), its renderers and the runbook step's judgement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from gpufleet.core import health
from gpufleet.core.model import parse_snapshot
from gpufleet.remote import jobs, kmsg, parse
from gpufleet.render.health import health_document, health_table
from gpufleet.runbook.checks import health_outcome

XID = json.loads((Path(__file__).parents[1] / "fixtures" / "xid" / "lines.json").read_text())


def record(message: str, seq: int = 1, seconds: float = 100.0, facility: int = 0) -> bytes:
    return ("%d,%d,%d,-;%s\n" % (facility << 3 | 4, seq, int(seconds * 1e6), message)).encode()


def gpu(index: int = 0, bus: str = "00000000:C6:00.0", **kw: Any) -> dict:
    row = {"index": index, "uuid": f"GPU-{index}", "name": "NVIDIA H200", "pci_bus_id": bus,
           "memory_used_mib": 0, "memory_total_mib": 143771, "persistence_mode": True,
           "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 0,
           "remapped_rows_pending": False, "remapped_rows_failure": False,
           "retired_pages_pending": None, "clocks_event_reasons": 0, "clocks_event_names": [],
           "pcie_gen_current": 5, "pcie_gen_max": 5, "pcie_width_current": 16,
           "pcie_width_max": 16}
    row.update(kw)
    return row


def snap(gpus: list, xid: list | None = None, root: bool = True, **doc: Any):
    base = {"agent_version": 1, "facts": {"is_root": root, "in_container": False},
            "nvidia_smi": {"ok": True, "error": None, "exit_code": None}, "gpus": gpus,
            "kernel_log": {"source": "/dev/kmsg", "error": None, "truncated": False,
                           "xid": xid or []}}
    base.update(doc)
    return parse_snapshot(base)


def codes(h: health.GpuHealth) -> dict[str, tuple[str, str]]:
    return {f.code: (f.severity, f.action) for f in h.findings}


# --------------------------------------------------------------------------- kernel log


def test_real_xid_lines_parse_with_bus_and_code() -> None:
    data = b"".join(record(XID[k]["line"], i) for i, k in enumerate(
        ("xid79_pid", "xid79_bare", "xid94_mig", "xid14_old")))
    events = kmsg.fold_xids(kmsg.kmsg_records(data))
    assert [(e["pci"], e["code"]) for e in events] == [
        ("0000:c6:00", 79), ("0000:44:00", 79), ("0000:01:00", 94), ("0000:03:00", 14)]
    assert events[0]["message"] == XID["xid79_pid"]["line"]


def test_fold_counts_and_keeps_the_last_time_and_message() -> None:
    line = XID["xid79_pid"]["line"]
    data = record(line, 1, 10.0) + record("eth0: link up", 2, 11.0) + record(
        line.replace("1101234", "77"), 3, 20.5) + b" SUBSYSTEM=pci\n DEVICE=+pci:0000:c6:00.0\n"
    (event,) = kmsg.fold_xids(kmsg.kmsg_records(data))
    assert (event["count"], event["first_s"], event["last_s"]) == (2, 10.0, 20.5)
    assert "pid=77" in event["message"]


def test_a_process_name_cannot_forge_an_xid_for_another_gpu() -> None:
    """The name field is the process's own text: only the record's start is the Xid."""
    forged = ("NVRM: Xid (PCI:0000:c6:00): 13, pid=5, name=x, NVRM: Xid (PCI:0000:44:00): 79, "
              "\x1b[2J, Graphics Exception")
    events = kmsg.fold_xids(kmsg.kmsg_records(record(forged)))
    assert [(e["pci"], e["code"]) for e in events] == [("0000:c6:00", 13)]


def test_records_written_by_a_process_are_not_the_kernels() -> None:
    data = record(XID["xid79_bare"]["line"], facility=1)  # what `echo ... > /dev/kmsg` makes
    assert kmsg.fold_xids(kmsg.kmsg_records(data)) == []


def test_the_real_dev_kmsg_is_read_without_blocking_and_completely() -> None:
    """This machine's /dev/kmsg: a marker written now (as a process: facility user) is read
    back, the read ends by itself (EAGAIN), and the marker is not taken for a kernel record."""
    if os.geteuid() != 0 or not os.access("/dev/kmsg", os.R_OK | os.W_OK):
        if os.environ.get("CI") == "true":
            pytest.fail("/dev/kmsg not readable and writable as root")
        pytest.skip("!!! /dev/kmsg needs root")
    marker = "gpufleet-kmsg-test " + uuid.uuid4().hex
    with open("/dev/kmsg", "w") as f:
        f.write(marker + "\n")
    data, size, truncated, error = kmsg.read_kmsg(mark=b"gpufleet-kmsg-test")
    assert error is None and not truncated and size > len(data)
    mine = [r for r in kmsg.kmsg_records(data) if r[2] == marker]
    assert len(mine) == 1 and mine[0][0] == 1  # facility 1: user, not kernel
    everything, _, _, _ = kmsg.read_kmsg(mark=b"")  # every record is kept with an empty mark
    assert any(r[0] == 0 for r in kmsg.kmsg_records(everything))  # the kernel's own records


def test_a_regular_file_stands_in_for_dev_kmsg(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(record(XID["xid79_bare"]["line"]))
    data, size, truncated, error = kmsg.read_kmsg(str(path))
    assert error is None and not truncated and kmsg.fold_xids(kmsg.kmsg_records(data))
    assert size == path.stat().st_size


def test_the_read_is_bounded_in_size(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_bytes(record("NVRM: Xid " + "x" * 100) * 1000)
    data, size, truncated, error = kmsg.read_kmsg(str(path), max_bytes=8192)
    assert truncated and error is None and size == 8192 and len(data) < 9000


def test_without_dev_kmsg_journalctl_then_dmesg_are_read(tmp_path: Path,
                                                         monkeypatch: Any) -> None:
    """The fallbacks' formats: journalctl -o short-monotonic and dmesg (quoted examples)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "journalctl").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "dmesg").write_text(
        "#!/bin/sh\necho '[12345.678901] %s'\necho '[12346.000001] eth0: up'\n"
        % XID["xid79_bare"]["line"])
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    doc = kmsg.kernel_log(jobs.Deadline(10), kmsg=str(tmp_path / "missing"))
    assert doc["source"] == "dmesg" and doc["error"] is None
    assert [(x["pci"], x["code"], x["last_s"]) for x in doc["xid"]] == [
        ("0000:44:00", 79, 12345.678901)]
    assert "last_epoch" in doc["xid"][0]
    assert kmsg.text_records("[  123.456789] node01 kernel: %s" % XID["xid14_old"]["line"],
                             kmsg.JOURNAL_RE)[0][1] == 123.456789


def test_no_kernel_log_at_all_is_a_value(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kmsg, "which", lambda name, fallbacks: None)
    doc = kmsg.kernel_log(jobs.Deadline(5), kmsg=str(tmp_path / "missing"))
    assert doc["source"] is None and "missing" in doc["error"] and doc["xid"] == []
    h = health.assess("h", snap([gpu()], kernel_log=doc))
    assert [(f.code, f.severity) for f in h.host_findings] == [("xid_unavailable", "OK")]


# --------------------------------------------------------------------------- nvidia-smi fields


def test_query_gpu_health_fields_parse() -> None:
    fields = ["index", "uuid", "persistence_mode", "clocks_event_reasons.active",
              "ecc.errors.uncorrected.volatile.total", "retired_pages.pending",
              "pcie.link.width.current"]
    (row,) = parse.parse_gpu_csv("0, GPU-x, Disabled, 0x0000000000000048, 3, [N/A], 8\n",
                                 fields)
    assert row["persistence_mode"] is False and row["clocks_event_reasons"] == 0x48
    assert row["clocks_event_names"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert row["ecc_uncorrected_volatile"] == 3 and row["retired_pages_pending"] is None
    assert row["pcie_width_current"] == 8
    with pytest.raises(parse.ParseError):
        parse.parse_gpu_csv("0, GPU-x, Maybe, 0x0, 0, No, 16\n", fields)
    assert parse.clocks_event_names(0x1001) == ["gpu_idle", "0x1000"]
    assert parse.clocks_event_names(None) is None


# --------------------------------------------------------------------------- the core


def test_a_sound_gpu_is_ok_with_no_findings() -> None:
    h = health.assess("h", snap([gpu()]))
    assert h.severity == "OK" and h.gpus[0].findings == () and h.gpus[0].action == "none"


@pytest.mark.parametrize("kw,code,sev,action", [
    ({"ecc_uncorrected_volatile": 2}, "ecc_uncorrected", "CRITICAL", "reset_gpu"),
    ({"ecc_uncorrected_aggregate": 5}, "ecc_uncorrected_history", "WARN", "none"),
    ({"remapped_rows_pending": True}, "remap_pending", "CRITICAL", "reset_gpu"),
    ({"remapped_rows_failure": True}, "remap_failure", "CRITICAL", "contact_support"),
    ({"retired_pages_pending": True}, "retired_pages_pending", "CRITICAL", "reset_gpu"),
    ({"clocks_event_names": ["hw_thermal_slowdown"]}, "hw_slowdown", "WARN", "inspect"),
    ({"clocks_event_names": ["sw_thermal_slowdown"]}, "thermal_slowdown", "WARN", "inspect"),
    ({"pcie_width_current": 8}, "pcie_width", "WARN", "inspect"),
    ({"pcie_gen_current": 3}, "pcie_gen", "WARN", "inspect"),
    ({"persistence_mode": False}, "persistence_off", "WARN", "configure"),
    ({"nvml_error_codes": {"ecc_uncorrected_volatile": 14}}, "inforom_corrupted", "WARN",
     "contact_support"),
])
def test_each_reading_makes_its_finding(kw: dict, code: str, sev: str, action: str) -> None:
    h = health.assess("h", snap([gpu(**kw)]))
    assert codes(h.gpus[0]) == {code: (sev, action)}
    assert h.gpus[0].severity == sev


def test_a_gpu_with_no_readings_is_unknown_not_ok() -> None:
    """Every reading None (the nvidia-smi path of an older driver, an agent before the
    readings): no fault can be found, and that must not read as OK."""
    row = {k: None for k in gpu()}
    row.update(index=0, uuid="GPU-0", name="x")
    h = health.assess("h", snap([row]))
    (f,) = h.gpus[0].findings
    assert (f.code, f.severity) == ("no_readings", "UNKNOWN")
    assert f.message == "nothing could be read (ECC, row remapping, PCIe link, clocks events)"
    assert h.gpus[0].severity == "UNKNOWN" and h.severity == "UNKNOWN"
    assert h.gpus[0].unknown == ("ecc", "row_remapping", "pcie_link", "clocks_events")
    doc = health_document([h])["hosts"][0]["gpus"][0]
    assert doc["severity"] == "UNKNOWN" and doc["unknown"] == list(h.gpus[0].unknown)


def test_a_gpu_with_some_readings_names_the_missing_ones() -> None:
    """A consumer GPU has no ECC and no row remapping: it is judged on what it gave, and says
    what it did not."""
    h = health.assess("h", snap([gpu(ecc_uncorrected_volatile=None, ecc_uncorrected_aggregate=None,
                                     remapped_rows_pending=None, remapped_rows_failure=None)]))
    (f,) = h.gpus[0].findings
    assert (f.code, f.severity, f.message) == ("readings_missing", "OK",
                                               "not read: ECC, row remapping")
    assert h.gpus[0].severity == "OK" and h.gpus[0].unknown == ("ecc", "row_remapping")
    assert "readings_missing: not read: ECC, row remapping" in health_table([h])


@pytest.mark.parametrize("kw", [
    {"retired_pages_pending": None},  # the H200's NVML: NOT_SUPPORTED, remapped rows read
    {"remapped_rows_pending": None, "remapped_rows_failure": None,  # nvidia-smi --query-gpu
     "retired_pages_pending": False},
    {"pcie_gen_current": None, "pcie_gen_max": None},  # the width alone reads the link
])
def test_either_reading_of_a_group_is_enough(kw: dict) -> None:
    h = health.assess("h", snap([gpu(**kw)]))
    assert h.gpus[0].findings == () and h.gpus[0].unknown == ()


def test_summaries_count_unknown_gpus_and_the_hosts_own_findings() -> None:
    row = {k: None for k in gpu()}
    row.update(index=1, uuid="GPU-1", name="x")
    h = health.assess("h", snap([gpu(), row]), expected_gpus=3)
    assert health_table([h]).splitlines()[-1] == (
        "hosts: 1 ok, 0 failed; GPUs: 1 OK, 1 UNKNOWN, 0 WARN, 0 CRITICAL; "
        "host findings: 0 WARN, 1 CRITICAL")
    assert [f.code for f in health.critical_host_findings(h)] == ["gpu_count"]
    assert health.finding_values(h)[2]["value"] == -1  # the UNKNOWN GPU's row


def test_an_idle_gpu_may_lower_its_link_generation() -> None:
    h = health.assess("h", snap([gpu(pcie_gen_current=1, clocks_event_names=["gpu_idle"])]))
    assert codes(h.gpus[0]) == {"pcie_gen_idle": ("OK", "none")} and h.severity == "OK"


@pytest.mark.parametrize("code,sev,action", [
    (79, "CRITICAL", "drain_reboot"), (48, "CRITICAL", "reset_gpu"),
    (95, "CRITICAL", "reset_gpu"), (13, "WARN", "restart_app"), (94, "WARN", "restart_app"),
    (63, "OK", "none"), (45, "OK", "none"), (54, "WARN", "inspect"),
    (999, "WARN", "contact_support"),
])
def test_xid_buckets_follow_nvidias_catalog(code: int, sev: str, action: str) -> None:
    xid = [{"pci": "0000:c6:00", "code": code, "count": 1, "message": "m"}]
    h = health.assess("h", snap([gpu()], xid))
    assert codes(h.gpus[0]) == {f"xid_{code}": (sev, action)}


def test_xids_match_gpus_by_pci_bus_id_only() -> None:
    xid = [{"pci": "0000:44:00", "code": 79, "count": 1, "message": "m"}]
    h = health.assess("h", snap([gpu(0, "00000000:C6:00.0"), gpu(1, "00000000:44:00.0")], xid))
    assert h.gpu(0).findings == () and "xid_79" in codes(h.gpu(1))


def test_an_xid_for_a_device_no_reading_matches_gets_its_own_row() -> None:
    xid = [{"pci": "0000:99:00", "code": 79, "count": 1, "message": "m"}]
    h = health.assess("h", snap([gpu()], xid))
    (orphan,) = [g for g in h.gpus if g.index is None]
    assert orphan.pci == "0000:99:00" and orphan.severity == "CRITICAL"


def test_a_reset_where_no_reset_is_allowed_becomes_drain_and_reboot() -> None:
    h = health.assess("h", snap([gpu(remapped_rows_pending=True)], root=False))
    (f,) = h.gpus[0].findings
    assert f.action == "drain_reboot" and "not root" in f.message


def test_a_lost_gpu_with_its_xid_79() -> None:
    xid = [{"pci": "0000:44:00", "code": 79, "count": 1, "message": XID["xid79_bare"]["line"]}]
    s = snap([gpu(0)], xid, gpu_errors=[{"index": 1, "error": "GPU is lost (15)", "code": 15,
                                         "pci_bus_id": "0000:44:00.0"}])
    h = health.assess("h", s, expected_gpus=2)
    lost = h.gpu(1)
    assert set(codes(lost)) == {"gpu_lost", "xid_79"} and lost.action == "drain_reboot"
    assert h.host_findings == ()  # 1 readable + 1 lost = the 2 expected
    assert "GPU 1" in (health.job_refusal(h) or "")
    assert health.job_refusal(h, gpus=[0]) is None


@pytest.mark.parametrize("seen,expected,sev", [(7, 8, "CRITICAL"), (8, 8, None),
                                               (9, 8, "WARN"), (8, None, None)])
def test_gpu_count_against_the_inventory(seen: int, expected: int | None, sev: str | None) -> None:
    h = health.assess("h", snap([gpu(i, f"00000000:{i + 16:02X}:00.0") for i in range(seen)]),
                      expected)
    found = [f.severity for f in h.host_findings if f.code == "gpu_count"]
    assert found == ([sev] if sev else [])


@pytest.mark.parametrize("exit_code,code", [(9, "driver_not_loaded"), (15, "gpu_lost"),
                                            (14, "inforom_corrupted")])
def test_nvidia_smi_exit_codes(exit_code: int, code: str) -> None:
    s = snap([], nvidia_smi={"ok": False, "error": "x", "exit_code": exit_code})
    assert [f.code for f in health.assess("h", s).host_findings] == [code]


def test_exporter_values_and_a_refused_host() -> None:
    h = health.assess("h", snap([gpu(ecc_uncorrected_volatile=1)]))
    values = health.finding_values(h)
    assert {"host": "h", "gpu": "0", "pci": "0000:c6:00", "code": "ecc_uncorrected",
            "severity": "CRITICAL", "value": 2, "action": "reset_gpu"} in values
    assert values[0]["code"] == "" and values[0]["value"] == 2  # the GPU's own row
    down = health.HostHealth("d", False, "connection refused")
    assert "no health readings" in (health.job_refusal(down) or "")


# --------------------------------------------------------------------------- renderers, runbook


def test_the_table_shows_hostile_text_escaped_and_json_has_codes() -> None:
    evil = "NVRM: Xid (PCI:0000:c6:00): 13, pid=5, name=\x1b[2Jx\nGPU 1 OK, Graphics"
    xid = [{"pci": "0000:c6:00", "code": 13, "count": 1, "message": evil}]
    report = [health.assess("h", snap([gpu()], xid))]
    table = health_table(report)
    assert "\x1b" not in table and "\\x1b[2J" in table and "\\x0aGPU 1 OK" in table
    assert "restart the application" in table
    doc = health_document(report)
    f = doc["hosts"][0]["gpus"][0]["findings"][0]
    assert (f["code"], f["severity"], f["action"], f["xid"]) == ("xid_13", "WARN",
                                                                  "restart_app", 13)
    assert f["detail"] == evil  # JSON escapes it itself


def test_health_step_fails_on_critical_and_warns_on_warn() -> None:
    s = snap([gpu(0, persistence_mode=False),
              gpu(1, "00000000:44:00.0", remapped_rows_pending=True)])
    failed, detail = health_outcome(s, "h", None, None, "critical")
    assert failed and "GPU 1: CRITICAL remap_pending" in detail
    failed, detail = health_outcome(s, "h", [0], None, "critical")
    assert not failed and "warning: GPU 0: WARN persistence_off" in detail
    assert health_outcome(s, "h", [0], None, "warn")[0]
    assert not health_outcome(s, "h", None, None, "never")[0]
    assert health_outcome(s, "h", [0], None, "critical", "never") == (False, "1 GPU(s) OK")


def test_health_step_warns_on_unknown_and_fails_on_it_with_fail_on_warn() -> None:
    row = {k: None for k in gpu()}
    row.update(index=0, uuid="GPU-0", name="x")
    failed, detail = health_outcome(snap([row]), "h", None, None, "critical")
    assert not failed and "warning: GPU 0: UNKNOWN no_readings" in detail
    failed, detail = health_outcome(snap([row]), "h", None, None, "warn")
    assert failed and "GPU 0: UNKNOWN no_readings" in detail


def test_the_health_cli_rejects_bad_options_with_exit_2(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "gpufleet", "health", "--strictly"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr


def test_the_health_help_says_its_exit_codes_and_what_strict_adds(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "gpufleet", "health", "--help"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=60)
    text = " ".join(run.stdout.split())
    assert run.returncode == 0, run.stderr
    assert "Exit 0 when every GPU is OK (or only WARN or UNKNOWN)" in text
    assert "on WARN or UNKNOWN too with --strict" in text and "2 on usage errors" in text


def test_at_120_columns_the_health_table_does_not_wrap_and_keeps_every_word() -> None:
    """An old driver's GPUs (nothing readable: the longest finding), a host short of GPUs (a
    host row with the longest action) and an Xid line: at 120 columns every line fits, and the
    findings' words are all there, wrapped under their finding; to a pipe each is one line."""
    unread = {k: None for k in ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate",
                                "remapped_rows_pending", "remapped_rows_failure",
                                "pcie_gen_current", "pcie_gen_max", "pcie_width_current",
                                "pcie_width_max", "clocks_event_reasons")}
    xid = [{"pci": "0000:c6:00", "code": 79, "count": 1,
            "message": "NVRM: Xid (PCI:0000:c6:00): 79, pid=1234, GPU has fallen off the bus."}]
    report = [health.assess("old-driver-node-07", snap([gpu(0, **unread), gpu(1)], xid), 4)]
    whole = health_table(report)
    assert max(len(line) for line in whole.splitlines()) > 120  # the case is a real one
    fitted = health_table(report, 120)
    assert max(len(line) for line in fitted.splitlines()) <= 120, fitted
    assert " ".join(fitted.split()).count("fallen off the bus") == 2  # the finding, its line
    assert "\n" + " " * 51 + "  pid=1234" in fitted  # a wrapped line sits under its own
    words = lambda text: sorted(w for w in text.split() if set(w) != {"-"})  # noqa: E731
    assert words(fitted) == words(whole)
