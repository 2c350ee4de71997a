"""A process whose main thread is gone while another thread still holds the GPU, end to end:
the real CLI over real SSH against lab hosts (tests/lab/README.md, `leader_exit` and `stuck`).

Recorded on a real H200 (tests/fixtures/real-h200/clean-cases/probe-1.log, part D): a torch
process whose main thread called pthread_exit while another thread held 5 GiB shows `Zl`,
NVML lists the PID with 5638 MiB, the leader's fd table and maps are empty while the live
threads' show every device file and a mapped nvidia-uvm, and SIGKILL of the leader PID freed
the memory in 0.13 s.
"""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from cli_helpers import (
    assert_no_traceback,
    home,  # noqa: F401  (fixture)
    run_gpufleet,
)

FAST = ("--grace", "1", "--timeout", "30")
HELD_MIB = 5638  # what NVML listed for the H200 probe's zombie leader


def clean(home: Path, inv: Path, *args: str) -> Any:
    return run_gpufleet(home, inv, "clean", "--all", "--audit-log", str(home / "audit.jsonl"), *args)


def test_zombie_leader_that_holds_is_a_target_killed_and_the_gpu_is_clean(
        lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("h200-like", gpus=2)
    holder = host.spawn_holder(gpus=[0], mib=HELD_MIB, title="torch-train", leader_exit=True,
                               ignore_term=True)
    other = host.spawn_holder(gpus=[1], mib=700, title="other-job")
    assert host.proc_state(holder) == "Z" and host.alive(holder)
    inv = lab.inventory_yaml([host])

    status = run_gpufleet(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    (shown,) = [h for h in status.json()["hosts"][0]["holders"] if h["pid"] == holder]
    # the leader's own maps are empty: its live thread's maps are read instead
    assert shown["mapped"] is not None and "/dev/nvidia-uvm" in shown["mapped"], shown

    run = clean(home, inv, "--gpus", "0", "--yes", "--json", *FAST)
    assert_no_traceback(run)
    assert run.rc == 0, str(run)
    doc = run.host("h200-like")
    assert doc["verdict"] == "clean", str(run)
    assert doc["refused"] == [], doc["refused"]
    assert [(t["pid"], t["evidence"], t["starttime"]) for t in doc["targets"]] == [
        (holder, "nvidia-smi", holder.starttime)]
    sent = [(s["pid"], s["signal"], s["outcome"]) for s in doc["signals"]]
    assert sent == [(holder, "TERM", "sent"), (holder, "KILL", "sent")], sent
    assert doc["after"] == [{"index": 0, "memory_used_mib": 0}]
    assert host.wait_gone(holder, 10) and host.proc_state(holder) is None
    assert host.alive(other) and host.gpu_used() == [0, 700]


def test_a_true_zombie_holds_nothing_and_the_memory_is_said_to_be_elsewhere(
        lab: Any, make_host: Any, home: Path) -> None:
    """A zombie with no thread left holds nothing (recorded): the vLLM engine core, killed,
    stays a zombie under its API server, which does not reap it. What is left on the GPU is
    memory no process holds; the verdict says so and does not blame the zombie. (A true
    zombie never reaches a plan in the lab: the agent lists device-file holders and listed
    PIDs, and it is neither; policy's refusal of one is unit-tested.)"""
    host = make_host("z-node", gpus=1, ghost_mib={0: 2000})
    api = host.spawn_vllm(gpus=[0], mib=3000)
    engine = api.children[0]
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--yes", "--json", *FAST)
    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    doc = run.host("z-node")
    assert doc["verdict"] == "dirty"
    assert {t["pid"] for t in doc["targets"]} == {engine, *engine.children}
    assert host.proc_state(engine) == "Z" and host.threads(engine) == 1
    survivors = {s["pid"]: s for s in doc["verdict_detail"]["survivors"]}
    zombie = survivors[engine]
    assert zombie["kind"] == "zombie", zombie
    assert zombie["detail"].startswith("zombie (exited, no thread left), parent PID %d " % api)
    assert "holds nothing" in zombie["detail"], zombie
    (line,) = doc["reason"].splitlines()[:1]
    assert line.startswith("GPU 0: 2000 MiB left"), doc["reason"]
    assert "2000 MiB no process here explains" in line, line
    assert str(engine) not in line, line  # the zombie is not named as what holds it
    assert doc["seconds"] < 10, doc["seconds"]  # no waiting for memory nothing could free


def test_a_stuck_thread_under_a_zombie_leader_gets_advice_not_a_wait(
        lab: Any, make_host: Any, home: Path) -> None:
    """Every live thread of a zombie leader is in uninterruptible sleep (a killed process
    stuck in the kernel): signals cannot end it. The plan refuses it with the thread and its
    wchan, the clean does not wait, and the verdict says what can still be done: here no GPU
    reset (the process holds the device files), so drain the node and reboot."""
    host = make_host("stuck-node", gpus=2)
    stuck = host.spawn_holder(gpus=[0], mib=3000, title="torch-dying", stuck=True)
    try:
        assert host.task_states(stuck)[stuck.thread] == ("D", "handle_userfault")
        inv = lab.inventory_yaml([host])
        run = clean(home, inv, "--gpus", "0", "--yes", "--json", *FAST)
        assert_no_traceback(run)
        assert run.rc == 1, str(run)
        doc = run.host("stuck-node")
        assert doc["verdict"] == "dirty" and doc["targets"] == [] and doc["signals"] == []
        (refused,) = doc["refused"]
        assert (refused["pid"], refused["kind"]) == (stuck, "stuck"), refused
        assert "thread %d" % stuck.thread in refused["reason"], refused
        assert "handle_userfault" in refused["reason"], refused
        assert doc["seconds"] < 10, doc["seconds"]  # no wait: --timeout is 30
        (line,) = [x for x in doc["reason"].splitlines() if x.startswith("GPU 0:")]
        assert "PID %d" % stuck in line and "D state in handle_userfault" in line, line
        assert "drain the node" in line and "reboot" in line, line
        # the plan says it too, before anything is done
        (note,) = [n for n in doc["plan_notes"] if n.startswith("PID %d " % stuck)]
        assert "is stuck: no signal ends it" in note and "state=drain" in note, note
        # nothing was signalled: the process and its memory are as they were
        assert host.task_states(stuck)[stuck.thread][0] == "D"
        assert host.gpu_used() == [3000, 0]
    finally:
        host.kill(stuck, signal.SIGKILL)
        host.wait_gone(stuck, 10)
