"""gpufleet.core.plan: the clean plan on named scenario fixtures (tests/fixtures/scenarios/*.json,
agent snapshot documents; each says what it models in its "scenario" key)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.core import plan as planmod
from gpufleet.core import policy
from gpufleet.errors import UsageError
from gpufleet.core.ledger import driver_allowance_mib
from gpufleet.core.model import Snapshot, parse_snapshot
from gpufleet.core.plan import Plan, UnitStop, make_plan, to_request

SCENARIOS = Path(__file__).resolve().parent.parent / "fixtures" / "scenarios"
ALL = sorted(p.stem for p in SCENARIOS.glob("*.json"))


def doc(name: str) -> dict[str, Any]:
    return json.loads((SCENARIOS / f"{name}.json").read_text())


def load(name: str) -> Snapshot:
    return parse_snapshot(doc(name))


def pids(plan: Plan) -> set[int]:
    return {t.pid for t in plan.targets}


def refused(plan: Plan) -> dict[int, tuple[str, str]]:
    return {r.pid: (r.kind, r.reason) for r in plan.refused}


VLLM = {4340, 4341, 4360, 4361, 4362, 4363}
RANKS = {4520, 4521, 4522, 4523}


# ---------------------------------------------------------------- train-node: vLLM + trainer


def test_train_node_vllm_gpus_take_the_vllm_family_only() -> None:
    plan = make_plan(load("train-node"), (0, 1, 2, 3))
    assert plan.host == "train-node" and plan.scope == (0, 1, 2, 3) and not plan.full_scope
    assert pids(plan) == VLLM
    by = {t.pid: t for t in plan.targets}
    # EngineCore_DPn are the family roots (wave 0); their workers follow (wave 1)
    assert [(t.pid, t.wave, t.family_root) for t in plan.targets] == [
        (4340, 0, 4340), (4341, 0, 4341),
        (4360, 1, 4340), (4361, 1, 4340), (4362, 1, 4341), (4363, 1, 4341),
    ]
    assert by[4360].gpus == (0,) and by[4360].used_mib == 44136 and by[4363].gpus == (3,)
    assert by[4340].used_mib == 420 and by[4340].evidence == "nvidia-smi"
    assert by[4360].name == "VLLM::Worker" and by[4360].cmdline == "VLLM::Worker_DP0_TP0"
    assert by[4360].starttime == 881300 and by[4360].user == "alice"
    # the ranks hold /dev/nvidia0-3 too (CUDA opens every device file) but nvidia-smi lists
    # them on 4-7 only: not targets, and not refusals either
    assert not RANKS & (pids(plan) | set(refused(plan)))
    # driver daemons hold every device file: refused by policy, not as "ambiguous"
    assert refused(plan)[1187][0] == policy.PROTECTED
    assert refused(plan)[1203][0] == policy.PROTECTED
    assert set(refused(plan)) == {1187, 1203}
    assert plan.units_to_stop == () and plan.invisible == ()
    assert plan.threshold_mib == {0: 64, 1: 64, 2: 64, 3: 64}


def test_train_node_trainer_gpus() -> None:
    plan = make_plan(load("train-node"), (4, 5, 6, 7))
    assert pids(plan) == RANKS
    assert {t.wave for t in plan.targets} == {0}  # torchrun has no GPU evidence: 4 roots


def test_train_node_everything() -> None:
    plan = make_plan(load("train-node"))
    assert plan.full_scope and plan.scope == tuple(range(8))
    assert pids(plan) == VLLM | RANKS
    # no process is a target because of its name: torchrun, the API server, the
    # resource tracker, bash and tmux have no GPU evidence
    assert not {4510, 4320, 4321, 3950, 3951, 3952} & pids(plan)
    # the agent, its sudo and sshd ancestors hold nothing: not even mentioned
    assert not {51190, 51205, 51206, 51212, 1290} & (pids(plan) | set(refused(plan)))


def test_scope_as_unordered_list_is_normalised() -> None:
    plan = make_plan(load("train-node"), [3, 1, 2, 0, 1])
    assert plan.scope == (0, 1, 2, 3) and not plan.full_scope
    assert make_plan(load("train-node"), tuple(range(8))).full_scope


def test_scope_cutting_a_family_refuses_the_parent_of_the_outside_child() -> None:
    plan = make_plan(load("train-node"), (0, 1, 2))
    # EngineCore_DP1 (GPU 2) would take its worker on GPU 3 down with it, and so would its
    # worker on GPU 2 (4362 was once a target: half a family, which ends the other half too)
    assert pids(plan) == {4340, 4360, 4361}
    family = ("its family (root PID 4341 VLLM::EngineCore_DP1) also uses GPU 3, outside the "
              "scope: pass --include-spanning to clean the whole family")
    assert refused(plan)[4341] == refused(plan)[4362] == (planmod.FAMILY, family)
    assert 4363 not in refused(plan)
    # the job-level risk is said, not guessed at
    assert any("4340 shares process group 4320 with PIDs 4363" in n for n in plan.notes)


def test_targets_never_depend_on_names() -> None:
    d = doc("train-node")
    for pid, proc in d["processes"].items():
        if int(pid) in VLLM | RANKS:
            proc["comm"] = "sshd-lookalike" if int(pid) % 2 else "x"
            proc["cmdline"] = f"/opt/bin/job{pid} --fast"
    for app in d["compute_apps"]:
        app["process_name"] = "nvidia-persistenced"
    assert pids(make_plan(parse_snapshot(d))) == VLLM | RANKS
    # and a process called VLLM::Worker without GPU evidence is no target
    d = doc("train-node")
    d["processes"]["4999"] = dict(d["processes"]["4360"], pid=4999, ppid=3951, starttime=9)
    assert 4999 not in pids(make_plan(parse_snapshot(d)))


def test_threshold_is_expected_unattributed_plus_tolerance() -> None:
    plan = make_plan(load("train-node"), (2, 5), unattributed_mib=300, tolerance_mib=32)
    # + the driver's share for the listed processes the plan leaves on GPU 2 (4341 and, as
    # part of 4341's family that also uses GPU 3, 4362: both refused)
    assert plan.refusal_of(4341) is not None and plan.refusal_of(4362) is not None
    left = {a.pid for a in load("train-node").apps_on(2)} - plan.target_pids
    assert left == {4341, 4362}
    assert plan.threshold_mib == {2: 332 + driver_allowance_mib(2), 5: 332}


@pytest.mark.parametrize("scope,words", [((), "empty"), ((0, 8), "no GPU 8"), ((-1,), "negative"),
                                         (("a",), "indices")])
def test_bad_scope_is_a_usage_error(scope, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        make_plan(load("train-node"), scope)


def test_negative_tolerance_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        make_plan(load("train-node"), tolerance_mib=-1)


# ------------------------------------------------ shared-node: spanning, bob, zombie, ctl-only


def test_spanning_process_is_refused_with_its_gpus() -> None:
    plan = make_plan(load("shared-node"), (0, 1, 2, 3))
    assert refused(plan)[5120] == (
        planmod.SPANNING,
        "spans GPUs 3,4 (GPU 4 outside the scope; pass --include-spanning)",
    )
    assert plan.refusal_of(5120).gpus == (3, 4)


def test_include_spanning_makes_it_a_target_and_says_so() -> None:
    plan = make_plan(load("shared-node"), (0, 1, 2, 3), include_spanning=True)
    t = plan.target(5120)
    assert t is not None and t.gpus == (3, 4) and t.used_mib == 30512 + 1234
    assert any("5120" in n and "outside the scope" in n for n in plan.notes)


def test_other_users_and_zombies_and_driver_only_holders() -> None:
    plan = make_plan(load("shared-node"), (0, 1, 2, 3))
    assert pids(plan) == {5400, 5300}
    r = refused(plan)
    assert r[6100] == (policy.OWNER, "owned by bob; connect as root or with sudo")
    # the zombie child of finetune.py holds nothing and is said to be a zombie
    assert r[5310] == (policy.ZOMBIE, "zombie (exited, no thread left), parent PID 5300 "
                       "(python): holds nothing; any memory on its GPUs is held elsewhere "
                       "(another process, or the driver)")
    # ...and it does not stop its parent from being signalled
    assert plan.target(5300).wave == 0
    # 5500 holds only nvidiactl + nvidia-uvm, is not listed, and no memory is unexplained: a
    # GPU client (open device files, no memory), neither a target nor a refusal
    assert 5500 not in r and [c.pid for c in plan.clients] == [5500]
    sudo = make_plan(load("shared-node"), (0, 1, 2, 3), is_sudo=True)
    assert 6100 in pids(sudo)


def test_driver_only_holder_without_memory_evidence_is_a_client_of_a_full_clean() -> None:
    """A full clean once signalled it (evidence "device-file"): an open file is not memory."""
    plan = make_plan(load("shared-node"))
    assert plan.target(5500) is None and plan.refusal_of(5500) is None
    assert [(c.pid, c.gpus) for c in plan.clients] == [(5500, ())]
    assert any(n.startswith("1 GPU client(s)") and "5500 python" in n for n in plan.notes)
    assert any("not root" in n for n in plan.notes)


def test_driver_only_holder_is_no_evidence_in_a_partial_scope_when_memory_is_hidden() -> None:
    d = doc("shared-node")
    d["facts"]["in_container"] = True  # nvidia-smi may miss holders here...
    d["gpus"][5]["memory_used_mib"] = 9000  # ...and GPU 5 has memory nobody explains
    plan = make_plan(parse_snapshot(d), (0, 1, 2, 3))
    kind, reason = refused(plan)[5500]
    assert kind == planmod.NO_EVIDENCE
    assert "/dev/nvidia-uvm, /dev/nvidiactl (no /dev/nvidiaN)" in reason
    full = make_plan(parse_snapshot(d))
    assert full.target(5500) is not None and full.target(5500).evidence == "device-file"


def test_zombie_with_gpu_evidence_is_never_a_target() -> None:
    d = doc("shared-node")
    d["processes"]["5400"]["state"] = "Z"
    plan = make_plan(parse_snapshot(d), (0,))
    assert pids(plan) == set()
    kind, reason = refused(plan)[5400]
    assert kind == policy.ZOMBIE
    assert reason.startswith("zombie (exited, no thread left), parent PID 1 (systemd): "
                             "holds nothing")


def test_zombie_leader_whose_threads_hold_the_gpu_is_a_target() -> None:
    """The H200 finding (probe-1.log part D): `Zl` with 19 threads, listed with its memory;
    it was refused as a zombie and the memory stayed. SIGKILL of the PID frees it."""
    d = doc("shared-node")
    d["processes"]["5400"].update(state="Z", threads=19, live_threads=18, stuck_threads=[])
    plan = make_plan(parse_snapshot(d), (0,))
    assert [(t.pid, t.evidence, t.gpus, t.used_mib) for t in plan.targets] == [
        (5400, "nvidia-smi", (0,), 10240)]
    assert plan.refusal_of(5400) is None
    assert to_request(plan, 1.0, 10.0, False, False, "op")["targets"] == [
        {"pid": 5400, "starttime": 730010, "wave": 0, "name": "python",
         "cmdline": "python eval.py --device cuda:0"}]


def test_stuck_zombie_leader_is_refused_and_does_not_block_its_parent() -> None:
    """Every thread left in D state: no signal ends it, so it is not signalled (and nothing
    waits for it); its parent, which holds memory of its own, is still a target."""
    d = doc("shared-node")
    d["processes"]["5400"].update(ppid=5300, state="Z", threads=2, live_threads=1,
                                  stuck_threads=[{"tid": 5401, "wchan": "os_acquire_mutex"}])
    plan = make_plan(parse_snapshot(d), (0, 1, 2, 3))
    assert refused(plan)[5400] == (policy.STUCK, "stuck: main thread gone, thread 5401 in D "
                                   "state in os_acquire_mutex; signals cannot end it")
    assert 5300 in pids(plan) and 5400 not in pids(plan)
    # what can still be done, said in the plan: no reset here (alice is not root, and the
    # GPU's device file is open), so drain the node and reboot
    (note,) = [n for n in plan.notes if n.startswith("PID 5400")]
    assert note == ("PID 5400 (python) is stuck: no signal ends it and nothing waits for it; "
                    "no GPU reset here (not root; its device file is open in 3 processes): "
                    "drain the node (Slurm: scontrol update nodename=shared-node state=drain "
                    "reason=...) and reboot")


# -------------------------------------------------------- hidden PIDs, containers, WSL2


def test_hidden_pids_full_scope_signals_the_device_holders() -> None:
    plan = make_plan(load("hidden-pids"))
    assert plan.full_scope
    assert [(t.pid, t.wave, t.family_root, t.evidence, t.gpus) for t in plan.targets] == [
        (57, 0, 57, "device-file", (0, 1)),  # minors 4,5 are nvidia-smi indices 0,1
        (88, 1, 57, "device-file", (0, 1)),
        (89, 1, 57, "device-file", (0, 1)),
    ]
    assert all(t.used_mib is None for t in plan.targets)
    assert any("container docker-7f3e2a91d0b4" in n for n in plan.notes)
    assert any("GPU 0: 126410 MiB used that nvidia-smi attributes to no process" in n
               for n in plan.notes)


def test_hidden_pids_partial_scope_is_ambiguous() -> None:
    plan = make_plan(load("hidden-pids"), (0,))
    assert pids(plan) == set()
    for pid in (57, 88, 89):
        kind, reason = refused(plan)[pid]
        assert kind == planmod.AMBIGUOUS
        assert reason.startswith("ambiguous: holds /dev/nvidiaN of GPUs 0,1")
        assert "opens every GPU's device file" in reason
    assert "nothing to signal" in plan.notes


def test_holder_of_only_scope_device_files_is_a_target_when_nobody_else_is_listed() -> None:
    d = doc("hidden-pids")
    for h in d["holders"]:
        h["devices"] = ["/dev/nvidia4", "/dev/nvidiactl", "/dev/nvidia-uvm"]  # GPU 0 only
    plan = make_plan(parse_snapshot(d), (0,))
    assert pids(plan) == {57, 88, 89}
    assert plan.target(88).gpus == (0,)
    # ...but not when nvidia-smi lists someone else on that GPU
    d["compute_apps"] = [{"pid": 4242, "process_name": "python", "used_mib": 900,
                          "gpu_uuid": d["gpus"][0]["uuid"]}]
    plan = make_plan(parse_snapshot(d), (0,))
    assert pids(plan) == set()
    assert refused(plan)[88] == (
        planmod.AMBIGUOUS,
        "ambiguous: not listed by nvidia-smi, which lists other processes on GPUs 0 (PIDs 4242)",
    )
    assert [(i.pid, i.gpu, i.used_mib) for i in plan.invisible] == [(4242, 0, 900)]


def test_nvidia_smi_failure_makes_partial_scopes_ambiguous() -> None:
    d = doc("train-node")
    d["nvidia_smi"] = {"ok": False, "error": "NVIDIA-SMI has failed because it couldn't "
                       "communicate with the NVIDIA driver", "exit_code": 9, "seconds": 0.2}
    d["compute_apps"] = []
    plan = make_plan(parse_snapshot(d), (0,))
    assert pids(plan) == set()
    assert all(r.kind in (planmod.AMBIGUOUS, policy.PROTECTED) for r in plan.refused)
    assert any(n.startswith("nvidia-smi failed (NVIDIA-SMI has failed") for n in plan.notes)
    d["gpus"] = []
    full = make_plan(parse_snapshot(d))
    assert full.full_scope and full.scope == () and full.threshold_mib == {}
    assert pids(full) == VLLM | RANKS  # full clean: every non-protected holder
    partial = make_plan(parse_snapshot(d), (0,))  # indices cannot be checked, nor mapped
    assert pids(partial) == set()
    assert "cannot be mapped" in refused(partial)[4360][1]


def test_processes_in_another_pid_namespace_are_invisible() -> None:
    plan = make_plan(load("pod-host-pids"))
    assert [(i.pid, i.gpu, i.process_name, i.used_mib, i.reason) for i in plan.invisible] == [
        (2841377, 0, "python", 30512, "not visible from this PID namespace (container?)")]
    assert pids(plan) == set() and plan.refused == ()
    assert make_plan(load("pod-host-pids"), (1,)).invisible == ()


def test_wsl2_dxg_holders() -> None:
    plan = make_plan(load("wsl2"))
    assert plan.full_scope and plan.scope == (0,)
    assert [(t.pid, t.evidence, t.gpus, t.wave) for t in plan.targets] == [
        (900, "device-file", (), 0), (950, "device-file", (), 0)]
    assert any(n.startswith("WSL2") for n in plan.notes)
    assert make_plan(load("wsl2"), (0,)).targets == plan.targets


def test_foreign_container_process_is_refused() -> None:
    d = doc("train-node")
    d["processes"]["4520"]["container"] = "docker-91ac0e55d2f1"
    plan = make_plan(parse_snapshot(d), (4,), stop_units=True)
    assert refused(plan)[4520] == (policy.CONTAINER,
                                   "runs in container docker-91ac0e55d2f1; stop the container")


# ------------------------------------------------------------------ units


def test_unit_owned_vllm_is_refused_by_default() -> None:
    plan = make_plan(load("unit-vllm"))
    assert pids(plan) == set()
    for pid in (2260, 2261):
        assert refused(plan)[pid] == (
            policy.UNIT, "belongs to vllm-minimax.service; stop the unit or pass --stop-units")


def test_stop_units_stops_the_unit_then_signals_what_remains() -> None:
    plan = make_plan(load("unit-vllm"), stop_units=True)
    assert pids(plan) == {2260, 2261}
    assert plan.units_to_stop == (UnitStop("vllm-minimax.service", False, (2260, 2261)),)
    assert plan.target(2260).unit == "vllm-minimax.service"
    disabled = make_plan(load("unit-vllm"), stop_units=True, disable_units=True)
    assert disabled.units_to_stop[0].disable is True


def test_unit_is_not_stopped_when_it_also_runs_gpus_outside_the_scope() -> None:
    plan = make_plan(load("unit-vllm"), (0,), stop_units=True)
    assert pids(plan) == set() and plan.units_to_stop == ()
    assert refused(plan)[2260] == (
        policy.UNIT,
        "belongs to vllm-minimax.service, which also runs PID 2261 (VLLM::Worker): uses GPU 1, "
        "outside the scope; not stopping it",
    )


def test_unit_is_not_stopped_when_it_holds_the_agents_ancestor() -> None:
    d = doc("unit-vllm")
    d["processes"]["2210"]["relation"] = "ancestor"
    plan = make_plan(parse_snapshot(d), stop_units=True)
    assert pids(plan) == set() and plan.units_to_stop == ()
    kind, reason = refused(plan)[2261]
    assert kind in (policy.UNIT, planmod.FAMILY)
    assert "PID 2210 (vllm)" in reason and "ancestor of the gpufleet agent" in reason


# ------------------------------------------------------------ agent session, protect globs


def test_agent_session_job_and_display_are_refused() -> None:
    plan = make_plan(load("agent-session"), (0,))
    assert pids(plan) == {2700}
    r = refused(plan)
    assert r[2600] == (policy.PROTECTED, "in the gpufleet agent's own session")
    assert r[1650] == (policy.PROTECTED, "Xorg (display server, never signalled)")
    assert r[1900][0] == policy.PROTECTED
    assert set(r) == {2600, 1650, 1900}
    assert pids(make_plan(load("agent-session"))) == {2700, 2750}


def test_a_protect_pattern_that_matches_no_process_is_a_note_naming_its_source() -> None:
    snap = load("train-node")
    plan = make_plan(snap, (4, 5, 6, 7), protect=("train.py", "train_dlfash"),
                     host_protect=("*trian*", "*llama3*"))
    assert pids(plan) == set()  # "train.py" (a plain word) protects the ranks
    assert refused(plan)[4520] == (policy.PROTECTED, "protected by '*llama3*'")
    assert "--protect 'train_dlfash' matches no GPU process on train-node: a typo?" in plan.notes
    assert ("inventory protect '*trian*' matches no GPU process on train-node: a typo?"
            in plan.notes)
    assert not any("'train.py'" in n or "'*llama3*'" in n for n in plan.notes)
    # the agent's own command line (python3 -c import sys...) is no match: it is never signalled
    own = make_plan(snap, (4,), protect=("import sys",), protect_label="the step's protect")
    assert ("the step's protect 'import sys' matches no GPU process on train-node: a typo?"
            in own.notes)
    assert not any("a typo?" in n for n in make_plan(snap, (4,), protect=("*train.py*",)).notes)


def test_protected_trainer_and_a_family_that_would_end_it() -> None:
    snap = load("protected-trainer")
    plan = make_plan(snap, (2,), protect=("*train_prod.py*",))
    assert pids(plan) == {3300}
    assert refused(plan)[3102] == (policy.PROTECTED, "protected by '*train_prod.py*'")
    assert refused(plan)[1220][0] == policy.PROTECTED  # dcgm-exporter, not "ambiguous"
    plan3 = make_plan(snap, (3,), protect=("*train_prod.py*",))
    assert pids(plan3) == set()
    assert refused(plan3)[3400] == (
        planmod.FAMILY,
        "signalling it would also end PID 3401 (python): refused: protected by "
        "'*train_prod.py*'",
    )
    free = make_plan(snap, (3,))
    assert [(t.pid, t.wave, t.family_root) for t in free.targets] == [
        (3103, 0, 3103), (3400, 0, 3400), (3401, 1, 3400)]


# ------------------------------------------------------------------ request


def test_request_is_the_documented_clean_request() -> None:
    plan = make_plan(load("unit-vllm"), stop_units=True)
    req = to_request(plan, grace_s=10, timeout_s=60, shm=True, reset=False,
                     operator="joel@laptop", lock_path="/run/lock/gpufleet.lock")
    assert req == {
        "mode": "clean", "deadline_s": 70.0, "nvidia_smi": None, "smi_timeout_s": 10.0,
        "scope": [0, 1],
        "targets": [{"pid": 2260, "starttime": 31200, "wave": 0, "name": "VLLM::Worker",
                     "cmdline": "VLLM::Worker_TP0"},
                    {"pid": 2261, "starttime": 31201, "wave": 0, "name": "VLLM::Worker",
                     "cmdline": "VLLM::Worker_TP1"}],
        "settle_s": 0.0,  # their unit is stopped: nothing left to restart them
        "scope_uuids": [g.uuid for g in load("unit-vllm").gpus],
        "listed_before": [2260, 2261],
        "units": [{"unit": "vllm-minimax.service", "disable": False}],
        "grace_s": 10.0, "timeout_s": 60.0, "poll_s": 0.1,
        "threshold_mib": {"0": 64, "1": 64},
        "shm": True, "reset": False, "lock_path": "/run/lock/gpufleet.lock",
        "operator": "joel@laptop",
    }
    assert json.loads(json.dumps(req)) == req


def test_request_lists_roots_first() -> None:
    plan = make_plan(load("train-node"), (0, 1, 2, 3))
    waves = [t["wave"] for t in to_request(plan, 5, 30, False, False, "op")["targets"]]
    assert waves == sorted(waves) and waves[0] == 0 and waves.count(0) == 2  # two EngineCores


@pytest.mark.parametrize("grace,timeout,kw", [(-1, 10, {}), (5, 0, {}), (20, 10, {}),
                                              (1, 10, {"deadline_s": 5}), (1, 10, {"poll_s": 0})])
def test_request_rejects_bad_times(grace, timeout, kw) -> None:
    plan = make_plan(load("train-node"), (0,))
    with pytest.raises(UsageError):
        to_request(plan, grace, timeout, False, False, "op", **kw)


def test_plan_as_dict_is_json() -> None:
    plan = make_plan(load("shared-node"), (0, 1, 2, 3))
    d = json.loads(json.dumps(plan.as_dict()))
    # GPUs 1 and 3 keep one listed process each that the plan does not signal (6100: bob's;
    # 5120: spans 3,4): the driver's share for it stays
    assert d["threshold_mib"] == {"0": 64, "1": 64 + driver_allowance_mib(1), "2": 64,
                                 "3": 64 + driver_allowance_mib(1)}
    assert {t["pid"] for t in d["targets"]} == {5300, 5400}


# ------------------------------------------------------------------ invariants


def _check_invariants(snap: Snapshot, plan: Plan, include_spanning: bool) -> None:
    ctx = policy.PolicyContext.from_snapshot(snap)
    tp = pids(plan)
    assert not tp & set(refused(plan)), "a process is both target and refused"
    for t in plan.targets:
        proc = snap.processes[t.pid]
        assert policy.never_signal_reason(proc, ctx) is None
        assert not policy.is_zombie(proc)
        assert t.starttime == proc.starttime is not None
        if t.evidence == "nvidia-smi" and not include_spanning:
            assert set(t.gpus) <= set(plan.scope)
        if t.evidence == "nvidia-smi":
            assert t.gpus == snap.gpu_indices_of_app(t.pid)
        # every family root is a target, and waves follow it
        assert t.family_root in tp
        assert t.wave == (0 if t.family_root == t.pid else 1)
    # every visible process nvidia-smi lists inside the scope is accounted for
    for pid in snap.listed_pids():
        gpus = set(snap.gpu_indices_of_app(pid))
        if pid in snap.processes and gpus & set(plan.scope):
            assert pid in tp or pid in refused(plan), pid
        if pid not in snap.processes and gpus & set(plan.scope):
            assert pid in {i.pid for i in plan.invisible}
    # a target's descendants never include something nvidia-smi shows outside the scope
    # (unless it is a spanning target itself)
    children: dict[int, list[int]] = {}
    for p in snap.processes.values():
        children.setdefault(p.ppid, []).append(p.pid)
    for t in plan.targets:
        stack = list(children.get(t.pid, ()))
        while stack:
            d = stack.pop()
            stack.extend(children.get(d, ()))
            gpus = set(snap.gpu_indices_of_app(d))
            if gpus and d not in tp:
                assert gpus <= set(plan.scope), (t.pid, d)
            assert d in tp or policy.never_signal_reason(snap.processes[d], ctx) is None


_SNAPS = {name: load(name) for name in ALL}


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(ALL),
    data=st.data(),
    include_spanning=st.booleans(),
    stop_units=st.booleans(),
    protect=st.sampled_from([(), ("*train*",), ("VLLM::Worker",)]),
)
def test_plan_invariants_on_every_scenario_and_scope(name, data, include_spanning,
                                                     stop_units, protect):
    snap = _SNAPS[name]
    indices = [g.index for g in snap.gpus]
    scope = data.draw(st.one_of(st.none(), st.sets(st.sampled_from(indices), min_size=1)))
    plan = make_plan(snap, None if scope is None else tuple(scope),
                     include_spanning=include_spanning,
                     stop_units=stop_units, protect=protect)
    _check_invariants(snap, plan, include_spanning)
    ctx = policy.PolicyContext.from_snapshot(snap, protect=protect, stop_units=stop_units)
    for t in plan.targets:
        assert policy.refusal_reason(snap.processes[t.pid], ctx) is None
    for u in plan.units_to_stop:
        assert stop_units and all(snap.processes[p].unit == u.unit for p in u.pids)


def test_fixtures_are_agent_documents() -> None:
    for name in ALL:
        d = doc(name)
        assert d["agent_version"] == 1 and d["scenario"], name
        snap = parse_snapshot(copy.deepcopy(d))
        for key, proc in d["processes"].items():
            assert int(key) == proc["pid"]
        assert snap.facts.agent_pid in snap.processes
        assert snap.processes[snap.facts.agent_pid].relation == "self"


# ------------------------------------------------------- family resolves an ambiguous holder


def _unlisted_engine_cores() -> Snapshot:
    """The lab's vLLM model: EngineCores hold every /dev/nvidiaN but nvidia-smi lists no
    memory of theirs; only the Workers are listed."""
    d = doc("train-node")
    d["compute_apps"] = [a for a in d["compute_apps"] if a["pid"] not in (4340, 4341)]
    return parse_snapshot(d)


def test_unlisted_engine_core_joins_its_family_as_root() -> None:
    plan = make_plan(_unlisted_engine_cores(), (0, 1, 2, 3))
    assert {4340, 4341, 4360, 4361, 4362, 4363} == pids(plan)
    for root in (4340, 4341):
        assert plan.target(root).evidence == planmod.EVIDENCE_FAMILY
        assert plan.target(root).wave == 0
    assert plan.target(4340).gpus == (0, 1) and plan.target(4341).gpus == (2, 3)
    assert plan.target(4360).wave == 1 and plan.target(4360).family_root == 4340
    assert 4520 not in pids(plan)  # the trainer on 4-7 is never part of it


def test_engine_core_stays_ambiguous_when_a_worker_is_outside_the_scope() -> None:
    plan = make_plan(_unlisted_engine_cores(), (0, 1, 2))
    assert 4340 in pids(plan)  # its workers are on 0 and 1
    assert 4341 not in pids(plan)  # its worker 4363 is on GPU 3
    # the family's reason, rather than "ambiguous", for the root and its worker on GPU 2
    assert refused(plan)[4341][0] == refused(plan)[4362][0] == planmod.FAMILY
    assert "root PID 4341 VLLM::EngineCore_DP1" in refused(plan)[4341][1]
    assert 4363 not in pids(plan)


def test_wait_floors_count_only_memory_the_plan_leaves_alone() -> None:
    from gpufleet.ops.clean import wait_floors

    snap = load("train-node")
    plan = make_plan(snap, (0, 1, 2, 3))
    assert wait_floors(plan, snap) == {}  # every listed process on 0-3 is a target
    half = make_plan(snap, (0, 1, 2), include_spanning=False)
    floors = wait_floors(half, snap)
    # GPU 2's EngineCore_DP1 and its worker are refused (family reaches GPU 3): their memory stays
    expected = sum(a.used_mib for a in snap.apps_on(2) if a.pid not in half.target_pids)
    assert expected > 0 and floors == {"2": expected}


# ------------------------------------------------- nvidia-smi rows that are evidence of nothing


def test_listed_process_without_device_files_is_an_untrusted_row() -> None:
    """A process title with a newline can forge a compute-apps row naming any PID; a listed
    process that holds no NVIDIA device file (its fds readable) is refused, never a target."""
    d = doc("train-node")
    d["holders"] = [h for h in d["holders"] if h["pid"] != 4360]  # worker on GPU 0 holds nothing
    plan = make_plan(parse_snapshot(d), (0, 1, 2, 3))
    assert 4360 not in pids(plan)
    kind, reason = refused(plan)[4360]
    assert kind == planmod.UNTRUSTED_ROW
    assert reason == "listed by nvidia-smi on GPU 0 but has no /dev/nvidia0 open"
    assert {4361, 4362, 4363} <= pids(plan)


def test_untrusted_row_outside_the_scope_is_not_reported() -> None:
    d = doc("train-node")
    d["holders"] = [h for h in d["holders"] if h["pid"] != 4520]  # trainer rank on GPU 4
    plan = make_plan(parse_snapshot(d), (0, 1, 2, 3))
    assert 4520 not in refused(plan) and 4520 not in pids(plan)


# ------------------------------------ a listed process must hold its GPU (policy.listing_check)


def _set_holder(d: dict, pid: int, devices: list, mapped: Any = "keep") -> dict:
    """Give holder ``pid`` these open device files (and maps: a list, None = not available)."""
    entry = next(h for h in d["holders"] if h["pid"] == pid)
    entry["devices"] = devices
    if mapped is None:
        entry.pop("mapped", None)
    elif mapped != "keep":
        entry["mapped"] = mapped
    return d


def test_listed_pid_without_its_gpus_device_file_is_refused() -> None:
    """nvidia-smi lists PID 4520 on GPU 4, but it has only /dev/nvidia5 open: whatever printed
    that row, the process holds nothing of GPU 4. Refused, never signalled (in a full scope
    not a device-file candidate either), and its memory counts as unexplained."""
    snap = parse_snapshot(_set_holder(doc("train-node"), 4520,
                                      ["/dev/nvidia-uvm", "/dev/nvidia5", "/dev/nvidiactl"]))
    reason = "listed by nvidia-smi on GPU 4 but has no /dev/nvidia4 open"
    check = policy.listing_check(snap, 4520)
    assert check is not None
    assert (check.trust, check.reason, check.gpus) == (policy.LISTING_REFUSED, reason, (4,))
    for scope in ((4, 5, 6, 7), None):
        plan = make_plan(snap, scope)
        assert 4520 not in pids(plan), scope
        assert refused(plan)[4520] == (planmod.UNTRUSTED_ROW, reason)
    plan = make_plan(snap, (4, 5, 6, 7))
    assert pids(plan) == RANKS - {4520}
    used = next(a.used_mib for a in snap.compute_apps if a.pid == 4520)
    assert any(n.startswith("GPU 4: %d MiB listed by nvidia-smi for PID 4520" % used)
               for n in plan.notes), plan.notes
    trusted = policy.without_refused_listings(snap)
    assert (policy.unexplained_mib(trusted, (4,), 64) or {}).get(4, 0) >= used


def test_listed_pid_with_the_device_file_but_no_cuda_context_is_refused() -> None:
    """A GPU monitor (every /dev/nvidiaN open, nothing mapped) listed with memory: its maps are
    readable and show no /dev/nvidia-uvm, so it has no CUDA context and is no holder."""
    d = _set_holder(doc("train-node"), 4521, list(EVERY_DEV), [])
    snap = parse_snapshot(d)
    check = policy.listing_check(snap, 4521)
    assert check is not None and check.trust == policy.LISTING_REFUSED
    assert check.reason == ("listed by nvidia-smi on GPU 5 but has no CUDA context "
                            "(/dev/nvidia-uvm not mapped)")
    assert 4521 not in pids(make_plan(snap))
    cuda = parse_snapshot(_set_holder(doc("train-node"), 4521, list(EVERY_DEV),
                                      ["/dev/nvidia-uvm", "/dev/nvidia5", "/dev/nvidiactl"]))
    verified = policy.listing_check(cuda, 4521)
    assert verified is not None and verified.trust == policy.LISTING_VERIFIED
    assert verified.reason == "has /dev/nvidia5 open and /dev/nvidia-uvm mapped"
    target = make_plan(cuda).target(4521)
    assert target is not None and target.evidence == planmod.EVIDENCE_SMI
    assert target.evidence_reason == "listed by nvidia-smi on GPU 5; " + verified.reason


def test_the_device_file_is_the_gpus_minor_not_its_index() -> None:
    d = _set_holder(doc("train-node"), 4520, ["/dev/nvidia-uvm", "/dev/nvidia4", "/dev/nvidiactl"])
    d["gpus"][4]["minor"], d["gpus"][6]["minor"] = 6, 4
    check = policy.listing_check(parse_snapshot(d), 4520)
    assert check is not None and check.trust == policy.LISTING_REFUSED
    assert check.reason == "listed by nvidia-smi on GPU 4 but has no /dev/nvidia6 open"
    _set_holder(d, 4520, ["/dev/nvidia-uvm", "/dev/nvidia6", "/dev/nvidiactl"])
    check = policy.listing_check(parse_snapshot(d), 4520)
    assert check is not None and check.trust == policy.LISTING_VERIFIED
    assert check.reason == "has /dev/nvidia6 open (its maps not available)"


def test_unreadable_open_files_leave_a_listed_pid_unverified() -> None:
    """Where the check cannot be made (the agent could not read its open files), the listing
    counts as before, and the evidence says it is unverified."""
    d = doc("train-node")
    d["holders"] = [h for h in d["holders"] if h["pid"] != 4520]
    d["processes"]["4520"]["fds_readable"] = False
    snap = parse_snapshot(d)
    check = policy.listing_check(snap, 4520)
    assert check is not None and check.trust == policy.LISTING_UNVERIFIED
    assert check.reason == "unverified: its open files could not be read"
    target = make_plan(snap, (4, 5, 6, 7)).target(4520)
    assert target is not None and target.evidence == planmod.EVIDENCE_SMI_UNVERIFIED
    assert target.evidence_reason == "listed by nvidia-smi on GPU 4; " + check.reason
    # readable and holding nothing: refused, as before
    d["processes"]["4520"]["fds_readable"] = True
    check = policy.listing_check(parse_snapshot(d), 4520)
    assert check is not None and check.trust == policy.LISTING_REFUSED
    assert check.reason == "listed by nvidia-smi on GPU 4 but has no /dev/nvidia4 open"


def test_other_users_unreadable_and_wsl2_listings_are_unverified() -> None:
    bob = policy.listing_check(load("shared-node"), 6100)  # alice's agent, bob's fds
    assert bob is not None and bob.trust == policy.LISTING_UNVERIFIED
    assert bob.reason == "unverified: its open files could not be read"
    d = doc("wsl2")  # /dev/dxg, no /dev/nvidiaN: which GPU a holder uses cannot be told
    d["compute_apps"] = [{"pid": 900, "process_name": "python3", "used_mib": None,
                          "gpu_uuid": d["gpus"][0]["uuid"]}]
    check = policy.listing_check(parse_snapshot(d), 900)
    assert check is not None and check.trust == policy.LISTING_UNVERIFIED
    assert check.reason == "unverified: WSL2 has no /dev/nvidiaN (its GPUs are /dev/dxg)"
    target = make_plan(parse_snapshot(d)).target(900)
    assert target is not None and target.evidence == planmod.EVIDENCE_SMI_UNVERIFIED


def test_a_zombie_leader_holds_its_gpu_through_its_threads() -> None:
    """A CUDA process whose leader is a zombie while its threads tear down still holds the
    GPU; the agent reads its fds through /proc/PID/task/TID/fd (maps: not available)."""
    d = _set_holder(doc("train-node"), 4520, ["/dev/nvidia-uvm", "/dev/nvidia4"], None)
    d["processes"]["4520"]["state"] = "Z"
    check = policy.listing_check(parse_snapshot(d), 4520)
    assert check is not None and check.trust == policy.LISTING_VERIFIED


# -------------------------------- GPU clients (monitors, exporters) are never targets

EVERY_DEV = ["/dev/nvidia%d" % i for i in range(8)] + ["/dev/nvidia-uvm", "/dev/nvidiactl"]


def _add_monitor(d: dict, pid: int = 7100, comm: str = "python3", mapped=()) -> dict:
    entry: dict[str, Any] = {"pid": pid, "devices": list(EVERY_DEV)}
    if mapped is not None:
        entry["mapped"] = list(mapped)
    d["holders"].append(entry)
    d["processes"][str(pid)] = {
        "pid": pid, "ppid": 1, "starttime": 990000, "state": "S", "uid": 0, "user": "root",
        "comm": comm, "cmdline": "python3 monitor.py", "cgroup": None, "unit": None,
        "container": None, "session": pid, "pgid": pid, "kernel_thread": False, "wchan": None,
        "relation": None}
    return d


def test_full_scope_clean_never_targets_an_nvml_client() -> None:
    """The real H200's pynvml poller died under `clean --yes` (evidence device-file)."""
    for mapped in ((), None):  # maps show no CUDA context / maps not available (older agent)
        plan = make_plan(parse_snapshot(_add_monitor(doc("train-node"), mapped=mapped)))
        assert plan.full_scope and plan.target(7100) is None and plan.refusal_of(7100) is None
        assert [(c.pid, c.gpus) for c in plan.clients] == [(7100, tuple(range(8)))]
        assert pids(plan) == VLLM | RANKS


def test_partial_scope_clean_shows_the_client_instead_of_an_ambiguous_refusal() -> None:
    plan = make_plan(parse_snapshot(_add_monitor(doc("train-node"))), (0, 1, 2, 3))
    assert pids(plan) == VLLM and 7100 not in refused(plan)
    assert [c.pid for c in plan.clients] == [7100]
    assert "NVML client" in plan.clients[0].reason


def test_container_full_scope_targets_holders_but_not_the_client() -> None:
    plan = make_plan(parse_snapshot(_add_monitor(doc("hidden-pids"), pid=700)))
    assert pids(plan) == {57, 88, 89}  # maps not available: the unexplained memory decides
    assert [c.pid for c in plan.clients] == [700]


def test_wsl2_dxg_holder_without_memory_is_a_client() -> None:
    d = doc("wsl2")
    d["gpus"][0]["memory_used_mib"] = 0
    plan = make_plan(parse_snapshot(d))
    assert plan.targets == () and {c.pid for c in plan.clients} == {900, 950}


def test_family_root_stays_wave_0_in_a_full_scope_even_as_an_nvml_only_process() -> None:
    d = doc("train-node")
    d["compute_apps"] = [a for a in d["compute_apps"] if a["pid"] not in (4340, 4341)]
    for h in d["holders"]:
        if h["pid"] in (4340, 4341):
            h["mapped"] = []  # the EngineCore uses NVML, no CUDA context of its own
    for scope in (None, (0, 1, 2, 3)):
        plan = make_plan(parse_snapshot(d), scope)
        for root in (4340, 4341):
            t = plan.target(root)
            assert t is not None and t.wave == 0 and t.family_root == root, scope
        assert plan.target(4360).family_root == 4340 and plan.clients == ()


def test_old_snapshots_without_maps_keep_their_family_roots() -> None:
    """Maps not available never make every old device-file holder a target, and never break
    the family rule: the unlisted EngineCores of the lab model stay wave-0 roots."""
    snap = _unlisted_engine_cores()
    assert all(h.mapped is None for h in snap.holders)
    plan = make_plan(snap)
    assert plan.target(4340).wave == 0 and plan.target(4341).wave == 0
    assert plan.clients == ()


def test_fd_note_says_the_true_reason() -> None:
    """As root in a container the note said "(not root)": a wrong reason sends the operator the wrong way."""
    d = doc("hidden-pids")
    d["facts"]["can_read_all_fds"] = False
    d["fd_unreadable"] = [{"pid": 1, "comm": "process_api", "reason": "permission denied "
                           "although the agent is root (no CAP_SYS_PTRACE here, or the process "
                           "belongs to another user namespace)"}]
    notes = make_plan(parse_snapshot(d)).notes
    assert not any("not root" in n for n in notes)
    assert any(n.startswith("cannot read the open files of PID 1 (process_api): permission "
                            "denied although the agent is root") for n in notes)
    d["facts"]["hidepid"] = True
    d["facts"]["is_root"] = False
    assert any(n.startswith("/proc is mounted hidepid") for n in make_plan(parse_snapshot(d)).notes)


def test_vanished_holders_are_counted_in_a_note() -> None:
    d = doc("train-node")
    d["holders_vanished"] = [9001, 9002]
    plan = make_plan(parse_snapshot(d))
    assert any(n.startswith("2 process(es) with device files open exited before") for n in
               plan.notes)
    assert not {9001, 9002} & (pids(plan) | set(refused(plan)))


# --------------- a family is planned as a whole (half a vLLM family ends the other half)

TP4 = (4340, 4360, 4361, 4362, 4363)  # EngineCore_DP0 (device files only) -> Worker_TP0..TP3
TP4_REASON = ("its family (root PID 4340 VLLM::EngineCore_DP0) also uses GPU 2,3, outside the "
              "scope: pass --include-spanning to clean the whole family")


def test_scope_cutting_a_family_refuses_all_of_it_naming_the_family() -> None:
    """Killing Worker_TP0 ends its EngineCore, which also serves GPUs 2-3: never half of it."""
    plan = make_plan(load("vllm-tp4"), (0, 1))
    assert pids(plan) == set() and "nothing to signal" in plan.notes
    r = refused(plan)
    assert {p: r[p] for p in (4340, 4360, 4361)} == {
        p: (planmod.FAMILY, TP4_REASON) for p in (4340, 4360, 4361)}
    assert not {4362, 4363} & set(r)  # wholly outside the scope: not this clean's business
    assert plan.refusal_of(4360).gpus == (0,)


def test_include_spanning_plans_the_whole_family_root_first() -> None:
    plan = make_plan(load("vllm-tp4"), (0, 1), include_spanning=True)
    assert [(t.pid, t.wave, t.family_root) for t in plan.targets] == [
        (4340, 0, 4340), (4360, 1, 4340), (4361, 1, 4340), (4362, 1, 4340), (4363, 1, 4340)]
    root = plan.target(4340)
    assert root.evidence == planmod.EVIDENCE_FAMILY and root.gpus == (0, 1, 2, 3)
    assert plan.target(4363).evidence == "nvidia-smi" and plan.target(4363).gpus == (3,)
    assert any(n.startswith("include_spanning: family (root PID 4340 VLLM::EngineCore_DP0) "
                            "also uses GPU 2,3 outside the scope; the whole family is planned")
               for n in plan.notes)
    assert not set(refused(plan)) & set(TP4)


def test_a_family_the_scope_does_not_cut_is_planned_as_before() -> None:
    for scope in (None, (0, 1, 2, 3)):
        plan = make_plan(load("vllm-tp4"), scope)
        assert [(t.pid, t.wave, t.family_root) for t in plan.targets if t.pid in TP4] == [
            (4340, 0, 4340), (4360, 1, 4340), (4361, 1, 4340), (4362, 1, 4340),
            (4363, 1, 4340)], scope
        assert not any("family (root PID" in n for n in plan.notes)
    assert pids(make_plan(load("vllm-tp4"), (4, 5))) == {4520, 4521}  # ranks: no common root


def test_include_spanning_refuses_the_family_when_policy_refuses_a_member() -> None:
    """include_spanning asks for the whole family; if one member may not be signalled, none is."""
    plan = make_plan(load("vllm-tp4"), (0, 1), include_spanning=True,
                     protect=("VLLM::Worker_TP3",))
    assert not set(TP4) & pids(plan)
    r = refused(plan)
    assert r[4363] == (policy.PROTECTED, "protected by 'VLLM::Worker_TP3'")
    assert r[4360][0] == planmod.FAMILY and r[4360][1] == (
        "its family (root PID 4340 VLLM::EngineCore_DP0) cannot be cleaned as a whole: PID 4363 "
        "(VLLM::Worker) refused: protected by 'VLLM::Worker_TP3'")
    plain = make_plan(load("vllm-tp4"), (0, 1), protect=("VLLM::Worker_TP3",))
    assert not set(TP4) & pids(plain) and refused(plain)[4360] == (planmod.FAMILY, TP4_REASON)


# ------------------------------------------------------------------ what the clean cannot free


def test_release_floors_are_the_memory_no_target_can_free() -> None:
    """Memory nvidia-smi attributes to no process, beyond the driver's share for the listed
    ones, on GPUs where every target is listed: no signal frees it, so the memory wait gives
    it only planmod.RELEASE_WAIT_S (a driver releasing a process already gone)."""
    d = doc("train-node")
    # GPU 0: 15 MiB unattributed, the driver's share for its two listed processes; GPUs 1 and
    # 3: 15 MiB for one process, 6 MiB more than its share
    assert planmod.release_floors(make_plan(parse_snapshot(d), (0, 1, 2, 3)),
                                  parse_snapshot(d)) == {"1": 6, "3": 6}
    d["gpus"][0]["memory_used_mib"] += 5000  # a leak, or another namespace's process
    before = parse_snapshot(d)
    plan = make_plan(before, (0, 1, 2, 3))
    assert pids(plan) and planmod.release_floors(plan, before) == {"0": 5000, "1": 6, "3": 6}
    # nothing to signal at all (the families span GPUs 1 and 3): the same floor
    cut = make_plan(before, (0, 2))
    assert pids(cut) == set() and planmod.release_floors(cut, before) == {"0": 5000}
    # a unit to stop may end more than the targets: wait for all of it
    unit = load("unit-vllm")
    stop = make_plan(unit, stop_units=True)
    assert stop.units_to_stop and planmod.release_floors(stop, unit) == {}


def test_an_unlisted_family_root_holds_no_memory_the_listing_would_not_show() -> None:
    """vLLM's EngineCore (device files only, a target as its workers' family root): nvidia-smi
    lists this namespace's processes, so its own memory would be listed; GPU 0's 5000 MiB
    that nobody explains is beyond every target."""
    d = doc("vllm-tp4")
    d["gpus"][0]["memory_used_mib"] += 5000
    before = parse_snapshot(d)
    plan = make_plan(before)
    assert plan.target(4340) is not None and plan.target(4340).evidence == "device-file"
    assert planmod.release_floors(plan, before)["0"] == 5006


def test_release_floors_leave_gpus_a_target_the_listing_misses_may_hold() -> None:
    """A host that cannot list its holders (another PID namespace): a device-file target may
    hold the unexplained memory, so its GPUs get no floor; with nothing signalled they do."""
    hidden = load("hidden-pids")
    full = make_plan(hidden)
    assert {t.evidence for t in full.targets} == {"device-file"}
    assert planmod.release_floors(full, hidden) == {}
    part = make_plan(hidden, (0,))
    assert pids(part) == set()
    assert planmod.release_floors(part, hidden) == {"0": 126410}


def test_a_run_pattern_that_protects_a_job_on_one_host_is_no_typo_on_the_others() -> None:
    """One --protect is given to every host of a run: a pattern that matches on one host is
    no typo because another has no such process; one that matches on none keeps its note."""
    from gpufleet.core.plan.notes import fleet_protect_notes

    train = make_plan(load("train-node"), (4, 5, 6, 7), protect=("train.py", "train_dlfash"))
    other = planmod.make_plan(load("agent-session"), (0,), protect=("train.py", "train_dlfash"),
                              host="other-node")
    typo = "--protect %r matches no GPU process on %s: a typo?"
    assert typo % ("train.py", "other-node") in other.notes  # alone, the host says it
    fixed_train, fixed_other = fleet_protect_notes([train, other], "--protect",
                                                   ("train.py", "train_dlfash"))
    assert not any("'train.py'" in n for n in fixed_other.notes)
    assert typo % ("train_dlfash", "other-node") in fixed_other.notes
    assert typo % ("train_dlfash", "train-node") in fixed_train.notes
    assert fixed_other.targets == other.targets and fixed_train.notes == train.notes
    # a host's own inventory pattern is that host's: the run's step leaves its note alone
    inv = make_plan(load("train-node"), (4,), host_protect=("*trian*",))
    assert fleet_protect_notes([inv, other], "--protect", ()) == [inv, other]
