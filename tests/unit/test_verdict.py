"""gpufleet.core.verdict: clean/dirty from plan + the agent's clean document + before snapshot.

After-snapshots are the named scenario fixtures with what a clean changed applied to them
(processes gone, memory back), so every case starts from a realistic host."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Iterable, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.core import verdict as V
from gpufleet.core.ledger import driver_allowance_mib
from gpufleet.core.model import parse_snapshot
from gpufleet.core.plan import make_plan

SCENARIOS = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"


def doc(name: str) -> dict[str, Any]:
    return json.loads((SCENARIOS / f"{name}.json").read_text())


def after_doc(name: str, gone: Iterable[int] = (), used: Optional[dict[int, int]] = None,
              keep: Iterable[int] = (), unlisted: Iterable[int] = ()) -> dict[str, Any]:
    """The fixture after a clean: ``gone`` PIDs exited (with their listings and fds), except
    those in ``keep``; ``unlisted`` PIDs live on without GPU memory or device files; GPU
    memory.used is set from ``used`` (default: what the remaining listings add up to, + 2)."""
    d = copy.deepcopy(doc(name))
    gone = set(gone) - set(keep) - set(unlisted)
    off = gone | set(unlisted)
    d["processes"] = {k: v for k, v in d["processes"].items() if int(k) not in gone}
    d["compute_apps"] = [a for a in d["compute_apps"] if a["pid"] not in off]
    d["holders"] = [h for h in d["holders"] if h["pid"] not in off]
    for g in d["gpus"]:
        if used is not None and g["index"] in used:
            g["memory_used_mib"] = used[g["index"]]
        else:
            g["memory_used_mib"] = sum(
                a["used_mib"] for a in d["compute_apps"] if a["gpu_uuid"] == g["uuid"]) + 2
        g["memory_free_mib"] = g["memory_total_mib"] - g["memory_used_mib"]
    return d


def clean_doc(after: Optional[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    out = {"agent_version": 1, "mode": "clean", "lock": "acquired", "units_stopped": [],
           "signals": [], "survivors": [], "memory_wait": {"ok": True, "seconds": 1.2, "polls": 12},
           "after": after, "shm_removed": [], "reset": [], "seconds": 3.4}
    out.update(kw)
    return out


VLLM = [4340, 4341, 4360, 4361, 4362, 4363]


def test_train_node_clean() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    v = V.make_verdict(plan, clean_doc(after_doc("train-node", gone=VLLM)), before)
    assert v.verdict == "clean" and v.clean and v.reason == ""
    assert v.left_mib == 4 * 2
    assert v.freed_mib == (44571 + 44151 + 44571 + 44151) - 8
    assert [(g.index, g.before_mib, g.after_mib, g.threshold_mib, g.ok) for g in v.gpus] == [
        (0, 44571, 2, 64, True), (1, 44151, 2, 64, True),
        (2, 44571, 2, 64, True), (3, 44151, 2, 64, True)]
    assert v.survivors == () and v.unattributed == ()
    # the ranks and driver daemons still hold device files: no reset here, clean or not
    assert not v.reset_possible
    assert any("1187 nvidia-persiste" in b and "4520 python" in b for b in v.reset_blockers)


def test_freed_counts_from_the_agents_reading_under_the_lock() -> None:
    """Another clean freed GPUs 0-1 while this one waited for the host's lock: the plan's
    snapshot still shows that memory, the agent's reading under the lock does not. Freed is
    what this clean freed itself; a failed reading leaves freed unknown, never a guess."""
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM)
    locked = {"used_mib": {"0": 2, "1": 2, "2": 44571, "3": 44151}, "error": None}
    v = V.make_verdict(plan, clean_doc(after, before_locked=locked), before)
    assert v.verdict == "clean"
    assert [(g.index, g.before_mib) for g in v.gpus] == [(0, 2), (1, 2), (2, 44571), (3, 44151)]
    assert v.freed_mib == (2 + 2 + 44571 + 44151) - 8
    failed = {"used_mib": None, "error": "NVML: GPU is lost"}
    v = V.make_verdict(plan, clean_doc(after, before_locked=failed), before)
    assert v.verdict == "clean" and v.freed_mib is None and v.left_mib == 8
    assert [g.before_mib for g in v.gpus] == [None] * 4


def test_stuck_worker_makes_it_dirty_and_says_why() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM, keep=[4363])
    after["processes"]["4363"].update(state="D", wchan="uvm_va_space_destroy", ppid=1)
    agent = [{"pid": 4363, "state": "D", "wchan": "uvm_va_space_destroy",
              "reason": "alive after KILL"}]
    v = V.make_verdict(plan, clean_doc(after, survivors=agent), before)
    assert v.verdict == "dirty"
    assert [(g.index, g.ok) for g in v.gpus] == [(0, True), (1, True), (2, True), (3, False)]
    assert v.left_mib == 2 + 2 + 2 + 44138
    (s,) = v.survivors
    assert (s.pid, s.name, s.gpus, s.used_mib, s.kind) == (4363, "VLLM::Worker", (3,), 44136,
                                                           V.STUCK)
    assert s.detail == "D state in uvm_va_space_destroy: signals cannot end it"
    # one line for the one dirty GPU: who, why, and what can still be done instead of waiting
    # (the ranks and nvidia-persistenced hold GPU 3's device file: no reset, so drain)
    assert v.reason == ("GPU 3: 44138 MiB left (threshold 64): PID 4363 VLLM::Worker "
                        "(44136 MiB) stuck: D state in uvm_va_space_destroy: signals cannot end "
                        "it; no GPU reset here (its device file is open in 7 processes): drain "
                        "the node and reboot")
    assert not v.reset_possible


def test_target_alive_but_off_the_gpu_is_reported_from_the_agents_survivors() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM, unlisted=[4340])
    agent = [{"pid": 4340, "state": "S", "wchan": "do_epoll_wait", "reason": "ignored TERM"}]
    v = V.make_verdict(plan, clean_doc(after, survivors=agent), before)
    assert v.verdict == "clean"  # memory is the proof; the survivor is still reported
    (s,) = v.survivors
    assert (s.pid, s.kind, s.detail, s.gpus) == (4340, V.SURVIVED, "ignored TERM", (0,))


def test_driver_leak_and_reset_possible() -> None:
    before = parse_snapshot(doc("unit-vllm"))
    plan = make_plan(before, stop_units=True)
    after = after_doc("unit-vllm", gone=[2210, 2240, 2260, 2261], used={1: 1500})
    v = V.make_verdict(plan, clean_doc(after), before)
    assert v.verdict == "dirty"
    (u,) = v.unattributed
    assert (u.gpu, u.mib, u.cause) == (1, 1500, V.CAUSE_LEAK)
    assert v.reset_possible and v.reset_blockers == ()
    assert v.reason == ("GPU 1: 1500 MiB left (threshold 64): 1500 MiB no process here "
                        "explains: the driver (a leak, or a process it still tears down) or "
                        "another PID namespace (NVML gives host PIDs: find them by NSpid in "
                        "/proc/PID/status); a GPU reset frees it: clean again with --reset")
    assert v.freed_mib == 2 * 125019 - (2 + 1500)


def test_refused_process_stays_and_display_memory_is_explained() -> None:
    before = parse_snapshot(doc("agent-session"))
    plan = make_plan(before, (0,))
    after = after_doc("agent-session", gone=[2700], used={0: 6100 + 612})
    v = V.make_verdict(plan, clean_doc(after), before)
    assert v.verdict == "dirty"
    (s,) = v.survivors
    assert (s.pid, s.kind, s.detail) == (2600, V.REFUSED, "in the gpufleet agent's own session")
    (u,) = v.unattributed
    assert (u.gpu, u.mib, u.cause) == (0, 612, V.CAUSE_DISPLAY)
    assert "1650 Xorg" in u.detail and "1900 gnome-shell" in u.detail
    assert v.reset_blockers[0] == "not root"


def test_hidden_pids_after_clean_point_at_the_namespace() -> None:
    before = parse_snapshot(doc("hidden-pids"))
    plan = make_plan(before, (0,))  # ambiguous: nothing signalled
    after = after_doc("hidden-pids", used={0: 126410, 1: 126406})
    v = V.make_verdict(plan, clean_doc(after), before)
    assert v.verdict == "dirty" and v.freed_mib == 0
    (u,) = v.unattributed
    assert u.cause == V.CAUSE_NAMESPACE
    assert "unlisted holders PID 57, 88, 89" in u.detail and "docker-7f3e2a91d0b4" in u.detail
    assert {s.pid: s.kind for s in v.survivors} == {57: V.REFUSED, 88: V.REFUSED,
                                                    89: V.REFUSED}
    assert "in container docker-7f3e2a91d0b4" in v.reset_blockers


def test_invisible_listing_survives() -> None:
    before = parse_snapshot(doc("pod-host-pids"))
    plan = make_plan(before, (0,))
    v = V.make_verdict(plan, clean_doc(doc("pod-host-pids")), before)
    assert v.verdict == "dirty"
    (s,) = v.survivors
    assert (s.pid, s.kind, s.used_mib) == (2841377, V.INVISIBLE, 30512)
    assert v.unattributed == ()  # listed memory is attributed, just not reachable


def test_wsl2_reservation() -> None:
    before = parse_snapshot(doc("wsl2"))
    after = after_doc("wsl2", gone=[900, 950], used={0: 1480})
    v = V.make_verdict(make_plan(before), clean_doc(after), before)
    assert v.verdict == "dirty"
    assert [(u.mib, u.cause) for u in v.unattributed] == [(1480, V.CAUSE_WSL2)]
    assert "WSL2 has no GPU reset" in v.reset_blockers
    # the host's expected unattributed memory makes the same numbers clean
    v2 = V.make_verdict(make_plan(before, unattributed_mib=1450), clean_doc(after), before)
    assert v2.verdict == "clean" and v2.freed_mib == 15873 - 1480


def test_new_process_and_pid_reuse() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM, keep=[4360])
    after["processes"]["4360"].update(starttime=999999999, comm="python", cmdline="python x.py")
    after["processes"]["7777"] = dict(after["processes"]["4360"], pid=7777, starttime=999999990)
    uuid1 = after["gpus"][1]["uuid"]
    after["compute_apps"] += [{"pid": 7777, "process_name": "python", "used_mib": 3000,
                               "gpu_uuid": uuid1}]
    after["gpus"][1]["memory_used_mib"] = 3002
    v = V.make_verdict(plan, clean_doc(after), before)
    kinds = {s.pid: s.kind for s in v.survivors}
    assert kinds == {4360: V.NEW, 7777: V.NEW}
    assert v.verdict == "dirty" and "GPU 1: 3002 MiB left" in v.reason


def test_zombie_survivor_named_by_the_agent() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM, unlisted=[4361])
    after["processes"]["4361"].update(state="Z", cmdline="")
    agent = [{"pid": 4361, "state": "Z", "wchan": "0", "reason": "zombie"}]
    v = V.make_verdict(plan, clean_doc(after, survivors=agent), before)
    (s,) = v.survivors
    assert s.kind == V.ZOMBIE and s.detail == ("zombie (exited, no thread left), parent PID "
                                               "4340 (VLLM::EngineCore_DP0): holds nothing")
    assert v.verdict == "clean"


@pytest.mark.parametrize("mutate,words", [
    (lambda c: c.update(after=None), "no after-snapshot"),
    (lambda c: c.update(after={"agent_version": 99}), "unreadable after-snapshot"),
    (lambda c: c["after"].update(nvidia_smi={"ok": False, "error": "Unable to determine the "
                                             "device handle for GPU0000:61:00.0: Unknown Error"}),
     "nvidia-smi failed after the clean: Unable to determine"),
])
def test_no_measurement_is_dirty(mutate, words: str) -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    c = clean_doc(after_doc("train-node", gone=VLLM))
    mutate(c)
    v = V.make_verdict(plan, c, before)
    assert v.verdict == "dirty" and words in v.reason
    assert v.freed_mib is None and v.left_mib is None


def test_agent_problems_are_quoted() -> None:
    before = parse_snapshot(doc("unit-vllm"))
    plan = make_plan(before, stop_units=True)
    after = after_doc("unit-vllm", gone=[2210, 2240, 2260], used={1: 125006})
    c = clean_doc(after, units_stopped=[{"unit": "vllm-minimax.service", "ok": False,
                                         "error": "Job for vllm-minimax.service canceled."}],
                  signals=[{"pid": 2261, "starttime": 31201, "signal": "TERM",
                            "outcome": "permission denied", "t": 0.01}],
                  reset=[{"index": 1, "ok": False, "message": "GPU is in use"}])
    v = V.make_verdict(plan, c, before)
    assert v.verdict == "dirty"
    assert v.problems == (
        "stopping vllm-minimax.service failed: Job for vllm-minimax.service canceled.",
        "SIGTERM to PID 2261: permission denied",
        "reset of GPU 1 failed: GPU is in use",
    )
    assert {s.pid: s.kind for s in v.survivors} == {2261: V.SURVIVED}


def test_busy_lock_is_dirty_even_with_low_memory() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    v = V.make_verdict(plan, clean_doc(after_doc("train-node", gone=VLLM), lock="busy"), before)
    assert v.verdict == "dirty" and "another gpufleet clean holds this host's lock" in v.reason


def test_a_refused_lock_is_dirty_and_says_why_and_a_busy_one_who_holds_it() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM)
    refused = V.make_verdict(plan, clean_doc(after, lock="refused", lock_refused={
        "kind": "unsafe_dir", "path": "/run/gpufleet",
        "reason": "/run/gpufleet is owned by uid 65534, not by the agent's uid 0"}), before)
    assert refused.verdict == "dirty" and refused.problems == (
        "no safe clean lock: /run/gpufleet is owned by uid 65534, not by the agent's uid 0; "
        "nothing was signalled",)
    busy = V.make_verdict(plan, clean_doc(after, lock="busy", lock_holder={
        "pid": 77, "uid": 0, "user": "root", "cmdline": "flock x sleep 9", "open": True}), before)
    assert busy.verdict == "dirty" and "PID 77, user root" in busy.reason


def test_as_dict_is_json() -> None:
    before = parse_snapshot(doc("agent-session"))
    v = V.make_verdict(make_plan(before, (0,)),
                       clean_doc(after_doc("agent-session", gone=[2700])), before)
    assert json.loads(json.dumps(v.as_dict()))["verdict"] == v.verdict


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 49140), min_size=8, max_size=8),
       st.sets(st.integers(0, 7), min_size=1), st.integers(0, 500))
def test_clean_iff_every_scope_gpu_at_or_below_threshold(used, scope, expected) -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, tuple(scope), unattributed_mib=expected)
    after = after_doc("train-node", gone=VLLM + [4520, 4521, 4522, 4523],
                      used=dict(enumerate(used)))
    v = V.make_verdict(plan, clean_doc(after), before)
    # expected + tolerance, + the driver's share for listed processes the plan leaves there
    left = {i: {a.pid for a in before.apps_on(i)} - plan.target_pids for i in scope}
    assert plan.threshold_mib == {i: expected + 64 + driver_allowance_mib(len(left[i])) for i in scope}
    ok = all(used[i] <= plan.threshold_mib[i] for i in scope)
    assert v.clean == ok
    assert v.left_mib == sum(used[i] for i in scope)
    before_used = {g.index: g.memory_used_mib for g in before.gpus}
    assert v.freed_mib == sum(before_used[i] for i in scope) - v.left_mib
    if not ok:
        assert all(f"GPU {i}: {used[i]} MiB left" in v.reason
                   for i in scope if used[i] > plan.threshold_mib[i])


# GPU 0's threshold: the 64 MiB tolerance + the driver's share for the two listed processes the
# plan leaves there (4340 and 4360, refused: their family also uses GPU 1)
GPU0_THRESHOLD = 64 + driver_allowance_mib(2)


@pytest.mark.parametrize("left,clean", [(GPU0_THRESHOLD, True), (GPU0_THRESHOLD + 1, False), (0, True)])
def test_threshold_boundary(left: int, clean: bool) -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0,))
    assert plan.threshold_mib == {0: GPU0_THRESHOLD}
    v = V.make_verdict(plan, clean_doc(after_doc("train-node", gone=VLLM, used={0: left})),
                       before)
    assert v.clean is clean


def test_a_retake_outranks_free_memory_and_names_who_and_what_to_do() -> None:
    """The memory came back (clean by memory alone), but a target's owner started it again,
    or a new process took a scope GPU: the verdict is retaken, never clean."""
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    target = plan.targets[0]
    restarted = {"pid": 9901, "starttime": 99, "how": "restarted", "name": "VLLM::Worker",
                 "replaces": target.pid, "owner": "PID 77 sh", "owner_pid": 77}
    listed = {"pid": 9902, "starttime": 98, "how": "listed", "name": "python3"}
    after = after_doc("train-node", gone=VLLM)
    for retakes, words in [([restarted], ["PID 9901 VLLM::Worker was started again by PID 77 sh",
                                          f"in place of PID {target.pid}", "--owner 77"]),
                           ([listed], ["PID 9902 python3 took a GPU in scope"])]:
        v = V.make_verdict(plan, clean_doc(after, settle={"seconds": 1.0, "retaken": retakes}),
                           before)
        assert v.verdict == V.RETAKEN and not v.clean
        assert v.reason.startswith("retaken: ") and all(w in v.reason for w in words), v.reason
    v = V.make_verdict(plan, clean_doc(after, settle={"seconds": 5.0, "retaken": []}), before)
    assert v.verdict == V.CLEAN


def with_monitor(d: dict[str, Any]) -> dict[str, Any]:
    """An nvtop on the host (recorded: every device file open, nothing mapped, no memory)."""
    d = copy.deepcopy(d)
    devices = sorted({dev for h in d["holders"] for dev in h["devices"]})
    d["holders"].append({"pid": 461, "devices": devices, "mapped": []})
    d["processes"]["461"] = dict(d["processes"]["3902"], pid=461, ppid=3902, starttime=777,
                                 comm="nvtop", cmdline="nvtop", relation=None)
    return d


def test_memory_no_process_explains_is_never_blamed_on_a_gpu_client() -> None:
    """The monitor holds device files and no memory: the reason says where unexplained memory
    may be (the driver, another PID namespace) and never names the monitor."""
    before = parse_snapshot(with_monitor(doc("train-node")))
    plan = make_plan(before, (0, 1, 2, 3))
    assert [c.pid for c in plan.clients] == [461]
    after = with_monitor(after_doc("train-node", gone=VLLM, used={2: 5000}))
    v = V.make_verdict(plan, clean_doc(after), before)
    assert v.verdict == "dirty"
    (u,) = v.unattributed
    assert (u.gpu, u.mib, u.cause) == (2, 5000, V.CAUSE_LEAK) and "461" not in u.detail
    assert v.reason == ("GPU 2: 5000 MiB left (threshold 64): 5000 MiB no process here "
                        "explains: the driver (a leak, or a process it still tears down) or "
                        "another PID namespace (NVML gives host PIDs: find them by NSpid in "
                        "/proc/PID/status); no GPU reset here (its device file is open in 7 "
                        "processes): drain the node and reboot")


def test_a_line_per_dirty_gpu_naming_each_refused_holder_with_its_reason() -> None:
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 2))  # both vLLM families also use GPU 1 or 3: refused
    assert plan.targets == ()
    v = V.make_verdict(plan, clean_doc(after_doc("train-node")), before)
    lines = v.reason.splitlines()
    assert [line.split(":")[0] for line in lines] == ["GPU 0", "GPU 2"]
    why = {r.pid: r.reason for r in plan.refused}
    assert why[4340] == why[4360]  # one family, one reason: said once
    assert lines[0] == (f"GPU 0: 44558 MiB left (threshold {GPU0_THRESHOLD}): PIDs 4340 "
                        f"VLLM::EngineCore_DP0 (420 MiB), 4360 VLLM::Worker (44136 MiB) "
                        f"refused: {why[4340]}")
    assert lines[1].startswith("GPU 2: 44558 MiB left") and why[4341] in lines[1]
    assert all(len(line) < 300 for line in lines), lines


def test_a_zombie_leader_left_holding_is_no_zombie_and_a_stuck_one_gets_advice() -> None:
    """A target whose main thread is gone while its threads still hold (the H200's `Zl`):
    it survived, it is not a zombie that holds nothing; with its threads in D state, it is
    stuck, and the line says what can still be done."""
    before = parse_snapshot(doc("train-node"))
    plan = make_plan(before, (0, 1, 2, 3))
    after = after_doc("train-node", gone=VLLM, keep=[4363])
    after["processes"]["4363"].update(state="Z", threads=19, live_threads=18, stuck_threads=[])
    v = V.make_verdict(plan, clean_doc(after), before)
    (s,) = v.survivors
    assert (s.pid, s.kind, s.gpus, s.used_mib) == (4363, V.SURVIVED, (3,), 44136)
    assert "PID 4363 VLLM::Worker (44136 MiB) survived" in v.reason
    after["processes"]["4363"].update(threads=2, live_threads=1, stuck_threads=[
        {"tid": 4377, "wchan": "uvm_va_space_destroy"}])
    v = V.make_verdict(plan, clean_doc(after), before)
    (s,) = v.survivors
    assert (s.kind, s.detail) == (V.STUCK, "D state in uvm_va_space_destroy: signals cannot "
                                           "end it")
    assert v.reason.endswith("no GPU reset here (its device file is open in 7 processes): "
                             "drain the node and reboot")
    # where --reset could do it (root, the host itself, nothing else has the file open)
    alone = copy.deepcopy(after)
    alone["holders"] = [h for h in alone["holders"] if h["pid"] == 4363]
    v = V.make_verdict(plan, clean_doc(alone), before)
    assert v.reason.endswith("its device file is open in 1 process): drain the node and reboot")
