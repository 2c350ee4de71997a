"""The agent's clean request from a plan (docs/protocol.md "Requests"); pure data, sent as JSON
on stdin."""
from __future__ import annotations

from typing import Any, Optional

from gpufleet.core import policy
from gpufleet.core.ledger import ledger
from gpufleet.core.model import Snapshot
from gpufleet.core.plan.types import EVIDENCE_SMI, Plan, Target
from gpufleet.errors import UsageError

#: How long the memory wait gives memory nothing signalled can free (release_floors): a driver
#: still releasing a process that is already gone frees it within moments (0.13-0.23 s after
#: SIGKILL on the H200: tests/fixtures/real-h200/clean-cases/probe-1.log, parts B and D);
#: anything else -- a driver's leak, another PID namespace's process, WSL2 -- no wait changes.
RELEASE_WAIT_S = 2.0


def _target(t: Target, plan: Plan) -> dict[str, Any]:
    """A target as the agent signals it, and the owner whose new child would be a restart
    (its PID and start time: the agent watches that process's children, never a name)."""
    out: dict[str, Any] = {"pid": t.pid, "starttime": t.starttime, "wave": t.wave,
                           "name": t.name, "cmdline": t.cmdline}
    o = t.owner
    if o is not None and o.pid is not None and plan.target(o.pid) is None:
        out["owner"] = {"pid": o.pid, "starttime": o.starttime, "name": o.name,
                        "restarts": o.restarts}
    return out


def to_request(
    plan: Plan,
    grace_s: float,
    timeout_s: float,
    shm: bool,
    reset: bool,
    operator: str,
    lock_path: Optional[str] = None,
    *,
    nvidia_smi: Optional[str] = None,
    smi_timeout_s: float = 10.0,
    poll_s: float = 0.1,
    deadline_s: Optional[float] = None,
) -> dict[str, Any]:
    """The agent's clean request (docs/protocol.md "Requests"); pure data, sent as JSON on stdin.

    The deadline leaves the agent time for the after-snapshot once the memory wait ends.
    """
    if grace_s < 0 or timeout_s <= 0 or poll_s <= 0 or smi_timeout_s <= 0:
        raise UsageError("grace and poll must be >= 0 and timeouts > 0 seconds")
    if grace_s > timeout_s:
        raise UsageError(f"grace ({grace_s:g}s) is longer than the timeout ({timeout_s:g}s)")
    if deadline_s is None:
        deadline_s = float(timeout_s) + float(smi_timeout_s)
    if deadline_s < timeout_s:
        raise UsageError(f"deadline ({deadline_s:g}s) is shorter than the timeout ({timeout_s:g}s)")
    return {
        "mode": "clean",
        "deadline_s": float(deadline_s),
        "nvidia_smi": nvidia_smi,
        "smi_timeout_s": float(smi_timeout_s),
        "scope": list(plan.scope),
        "targets": [_target(t, plan) for t in plan.targets],
        "settle_s": float(plan.settle_s),
        "scope_uuids": list(plan.scope_uuids),
        "listed_before": list(plan.listed_pids),
        "units": [{"unit": u.unit, "disable": u.disable} for u in plan.units_to_stop],
        "grace_s": float(grace_s),
        "timeout_s": float(timeout_s),
        "poll_s": float(poll_s),
        "threshold_mib": {str(i): v for i, v in sorted(plan.threshold_mib.items())},
        "shm": bool(shm),
        "reset": bool(reset),
        "lock_path": lock_path,
        "operator": operator,
    }


def release_floors(plan: Plan, before: Snapshot) -> dict[str, int]:
    """Per scope GPU, MiB that no target of the plan can free: what nvidia-smi attributes to no
    process, beyond the driver's share for the listed ones, on a GPU where no target could
    hold memory the listing does not show. An unlisted target could (a device-file holder
    taken on memory evidence), unless it is the family root of listed processes while
    nvidia-smi lists this PID namespace's processes: its own memory would be listed too. No
    GPU with units to stop (they may end more than the targets), or whose memory is not
    known. The memory wait stops once only this and the wait floors are left, after
    RELEASE_WAIT_S: waiting longer cannot change the verdict."""
    if plan.units_to_stop:
        return {}
    lists_here = any(a.pid in before.processes for a in before.compute_apps)
    hidden = [t for t in plan.targets if t.evidence != EVIDENCE_SMI
              and not (lists_here and policy.has_listed_descendant(before, t.pid))]
    out: dict[str, int] = {}
    for row in ledger(before):
        if row.index not in plan.scope or row.unattributed_mib is None:
            continue
        if any(not t.gpus or row.index in t.gpus for t in hidden):
            continue
        extra = row.unattributed_mib - row.driver_allowance_mib
        if extra > 0:
            out[str(row.index)] = extra
    return out
