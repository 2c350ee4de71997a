"""In the lab: GPU clients (NVML monitors, nvidia-smi runs) are never signalled and
never shown as holders; concurrent GPU queries leave no ghost holders.

The lab's monitor (LabHost.spawn_monitor) is an NVML client as recorded on the H200: every
/dev/nvidia* open, nothing mapped, no memory. The lab's nvidia-smi holds nvidiactl, nvidia-uvm
and every /dev/nvidiaN open while it runs and maps only nvidiactl, as the real one does.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cli_helpers import (
    home,  # noqa: F401  (fixture)
    run_gpufleet,
)

FAST = ("--grace", "1", "--timeout", "15")


def clean(home: Path, inv: Path, *args: str) -> Any:
    return run_gpufleet(home, inv, "clean", "--all", "--audit-log", str(home / "audit.jsonl"), *args)


def _roles(doc: dict) -> dict[int, str]:
    return {h["pid"]: h["role"] for h in doc["holders"]}


def test_workstation_monitor_is_a_client_and_survives_a_full_clean(lab: Any, make_host: Any,
                                                                    home: Path) -> None:
    """1 GPU, an untitled NVML monitor (its name says nothing: maps are the evidence) next to
    a CUDA holder. A full clean once signalled both (open device files were taken as holding memory)."""
    host = make_host("workstation", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=3000, title="train.py")
    mon = host.spawn_monitor()
    assert host.comm(mon) != "nvitop"  # no name to go by
    inv = lab.inventory_yaml([host])

    status = run_gpufleet(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    doc = status.host("workstation")
    holders = {h["pid"]: h for h in doc["holders"]}
    assert holders[mon].get("mapped") == [] and holders[mon].get("role") == "client", holders
    assert set(holders[job]["mapped"]) == {"/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"}
    assert holders[job]["role"] == "holder"
    text = run_gpufleet(home, inv, "status")
    rows = [line for line in text.stdout.splitlines() if line.startswith("workstation")]
    assert any(" clients " in r and f" {mon} root (fd: GPUs 0) " in r for r in rows), text.stdout
    assert not any(r.split()[1] == "fd" for r in rows), text.stdout

    run = clean(home, inv, "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("workstation")
    assert doc["verdict"] == "clean", str(run)
    assert [t["pid"] for t in doc["targets"]] == [job]
    assert [c["pid"] for c in doc["clients"]] == [mon]
    assert not host.alive(job)
    assert host.alive(mon), "the NVML monitor was signalled"
    assert all(s["pid"] != mon for s in doc["signals"])


def test_nvitop_on_an_8_gpu_node_survives_a_full_clean(lab: Any, make_host: Any,
                                                       home: Path) -> None:
    host = make_host("octo-node", gpus=8)
    api = host.spawn_vllm(gpus=list(range(8)), mib=2000)
    engine = api.children[0]
    mon = host.spawn_monitor(title="nvitop")
    inv = lab.inventory_yaml([host])

    plan = clean(home, inv, "--dry-run", "--json", *FAST)
    doc = plan.host("octo-node")
    targets = {t["pid"]: t for t in doc["targets"]}
    assert mon not in targets and mon not in {r["pid"] for r in doc["refused"]}
    assert targets[engine]["wave"] == 0  # the EngineCore stays the family's root
    assert {w for w in engine.children} <= set(targets)

    run = clean(home, inv, "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("octo-node")
    assert doc["verdict"] == "clean", str(run)
    assert mon in {c["pid"] for c in doc["clients"]}
    assert not host.alive(engine) and not any(host.alive(w) for w in engine.children)
    time.sleep(0.2)
    assert host.alive(mon), "nvitop was signalled"
    assert host.gpu_used() == [0] * 8


def test_container_like_host_cleans_holders_and_spares_the_monitor(lab: Any, make_host: Any,
                                                                  home: Path) -> None:
    """nvidia-smi lists nobody (other PID namespace), so memory is unexplained: device-file
    holders are targets of a full clean -- but the monitor's maps show no CUDA context."""
    host = make_host("pod-box", gpus=2, hidden_pids=True)
    a = host.spawn_holder(gpus=[0], mib=3000, title="job-a")
    mon = host.spawn_monitor()
    inv = lab.inventory_yaml([host])
    run = clean(home, inv, "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("pod-box")
    assert doc["verdict"] == "clean", str(run)
    assert [(t["pid"], t["evidence"]) for t in doc["targets"]] == [(a, "device-file")]
    assert not host.alive(a) and host.alive(mon)


def test_two_agents_and_a_monitor_loop_leave_no_ghost_holders(lab: Any, make_host: Any,
                                                              home: Path) -> None:
    """Concurrent scans: two status runs of the same host at once plus a `watch nvidia-smi`
    loop: each catches the others' nvidia-smi runs mid-scan. None of them is a holder, a `?`
    line or an unreadable refusal; at least one was really caught (the race is exercised)."""
    host = make_host("shared-box", gpus=2, nvml=False)  # agents that run nvidia-smi: the race
    job = host.spawn_holder(gpus=[0], mib=1500, title="train.py")
    loop = host.spawn_smi_loop(0.02)
    inv = lab.inventory_yaml([host])
    caught = 0
    try:
        for _ in range(8):
            with ThreadPoolExecutor(3) as pool:
                runs = [pool.submit(run_gpufleet, home, inv, "status", "--json")
                        for _ in range(2)]
                planned = pool.submit(clean, home, inv, "--dry-run", "--json", *FAST)
                docs = [r.result().host("shared-box") for r in runs]
                plan = planned.result()
            for doc in docs:
                for h in doc["holders"]:
                    assert h["name"] is not None, doc["holders"]  # no `? 695 (fd: GPUs 0)`
                    if h["pid"] != job:
                        assert h.get("role") == "client", h
                caught += len(doc["holders"]) - 1 + len(doc.get("holders_vanished", []))
            pdoc = plan.host("shared-box")
            assert [t["pid"] for t in pdoc["targets"]] == [job], str(plan)
            assert pdoc["refused"] == [], str(plan)  # no "unreadable" ghost refusals
            caught += len(pdoc.get("clients", []))
            text = run_gpufleet(home, inv, "status")
            rows = [line.split() for line in text.stdout.splitlines()
                    if line.startswith("shared-box")]
            assert not any(r[1] == "fd" for r in rows), text.stdout
            assert " ? " not in text.stdout, text.stdout
    finally:
        host.kill(loop)
    assert caught > 0, "no concurrent nvidia-smi was ever caught: the test proves nothing"
    assert host.alive(job)
