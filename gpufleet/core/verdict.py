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

from gpufleet.core import evidence, policy
from gpufleet.core.hostlock import lock_failure
from gpufleet.core.ledger import ledger
from gpufleet.core.model import ProcessInfo, Snapshot, SnapshotError, parse_snapshot
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
    reason = _dirty_reason(_Why(plan, after, survivors, unattributed), bad, problems)
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


@dataclass(frozen=True)
class _Why:
    """What a dirty GPU's line reads: the plan, the after-snapshot, who is left, and memory
    no visible process explains."""

    plan: Plan
    after: Snapshot
    survivors: list[Survivor]
    unattributed: list[Unattributed]


def _dirty_reason(why: _Why, bad: list[GpuOutcome], problems: list[str]) -> str:
    """One short line per GPU left over its threshold (how much; who holds it, each with its
    own reason; memory no visible process explains and where it may be; what can still be
    done), then the agent's own problems. Lines are joined by newlines: a string in JSON, a
    line per GPU on screen."""
    return "\n".join([_gpu_line(why, o) for o in bad] + problems)


def _gpu_line(why: _Why, o: GpuOutcome) -> str:
    """One dirty GPU: the holders that may hold its memory (a zombie, a client or a process
    whose context is elsewhere holds none of it), else where unexplained memory may be, and
    the next action where no signal helps."""
    if o.after_mib is None:
        return f"GPU {o.index}: memory unknown after the clean"
    head = f"GPU {o.index}: {o.after_mib} MiB left (threshold {o.threshold_mib})"
    unexplained = next((u for u in why.unattributed if u.gpu == o.index), None)
    held = [s for s in why.survivors if o.index in s.gpus and _holds_there(why, s, o.index,
                                                                            unexplained)]
    parts = [_group_text(why, group, o.index) for group in _groups(held)]
    unlisted = [s for s in held if not _listed_on(why.after, s.pid, o.index)]
    if unexplained is not None and not unlisted:
        parts.append(f"{unexplained.mib} MiB no process here explains: {unexplained.detail}")
    stuck = any(s.kind == STUCK or _refusal_kind(why, s) == policy.STUCK for s in held)
    if stuck or (unexplained is not None and not unlisted and unexplained.cause == CAUSE_LEAK):
        parts.append(policy.reset_or_drain(why.after, (o.index,)))
    elif unexplained is not None and not unlisted and unexplained.cause == CAUSE_NAMESPACE:
        parts.append("clean it where those processes are visible (the host, or their "
                     "container)")
    return head + (": " + "; ".join(parts) if parts else "")


def _refusal_kind(why: _Why, s: Survivor) -> Optional[str]:
    ref = why.plan.refusal_of(s.pid) if s.kind == REFUSED else None
    return ref.kind if ref is not None else None


def _listed_on(after: Snapshot, pid: int, index: int) -> bool:
    return any(a.pid == pid for a in after.apps_on(index))


def _holds_there(why: _Why, s: Survivor, index: int, unexplained: Optional[Unattributed]
                 ) -> bool:
    """Whether ``s`` may hold memory on GPU ``index``: listed there; or, not listed, a target
    still there, or a holder whose context may be on it while memory there is unexplained. A
    zombie holds nothing; a process without a CUDA context (maps) holds no memory."""
    if s.kind == ZOMBIE:
        return False
    if _listed_on(why.after, s.pid, index) or s.kind in (STUCK, SURVIVED, NEW):
        return True
    if unexplained is None:
        return False
    holder = next((h for h in why.after.holders if h.pid == s.pid), None)
    if holder is None or holder.mapped is None:
        return True
    if evidence.maps_kind(holder.mapped, why.after.facts.wsl2) == evidence.MAPS_CLIENT:
        return False
    mapped = why.after.device_gpu_indices(holder.mapped)
    return index in mapped if mapped else True


_KIND_WORDS = {REFUSED: "refused", STUCK: "stuck", SURVIVED: "survived", NEW: "new",
               INVISIBLE: "not visible here", UNTOUCHED: "untouched"}


def _groups(held: list[Survivor]) -> list[list[Survivor]]:
    """Holders that share a kind and a reason, together (a family refused as one)."""
    out: dict[tuple[str, str], list[Survivor]] = {}
    for s in held:
        out.setdefault((s.kind, s.detail), []).append(s)
    return list(out.values())


def _group_text(why: _Why, group: list[Survivor], index: int) -> str:
    """``PID 4711 VLLM::Worker (3000 MiB) refused: <its reason>``."""
    names = []
    for s in group:
        apps = [a for a in why.after.apps_on(index) if a.pid == s.pid]
        mib = None if not apps or any(a.used_mib is None for a in apps) else \
            sum(a.used_mib or 0 for a in apps)
        names.append(f"{s.pid} {s.name}" + (f" ({mib} MiB)" if mib is not None else ""))
    first = group[0]
    return (f"PID{'s' if len(group) > 1 else ''} {', '.join(names)} "
            f"{_KIND_WORDS.get(first.kind, first.kind)}: {first.detail}")


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
                        f"another PID namespace ({_NSPID})")
    name = proc.name if proc is not None else (targets[pid].name if pid in targets else "?")
    state, wchan = _state_of(proc, said)
    old = before.processes.get(pid)
    same = old is not None and proc is not None and old.starttime == proc.starttime
    if proc is not None and not same and pid not in seen.agent_said:
        kind, detail = NEW, "started during the clean"
    elif state == "D":
        kind, detail = STUCK, f"D state in {wchan}: signals cannot end it"
    elif state in ("Z", "X"):
        # a zombie holds no device file, so the after-snapshot often lacks it: the agent's
        # survivor entry still knows its parent
        ppid = proc.ppid if proc is not None else said.get("ppid")
        parent = after.processes.get(ppid) if ppid else None
        if parent is None and ppid is not None:
            parent = before.processes.get(ppid)
        kind, detail = ZOMBIE, (f"zombie (exited, no thread left), parent PID "
                                f"{ppid if ppid is not None else '?'} "
                                f"({parent.name if parent else '?'}): holds nothing")
    elif pid in targets:
        kind = SURVIVED
        detail = said.get("reason") or "still alive after TERM and KILL"
    elif pid in seen.refused:
        kind, detail = REFUSED, seen.refused[pid].reason
    else:
        kind, detail = UNTOUCHED, "was not in the plan"
    return Survivor(pid, name, gpus, used, kind, detail)


def _state_of(proc: Optional[ProcessInfo], said: Mapping[str, Any]) -> tuple[str, str]:
    """(state letter, wchan) of a survivor. A zombie leader whose threads still run is no
    zombie: D when its threads are stuck there (their wchan), else still running; the agent's
    own reading (a D thread under any leader) counts too."""
    if proc is not None and policy.leader_gone(proc):
        stuck = proc.stuck_threads
        if stuck or said.get("state") == "D":
            return "D", (stuck[0].wchan if stuck else None) or said.get("wchan") or "?"
        return "R", "?"
    state = _state(proc.state if proc is not None else said.get("state"))
    if said.get("state") == "D":
        state = "D"
    return state, (proc.wchan if proc is not None else None) or said.get("wchan") or "?"


def _unattributed(plan, after, scope, ctx) -> list[Unattributed]:
    """Memory over threshold that no listed process accounts for, with where it may be. GPU
    clients (monitors, exporters: no CUDA context, policy.holder_role) never hold it."""
    out = []
    minor_of = {g.index: (g.minor if g.minor is not None else g.index) for g in after.gpus}
    roles = policy.holder_roles(after, max(plan.threshold_mib.values(), default=0))
    for row in ledger(after):
        if row.index not in scope or row.unattributed_mib is None:
            continue
        if row.unattributed_mib <= plan.threshold_mib.get(row.index, 0):
            continue
        dev = f"/dev/nvidia{minor_of[row.index]}"
        hidden, display = [], []
        for holder in after.unlisted_holders():
            role = roles.get(holder.pid)
            if (dev not in holder.devices and "/dev/dxg" not in holder.devices) or \
                    (role is not None and role.role == policy.ROLE_CLIENT):
                continue
            proc = after.processes.get(holder.pid)
            if proc is not None and policy.protected_daemon(proc) in _DISPLAY:
                display.append(f"{proc.pid} {proc.name}")
            elif proc is None or policy.never_signal_reason(proc, ctx) is None:
                hidden.append(str(holder.pid))
        invisible = sorted(a.pid for a in after.apps_on(row.index) if a.pid not in after.processes)
        cause, detail = _where(after, hidden, invisible, display)
        out.append(Unattributed(row.index, row.unattributed_mib, cause, detail))
    return out


# Where memory no visible process explains may be, for people: NVML and nvidia-smi give the
# host's PIDs, which a process in another PID namespace knows by other numbers (NSpid).
_NSPID = "NVML gives host PIDs: find them by NSpid in /proc/PID/status"


def _where(after: Snapshot, hidden: list[str], invisible: list[int], display: list[str]
           ) -> tuple[str, str]:
    """(likely cause, where the memory may be) for one GPU's unexplained memory."""
    if after.facts.wsl2:
        return CAUSE_WSL2, "WSL2: Windows and its GPU driver hold memory no Linux process owns"
    if hidden or invisible or after.facts.in_container:
        who = []
        if invisible:
            who.append("listed PIDs " + ", ".join(map(str, invisible)) + " are not in this /proc")
        if hidden:
            who.append("unlisted holders PID " + ", ".join(hidden))
        if after.facts.in_container:
            who.append(f"the agent runs in container {after.facts.container or '?'}")
        return CAUSE_NAMESPACE, (f"likely another PID namespace ({'; '.join(who)}; {_NSPID}), "
                                 "else the driver")
    if display:
        return CAUSE_DISPLAY, ("display clients (graphics memory is not in compute-apps): "
                               + ", ".join(display))
    return CAUSE_LEAK, ("the driver (a leak, or a process it still tears down) or another PID "
                        f"namespace ({_NSPID})")


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
