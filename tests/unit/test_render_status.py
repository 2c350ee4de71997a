"""Status rendering from named scenario fixtures (gpustat style), against golden output.

Fixtures in tests/fixtures/status/ are agent documents built from the recorded H200 output
(tests/fixtures/recorded/logs/h200-single-gpu.log) and the product's WSL2/container cases.
Regenerate goldens deliberately with GPUFLEET_UPDATE_GOLDEN=1 and review the diff.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufleet.core.model import HostResult, parse_snapshot
from gpufleet.core.hostwarnings import host_warnings
from gpufleet.render.status import status_document, status_table

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "status"
SCENARIOS = ["basic", "vanished_pid", "na_fields", "na_fields_busy", "hidden_pids", "broken_driver"]
EXPECTED = {"na_fields": 1680, "na_fields_busy": 1680}


def result(name: str) -> HostResult:
    snap = parse_snapshot(json.loads((FIX / f"{name}.json").read_text()))
    return HostResult(host=name, ok=True, snapshot=snap)


@pytest.mark.parametrize("name", SCENARIOS)
def test_status_table_matches_golden(name: str) -> None:
    text = status_table([result(name)], {name: EXPECTED.get(name, 0)}) + "\n"
    golden = FIX / f"{name}.golden.txt"
    if os.environ.get("GPUFLEET_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


def test_unreachable_host_is_one_row_and_others_complete() -> None:
    dead = HostResult(host="dead", ok=False, error="connection refused")
    text = status_table([result("basic"), dead], {})
    lines = text.splitlines()
    assert any(line.startswith("dead") and "ERROR: connection refused" in line for line in lines)
    assert "425 root 20998MiB hold.py VLLM::Worker 20" in text
    assert lines[-1] == "hosts: 1 ok, 1 failed; GPUs: 1 busy, 0 free; health: 1 OK"


def test_renamed_vllm_worker_is_shown_by_its_new_name() -> None:
    # nvidia-smi says "python3" for pid 425 (recorded); the operator needs VLLM::Worker.
    doc = status_document([result("basic")], {})
    procs = {p["pid"]: p for p in doc["hosts"][0]["gpus"][0]["processes"]}
    assert procs[425]["name"] == "VLLM::Worker"
    assert procs[426]["name"] == "trainer"


def test_json_contract_keys() -> None:
    doc = status_document([result("basic")], {})
    host = doc["hosts"][0]
    assert {"host", "ok", "error", "facts", "gpus", "holders"} <= set(host)
    gpu = host["gpus"][0]
    assert {"index", "uuid", "name", "memory_used_mib", "memory_total_mib", "attributed_mib",
            "unattributed_mib", "expected_unattributed_mib", "utilization_pct", "processes"} <= set(gpu)
    assert {"pid", "name", "cmdline", "user", "state", "used_mib", "unit"} <= set(gpu["processes"][0])
    assert {"pid", "name", "devices", "listed_by_nvidia_smi"} <= set(host["holders"][0])


def test_ledger_numbers_basic() -> None:
    gpu = status_document([result("basic")], {})["hosts"][0]["gpus"][0]
    # 26651 used, 5638 + 20998 attributed (recorded): 15 MiB is nobody's.
    assert gpu["attributed_mib"] == 26636
    assert gpu["unattributed_mib"] == 15


def test_wsl2_reservation_is_expected_not_a_leak() -> None:
    gpu = status_document([result("na_fields")], {"na_fields": 1680})["hosts"][0]["gpus"][0]
    assert gpu["unattributed_mib"] == 1680
    assert gpu["unexpected_unattributed_mib"] == 0
    gpu2 = status_document([result("na_fields")], {"na_fields": 0})["hosts"][0]["gpus"][0]
    assert gpu2["unexpected_unattributed_mib"] == 1680


def test_wsl2_per_process_memory_not_available_is_a_value() -> None:
    gpu = status_document([result("na_fields_busy")], {})["hosts"][0]["gpus"][0]
    assert gpu["processes"][0]["used_mib"] is None
    assert gpu["attributed_mib"] is None and gpu["unattributed_mib"] is None
    assert "n/a" in status_table([result("na_fields_busy")], {})


def test_hidden_pid_holder_shown_as_fd_holder() -> None:
    text = status_table([result("hidden_pids")], {})
    assert "77 root (fd: GPUs 0) VLLM::Worker_TP0" in text
    doc = status_document([result("hidden_pids")], {})
    assert doc["hosts"][0]["holders"][0]["listed_by_nvidia_smi"] is False
    assert doc["hosts"][0]["gpus"][0]["unattributed_mib"] == 20998


def test_broken_driver_is_a_host_error_row() -> None:
    doc = status_document([result("broken_driver")], {})
    assert doc["hosts"][0]["ok"] is False
    assert "couldn't communicate with the NVIDIA driver" in doc["hosts"][0]["error"]


def test_truncated_comm_is_completed_from_the_rewritten_cmdline() -> None:
    from gpufleet.core.model import ProcessInfo

    def proc(comm: str, cmdline: str) -> ProcessInfo:
        return ProcessInfo(pid=1, ppid=0, starttime=1, state="S", uid=0, user="root", comm=comm, cmdline=cmdline)

    assert proc("VLLM::EngineCor", "VLLM::EngineCore_DP0").name == "VLLM::EngineCore_DP0"
    assert proc("VLLM::Worker", "python3 /tmp/hold.py VLLM::Worker 20").name == "VLLM::Worker"
    assert proc("python3.11-confi", "python3 x").name == "python3.11-confi"


DENIED = ("cannot read the open files of 1 process(es): 1 (process_api); GPU holders among "
          "them would be hidden")


def test_host_warnings_are_lines_of_their_own_never_in_the_table() -> None:
    """A script's grep or awk over the rows never meets a warning: the CLI prints them on
    stderr (core.hostwarnings), the table has none."""
    doc = json.loads((FIX / "basic.json").read_text())
    doc["warnings"] = ["cmdline of PID 7 unreadable (D state, memory lock held)"]
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    assert "warning" not in status_table([res], {})
    assert host_warnings("box", res.snapshot) == ["box: warning: " + doc["warnings"][0]]


def test_unreadable_fds_warning_is_printed_only_when_memory_is_unexplained() -> None:
    """A warning that cries wolf is not read: in a container the runtime's PID 1 is always unreadable; with every
    GPU's memory accounted for, the warning stays in JSON and off the screen."""
    doc = json.loads((FIX / "basic.json").read_text())
    doc["facts"].update(in_container=True, container="docker", can_read_all_fds=False)
    doc["warnings"] = [DENIED]
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    assert host_warnings("box", res.snapshot) == []
    assert status_document([res], {})["hosts"][0]["warnings"] == [DENIED]
    doc["gpus"][0]["memory_used_mib"] += 4000  # memory no listed process accounts for
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    assert host_warnings("box", res.snapshot) == ["box: warning: " + DENIED]
    # ...unless the host's expected unattributed memory covers it
    assert host_warnings("box", res.snapshot, 4000) == []


def test_a_newline_in_a_process_title_cannot_fake_a_holder_line() -> None:
    doc = json.loads((FIX / "basic.json").read_text())
    doc["processes"]["426"]["comm"] = "trainer\nVLLM::Worker 1 999MiB"
    text = status_table([HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))], {})
    assert "426 root 5638MiB trainer\\x0aVLLM::Worker 1 999MiB: hold.py trainer 5" in text
    assert not any(line.strip().startswith("VLLM::Worker 1 999MiB") for line in text.splitlines())


def test_a_listed_process_without_its_gpus_device_file_is_an_untrusted_row() -> None:
    """nvidia-smi lists PID 426 on GPU 0 with 5638 MiB, but its open files hold no
    /dev/nvidia0 (policy.listing_check): status shows the row marked, leaves its memory
    unattributed and says why; the other listed process is verified."""
    doc = json.loads((FIX / "basic.json").read_text())
    doc["holders"] = [h for h in doc["holders"] if h["pid"] != 426]
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    reason = "listed by nvidia-smi on GPU 0 but has no /dev/nvidia0 open"
    gpu = status_document([res], {})["hosts"][0]["gpus"][0]
    assert {p["pid"]: (p["listing"], p["listing_reason"]) for p in gpu["processes"]} == {
        426: ("refused", reason),
        425: ("verified", "has /dev/nvidia0 open (its maps not available)")}
    assert (gpu["attributed_mib"], gpu["unattributed_mib"]) == (20998, 26651 - 20998)
    text = status_table([res], {})
    assert "426 root 5638MiB (untrusted row) hold.py trainer 5" in text
    assert "warning" not in text  # on stderr: core.hostwarnings
    assert host_warnings("box", res.snapshot) == [
        "box: warning: PID 426 is an untrusted row: %s; its memory counts as unattributed" % reason]


def test_status_json_from_host_entries_is_the_same_text_as_the_whole_document() -> None:
    """`status --json` encodes each host in its worker (render.status.host_json) and joins the
    entries: the text must be exactly what encoding the whole document gives."""
    from gpufleet.render.status import host_json, status_json, to_json

    results = [result(n) for n in SCENARIOS]
    results.append(HostResult(host="down", ok=False, error="connection refused", seconds=0.5,
                              error_kind="refused"))
    expected = {"na_fields": 1680}
    gpus = {"basic": 8}
    doc = status_document(results, expected, gpus)
    doc["seconds"] = 1.25
    entries = [host_json(r, expected.get(r.host, 0), gpus.get(r.host)) for r in results]
    assert status_json(entries, 1.25) == to_json(doc)
    assert json.loads(status_json(entries, 1.25)) == doc
    assert status_json([], 0.0) == to_json({"hosts": [], "seconds": 0.0})


def test_watch_documents_reuse_a_host_part_until_its_next_snapshot(monkeypatch) -> None:
    """status --watch --json writes a document every interval; a host's part is made once per
    snapshot (render.status.HostDocs) and the document is the same as without it."""
    from gpufleet.core.live import LiveHost
    from gpufleet.render import status_json as rs

    views = [LiveHost(n, result=result(n), received_at=10.0) for n in ("basic", "hidden_pids")]
    views.append(LiveHost("down"))  # no snapshot yet: made every time, never cached
    plain = rs.watch_document(views, EXPECTED, 11.0, 3)
    calls: list[str] = []
    real = rs.host_doc
    monkeypatch.setattr(rs, "host_doc", lambda res, *a: calls.append(res.host) or real(res, *a))
    docs = rs.HostDocs(EXPECTED)
    assert rs.watch_document(views, EXPECTED, 11.0, 3, docs) == plain
    assert rs.watch_document(views, EXPECTED, 12.0, 4, docs)["hosts"][0]["age_s"] == 2.0
    assert sorted(calls) == ["basic", "down", "down", "hidden_pids"]
    views[0] = LiveHost("basic", result=result("basic"), received_at=12.5)  # a new snapshot
    rs.watch_document(views, EXPECTED, 13.0, 5, docs)
    assert calls.count("basic") == 2 and calls.count("hidden_pids") == 1


def test_a_hosts_own_critical_finding_is_a_row_counted_and_fails_status() -> None:
    """The inventory expects 2 GPUs and 1 answered: each GPU row reads OK, so the finding
    needs its own row, the summary counts it and `status` does not pass (exit 1)."""
    from gpufleet.render.status import failing_hosts

    res = result("basic")
    text = status_table([res], {}, {"basic": 2})
    rows = [line for line in text.splitlines() if line.startswith("basic ")]
    assert rows[-1].split()[1:4] == ["host", "CRITICAL", "gpu_count"]
    assert rows[-1].endswith("1 GPU(s) found, the inventory expects 2")
    assert text.splitlines()[-1].endswith("; health: 1 OK; host findings: 1 CRITICAL")
    assert failing_hosts([res], {"basic": 2}) == ["basic"]
    assert failing_hosts([res], {"basic": 1}) == [] and failing_hosts([res]) == []
    assert " host " not in status_table([res], {}, {"basic": 1})
    more = status_table([res], {}, {"basic": 0})  # more GPUs than expected: shown, passes
    assert "WARN gpu_count" in more and failing_hosts([res], {"basic": 0}) == []


def test_holders_say_what_runs_and_whose_it_is() -> None:
    """comm names the interpreter (python3 for every job); the command line says what runs:
    the script and its arguments, and the user; a container only when it is not the agent's."""
    doc = json.loads((FIX / "basic.json").read_text())
    doc["processes"]["426"].update(comm="python3", user="alice", container="docker:0123456789ab",
                                   cmdline="/usr/bin/python3 /data/alice/train_dflash.py --epochs 3")
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    text = status_table([res], {})
    assert "426 alice 5638MiB [docker:0123456789ab] train_dflash.py --epochs 3" in text
    doc["facts"].update(in_container=True, container="docker:0123456789ab")
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    assert "426 alice 5638MiB train_dflash.py --epochs 3" in status_table([res], {})


def test_a_container_is_named_as_its_runtime_names_it() -> None:
    """The runtime's own name (docker/podman inspect, asked by the agent) where it answered;
    its short id otherwise."""
    doc = json.loads((FIX / "basic.json").read_text())
    doc["processes"]["426"].update(comm="python3", user="alice", container="docker:0123456789ab",
                                   container_name="vllm-llama", cmdline="vllm serve llama")
    res = HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))
    assert "426 alice 5638MiB [vllm-llama] vllm serve llama" in status_table([res], {})
