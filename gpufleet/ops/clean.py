"""Controller side of `gpufleet clean`: snapshot -> plan -> (confirm) -> agent clean -> verdict.

Two execs per host over one SSH connection: the snapshot the plan is made from, and the clean
sequence itself (identity re-check, TERM, grace, KILL, wait for memory, final snapshot), which
runs on the host in one go so a slow link adds nothing between signal and verification.
Runbooks call ``plan_host`` / ``execute_plan`` on a session they already hold.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from gpufleet.ops import audit
from gpufleet.ops.collect import result_from_reply, snapshot_request
from gpufleet.errors import UsageError
from gpufleet.config.inventory import Host
from gpufleet.core.model import HostResult, SnapshotError, parse_snapshot
from gpufleet.core.plan import Plan, make_plan, to_request
from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.config.selection import parse_gpu_list

AGENT_MARGIN_S = 5.0  # the controller waits this much longer than the agent's own deadline


@dataclass(frozen=True)
class CleanOptions:
    gpus: str = "all"
    grace_s: float = 10.0
    timeout_s: float = 60.0
    tolerance_mib: int = DEFAULT_TOLERANCE_MIB
    protect: tuple[str, ...] = ()
    include_spanning: bool = False
    stop_units: bool = False
    disable_units: bool = False
    shm: bool = False
    reset: bool = False
    audit_log: Optional[str] = None
    operator: str = field(default_factory=audit.operator_name)
    lock_path: Optional[str] = None


@dataclass
class HostClean:
    """Everything one host's clean produced; failures are values (``error``)."""

    host: str
    ok: bool = True
    error: Optional[str] = None
    verdict: str = "error"
    reason: Optional[str] = None
    usage_error: bool = False
    outcome_unknown: bool = False  # the clean ran but its report never came back
    before: Optional[HostResult] = None
    plan: Optional[Plan] = None
    agent_doc: Optional[dict[str, Any]] = None
    after: Optional[Any] = None
    seconds: float = 0.0
    verdict_detail: dict[str, Any] = field(default_factory=dict)


def plan_host(host: Host, session: Any, opts: CleanOptions) -> HostClean:
    """Exec 1: the snapshot, and the pure plan made from it."""
    started = time.monotonic()
    reply = session.run_agent(snapshot_request(host), timeout=float(host.command_timeout))
    before = result_from_reply(host, reply, started)
    out = HostClean(host=host.name, before=before)
    if not before.ok or before.snapshot is None:
        out.ok, out.error, out.verdict = False, before.error, "unreachable" if _is_connect_error(before.error) else "error"
        return out
    snap = before.snapshot
    if not snap.nvidia_smi_ok:
        out.ok, out.error = False, f"nvidia-smi failed: {snap.nvidia_smi_error}"
        return out
    try:
        scope = parse_gpu_list(opts.gpus, available=[g.index for g in snap.gpus], host=host.name)
        out.plan = make_plan(
            snap, scope, protect=tuple(host.protect) + tuple(opts.protect),
            include_spanning=opts.include_spanning, stop_units=opts.stop_units,
            disable_units=opts.disable_units, unattributed_mib=int(host.unattributed_mib or 0),
            tolerance_mib=opts.tolerance_mib, is_sudo=bool(host.sudo), host=host.name)
    except UsageError as exc:
        out.ok, out.error, out.usage_error = False, str(exc), True
        return out
    out.verdict = "planned"
    out.seconds = time.monotonic() - started
    return out


def _is_connect_error(error: Optional[str]) -> bool:
    text = (error or "").lower()
    return any(w in text for w in ("refused", "timed out", "unreachable", "no route", "resolve", "connect"))


def clean_request(host: Host, plan: Plan, opts: CleanOptions, before: Optional[Any] = None) -> dict[str, Any]:
    request = to_request(plan, grace_s=opts.grace_s, timeout_s=opts.timeout_s, shm=opts.shm,
                         reset=opts.reset, operator=opts.operator, lock_path=opts.lock_path,
                         nvidia_smi=host.nvidia_smi)
    if before is not None:
        request["wait_floor_mib"] = wait_floors(plan, before)
    return request


def wait_floors(plan: Plan, before: Any) -> dict[str, int]:
    """Per scope GPU, MiB that nvidia-smi lists for processes the plan will not signal.

    That memory will not come back, so the agent stops waiting once only it is left. A GPU
    with a listed process of unknown memory (WSL2 n/a) gets no floor: wait the full time.
    """
    floors: dict[str, int] = {}
    targets = plan.target_pids
    for index in plan.scope:
        others = [a for a in before.apps_on(index) if a.pid not in targets]
        if not others or any(a.used_mib is None for a in others):
            continue
        floors[str(index)] = sum(int(a.used_mib) for a in others)
    return floors


def execute_plan(host: Host, session: Any, planned: HostClean, opts: CleanOptions) -> HostClean:
    """Exec 2: the agent runs the whole sequence; the verdict is computed here from its report."""
    from gpufleet.core.verdict import make_verdict

    if planned.plan is None or not planned.ok:
        return planned
    started = time.monotonic()
    request = clean_request(host, planned.plan, opts,
                            planned.before.snapshot if planned.before else None)
    reply = session.run_agent(request, timeout=float(request["deadline_s"]) + AGENT_MARGIN_S)
    planned.seconds += time.monotonic() - started
    if not reply.ok or reply.doc is None:
        planned.ok = False
        planned.verdict = "error"
        planned.outcome_unknown = True
        planned.error = (f"{reply.error or 'agent failed'}; the outcome on the host is unknown: "
                         f"run `gpufleet status --host {host.name}` (the host keeps an audit record)")
        return planned
    doc = reply.doc
    planned.agent_doc = doc
    _record_signals(host, planned, opts)
    if doc.get("lock") == "busy":
        planned.ok, planned.verdict = False, "busy"
        planned.error = "another gpufleet clean holds this host's lock; nothing was signalled"
        return planned
    try:
        planned.after = parse_snapshot(doc["after"]) if doc.get("after") else None
    except SnapshotError as exc:
        planned.after = None
        planned.error = f"final snapshot unreadable: {exc}"
    assert planned.before is not None and planned.before.snapshot is not None
    result = make_verdict(planned.plan, doc, planned.before.snapshot)
    planned.verdict = result.verdict
    planned.reason = result.reason
    planned.verdict_detail = result.as_dict()
    planned.ok = result.verdict == "clean"
    return planned


def _record_signals(host: Host, planned: HostClean, opts: CleanOptions) -> None:
    doc = planned.agent_doc or {}
    signals = [s for s in doc.get("signals") or () if s.get("signal")]
    if not signals:
        return
    snap = planned.before.snapshot if planned.before else None
    cmdlines = {pid: p.cmdline for pid, p in (snap.processes.items() if snap else ())}
    started_at = doc.get("started_at")
    audit.append(opts.audit_log, audit.signal_records(
        host.name, opts.operator, signals, cmdlines,
        started_at=float(started_at) if isinstance(started_at, (int, float)) else None))


def clean_host(host: Host, opts: CleanOptions, dry_run: bool, dial: Optional[Any] = None) -> HostClean:
    """Plan and (unless dry_run) execute on one connection: the `--yes` fast path.
    ``dial``: the host's pre-dialled connection (transport.predial)."""
    from gpufleet.transport import open_session

    started = time.monotonic()
    try:
        with open_session(host, dial) as session:
            planned = plan_host(host, session, opts)
            if dry_run or not planned.ok:
                return planned
            return execute_plan(host, session, planned, opts)
    except Exception as exc:  # a failed host is a value
        return HostClean(host=host.name, ok=False, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                         verdict="unreachable" if _is_connect_error(str(exc)) else "error",
                         seconds=time.monotonic() - started)


def used_by_index(snapshot: Any, scope: Sequence[int]) -> list[dict[str, Any]]:
    if snapshot is None:
        return []
    return [{"index": g.index, "memory_used_mib": g.memory_used_mib} for g in snapshot.gpus if g.index in scope]
