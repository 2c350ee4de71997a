"""Step 6 of the plan: each target's owner, the owners the operator names, the settle window
(pure).

An owner is whatever may start a target again (gpufleet.core.policy.owner_of). It is shown
with its target and never signalled unless the operator names it (``clean --owner PID`` or
``--owner UNIT``): then a supervisor is planned first, in wave 0 (identity-checked like any
target), and a unit is stopped. The settle window is how long the clean watches the GPUs for
a retake once the memory is back: only when some target has an owner; nothing restarts a
process whose parent is init and that no unit, container, pod or job holds.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Optional

from gpufleet.core import policy
from gpufleet.core.model import Snapshot
from gpufleet.core.plan.types import EVIDENCE_OWNER, Refusal, Target, UnitStop

#: Seconds the clean watches for a retake once memory is back, when a target has an owner.
#: Measured on an H200 (tests/fixtures/real-h200/clean-cases/): a supervisor's torch child,
#: restarted 0.3 s after SIGKILL, was running 0.50-0.57 s later and listed by NVML 3.50-4.02
#: s later (torch's import and CUDA's start); 5 s covers that with a second to spare. A
#: restart by the target's own parent is seen earlier, when the new child starts.
DEFAULT_SETTLE_S = 5.0

OWNER_KIND = "owner"  # a refusal kind: an owner the operator named that cannot be planned


def with_owners(snapshot: Snapshot, targets: tuple[Target, ...]) -> tuple[Target, ...]:
    """The targets, each with its owner (policy.owner_of)."""
    pids = frozenset(t.pid for t in targets)
    return tuple(replace(t, owner=policy.owner_of(snapshot.processes[t.pid],
                                                  snapshot.processes, pids))
                 for t in targets)


def plan_owners(snapshot: Snapshot, targets: tuple[Target, ...], names: Iterable[str],
                ctx: policy.PolicyContext, refused: dict[int, Refusal]
                ) -> tuple[tuple[Target, ...], tuple[UnitStop, ...]]:
    """(targets with their owners, and the named owners first; units to stop); a named owner
    that cannot be planned goes into ``refused``. An owner the operator names goes in wave 0;
    what it started follows in wave 1."""
    targets = with_owners(snapshot, targets)
    first, units, not_planned = named_owners(snapshot, targets, names, ctx)
    refused.update((r.pid, r) for r in not_planned)
    if first:
        led = {p.pid for p in first}
        targets = tuple(sorted(first + tuple(
            replace(t, wave=1) if t.owner is not None and t.owner.pid in led else t
            for t in targets), key=lambda t: (t.wave, t.pid)))
    return targets, units


def named_owners(snapshot: Snapshot, targets: tuple[Target, ...], names: Iterable[str],
                 ctx: policy.PolicyContext
                 ) -> tuple[tuple[Target, ...], tuple[UnitStop, ...], tuple[Refusal, ...]]:
    """(supervisors to signal first, units to stop, refusals) for ``clean --owner``: a PID
    must be the owner (supervisor or parent) of a target and pass policy; a unit must own a
    target. Anything else is refused with the reason, and nothing is signalled for it."""
    extra: list[Target] = []
    units: list[UnitStop] = []
    refused: list[Refusal] = []
    for name in names:
        owned = [t for t in targets if t.owner is not None and
                 (str(t.owner.pid) == name or t.owner.name == name)]
        if not owned:
            refused.append(Refusal(int(name) if name.isdigit() else -1, name,
                                   "--owner: owns no target of this plan", OWNER_KIND))
            continue
        owner = owned[0].owner
        assert owner is not None
        if owner.kind == policy.OWNER_UNIT:
            units.append(UnitStop(owner.name, False, tuple(t.pid for t in owned)))
            continue
        proc = snapshot.processes.get(owner.pid) if owner.pid is not None else None
        why = policy.signal_refusal(proc, ctx) if proc is not None else (
            policy.IDENTITY, "not a process gpufleet can signal")
        if proc is None or why is not None:
            refused.append(Refusal(owner.pid or -1, owner.name, f"--owner: {why[1] if why else '?'}",
                                   OWNER_KIND))
            continue
        extra.append(Target(
            pid=proc.pid, starttime=proc.starttime, name=proc.name, cmdline=proc.cmdline,
            gpus=tuple(sorted({g for t in owned for g in t.gpus})), evidence=EVIDENCE_OWNER,
            wave=0, family_root=proc.pid, used_mib=None, user=proc.user, unit=proc.unit))
    return tuple(extra), tuple(units), tuple(refused)


def settle_seconds(targets: tuple[Target, ...], asked: Optional[float],
                   stop_units: bool = False) -> float:
    """The settle window: ``asked`` when given, else DEFAULT_SETTLE_S when a target has an
    owner that the clean does not stop itself (a supervisor not named with --owner, a unit
    without --stop-units, a container, a pod, a job), else 0."""
    if asked is not None:
        return max(0.0, asked)
    planned = {t.pid for t in targets}
    for t in targets:
        o = t.owner
        if o is None or (o.pid is not None and o.pid in planned):
            continue
        if o.kind == policy.OWNER_UNIT and stop_units:
            continue
        return DEFAULT_SETTLE_S
    return 0.0


def watch_fields(snapshot: Snapshot, scope: tuple[int, ...], targets: tuple[Target, ...],
                 asked: Optional[float], stop_units: bool) -> dict[str, Any]:
    """The Plan's fields for the settle window: how long, which PIDs the driver listed on the
    scope GPUs before (not a retake later) and the scope GPUs' UUIDs (how nvidia-smi names
    them)."""
    return {
        "settle_s": settle_seconds(targets, asked, stop_units),
        "listed_pids": tuple(sorted({a.pid for i in scope for a in snapshot.apps_on(i)})),
        "scope_uuids": tuple(g.uuid for g in snapshot.gpus if g.index in scope),
    }


def owner_notes(targets: tuple[Target, ...]) -> list[str]:
    """One note per owner that may start its target again: who, why, what to do."""
    notes = []
    planned = {t.pid for t in targets}
    for t in targets:
        o = t.owner
        if o is None or (o.pid is not None and o.pid in planned):
            continue
        if o.kind == policy.OWNER_PARENT:
            continue  # shown in the table; nothing says it restarts anything
        verb = "restarts" if o.restarts else "may restart"
        notes.append(f"{o.name} {verb} PID {t.pid} {t.name} ({o.evidence}): {o.action}")
    return notes
