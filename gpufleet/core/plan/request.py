"""The agent's clean request from a plan (docs/DESIGN.md "Request"); pure data, sent as JSON
on stdin."""
from __future__ import annotations

from typing import Any, Optional

from gpufleet.core.plan.types import Plan, Target
from gpufleet.errors import UsageError


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
    """The agent's clean request (docs/DESIGN.md "Request"); pure data, sent as JSON on stdin.

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
