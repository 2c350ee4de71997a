"""Step 1 of the plan: GPU evidence -> candidates, or refusals about the evidence itself (pure).

Evidence is nvidia-smi's compute-apps listing, else open /dev/nvidiaN files; never a name.
A listed process is judged by gpufleet.core.policy.listing_check (does it hold the GPU it is
listed on?); a holder nvidia-smi does not list by gpufleet.core.policy.holder_role first: GPU
clients (monitors, exporters, nvidia-smi runs) are set aside, never candidates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gpufleet.core import mps, policy
from gpufleet.core.gpus import format_gpu_indices
from gpufleet.core.model import Holder, ProcessInfo, Snapshot
from gpufleet.core.plan.types import (
    AMBIGUOUS,
    EVIDENCE_DEVICE,
    EVIDENCE_MPS,
    EVIDENCE_SMI,
    EVIDENCE_SMI_UNVERIFIED,
    NO_EVIDENCE,
    SPANNING,
    UNREADABLE,
    Candidate,
    Client,
    Invisible,
    PlanScope,
    Refusal,
)
from gpufleet.errors import UsageError

# pid -> (GPU indices nvidia-smi lists it on, total MiB or None when not available)
Listed = dict[int, tuple[tuple[int, ...], Optional[int]]]


@dataclass
class Evidence:
    """What the GPU evidence says, per pid: a candidate, or a refusal about the evidence;
    plus the GPU clients, the holders whose details are unreadable, and invisible rows."""

    listed: Listed
    checks: dict[int, policy.ListingCheck] = field(default_factory=dict)
    candidates: dict[int, Candidate] = field(default_factory=dict)
    refusals: dict[int, Refusal] = field(default_factory=dict)
    clients: dict[int, Client] = field(default_factory=dict)
    unreadable: dict[int, Refusal] = field(default_factory=dict)
    invisible: tuple[Invisible, ...] = ()
    # visible processes with GPU evidence that are not GPU clients: who can be in a family
    family_members: frozenset[int] = frozenset()
    include_spanning: bool = False

    def refuse(self, proc: ProcessInfo, kind: str, reason: str, gpus: tuple[int, ...]) -> None:
        self.candidates.pop(proc.pid, None)
        self.refusals[proc.pid] = Refusal(proc.pid, proc.name, reason, kind, gpus)

    def listed_candidate(self, proc: ProcessInfo) -> Candidate:
        """A listed process as a candidate: nvidia-smi evidence, verified or not
        (policy.listing_check; refused listings never get here)."""
        gpus, used = self.listed[proc.pid]
        check = self.checks.get(proc.pid)
        if check is None:
            return Candidate(proc, EVIDENCE_SMI, gpus, used)
        evidence = EVIDENCE_SMI if check.trust == policy.LISTING_VERIFIED else \
            EVIDENCE_SMI_UNVERIFIED
        return Candidate(proc, evidence, gpus, used, check.evidence_reason)


def resolve_scope(snapshot: Snapshot, scope: Optional[tuple[int, ...]], host: str) -> PlanScope:
    """The scope as sorted indices the host has; bad input is a one-line UsageError."""
    all_idx = tuple(g.index for g in snapshot.gpus)
    if scope is None:
        return PlanScope(all_idx, True)
    try:
        wanted = tuple(sorted({int(i) for i in scope}))
    except (TypeError, ValueError):
        raise UsageError(f"{host}: GPU scope must be indices, got {scope!r}") from None
    if not wanted:
        raise UsageError(f"{host}: empty GPU scope")
    if any(i < 0 for i in wanted):
        raise UsageError(f"{host}: negative GPU index in scope {format_gpu_indices(wanted)}")
    if all_idx:
        missing = [i for i in wanted if i not in all_idx]
        if missing:
            raise UsageError(f"{host}: no GPU {format_gpu_indices(missing)} "
                             f"(GPUs {format_gpu_indices(all_idx)})")
    return PlanScope(wanted, bool(all_idx) and set(wanted) >= set(all_idx))


def listed_usage(snapshot: Snapshot) -> Listed:
    """pid -> (GPU indices nvidia-smi lists it on, total MiB or None when not available)."""
    gpus: dict[int, set[int]] = {}
    used: dict[int, Optional[int]] = {}
    for app in snapshot.compute_apps:
        gpu = snapshot.gpu_by_uuid(app.gpu_uuid)
        if gpu is None:
            continue
        gpus.setdefault(app.pid, set()).add(gpu.index)
        if app.used_mib is None or used.get(app.pid, 0) is None:
            used[app.pid] = None
        else:
            used[app.pid] = (used.get(app.pid) or 0) + app.used_mib
    return {pid: (tuple(sorted(g)), used.get(pid)) for pid, g in gpus.items()}


def invisible_rows(snapshot: Snapshot, scope: PlanScope) -> tuple[Invisible, ...]:
    """Compute-app rows on scope GPUs whose PID this PID namespace does not have."""
    rows = (
        Invisible(app.pid, gpu.index, app.process_name, app.used_mib)
        for app in snapshot.compute_apps
        for gpu in [snapshot.gpu_by_uuid(app.gpu_uuid)]
        if gpu is not None and gpu.index in scope.indices and app.pid not in snapshot.processes
    )
    return tuple(sorted(rows, key=lambda r: (r.gpu, r.pid)))


def gather_evidence(snapshot: Snapshot, scope: PlanScope, threshold_mib: int,
                    ctx: policy.PolicyContext, include_spanning: bool) -> Evidence:
    """Rules 1-2 of the module docstring of gpufleet.core.plan, and the GPU clients."""
    ev = Evidence(listed=listed_usage(snapshot), checks=policy.listing_checks(snapshot),
                  invisible=invisible_rows(snapshot, scope), include_spanning=include_spanning)
    _judge_listed(snapshot, scope, include_spanning, ev)
    roles = policy.holder_roles(snapshot, threshold_mib)
    for holder in sorted(snapshot.holders, key=lambda h: h.pid):
        if holder.pid not in ev.listed:  # nvidia-smi's listing is the better evidence
            _judge_holder(snapshot, scope, holder, roles.get(holder.pid), ctx, ev)
    ev.family_members = frozenset(
        {p for p in ev.listed if p in snapshot.processes}
        | {p for p, r in roles.items() if r.role == policy.ROLE_HOLDER and p in snapshot.processes})
    return ev


def _judge_listed(snapshot: Snapshot, scope: PlanScope, include_spanning: bool,
                  ev: Evidence) -> None:
    """Rule 1: listed on scope GPUs only -> candidate; also elsewhere -> spanning."""
    for pid, (gpus, _used) in sorted(ev.listed.items()):
        proc = snapshot.processes.get(pid)
        if proc is None or not scope.touches(gpus):
            continue
        if scope.covers(gpus) or include_spanning:
            ev.candidates[pid] = ev.listed_candidate(proc)
            continue
        outside = format_gpu_indices(scope.outside(gpus))
        ev.refuse(proc, SPANNING, f"spans GPUs {format_gpu_indices(gpus)} (GPU {outside} outside "
                  "the scope; pass --include-spanning)", gpus)


def _judge_holder(snapshot: Snapshot, scope: PlanScope, holder: Holder,
                  role: Optional[policy.HolderRole], ctx: policy.PolicyContext,
                  ev: Evidence) -> None:
    """Rule 2 for one device-file holder nvidia-smi does not list (GPU clients aside)."""
    held = snapshot.holder_gpu_indices(holder)
    if not scope.full and held and not scope.touches(held):
        return  # only other GPUs' device files: nothing to do with this scope
    proc = snapshot.processes.get(holder.pid)
    if proc is None:
        if scope.full or held:
            ev.unreadable[holder.pid] = Refusal(
                holder.pid, "?", "holds NVIDIA device files but its process details could not "
                "be read", UNREADABLE, held)
        return
    if role is not None and role.role == policy.ROLE_CLIENT and \
            policy.never_signal_reason(proc, ctx) is None:
        ev.clients[holder.pid] = Client(holder.pid, proc.name, held, role.reason)
        return
    server = mps.unlisted_clients(snapshot).get(holder.pid) if snapshot.mps else None
    if server is not None:
        _judge_mps_client(snapshot, scope, holder, proc, server, ev)
        return
    why = None if scope.full else _partial_scope_doubt(snapshot, scope, holder, held)
    if why is None:
        ev.candidates[holder.pid] = Candidate(proc, EVIDENCE_DEVICE, held, None)
    else:
        ev.refuse(proc, why[0], why[1], held)


def _judge_mps_client(snapshot: Snapshot, scope: PlanScope, holder: Holder, proc: ProcessInfo,
                      server: int, ev: Evidence) -> None:
    """An MPS client NVML does not list (its memory is in its server's row): placed on the
    server's GPUs it maps, judged like a listed process (rule 1)."""
    gpus = mps.client_gpus(snapshot, holder, server)
    if not scope.touches(gpus):
        return
    if scope.covers(gpus) or ev.include_spanning:
        ev.candidates[holder.pid] = Candidate(proc, EVIDENCE_MPS, gpus, None)
        return
    ev.refuse(proc, SPANNING, f"an MPS client of server PID {server} on GPUs "
              f"{format_gpu_indices(gpus)} (GPU {format_gpu_indices(scope.outside(gpus))} "
              "outside the scope; pass --include-spanning)", gpus)


def _partial_scope_doubt(snapshot: Snapshot, scope: PlanScope, holder: Holder,
                         held: tuple[int, ...]) -> Optional[tuple[str, str]]:
    """(kind, reason) why device files alone do not place this holder inside a partial
    scope, or None when they do: a CUDA process opens EVERY /dev/nvidiaN of the machine."""
    if not snapshot.gpus:
        return AMBIGUOUS, ("ambiguous: nvidia-smi reported no GPUs, so device files cannot be "
                           "mapped to GPU indices")
    if not held:
        devs = ", ".join(holder.devices) or "no device"
        return NO_EVIDENCE, (f"holds only {devs} (no /dev/nvidiaN) and nvidia-smi does not list "
                             "it: no GPU evidence; only a clean of every GPU takes it")
    gpus = format_gpu_indices(held)
    if not scope.covers(held):
        return AMBIGUOUS, (f"ambiguous: holds /dev/nvidiaN of GPUs {gpus} and nvidia-smi does "
                           "not list it; a CUDA process opens every GPU's device file, so it "
                           "may use GPUs outside the scope")
    if not snapshot.nvidia_smi_ok:
        return AMBIGUOUS, (f"ambiguous: nvidia-smi failed, so who else uses GPUs {gpus} is "
                           "unknown")
    others = sorted({a.pid for i in held for a in snapshot.apps_on(i)} - {holder.pid})
    if others:
        return AMBIGUOUS, (f"ambiguous: not listed by nvidia-smi, which lists other processes "
                           f"on GPUs {gpus} (PIDs {', '.join(map(str, others))})")
    return None
