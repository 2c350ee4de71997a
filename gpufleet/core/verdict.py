"""Did a clean work? The verdict on one host, from the plan, the agent's clean document and the
before snapshot (pure).

``clean`` means every scope GPU's memory.used is at or below its threshold (the host's expected
unattributed memory + tolerance + the driver's share for listed processes the plan leaves
there: ``plan.threshold_mib``) in the agent's after-snapshot; anything else is ``dirty``, with
a reason that says what is left, who holds it, where unattributed memory most likely went, and
whether a GPU reset is possible on this host. Memory is the proof, not the signals: a process
can be gone while the driver still holds its memory, and a zombie holds none (measured).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from gpufleet.core import policy
from gpufleet.core.hostlock import lock_failure
from gpufleet.core.model import Snapshot, SnapshotError, ledger, parse_snapshot
from gpufleet.core.gpus import format_gpu_indices
from gpufleet.core.plan import Plan, Refusal, Target

CLEAN = "clean"
DIRTY = "dirty"
RETAKEN = "retaken"  # a target was started again, or a new process took the GPU: exit 1

# Survivor kinds.
SURVIVED = "survived"  # a target still alive (same pid and start time)
STUCK = "stuck"  # uninterruptible sleep: signals cannot end it
ZOMBIE = "zombie"
REFUSED = "refused"  # the plan refused it; expected to remain
INVISIBLE = "invisible"  # listed by nvidia-smi, not in this PID namespace
NEW = "new"  # appeared during the clean
UNTOUCHED = "untouched"  # was there, not in the plan

# Likely causes of unattributed memory.
CAUSE_WSL2 = "WSL2 reservation"
CAUSE_NAMESPACE = "other PID namespace"
CAUSE_DISPLAY = "display clients"
CAUSE_LEAK = "driver leak"


@dataclass(frozen=True)
class GpuOutcome:
    index: int
    before_mib: Optional[int]
    after_mib: Optional[int]
    threshold_mib: int
    ok: bool


@dataclass(frozen=True)
class Survivor:
    pid: int
    name: str
    gpus: tuple[int, ...]
    used_mib: Optional[int]
    kind: str
    detail: str


@dataclass(frozen=True)
class Unattributed:
    gpu: int
    mib: int
    cause: str
    detail: str


@dataclass(frozen=True)
class CleanVerdict:
    """One host's verdict (``verdict`` is CLEAN, DIRTY or RETAKEN), with the evidence."""

    host: str
    verdict: str
    reason: str
    freed_mib: Optional[int]
    left_mib: Optional[int]
    gpus: tuple[GpuOutcome, ...] = ()
    survivors: tuple[Survivor, ...] = ()
    unattributed: tuple[Unattributed, ...] = ()
    reset_possible: bool = False
    reset_blockers: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return self.verdict == CLEAN

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _state(raw: Optional[str]) -> str:
    return (raw or "?")[:1]


def _problems(clean: Mapping[str, Any]) -> list[str]:
    """What went wrong in the agent's own steps, quoted from its document."""
    out = []
    lock = lock_failure(clean)
    if lock is not None:
        out.append(lock)
    for unit in clean.get("units_stopped") or ():
        if not unit.get("ok"):
            out.append(f"stopping {unit.get('unit')} failed: {unit.get('error') or '?'}")
    for sig in clean.get("signals") or ():
        outcome = str(sig.get("outcome") or "")
        if outcome == "permission denied" or outcome.startswith("error"):
            out.append(f"SIG{sig.get('signal')} to PID {sig.get('pid')}: {outcome}")
    for reset in clean.get("reset") or ():
        if not reset.get("ok"):
            out.append(f"reset of GPU {reset.get('index')} failed: {reset.get('message') or '?'}")
    return out


def _dirty_early(plan: Plan, why: str, problems: list[str]) -> CleanVerdict:
    return CleanVerdict(plan.host, DIRTY, "; ".join([why] + problems), None, None,
                        problems=tuple(problems))


def make_verdict(plan: Plan, clean: Mapping[str, Any], before: Snapshot) -> CleanVerdict:
    """The verdict for one host. ``clean`` is the agent's clean document (parsed JSON)."""
    problems = _problems(clean)
    after = _after_snapshot(clean)
    if isinstance(after, str):
        return _dirty_early(plan, after, problems)
    scope = set(plan.scope)
    outcomes = _gpu_outcomes(plan, before, after, _locked_before(clean))
    freed, left = _freed_and_left(outcomes)
    ctx = policy.PolicyContext.from_snapshot(after)
    survivors = _survivors(plan, clean, before, after, scope)
    unattributed = _unattributed(plan, after, scope, ctx)
    blockers = _reset_blockers(after, ctx)

    bad = [o for o in outcomes if not o.ok]
    retakes = [r for r in (clean.get("settle") or {}).get("retaken") or () if isinstance(r, dict)]
    if retakes:
        return CleanVerdict(plan.host, RETAKEN, retaken_reason(plan, retakes), freed, left,
                            tuple(outcomes), tuple(survivors), tuple(unattributed),
                            not blockers, tuple(blockers), tuple(problems))
    if not bad and lock_failure(clean) is None:
        return CleanVerdict(plan.host, CLEAN, "", freed, left, tuple(outcomes),
                            tuple(survivors), tuple(unattributed), not blockers,
                            tuple(blockers), tuple(problems))
    reason = _dirty_reason(bad, survivors, unattributed, problems, blockers)
    return CleanVerdict(plan.host, DIRTY, reason, freed, left, tuple(outcomes),
                        tuple(survivors), tuple(unattributed), not blockers, tuple(blockers),
                        tuple(problems))


def retaken_reason(plan: Plan, retakes: Sequence[Mapping[str, Any]]) -> str:
    """Who took the GPU back, started by whom, and what to do: one clause per new process."""
    parts = []
    for r in retakes:
        who = f"PID {r.get('pid')} {r.get('name') or '?'}"
        replaced = plan.target(r["replaces"]) if isinstance(r.get("replaces"), int) else None
        owner = replaced.owner if replaced is not None else None
        if r.get("how") == "restarted" and replaced is not None:
            by = r.get("owner") or (owner.name if owner else "its owner")
            pid = r.get("owner_pid")  # the restart is the evidence that it is the owner
            action = f"stop it, or pass --owner {pid} to include it" if pid else \
                (owner.action if owner is not None else "stop its owner")
            parts.append(f"{who} was started again by {by} in place of PID {replaced.pid}: "
                         f"{action}")
        else:
            parts.append(f"{who} took a GPU in scope once the memory was free: find what "
                         "started it (a supervisor, a unit, a scheduler) before loading a model")
    return "retaken: " + "; ".join(parts)


def _after_snapshot(clean: Mapping[str, Any]) -> Union[Snapshot, str]:
    """The agent's after-snapshot, or why there is none to judge by."""
    raw_after = clean.get("after")
    if raw_after is None:
        return "the agent returned no after-snapshot"
    if isinstance(raw_after, Snapshot):
        after = raw_after
    else:
        try:
            after = parse_snapshot(raw_after)
        except SnapshotError as exc:
            return f"unreadable after-snapshot: {exc}"
    if not after.nvidia_smi_ok:
        return f"{after.gpu_reader} failed after the clean: {after.nvidia_smi_error or '?'}"
    return after


def _locked_before(clean: Mapping[str, Any]) -> Optional[dict[int, Optional[int]]]:
    """Per GPU, memory.used as the agent read it once it held the host's lock: the clean's
    own "before", so that memory another clean freed while this one waited for the lock is
    never counted as freed here. {} when that read failed (every before unknown); None for a
    document without it (the plan's snapshot stands in)."""
    raw = clean.get("before_locked")
    if not isinstance(raw, Mapping):
        return None
    used = raw.get("used_mib")
    out: dict[int, Optional[int]] = {}
    for key, value in (used.items() if isinstance(used, Mapping) else ()):
        if str(key).isdigit():
            ok = isinstance(value, int) and not isinstance(value, bool)
            out[int(key)] = value if ok else None
    return out


def _gpu_outcomes(plan: Plan, before: Snapshot, after: Snapshot,
                  locked: Optional[Mapping[int, Optional[int]]] = None) -> list[GpuOutcome]:
    """Per GPU: used after vs threshold. A GPU is matched to its before self by UUID; its
    before memory is ``locked``'s (the agent's reading under the lock) when given."""
    before_by_uuid = {g.uuid: g for g in before.gpus}
    before_by_index = {g.index: g for g in before.gpus}
    after_by_index = {g.index: g for g in after.gpus}
    outcomes = []
    for index in plan.scope:
        a = after_by_index.get(index)
        b = before_by_uuid.get(a.uuid) if a is not None else None
        if b is None:
            b = before_by_index.get(index)
        threshold = plan.threshold_mib.get(index, 0)
        after_used = a.memory_used_mib if a is not None else None
        ok = after_used is not None and after_used <= threshold
        before_mib = b.memory_used_mib if b else None
        if locked is not None:
            before_mib = locked.get(index)
        outcomes.append(GpuOutcome(index, before_mib, after_used, threshold, ok))
    return outcomes


def _freed_and_left(outcomes: list[GpuOutcome]) -> tuple[Optional[int], Optional[int]]:
    if any(o.after_mib is None for o in outcomes):
        left = None
    else:
        left = sum(o.after_mib or 0 for o in outcomes)
    if left is None or any(o.before_mib is None for o in outcomes):
        freed = None
    else:
        freed = sum(o.before_mib or 0 for o in outcomes) - left
    return freed, left


def _dirty_reason(bad: list[GpuOutcome], survivors: list[Survivor],
                  unattributed: list[Unattributed], problems: list[str],
                  blockers: list[str]) -> str:
    """What is left, who holds it, where unattributed memory went, whether a reset helps."""
    parts = []
    for o in bad:
        if o.after_mib is None:
            parts.append(f"GPU {o.index}: memory unknown after the clean")
        else:
            parts.append(f"GPU {o.index}: {o.after_mib} MiB left (threshold {o.threshold_mib})")
    if survivors:
        parts.append("survivors: " + ", ".join(
            f"{s.pid} {s.name} on GPU {format_gpu_indices(s.gpus) or '-'} ({s.kind}: {s.detail})"
            for s in survivors
        ))
    for u in unattributed:
        parts.append(f"GPU {u.gpu}: {u.mib} MiB unattributed, likely {u.cause} ({u.detail})")
    parts.extend(problems)
    if blockers:
        parts.append("GPU reset not possible here: " + ", ".join(blockers))
    else:
        parts.append("a GPU reset is possible here (--reset)")
    return "; ".join(parts)


@dataclass(frozen=True)
class _Seen:
    """What the survivor rules read: the plan's targets and refusals, the agent's survivors."""

    plan: Plan
    before: Snapshot
    after: Snapshot
    scope: set[int]
    targets: Mapping[int, Target]
    refused: Mapping[int, Refusal]
    agent_said: Mapping[int, Mapping[str, Any]]


def _survivors(plan: Plan, clean: Mapping[str, Any], before: Snapshot, after: Snapshot,
               scope: set[int]) -> list[Survivor]:
    """Who still holds a scope GPU after the clean, and what kind of holder it is."""
    seen = _Seen(plan, before, after, scope, {t.pid: t for t in plan.targets},
                 {r.pid: r for r in plan.refused},
                 {int(s["pid"]): s for s in clean.get("survivors") or () if "pid" in s})
    gpus_of, used_of = _left_on_scope(seen)
    return [_survivor(seen, pid, tuple(sorted(gpus_of[pid])), used_of[pid])
            for pid in sorted(gpus_of)]


def _left_on_scope(seen: _Seen) -> tuple[dict[int, set[int]], dict[int, Optional[int]]]:
    """pid -> scope GPUs it still holds, and the MiB nvidia-smi lists for it there."""
    after, scope, targets, agent_said = seen.after, seen.scope, seen.targets, seen.agent_said
    gpus_of: dict[int, set[int]] = {}
    used_of: dict[int, Optional[int]] = {}
    for app in after.compute_apps:
        gpu = after.gpu_by_uuid(app.gpu_uuid)
        if gpu is None or gpu.index not in scope:
            continue
        gpus_of.setdefault(app.pid, set()).add(gpu.index)
        prev = used_of.get(app.pid, 0)
        used_of[app.pid] = None if prev is None or app.used_mib is None else prev + app.used_mib
    listed = set(gpus_of)
    ctx = policy.PolicyContext.from_snapshot(after)
    roles = policy.holder_roles(after, max(seen.plan.threshold_mib.values(), default=0))
    for holder in after.holders:
        if holder.pid in listed:
            continue
        known = holder.pid in targets or holder.pid in seen.refused or holder.pid in agent_said
        role = roles.get(holder.pid)
        if role is not None and role.role == policy.ROLE_CLIENT and not known:
            continue  # a monitor, an exporter, a concurrent nvidia-smi: holds no memory
        held = set(after.holder_gpu_indices(holder))
        mine = held & scope
        if not (mine or (seen.plan.full_scope and not held)):
            continue
        proc = after.processes.get(holder.pid)
        if proc is not None and policy.never_signal_reason(proc, ctx) is not None:
            continue  # driver daemons and display servers stay by design; see reset blockers
        if known or holder.pid not in seen.before.processes:
            gpus_of.setdefault(holder.pid, set()).update(mine)
            used_of.setdefault(holder.pid, None)
    for pid in agent_said:
        gpus_of.setdefault(pid, set(targets[pid].gpus) & scope if pid in targets else set())
        used_of.setdefault(pid, None)
    return gpus_of, used_of


def _survivor(seen: _Seen, pid: int, gpus: tuple[int, ...], used: Optional[int]) -> Survivor:
    """One survivor and its kind: invisible, new, stuck, zombie, survived, refused, untouched."""
    after, before, targets = seen.after, seen.before, seen.targets
    proc = after.processes.get(pid)
    said = seen.agent_said.get(pid, {})
    if proc is None and not said:
        app_name = next((a.process_name for a in after.compute_apps if a.pid == pid), "?")
        return Survivor(pid, app_name, gpus, used, INVISIBLE,
                        "not visible from this PID namespace (container?)")
    name = proc.name if proc is not None else (targets[pid].name if pid in targets else "?")
    state = _state(proc.state if proc is not None else said.get("state"))
    wchan = (proc.wchan if proc is not None else None) or said.get("wchan") or "?"
    old = before.processes.get(pid)
    same = old is not None and proc is not None and old.starttime == proc.starttime
    if proc is not None and not same and pid not in seen.agent_said:
        kind, detail = NEW, "started during the clean"
    elif state == "D":
        kind, detail = STUCK, (f"uninterruptible sleep in {wchan}: signals cannot end it; "
                               "a GPU reset or a reboot frees it")
    elif state in ("Z", "X"):
        # a zombie holds no device file, so the after-snapshot often lacks it: the agent's
        # survivor entry still knows its parent
        ppid = proc.ppid if proc is not None else said.get("ppid")
        parent = after.processes.get(ppid) if ppid else None
        if parent is None and ppid is not None:
            parent = before.processes.get(ppid)
        kind, detail = ZOMBIE, (f"zombie, parent PID {ppid if ppid is not None else '?'} "
                                f"({parent.name if parent else '?'}); holds no GPU memory")
    elif pid in targets:
        kind = SURVIVED
        detail = said.get("reason") or "still alive after TERM and KILL"
    elif pid in seen.refused:
        kind, detail = REFUSED, seen.refused[pid].reason
    else:
        kind, detail = UNTOUCHED, "was not in the plan"
    return Survivor(pid, name, gpus, used, kind, detail)


def _unattributed(plan, after, scope, ctx) -> list[Unattributed]:
    """Memory over threshold that no listed process accounts for, with its likely cause."""
    out = []
    minor_of = {g.index: (g.minor if g.minor is not None else g.index) for g in after.gpus}
    for row in ledger(after):
        if row.index not in scope or row.unattributed_mib is None:
            continue
        if row.unattributed_mib <= plan.threshold_mib.get(row.index, 0):
            continue
        dev = f"/dev/nvidia{minor_of[row.index]}"
        hidden, display = [], []
        for holder in after.holders:
            if holder.pid in after.listed_pids():
                continue
            if dev not in holder.devices and "/dev/dxg" not in holder.devices:
                continue
            proc = after.processes.get(holder.pid)
            if proc is not None and policy.protected_daemon(proc) in _DISPLAY:
                display.append(f"{proc.pid} {proc.name}")
            elif proc is None or policy.never_signal_reason(proc, ctx) is None:
                hidden.append(str(holder.pid))
        invisible = sorted(a.pid for a in after.apps_on(row.index) if a.pid not in after.processes)
        if after.facts.wsl2:
            cause, detail = CAUSE_WSL2, ("Windows and the WSL2 GPU driver hold memory that no "
                                         "Linux process owns")
        elif hidden or invisible or after.facts.in_container:
            who = []
            if hidden:
                who.append("unlisted holders PID " + ", ".join(hidden))
            if invisible:
                who.append("PIDs " + ", ".join(map(str, invisible)) + " not visible here")
            if after.facts.in_container:
                who.append(f"the agent runs in container {after.facts.container or '?'}")
            cause, detail = CAUSE_NAMESPACE, "hidden PIDs / in a container: " + "; ".join(who)
        elif display:
            cause, detail = CAUSE_DISPLAY, ("graphics clients are not in nvidia-smi's "
                                            "compute-apps: " + ", ".join(display))
        else:
            cause, detail = CAUSE_LEAK, "memory no process holds; a GPU reset frees it"
        out.append(Unattributed(row.index, row.unattributed_mib, cause, detail))
    return out


_DISPLAY = frozenset(
    name for name, what in policy.PROTECTED_DAEMONS.items() if what.startswith("display")
)


def _reset_blockers(after: Snapshot, ctx: policy.PolicyContext) -> list[str]:
    """Why `nvidia-smi -r` cannot work here: it needs root, the host itself, and no holders."""
    out = []
    facts = after.facts
    if not facts.is_root:
        out.append("not root")
    if facts.in_container:
        out.append(f"in container {facts.container or '?'}")
    if facts.wsl2:
        out.append("WSL2 has no GPU reset")
    holders = []
    for holder in sorted(after.holders, key=lambda h: h.pid):
        if holder.pid == facts.agent_pid:
            continue
        proc = after.processes.get(holder.pid)
        holders.append(f"{holder.pid} {proc.name if proc else '?'}")
    if holders:
        out.append("NVIDIA device files held by " + ", ".join(holders))
    return out
