"""The clean plan: which processes to signal on one host, in which order, and why not the rest.

Pure: a Snapshot + a scope + options in, a frozen Plan out. Targets come from GPU evidence only
(nvidia-smi's compute-apps listing, else open /dev/nvidiaN files), never from a process name;
gpufleet.core.policy has the last word on every one of them. The steps, in order (one module
each):

1. evidence (plan/evidence.py). Listed by nvidia-smi: a candidate when ALL the GPUs it is
   listed on are in scope; a process that also uses a GPU outside the scope is refused ("spans
   GPUs 3,4") unless include_spanning. Holding /dev/nvidiaN without being listed (other PID
   namespace, WSL2, hidden PIDs): a candidate in a full scope, or when every GPU it holds is
   in scope and nvidia-smi lists nobody else on them; otherwise ambiguous, because a CUDA
   process opens EVERY /dev/nvidiaN of the machine (measured, recorded/h200-two-gpus.log).
   Holding only nvidiactl/nvidia-uvm (or /dev/dxg): a candidate in a full scope only. GPU
   clients (gpufleet.core.policy.holder_role: no evidence of memory) are never candidates:
   listed in ``Plan.clients`` and in one note. A listed process that holds nothing of the GPU
   it is listed on (gpufleet.core.policy.listing_check: no /dev/nvidiaN of that GPU open, or
   maps without /dev/nvidia-uvm) is no evidence: its rows are set aside first (their memory
   counts as unexplained), its PID refused (``untrusted-row``) and never a target; a listing
   that cannot be checked is evidence as before, marked "nvidia-smi (unverified)".
2. whole families (plan/families.py). A family is a chain of GPU-evidence processes up to its
   root (vLLM's EngineCore above its Workers) and the root's GPU-evidence descendants. When
   the scope cuts a family (nvidia-smi lists members inside and outside it), its in-scope
   members are refused with the family's reason; with include_spanning the whole family is
   planned (and a note says so). Never a half-family by surprise.
3. policy (gpufleet.core.policy.signal_refusal) refuses the never-signal list, zombies (they
   hold no GPU memory, measured; a zombie *leader* whose threads still run holds theirs and
   is a target), processes whose every thread left is stuck in D state (no signal ends
   them), other users' processes without root, containers, and
   systemd services unless stop_units.
4. families and services: a target whose process subtree holds a process that must not be
   signalled is refused too, because a family root shuts its children down; a service is
   stopped only when nothing in it is refused. A device-file holder refused as ambiguous whose
   GPU descendants are all targets is promoted to their family root. The topmost target of
   each parent/child chain is its family root, signalled in wave 0; the rest follows in wave 1.
5. notes (plan/notes.py); processes nvidia-smi lists but this PID namespace cannot see are
   reported as ``invisible``.
6. owners (plan/owners.py): each target's owner (whatever may start it again: a unit, a
   container, a pod, a Slurm job, a supervisor or shell loop above it), those the operator
   names with --owner planned first, and the settle window the clean then watches for a
   retake.

The agent's request is built from the plan by ``to_request`` (plan/request.py).
"""
from __future__ import annotations

from typing import Iterable, Optional

from gpufleet.core import mps, policy
from gpufleet.core.gpus import format_gpu_indices
from gpufleet.core.ledger import driver_allowance_mib
from gpufleet.core.model import Snapshot
from gpufleet.core.plan.evidence import gather_evidence, resolve_scope
from gpufleet.core.plan.families import (
    Rules,
    Tree,
    add_zombie_children,
    apply_policy,
    assemble_targets,
    plan_whole_families,
    promote_roots,
    settle_families,
    unit_stops,
)
from gpufleet.core.plan.notes import NoteInputs, plan_notes, unreadable_fds_note
from gpufleet.core.plan.owners import owner_notes, plan_owners, watch_fields
from gpufleet.core.plan.request import RELEASE_WAIT_S, release_floors, to_request
from gpufleet.core.plan.types import (
    AMBIGUOUS,
    EVIDENCE_DEVICE,
    EVIDENCE_FAMILY,
    EVIDENCE_SMI,
    EVIDENCE_SMI_UNVERIFIED,
    FAMILY,
    INVISIBLE_REASON,
    NO_EVIDENCE,
    SPANNING,
    UNREADABLE,
    UNTRUSTED_ROW,
    Client,
    Invisible,
    Plan,
    Refusal,
    Target,
    UnitStop,
)
from gpufleet.errors import UsageError

__all__ = [
    "AMBIGUOUS", "EVIDENCE_DEVICE", "EVIDENCE_FAMILY", "EVIDENCE_SMI", "EVIDENCE_SMI_UNVERIFIED",
    "FAMILY", "INVISIBLE_REASON", "NO_EVIDENCE", "RELEASE_WAIT_S", "SPANNING", "UNREADABLE",
    "UNTRUSTED_ROW", "Client", "Invisible", "Plan", "Refusal", "Target", "UnitStop",
    "format_gpu_indices", "make_plan", "release_floors", "to_request", "unreadable_fds_note",
]


def make_plan(
    snapshot: Snapshot,
    scope: Optional[tuple[int, ...]] = None,
    *,
    protect: Iterable[str] = (),
    host_protect: Iterable[str] = (),
    protect_label: str = "--protect",
    include_spanning: bool = False,
    stop_units: bool = False,
    disable_units: bool = False,
    unattributed_mib: int = 0,
    tolerance_mib: int = policy.DEFAULT_TOLERANCE_MIB,
    is_sudo: bool = False,
    host: Optional[str] = None,
    job_uid: Optional[int] = None,
    owners: Iterable[str] = (),
    settle_s: Optional[float] = None,
) -> Plan:
    """Decide what a clean of ``scope`` (None = every GPU) on this host would signal: the
    steps of the module docstring, in order. ``protect``: this run's patterns (named
    ``protect_label`` in the plan's notes), ``host_protect``: the inventory's for this host;
    both protect alike. ``job_uid`` (a Slurm epilog): only that user's processes may be
    signalled (policy.job_owner_reason)."""
    host = host or snapshot.facts.hostname or "?"
    untrusted = policy.refused_listings(snapshot)
    dropped = tuple(a for a in snapshot.compute_apps if a.pid in untrusted)
    snapshot = policy.without_refused_listings(snapshot)
    if unattributed_mib < 0 or tolerance_mib < 0:
        raise UsageError(f"{host}: unattributed_mib and tolerance_mib must be >= 0")
    plan_scope = resolve_scope(snapshot, scope, host)
    sources = tuple(("inventory protect", p) for p in host_protect) + tuple(
        (protect_label, p) for p in protect)
    ctx = policy.PolicyContext.from_snapshot(
        snapshot, protect=tuple(dict.fromkeys(p for _, p in sources)), stop_units=stop_units,
        is_sudo=is_sudo, job_uid=job_uid)
    threshold = unattributed_mib + tolerance_mib
    tree = Tree.of(snapshot.processes)

    ev = gather_evidence(snapshot, plan_scope, threshold, ctx, include_spanning)
    spans, family_notes = plan_whole_families(ev, tree, plan_scope, include_spanning)
    rules = Rules(tree, ev, plan_scope, ctx, apply_policy(ev, tree, ctx), spans)
    settle_families(rules, stop_units)
    promote_roots(rules, snapshot)
    add_zombie_children(rules)
    refuse_untrusted(rules, untrusted)
    targets, owner_units = plan_owners(snapshot, assemble_targets(rules.dec, tree), owners,
                                       ctx, rules.dec.refused)
    stuck = tuple(r for r in rules.dec.refused.values() if r.kind == policy.STUCK)
    notes = plan_notes(NoteInputs(snapshot, plan_scope, threshold, ev, targets,
                                  tuple(family_notes), dropped, host, sources, stuck)
                       ) + tuple(owner_notes(targets))
    return Plan(
        host=host, scope=plan_scope.indices, full_scope=plan_scope.full, targets=targets,
        refused=tuple(sorted(rules.dec.refused.values(), key=lambda r: r.pid)),
        units_to_stop=unit_stops(targets, tree, stop_units, disable_units) + owner_units,
        invisible=ev.invisible, threshold_mib=after_thresholds(snapshot, plan_scope.indices, threshold, targets),
        notes=notes, clients=tuple(sorted(ev.clients.values(), key=lambda c: c.pid)),
        **watch_fields(snapshot, plan_scope.indices, targets, settle_s, stop_units),
    )


def refuse_untrusted(rules: Rules, untrusted: dict[int, policy.ListingCheck]) -> None:
    """A listed process that holds nothing of its GPUs (policy.listing_check) is refused with
    the reason, whatever else the plan decided: its row is no evidence, never a target."""
    for pid, check in untrusted.items():
        rules.dec.targets.pop(pid, None)
        if rules.scope.full or rules.scope.touches(check.gpus):
            rules.dec.refused[pid] = Refusal(pid, rules.tree.name(pid), check.reason,
                                             UNTRUSTED_ROW, check.gpus)


def after_thresholds(snapshot: Snapshot, scope: tuple[int, ...], threshold: int,
                     targets: tuple[Target, ...]) -> dict[int, int]:
    """What may stay on each GPU after the clean: the threshold, the driver's own share for
    the listed processes the plan does not signal (ledger.driver_allowance_mib), and the
    memory of CUDA MPS servers, expected while MPS runs (core/mps.py)."""
    signalled = {t.pid for t in targets}
    servers = mps.expected_server_mib(snapshot)
    return {i: threshold + servers.get(i, 0)
            + driver_allowance_mib(len({a.pid for a in snapshot.apps_on(i)} - signalled))
            for i in scope}
