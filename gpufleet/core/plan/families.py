"""Steps 2-4 of the plan: policy, families and units, then waves (pure).

A family is a chain of GPU-evidence processes (listed by nvidia-smi, or device-file holders
that are not GPU clients) up to its topmost one, the family root (vLLM's EngineCore above its
Workers), and everything below the root with GPU evidence. Ending one member can end the root,
and the root ends them all: a family is planned as a whole, never half of it by surprise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from gpufleet.core import policy
from gpufleet.core.gpus import format_gpu_indices
from gpufleet.core.model import ProcessInfo, Snapshot
from gpufleet.core.plan.evidence import Evidence
from gpufleet.core.plan.types import (
    AMBIGUOUS,
    EVIDENCE_FAMILY,
    FAMILY,
    NO_EVIDENCE,
    Candidate,
    PlanScope,
    Refusal,
    Target,
    UnitStop,
)

# Refusals that do NOT stop a relative from being signalled: these processes hold no memory we
# can attribute outside the scope, and would have been targets in a full scope; or, stuck,
# are already ending and no parent's shutdown changes them.
SOFT_KINDS = frozenset({AMBIGUOUS, NO_EVIDENCE, policy.ZOMBIE, policy.STUCK})
# Policy's refusals that outrank what the evidence says: final whatever the scope.
_FINAL_KINDS = (policy.PROTECTED, policy.ZOMBIE, policy.STUCK)
# Evidence refusals a family's own reason replaces (it says more than "ambiguous").
_DOUBT_KINDS = frozenset({AMBIGUOUS, NO_EVIDENCE})


@dataclass(frozen=True)
class Tree:
    """The process tree: who is whose child."""

    procs: Mapping[int, ProcessInfo]
    children: Mapping[int, tuple[int, ...]]

    @classmethod
    def of(cls, procs: Mapping[int, ProcessInfo]) -> "Tree":
        out: dict[int, list[int]] = {}
        for proc in procs.values():
            if proc.ppid is not None and proc.ppid != proc.pid:
                out.setdefault(proc.ppid, []).append(proc.pid)
        return cls(procs, {k: tuple(v) for k, v in out.items()})

    def descendants(self, pid: int) -> list[int]:
        out, stack, seen = [], list(self.children.get(pid, ())), {pid}
        while stack:
            cur = stack.pop()
            if cur in seen:
                continue
            seen.add(cur)
            out.append(cur)
            stack.extend(self.children.get(cur, ()))
        return sorted(out)

    def name(self, pid: int) -> str:
        proc = self.procs.get(pid)
        return proc.name if proc is not None else "?"


@dataclass(frozen=True)
class Family:
    """A family root and its members (root included), with the GPUs nvidia-smi lists them on
    outside the scope."""

    root: int
    members: tuple[int, ...]
    outside: tuple[int, ...]


@dataclass
class Decisions:
    """Who is a target and who is refused, as the rules below settle it."""

    targets: dict[int, Candidate] = field(default_factory=dict)
    refused: dict[int, Refusal] = field(default_factory=dict)

    def refuse(self, pid: int, reason: str, kind: str) -> None:
        cand = self.targets.pop(pid)
        self.refused[pid] = Refusal(pid, cand.proc.name, reason, kind, cand.gpus)


@dataclass
class Rules:
    """What the family and unit rules read: the tree, the evidence, the scope, the policy
    context, the spanning families, and the decisions they change."""

    tree: Tree
    ev: Evidence
    scope: PlanScope
    ctx: policy.PolicyContext
    dec: Decisions
    spans: list[Family] = field(default_factory=list)

    def blocking_reason(self, pid: int) -> Optional[str]:
        """Why ending ``pid`` as a side effect (parent shutdown, unit stop) is not allowed."""
        dec, listed = self.dec, self.ev.listed
        if pid in dec.targets:
            return None
        if pid in dec.refused and dec.refused[pid].kind not in SOFT_KINDS:
            return "refused: " + dec.refused[pid].reason
        if pid in listed and not self.scope.covers(listed[pid][0]):
            return f"uses GPU {format_gpu_indices(self.scope.outside(listed[pid][0]))}, " \
                   "outside the scope"
        proc = self.tree.procs.get(pid)
        if proc is not None:
            why = policy.never_signal_reason(proc, self.ctx)
            return None if why is None else "refused: " + why
        return None


# ------------------------------------------------------------------ families as a whole


def find_families(ev: Evidence, tree: Tree, scope: PlanScope) -> list[Family]:
    """Every family of two or more GPU-evidence processes, by root pid."""
    members = ev.family_members
    by_root: dict[int, list[int]] = {}
    for pid in sorted(members):
        root, seen = pid, {pid}
        while True:
            ppid = tree.procs[root].ppid
            if ppid is None or ppid not in members or ppid in seen:
                break
            seen.add(ppid)
            root = ppid
        by_root.setdefault(root, []).append(pid)
    out = []
    for root, pids in sorted(by_root.items()):
        outside: set[int] = set()
        for pid in pids:
            outside |= scope.outside(ev.listed.get(pid, ((), None))[0])
        if len(pids) > 1:
            out.append(Family(root, tuple(pids), tuple(sorted(outside))))
    return out


def plan_whole_families(ev: Evidence, tree: Tree, scope: PlanScope,
                        include_spanning: bool) -> tuple[list[Family], list[str]]:
    """Families this scope cuts (members listed inside and outside it): their in-scope members
    are refused with the family's reason, or, with include_spanning, every member becomes a
    candidate. Returns those families and the notes that say so."""
    spans, notes = [], []
    for fam in find_families(ev, tree, scope):
        if not fam.outside or not _touches_scope(fam, ev, scope):
            continue
        spans.append(fam)
        head = f"its family (root PID {fam.root} {tree.name(fam.root)}) also uses GPU " \
               f"{format_gpu_indices(fam.outside)}"
        if include_spanning:
            _include_family(fam, ev, tree)
            notes.append(f"include_spanning: {head[4:]} outside the scope; the whole family is "
                         f"planned: PIDs {', '.join(map(str, fam.members))}")
            continue
        # short: it is quoted in the plan and on the dirty GPU's line of the verdict
        reason = f"{head}, outside the scope: pass --include-spanning to clean the whole family"
        for pid in fam.members:
            cand, doubt = ev.candidates.get(pid), ev.refusals.get(pid)
            if cand is not None:
                ev.refuse(tree.procs[pid], FAMILY, reason, cand.gpus)
            elif doubt is not None and doubt.kind in _DOUBT_KINDS:
                ev.refuse(tree.procs[pid], FAMILY, reason, doubt.gpus)
    return spans, notes


def _touches_scope(fam: Family, ev: Evidence, scope: PlanScope) -> bool:
    return any(pid in ev.candidates or scope.touches(ev.listed.get(pid, ((), None))[0])
               for pid in fam.members)


def _include_family(fam: Family, ev: Evidence, tree: Tree) -> None:
    """include_spanning: every member of the family is a candidate (policy still decides)."""
    for pid in fam.members:
        if pid in ev.candidates:
            continue
        ev.refusals.pop(pid, None)
        proc = tree.procs[pid]
        if pid in ev.listed:
            ev.candidates[pid] = ev.listed_candidate(proc)
            continue
        below = tree.descendants(pid)
        gpus = tuple(sorted({g for d in below if d in fam.members
                             for g in ev.listed.get(d, ((), None))[0]}))
        ev.candidates[pid] = Candidate(proc, EVIDENCE_FAMILY, gpus, None)


# ------------------------------------------------------------------ policy, then families


def apply_policy(ev: Evidence, tree: Tree, ctx: policy.PolicyContext) -> Decisions:
    """Policy has the last word. Absolute protection, zombies and stuck processes outrank
    evidence reasons."""
    dec = Decisions(refused=dict(ev.unreadable))
    for pid in sorted(set(ev.candidates) | set(ev.refusals)):
        proc = tree.procs[pid]
        cand = ev.candidates.get(pid)
        doubt = ev.refusals.get(pid)
        gpus = cand.gpus if cand is not None else doubt.gpus if doubt is not None else ()
        pol = policy.signal_refusal(proc, ctx)
        if pol is not None and pol[0] in _FINAL_KINDS:
            dec.refused[pid] = Refusal(pid, proc.name, pol[1], pol[0], gpus)
        elif doubt is not None:
            dec.refused[pid] = doubt
        elif pol is not None:
            dec.refused[pid] = Refusal(pid, proc.name, pol[1], pol[0], gpus)
        elif cand is not None:
            dec.targets[pid] = cand
    return dec


def settle_families(rules: Rules, stop_units: bool) -> None:
    """Refuse targets whose ending would end something that must not end, until nothing
    changes: a process below them, a half of their family, a unit's other processes."""
    changed = True
    while changed:
        changed = _refuse_family_breakers(rules)
        changed = _refuse_split_families(rules) or changed
        if stop_units:
            changed = _refuse_blocked_units(rules) or changed


def _refuse_family_breakers(rules: Rules) -> bool:
    """A target whose subtree holds a process that must not end: a root ends its children."""
    changed = False
    for pid in sorted(rules.dec.targets):
        for d in rules.tree.descendants(pid):
            why = rules.blocking_reason(d)
            if why is not None:
                rules.dec.refuse(pid, f"signalling it would also end PID {d} "
                                 f"({rules.tree.name(d)}): {why}", FAMILY)
                changed = True
                break
    return changed


def _refuse_split_families(rules: Rules) -> bool:
    """A family the scope cuts is signalled whole or not at all (include_spanning made every
    member a candidate, but policy may still have refused one)."""
    changed = False
    for fam in rules.spans:
        left = [m for m in fam.members if m not in rules.dec.targets]
        hit = [m for m in fam.members if m in rules.dec.targets]
        if not left or not hit:
            continue
        m = next((x for x in left if x != fam.root), fam.root)  # the cause, not the root
        why = rules.blocking_reason(m) or "not signalled"
        for pid in hit:
            rules.dec.refuse(pid, f"its family (root PID {fam.root} {rules.tree.name(fam.root)}) "
                             f"cannot be cleaned as a whole: PID {m} ({rules.tree.name(m)}) "
                             f"{why}", FAMILY)
        changed = True
    return changed


def _refuse_blocked_units(rules: Rules) -> bool:
    """A service is stopped only when nothing in it is refused."""
    changed = False
    dec, procs = rules.dec, rules.tree.procs
    units = {policy.service_unit(c.proc) for c in dec.targets.values()}
    for unit in sorted(u for u in units if u is not None):
        members = sorted(p.pid for p in procs.values() if p.unit == unit)
        blocker = next(((m, rules.blocking_reason(m)) for m in members
                        if rules.blocking_reason(m) is not None), None)
        if blocker is None:
            continue
        m, why = blocker
        for pid in [p for p, c in dec.targets.items() if c.proc.unit == unit]:
            dec.refuse(pid, f"belongs to {unit}, which also runs PID {m} ({procs[m].name}): "
                       f"{why}; not stopping it", policy.UNIT)
            changed = True
    return changed


def promote_roots(rules: Rules, snapshot: Snapshot) -> None:
    """A device-file holder refused as ambiguous is resolved by its family: when every GPU
    process below it is a target (and nothing below is protected), it is the family's root
    (vLLM's EngineCore above its Workers): signalled first so it can shut its children down.
    nvidia-smi lists no memory of its own, so ending it frees nothing outside the scope."""
    dec, listed = rules.dec, rules.ev.listed
    gpu_evidence = set(listed) | {h.pid for h in snapshot.holders}
    promoted = True
    while promoted and snapshot.nvidia_smi_ok:
        promoted = False
        for pid in sorted(p for p, r in dec.refused.items()
                          if r.kind == AMBIGUOUS and p not in listed):
            proc = rules.tree.procs.get(pid)
            below = rules.tree.descendants(pid)
            if proc is None or not any(d in dec.targets for d in below):
                continue
            if any(d in gpu_evidence and d not in dec.targets for d in below):
                continue
            if any(rules.blocking_reason(d) is not None for d in below):
                continue
            if policy.signal_refusal(proc, rules.ctx) is not None:
                continue
            gpus = tuple(sorted({g for d in below if d in dec.targets
                                 for g in dec.targets[d].gpus}))
            del dec.refused[pid]
            dec.targets[pid] = Candidate(proc, EVIDENCE_FAMILY, gpus, None)
            promoted = True


def add_zombie_children(rules: Rules) -> None:
    """Zombie children of anything in the plan: shown, so nobody hunts them as GPU holders."""
    dec = rules.dec
    in_plan = set(dec.targets) | set(dec.refused)
    for proc in sorted(rules.tree.procs.values(), key=lambda p: p.pid):
        if policy.is_zombie(proc) and proc.ppid in in_plan and proc.pid not in in_plan:
            dec.refused[proc.pid] = Refusal(proc.pid, proc.name,
                                            policy.zombie_reason(proc, rules.ctx), policy.ZOMBIE)


# ------------------------------------------------------------------ waves and units


def assemble_targets(dec: Decisions, tree: Tree) -> tuple[Target, ...]:
    """Waves: the topmost target of each parent/child chain goes first (wave 0)."""
    out = []
    for pid, cand in dec.targets.items():
        root, seen = pid, {pid}
        while True:
            ppid = tree.procs[root].ppid
            if ppid is None or ppid not in dec.targets or ppid in seen:
                break
            seen.add(ppid)
            root = ppid
        proc = cand.proc
        out.append(Target(
            pid=pid, starttime=proc.starttime, name=proc.name, cmdline=proc.cmdline,
            gpus=cand.gpus, evidence=cand.evidence, wave=0 if root == pid else 1,
            family_root=root, used_mib=cand.used_mib, user=proc.user, unit=proc.unit,
            evidence_reason=cand.evidence_reason,
        ))
    return tuple(sorted(out, key=lambda t: (t.wave, t.pid)))


def unit_stops(targets: tuple[Target, ...], tree: Tree, stop_units: bool,
               disable_units: bool) -> tuple[UnitStop, ...]:
    """The services to stop (stop_units): those that own a target."""
    if not stop_units:
        return ()
    by_unit: dict[str, list[int]] = {}
    for t in targets:
        unit = policy.service_unit(tree.procs[t.pid])
        if unit is not None:
            by_unit.setdefault(unit, []).append(t.pid)
    return tuple(UnitStop(u, disable_units, tuple(sorted(p))) for u, p in sorted(by_unit.items()))
