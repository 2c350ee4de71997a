"""CUDA MPS: its control daemon and servers are infrastructure, its clients are targets, the
servers' memory is expected while MPS runs, and the plan says how to stop MPS.

The scenario (tests/fixtures/scenarios/mps-h200.json) is the H200 recording of
tests/fixtures/real-h200/clean-cases/probe-1.log part C: the daemon 888
(/usr/local/nvidia/bin/nvidia-cuda-mps-control -d, comm nvidia-cuda-mps, ppid 1, nvidia0 and
nvidiactl open and mapped), its child the server 908 (nvidia-cuda-mps-server, comm
nvidia-cuda-mps, nvidia-uvm mapped, NVML: 66 MiB) and a torch client 891 (NVML: 3588 MiB).
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet.core import policy
from gpufleet.core.ledger import driver_allowance_mib, ledger
from gpufleet.core.model import ProcessInfo, Snapshot, parse_snapshot
from gpufleet.core.plan import make_plan
from gpufleet.core.verdict import CLEAN, DIRTY, make_verdict
from gpufleet.ops.clean import wait_floors
from gpufleet.render.status import gpu_is_busy, holders_text, host_doc
from gpufleet.core.model import HostResult

SCENARIO = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios" / "mps-h200.json"
DAEMON, SERVER, CLIENT = 888, 908, 891
MPS_CONTROL, MPS_SERVER = "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"
SERVER_MIB = 66
PYTHON = "/usr/bin/python3.11"


def doc() -> dict[str, Any]:
    return json.loads(SCENARIO.read_text())


@pytest.fixture
def snap() -> Snapshot:
    return parse_snapshot(doc())


def ctx(snapshot: Snapshot) -> policy.PolicyContext:
    return policy.PolicyContext.from_snapshot(snapshot)


def after_doc(used_mib: int = 73) -> dict[str, Any]:
    """The recorded state after the client's SIGKILL: NVML lists only the server (66 MiB);
    memory.used 689 MiB by NVML's v1 reading, 616 of them the reservation."""
    d = doc()
    d["compute_apps"] = [a for a in d["compute_apps"] if a["pid"] == SERVER]
    d["holders"] = [h for h in d["holders"] if h["pid"] != CLIENT]
    del d["processes"][str(CLIENT)]
    d["gpus"][0]["memory_used_mib"] = used_mib
    d["gpus"][0]["memory_free_mib"] = 143771 - 616 - used_mib
    return d


# --- policy ---------------------------------------------------------------------------------


def test_the_recorded_daemon_and_server_are_never_signalled(snap: Snapshot) -> None:
    c = ctx(snap)
    assert policy.signal_refusal(snap.processes[DAEMON], c) == (
        policy.PROTECTED, "nvidia-cuda-mps-control (CUDA MPS control daemon, never signalled)")
    assert policy.signal_refusal(snap.processes[SERVER], c) == (
        policy.PROTECTED, "nvidia-cuda-mps-server (CUDA MPS server, never signalled)")
    assert policy.may_signal(snap.processes[CLIENT], c)  # a client is a process like any


def test_a_cut_comm_claims_both_names_and_the_executable_picks_one(snap: Snapshot) -> None:
    """Both have comm "nvidia-cuda-mps": the claim must try every name it could be."""
    c = ctx(snap)
    for pid, name in ((DAEMON, MPS_CONTROL), (SERVER, MPS_SERVER)):
        bare = dataclasses.replace(snap.processes[pid], cmdline="", ppid=1)  # the comm alone
        assert policy.protected_daemon(bare) == name
        assert policy.false_claim(bare) is None
        found = policy.signal_refusal(bare, c)
        assert found is not None and found[1].startswith(name + " (")


def test_a_user_process_claiming_the_server_name_runs_python_and_is_a_target(snap: Snapshot
                                                                              ) -> None:
    d = doc()
    d["processes"][str(CLIENT)].update(comm="nvidia-cuda-mps", cmdline="nvidia-cuda-mps-server",
                                       exe=PYTHON, exe_root=True, uid=65534, user="nobody")
    fake = parse_snapshot(d)
    proc = fake.processes[CLIENT]
    assert policy.claimed_daemon(proc) == MPS_SERVER  # the whole name first
    assert policy.protected_daemon(proc) is None and policy.may_signal(proc, ctx(fake))
    plan = make_plan(fake, (0,))
    assert [t.pid for t in plan.targets] == [CLIENT]
    assert any(f"PID {CLIENT} claims to be nvidia-cuda-mps-server, but its executable is "
               f"{PYTHON}" in n for n in plan.notes), plan.notes
    # nor does naming a python parent "nvidia-cuda-mps-control" make its children servers
    d["processes"][str(DAEMON)].update(exe=PYTHON)
    d["processes"][str(CLIENT)].update(ppid=DAEMON)
    fake = parse_snapshot(d)
    assert policy.may_signal(fake.processes[CLIENT], ctx(fake))
    assert CLIENT in make_plan(fake, (0,)).target_pids


def test_a_child_of_the_verified_daemon_is_a_server_whatever_it_is_named(snap: Snapshot) -> None:
    """The daemon's children are its servers: the child rule needs no name and no readable
    executable of the child's own (names may only add protection)."""
    child = ProcessInfo(pid=990, ppid=DAEMON, starttime=5, state="S", uid=1000, user="alice",
                        comm="worker", cmdline="worker", exe=None, exe_root=None)
    procs = dict(snap.processes)
    procs[990] = child
    c = dataclasses.replace(ctx(snap), processes=procs)
    found = policy.signal_refusal(child, c)
    assert found is not None and found[0] == policy.PROTECTED and "CUDA MPS server" in found[1]


# --- the plan, the ledger, the threshold, the verdict ----------------------------------------


def test_the_recorded_clean_signals_only_the_client(snap: Snapshot) -> None:
    plan = make_plan(snap, (0,))
    assert [(t.pid, t.wave) for t in plan.targets] == [(CLIENT, 0)]
    assert {r.pid: r.kind for r in plan.refused} == {DAEMON: policy.PROTECTED,
                                                     SERVER: policy.PROTECTED}
    assert make_plan(snap).target_pids == {CLIENT}  # every GPU: the same


def test_the_servers_memory_is_expected_in_the_ledger_and_the_threshold(snap: Snapshot) -> None:
    row = ledger(snap)[0]
    assert row.mps_server_mib == SERVER_MIB and row.attributed_mib == 3654
    plan = make_plan(snap, (0,), tolerance_mib=64)
    # tolerance + the server's 66 MiB + the driver's share for the one listed process left
    assert plan.threshold_mib == {0: 64 + SERVER_MIB + driver_allowance_mib(1)}
    assert wait_floors(plan, snap) == {}  # expected already: no floor on top of it


def test_a_clean_that_frees_the_client_is_clean_with_the_servers_mib_left(snap: Snapshot) -> None:
    plan = make_plan(snap, (0,))
    clean = {"signals": [{"pid": CLIENT, "signal": "TERM", "outcome": "sent"}],
             "survivors": [], "after": after_doc(73)}
    verdict = make_verdict(plan, clean, snap)
    assert verdict.verdict == CLEAN, verdict.reason
    assert verdict.left_mib == 73 and verdict.freed_mib == 3663 - 73
    # what the server does not explain still makes it dirty
    leak = make_verdict(plan, dict(clean, after=after_doc(73 + 200)), snap)
    assert leak.verdict == DIRTY and "273 MiB left" in leak.reason, leak.reason


def test_the_plan_says_how_to_stop_mps(snap: Snapshot) -> None:
    plan = make_plan(snap, (0,))
    note = next(n for n in plan.notes if n.startswith("CUDA MPS runs here"))
    assert f"control daemon PID {DAEMON}, server PID {SERVER}" in note
    assert f"expected ({SERVER_MIB} MiB on GPU 0)" in note
    assert "echo quit | /usr/local/nvidia/bin/nvidia-cuda-mps-control" in note
    assert "CUDA_MPS_PIPE_DIRECTORY the daemon was started with; default /tmp/nvidia-mps" in note
    d = doc()  # the agent read and trusted the daemon's own pipe directory
    d["mps"] = [{"pid": DAEMON, "pipe_dir": "/run/mps pipes", "pipe_dir_trusted": True,
                 "servers": [{"pid": SERVER, "clients": [CLIENT]}], "error": None}]
    note = next(n for n in make_plan(parse_snapshot(d), (0,)).notes if n.startswith("CUDA MPS"))
    assert "echo quit | CUDA_MPS_PIPE_DIRECTORY='/run/mps pipes' " \
           "/usr/local/nvidia/bin/nvidia-cuda-mps-control" in note
    d["mps"][0]["pipe_dir_trusted"] = False  # a directory someone else could have made
    note = next(n for n in make_plan(parse_snapshot(d), (0,)).notes if n.startswith("CUDA MPS"))
    assert "/run/mps pipes" not in note and "default /tmp/nvidia-mps" in note


def test_a_renamed_daemon_is_still_the_daemon_by_its_executable(snap: Snapshot) -> None:
    renamed = dataclasses.replace(snap.processes[DAEMON], comm="mpsd", cmdline="mpsd")
    found = policy.signal_refusal(renamed, ctx(snap))
    assert found is not None and found[1].startswith(MPS_CONTROL + " (")


def test_a_slurm_epilog_counts_the_mps_server_as_no_holder(snap: Snapshot) -> None:
    """After the job's client is gone, only MPS is left: the GPU is free for the next job."""
    from gpufleet.core.slurm import gpu_problems, plan_holders

    after = parse_snapshot(after_doc(73))
    plan = make_plan(after, (0,))
    assert gpu_problems(after, plan.scope, plan.threshold_mib, plan_holders(plan, after)) == []
    plan = make_plan(snap, (0,))  # with the client: it is the one holder named
    held = gpu_problems(snap, plan.scope, plan.threshold_mib, plan_holders(plan, snap))
    assert [h.gpu for h in held] == [0] and str(CLIENT) in held[0].text, held


def test_status_shows_the_servers_memory_and_a_gpu_with_only_it_is_free(snap: Snapshot) -> None:
    after = parse_snapshot(after_doc(73))
    gpu = after.gpus[0]
    assert holders_text(after, gpu) == "908 root 66MiB (MPS server)\tnvidia-cuda-mps-server"
    assert not gpu_is_busy(after, gpu, 0)
    assert gpu_is_busy(snap, snap.gpus[0], 0)  # the client is someone's
    out = host_doc(HostResult(host="h200", ok=True, snapshot=after), 0)
    assert out["gpus"][0]["mps_server_mib"] == SERVER_MIB


# --- NVML lists only the server: the daemon's own lists ----------------------------------------


def server_only_doc(clients: list[int]) -> dict[str, Any]:
    """NVML counts the client's memory in the server's row (some drivers and containers);
    the agent asked the daemon (get_server_list, get_client_list)."""
    d = doc()
    d["compute_apps"] = [dict(d["compute_apps"][0], used_mib=3654)]
    d["mps"] = [{"pid": DAEMON, "pipe_dir": "/tmp/nvidia-mps", "pipe_dir_trusted": True,
                 "servers": [{"pid": SERVER, "clients": clients}], "error": None}]
    return d


def test_clients_from_the_daemons_list_are_targets_and_claims_need_device_files() -> None:
    d = server_only_doc([CLIENT, 4242, 4343])
    d["processes"]["4242"] = dict(d["processes"][str(CLIENT)], pid=4242, comm="bash",
                                  cmdline="-bash", exe="/usr/bin/bash")  # no device file open
    d["processes"]["4343"] = dict(d["processes"][str(CLIENT)], pid=4343, comm="python3",
                                  cmdline="python3 poll_nvml.py")  # a monitor: nothing mapped
    d["holders"].append({"pid": 4343, "devices": ["/dev/nvidia-uvm", "/dev/nvidia0",
                                                  "/dev/nvidiactl"], "mapped": []})
    snap = parse_snapshot(d)
    plan = make_plan(snap, (0,))
    assert [(t.pid, t.evidence, t.gpus) for t in plan.targets] == [(CLIENT, "mps-client", (0,))]
    assert policy.holder_role(snap, CLIENT, 64).role == policy.ROLE_HOLDER
    # the server's row is not all its own: only the measured share is expected (66 MiB)
    assert ledger(snap)[0].mps_server_mib == SERVER_MIB
    assert plan.threshold_mib == {0: 64 + SERVER_MIB + driver_allowance_mib(1)}
    d2 = copy.deepcopy(d)  # a smaller row (a smaller server) is all expected, never more
    d2["compute_apps"][0]["used_mib"] = 40
    assert ledger(parse_snapshot(d2))[0].mps_server_mib == 40
    # a list is taken only from the daemon's own binary: a python "daemon" lists nothing
    fake = copy.deepcopy(d)
    fake["processes"][str(DAEMON)]["exe"] = PYTHON
    assert policy.holder_role(parse_snapshot(fake), CLIENT, 64).role == policy.ROLE_CLIENT
    assert CLIENT not in make_plan(parse_snapshot(fake), (0,)).target_pids
    # without the daemon's list, the same client is a GPU client nobody may signal
    d["mps"] = []
    assert make_plan(parse_snapshot(d), (0,)).target_pids == frozenset()


def test_an_mps_client_is_placed_on_the_gpus_its_context_maps() -> None:
    d = server_only_doc([CLIENT])
    second = copy.deepcopy(d["gpus"][0])
    second.update(index=1, minor=1, uuid="GPU-11111111-2222-3333-4444-555555555555")
    d["gpus"].append(second)
    d["compute_apps"].append(dict(d["compute_apps"][0], gpu_uuid=second["uuid"], used_mib=66))
    client = next(h for h in d["holders"] if h["pid"] == CLIENT)
    client["devices"] = sorted(client["devices"] + ["/dev/nvidia1"])  # CUDA opens them all
    client["mapped"] = sorted(client["mapped"] + ["/dev/nvidia1"])  # its context: both GPUs
    server = next(h for h in d["holders"] if h["pid"] == d["compute_apps"][0]["pid"])
    server["devices"] = sorted(server["devices"] + ["/dev/nvidia1"])  # it serves GPU 1 too
    plan = make_plan(parse_snapshot(d), (0,))
    refusal = plan.refusal_of(CLIENT)
    assert plan.target_pids == frozenset() and refusal is not None, plan
    assert refusal.kind == "spanning" and "GPU 1 outside the scope" in refusal.reason
    assert make_plan(parse_snapshot(d), (0, 1)).target_pids == {CLIENT}
    assert make_plan(parse_snapshot(d), (0,), include_spanning=True).target_pids == {CLIENT}
    client["mapped"].remove("/dev/nvidia0")  # a context on GPU 1 only
    assert make_plan(parse_snapshot(d), (1,)).target_pids == {CLIENT}
    plan = make_plan(parse_snapshot(d), (0,))
    assert plan.target_pids == frozenset() and plan.refusal_of(CLIENT) is None
