"""gpufleet.core.slurm (pure) and the job-owner rule of gpufleet.core.policy: the job's
environment as Slurm 22.05 gives it (recorded), its GPUs, the budget, what keeps GPUs from
being free, the one-line reason, dcgm-exporter's job map and `scontrol show node -o`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import pytest

from gpufleet.core import policy
from gpufleet.core import slurm
from gpufleet.core.model import Snapshot, parse_snapshot
from gpufleet.core.plan import make_plan
from gpufleet.errors import SlurmConfigError, UsageError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RECORDED = FIXTURES / "recorded" / "slurm"
USERS = {0: "root", 1000: "alice", 1001: "gflabuser"}


def users(uid: int) -> Optional[str]:
    return USERS.get(uid)


def recorded_env() -> dict[str, str]:
    lines = (RECORDED / "epilog-env.txt").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def train() -> Snapshot:
    return parse_snapshot(json.loads((FIXTURES / "scenarios" / "train-node.json").read_text()))


# ------------------------------------------------------------------------------ the job


def test_the_recorded_epilog_environment() -> None:
    job = slurm.parse_job_env(recorded_env(), users)
    assert (job.job_id, job.uid, job.user) == ("1", 1001, "gflabuser")
    assert job.gpus == ("0", "1") and job.gpu_source == "SLURM_JOB_GPUS"
    assert job.node == "node01" and job.context == "epilog_slurmd"
    assert job.who == "gflabuser (uid 1001)"


def test_no_job_id_is_usage_not_configuration() -> None:
    with pytest.raises(UsageError, match="SLURM_JOB_ID is not set") as info:
        slurm.parse_job_env({"SLURM_JOB_UID": "0"}, users)
    assert not isinstance(info.value, SlurmConfigError)
    assert "nothing touched" in str(info.value)


@pytest.mark.parametrize("env,words", [
    ({"SLURM_JOB_ID": "12x", "SLURM_JOB_UID": "0"}, "is not a job id"),
    ({"SLURM_JOB_ID": "12"}, "SLURM_JOB_UID is not set"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "-1"}, "is not a user id"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "4242"}, "4242 has no passwd entry"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "1000", "SLURM_JOB_USER": "bob"}, "is not uid 1000"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "0,,1"}, "'' is not a GPU"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "gpu0"}, "'gpu0' is not a GPU"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "3-1"}, "'3-1' is not a GPU"),
    ({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "0", "CUDA_VISIBLE_DEVICES": "MIG-1c2a"}, "MIG"),
])
def test_a_broken_environment_blames_the_configuration(env: dict, words: str) -> None:
    with pytest.raises(SlurmConfigError) as info:
        slurm.parse_job_env(env, users)
    assert words in str(info.value)
    assert str(info.value).endswith(SlurmConfigError.AT_FAULT)
    assert "nothing signalled" in str(info.value)
    assert info.value.exit_code == 2


def test_gpu_variables_in_order_and_forms() -> None:
    base = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "0"}
    job = slurm.parse_job_env(dict(base, CUDA_VISIBLE_DEVICES="3,1", GPU_DEVICE_ORDINAL="9"), users)
    assert job.gpus == ("3", "1") and job.gpu_source == "CUDA_VISIBLE_DEVICES"
    job = slurm.parse_job_env(dict(base, GPU_DEVICE_ORDINAL="0-2,5"), users)
    assert job.gpus == ("0", "1", "2", "5") and job.gpu_source == "GPU_DEVICE_ORDINAL"
    job = slurm.parse_job_env(dict(base, SLURM_JOB_GPUS="", CUDA_VISIBLE_DEVICES="1"), users)
    assert job.gpu_source == "CUDA_VISIBLE_DEVICES"  # an empty variable is not a source
    assert slurm.parse_job_env(base, users).gpus is None  # a CPU job: no GPUs here
    assert slurm.split_gpu_tokens("GPU-0a1B-2c,1,1", "X") == ("GPU-0a1B-2c", "1")


def test_resolve_gpus_by_index_and_uuid() -> None:
    snap = train()
    pairs = [(g.index, g.uuid) for g in snap.gpus]
    job = slurm.JobEnv("1", 0, "root", ("2", pairs[5][1].upper()), "CUDA_VISIBLE_DEVICES", None, None)
    assert slurm.resolve_gpus(job, pairs) == (2, 5)
    bad = dataclasses.replace(job, gpus=("8",), gpu_source="SLURM_JOB_GPUS")
    with pytest.raises(SlurmConfigError, match=r"SLURM_JOB_GPUS: GPU 8 does not exist on this "
                                                r"node \(has GPUs 0-7\)"):
        slurm.resolve_gpus(bad, pairs)
    with pytest.raises(SlurmConfigError, match="GPU-nope does not exist"):
        slurm.resolve_gpus(dataclasses.replace(job, gpus=("GPU-nope",)), pairs)


# ------------------------------------------------------------------------------ budget


def test_default_budget_adds_up() -> None:
    b = slurm.split_budget(slurm.DEFAULT_BUDGET_S)
    assert b.grace_s == 5.0 and b.snapshot_s == 7.5 and b.smi_s == 4.5
    assert b.snapshot_s + b.timeout_s + b.smi_s + slurm.STARTUP_S == pytest.approx(30.0)
    big = slurm.split_budget(600, 30)
    assert big.snapshot_s == slurm.SNAPSHOT_MAX_S and big.smi_s == slurm.SMI_MAX_S
    assert big.snapshot_s + big.timeout_s + big.smi_s + slurm.STARTUP_S == pytest.approx(600)


def test_budget_too_small_for_its_grace() -> None:
    with pytest.raises(UsageError, match="too short"):
        slurm.split_budget(2)
    with pytest.raises(UsageError, match="leaves no time to verify the memory"):
        slurm.split_budget(8, grace_s=5)
    assert slurm.split_budget(8, grace_s=1).timeout_s > 1


# ------------------------------------------------------------------- free? and the line


def test_problems_name_holders_and_unexplained_memory() -> None:
    snap = train()
    problems = slurm.gpu_problems(snap, (0, 4), {0: 64, 4: 64}, [(4360, (0,), " after KILL")])
    texts = [p.text for p in problems]
    assert texts[0] == "GPU 0: 44136 MiB held by pid 4360 VLLM::Worker (uid 1000) after KILL"
    assert texts[1] == "GPU 4: 38925 MiB used, no process holds it (expected at most 64 MiB)"
    assert len(texts) == 2  # GPU 0's memory is explained by its holder: said once
    assert slurm.gpu_problems(snap, (0,), {0: 50000}) == []
    line = slurm.failure_line(problems)
    assert line == ("gpufleet: GPU 0: 44136 MiB held by pid 4360 VLLM::Worker (uid 1000) after "
                    "KILL (+1 more)")
    assert len(slurm.one_reason("x " * 500)) == slurm.REASON_MAX
    assert "\n" not in slurm.one_reason("a\nb")


def test_prolog_sees_every_holder_of_a_job_gpu_through_the_plan() -> None:
    snap = train()
    plan = make_plan(snap, (1,))  # cuts the vLLM family: its members are refused, still holders
    texts = [p.text for p in slurm.gpu_problems(snap, (1,), plan.threshold_mib,
                                                slurm.plan_holders(plan, snap))]
    assert any(t.startswith("GPU 1: 44136 MiB held by pid 4361 VLLM::Worker (uid 1000): ")
               for t in texts), texts
    assert not any("no process holds it" in t for t in texts)


def test_driver_daemons_holding_every_device_file_do_not_make_a_gpu_busy() -> None:
    snap = train()
    plan = make_plan(snap, (0, 1, 2, 3))
    refused = {r.pid: r.kind for r in plan.refused}
    assert refused[1187] == policy.PROTECTED  # nvidia-persistenced: every device file open
    pids = {pid for pid, _, _ in slurm.plan_holders(plan, snap)}
    assert 1187 not in pids and 1203 not in pids
    assert {4360, 4361, 4362, 4363} <= pids
    # the same GPUs with the vLLM family gone: free, persistenced or not
    gone = {4340, 4341, 4360, 4361, 4362, 4363}
    idle = dataclasses.replace(
        snap, compute_apps=tuple(a for a in snap.compute_apps if a.pid not in gone),
        processes={p: v for p, v in snap.processes.items() if p not in gone},
        holders=tuple(h for h in snap.holders if h.pid not in gone),
        gpus=tuple(dataclasses.replace(g, memory_used_mib=0) if g.index < 4 else g
                   for g in snap.gpus))
    plan = make_plan(idle, (0, 1, 2, 3))
    assert 1187 in {r.pid for r in plan.refused}
    assert slurm.gpu_problems(idle, plan.scope, plan.threshold_mib,
                              slurm.plan_holders(plan, idle)) == []


# ------------------------------------------------------------ policy: the job's owner


def test_job_owner_rule_refuses_other_users_even_as_root() -> None:
    snap = train()
    ctx = policy.PolicyContext.from_snapshot(snap, job_uid=1001)
    worker = snap.processes[4360]  # alice's, uid 1000
    assert ctx.privileged  # the epilog runs as root: ownership alone would allow it
    found = policy.signal_refusal(worker, ctx)
    assert found == (policy.JOB_OWNER, "owned by alice (uid 1000), not the job's user (uid 1001)")
    assert policy.signal_refusal(worker, policy.PolicyContext.from_snapshot(snap, job_uid=1000)) is None
    assert policy.signal_refusal(worker, policy.PolicyContext.from_snapshot(snap)) is None
    unknown = dataclasses.replace(worker, uid=None)
    assert policy.signal_refusal(unknown, ctx)[0] == policy.JOB_OWNER
    # the never-signal list still comes first
    assert policy.signal_refusal(snap.processes[1187], ctx)[0] == policy.PROTECTED


def test_plan_with_a_job_uid_refuses_and_reports_other_users() -> None:
    snap = train()
    mine = make_plan(snap, (0, 1, 2, 3), job_uid=1000)
    assert {t.pid for t in mine.targets} == {4340, 4341, 4360, 4361, 4362, 4363}
    other = make_plan(snap, (0, 1, 2, 3), job_uid=1001)
    assert other.targets == ()
    kinds = {r.pid: r.kind for r in other.refused}
    assert {4340, 4341, 4360, 4361, 4362, 4363} <= set(kinds)
    assert kinds[4360] == policy.JOB_OWNER


# --------------------------------------------------------------- dcgm map, scontrol


def test_dcgm_job_map_files() -> None:
    assert slurm.job_map_add("", "42") == "42\n"
    assert slurm.job_map_add("41\n", "42") == "41\n42\n"
    assert slurm.job_map_add("41\n42\n", "42") == "41\n42\n"
    assert slurm.job_map_remove("41\n42\n", "42") == "41\n"
    assert slurm.job_map_remove("42\n", "42") is None


def test_show_node_as_recorded() -> None:
    idle = slurm.parse_show_node((RECORDED / "show-node-idle.txt").read_text())
    assert [(n.name, n.state, n.reason, n.drained) for n in idle] == [("node01", "IDLE", "", False)]
    drained = slurm.parse_show_node((RECORDED / "show-node-drain.txt").read_text())[0]
    assert drained.state == "IDLE+DRAIN" and drained.drained and drained.gpufleet_reason
    assert drained.reason == ("gpufleet: GPU 1: 716 MiB held by pid 4711 VLLM::Worker (uid 1001) "
                              "after KILL")
    assert slurm.parse_show_node("No nodes in the system\n") == []
