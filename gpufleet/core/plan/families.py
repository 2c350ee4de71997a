"""The clean plan: which processes to signal on one host, in which order, and why not the rest.

Pure: a Snapshot + a scope + options in, a frozen Plan out. Targets come from GPU evidence only
(nvidia-smi's compute-apps listing, else open /dev/nvidiaN files), never from a process name;
gpufleet.policy has the last word on every one of them. Rules, in order:

1. Listed by nvidia-smi: a candidate when ALL the GPUs it is listed on are in scope; a process
   that also uses a GPU outside the scope is refused ("spans GPUs 3,4") unless include_spanning.
2. Holding /dev/nvidiaN without being listed (other PID namespace, WSL2, hidden PIDs): a
   candidate in a full scope, or when every GPU it holds is in scope and nvidia-smi lists nobody
   else on them; otherwise ambiguous, because a CUDA process opens EVERY /dev/nvidiaN of the
   machine (measured, shared/recorded/h200-two-gpus.log). Holding only nvidiactl/nvidia-uvm
   (or /dev/dxg): a candidate in a full scope only (it holds the driver).
3. Zombies hold no GPU memory (measured) and are never targets.
4. Policy (gpufleet.policy.refusal) refuses the never-signal list, other users' processes
   without root, containers, and systemd services unless stop_units.
5. Families: a target whose process subtree holds a process that must not be signalled is
   refused too, because a family root shuts its children down; a service is stopped only when
   nothing in it is refused. The topmost target of each parent/child chain is its family root,
   signalled in wave 0; the rest of the family follows in wave 1. With include_parents, a
   non-listed parent in the same session (not a session leader) whose GPU descendants are all
   targets joins the family as its new root.
6. Processes nvidia-smi lists but this PID namespace cannot see are reported as ``invisible``.
7. GPU clients: a device-file holder nvidia-smi does not list is a target only on evidence that
   it holds memory (gpufleet.policy.holder_role: family root, CUDA maps, or a host that cannot
   list every holder, each with unexplained memory on its GPUs). Otherwise it is a GPU client
   (nvtop, nvitop, gpustat, dcgm-exporter, a running nvidia-smi): never a target, listed in
   ``Plan.clients`` and in one note. Rule 2 applies only to holders that are not clients.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Optional

from gpufleet.core import policy
from gpufleet.errors import UsageError
from gpufleet.core.model import ProcessInfo, Snapshot, ledger

EVIDENCE_SMI = "nvidia-smi"
EVIDENCE_DEVICE = "device-file"
EVIDENCE_FAMILY = "family"  # device-file holder whose GPU processes below are all targets
EVIDENCE_PARENT = "parent"  # added by include_parents: no GPU evidence of its own

# Refusal kinds decided here (policy's kinds are in gpufleet.policy).
SPANNING = "spanning"
AMBIGUOUS = "ambiguous"
NO_EVIDENCE = "no-evidence"
FAMILY = "family"
UNREADABLE = "unreadable"

# Refusals that do NOT stop a relative from being signalled: these processes hold no memory we
# can attribute outside the scope, and would have been targets in a full scope.
_SOFT_KINDS = frozenset({AMBIGUOUS, NO_EVIDENCE, policy.ZOMBIE})

INVISIBLE_REASON = "not visible from this PID namespace (container?)"


@dataclass(frozen=True)
class Target:
    """A process the agent will signal, identified by (pid, starttime) against PID reuse."""

    pid: int
    starttime: Optional[int]
    name: str
    cmdline: str
    gpus: tuple[int, ...]
    evidence: str
    wave: int
    family_root: int
    used_mib: Optional[int]
    user: Optional[str] = None
    unit: Optional[str] = None


@dataclass(frozen=True)
class Refusal:
    """A process with GPU evidence (or a family tie) that will NOT be signalled, and why."""

    pid: int
    name: str
    reason: str
    kind: str = ""
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class UnitStop:
    unit: str
    disable: bool
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Invisible:
    """A compute-app row whose PID does not exist in the agent's PID namespace."""

    pid: int
    gpu: int
    process_name: str
    used_mib: Optional[int]
    reason: str = INVISIBLE_REASON


@dataclass(frozen=True)
class Client:
    """A device-file holder with no evidence of GPU memory (a monitor, an exporter): shown,
    never signalled."""

    pid: int
    name: str
    gpus: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class Plan:
    host: str
    scope: tuple[int, ...]
    full_scope: bool
    targets: tuple[Target, ...]
    refused: tuple[Refusal, ...]
    units_to_stop: tuple[UnitStop, ...]
    invisible: tuple[Invisible, ...]
    threshold_mib: Mapping[int, int]
    notes: tuple[str, ...] = ()
    clients: tuple[Client, ...] = ()

    def target(self, pid: int) -> Optional[Target]:
        return next((t for t in self.targets if t.pid == pid), None)

    def refusal(self, pid: int) -> Optional[Refusal]:
        return next((r for r in self.refused if r.pid == pid), None)

    @property
    def target_pids(self) -> frozenset[int]:
        return frozenset(t.pid for t in self.targets)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (threshold keys as strings, like the agent request)."""
        out = asdict(self)
        out["threshold_mib"] = {str(k): v for k, v in sorted(self.threshold_mib.items())}
        return out


def fmt_gpus(indices: Iterable[int]) -> str:
    return ",".join(str(i) for i in sorted(set(indices)))


@dataclass
class _Candidate:
    proc: ProcessInfo
    evidence: str
    gpus: tuple[int, ...]
    used_mib: Optional[int]


def _resolve_scope(snapshot: Snapshot, scope: Optional[tuple[int, ...]], host: str):
    all_idx = tuple(g.index for g in snapshot.gpus)
    if scope is None:
        return all_idx, True
    try:
        wanted = tuple(sorted({int(i) for i in scope}))
    except (TypeError, ValueError):
        raise UsageError(f"{host}: GPU scope must be indices, got {scope!r}") from None
    if not wanted:
        raise UsageError(f"{host}: empty GPU scope")
    if any(i < 0 for i in wanted):
        raise UsageError(f"{host}: negative GPU index in scope {fmt_gpus(wanted)}")
    if all_idx:
        missing = [i for i in wanted if i not in all_idx]
        if missing:
            raise UsageError(f"{host}: no GPU {fmt_gpus(missing)} (GPUs {fmt_gpus(all_idx)})")
    full = bool(all_idx) and set(wanted) >= set(all_idx)
    return wanted, full


def _listed_usage(snapshot: Snapshot) -> dict[int, tuple[tuple[int, ...], Optional[int]]]:
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


def _children(processes: Mapping[int, ProcessInfo]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for proc in processes.values():
        if proc.ppid is not None and proc.ppid != proc.pid:
            out.setdefault(proc.ppid, []).append(proc.pid)
    return out


def _descendants(pid: int, children: Mapping[int, list[int]]) -> list[int]:
    out, stack, seen = [], list(children.get(pid, ())), {pid}
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        out.append(cur)
        stack.extend(children.get(cur, ()))
    return sorted(out)



UNTRUSTED_ROW = "untrusted-row"


def untrusted_rows(snapshot: Snapshot) -> dict[int, str]:
    """Compute-app rows not to act on: a process nvidia-smi lists with GPU memory that holds
    no NVIDIA device file, although its file descriptors were readable. CUDA opens them all
    (recorded); nvidia-smi prints process names verbatim, so a process titled
    "x, 100, GPU-...\\nPID, name" forges a row for any PID -- e.g. a root daemon that never
    touched a GPU -- and a stale row can name a PID since reused. Such a row is evidence of
    nothing, and its PID is refused."""
    facts = snapshot.facts
    holding = {h.pid for h in snapshot.holders}
    out: dict[int, str] = {}
    for app in snapshot.compute_apps:
        proc = snapshot.processes.get(app.pid)
        if proc is None or app.pid in holding or (proc.state or "")[:1] in ("Z", "X"):
            continue
        readable = (facts.is_root or facts.can_read_all_fds
                    or (facts.uid is not None and proc.uid == facts.uid))
        if readable:
            out[app.pid] = ("listed by nvidia-smi but holds no NVIDIA device file "
                            "(a forged or stale nvidia-smi row?)")
    return out


def make_plan(
    snapshot: Snapshot,
    scope: Optional[tuple[int, ...]] = None,
    *,
    protect: Iterable[str] = (),
    include_spanning: bool = False,
    include_parents: bool = False,
    stop_units: bool = False,
    disable_units: bool = False,
    unattributed_mib: int = 0,
    tolerance_mib: int = 64,
    is_sudo: bool = False,
    host: Optional[str] = None,
) -> Plan:
    """Decide what a clean of ``scope`` (None = every GPU) on this host would signal.

    nvidia-smi rows that are evidence of nothing (``untrusted_rows``) are set aside first and
    their PIDs refused; the rules in the module docstring decide the rest.
    """
    host = host or snapshot.facts.hostname or "?"
    untrusted = untrusted_rows(snapshot)
    listed_as = {pid: snapshot.gpu_indices_of_app(pid) for pid in untrusted}
    if untrusted:
        snapshot = replace(snapshot, compute_apps=tuple(
            a for a in snapshot.compute_apps if a.pid not in untrusted))
    if unattributed_mib < 0 or tolerance_mib < 0:
        raise UsageError(f"{host}: unattributed_mib and tolerance_mib must be >= 0")
    scope_t, full = _resolve_scope(snapshot, scope, host)
    in_scope = set(scope_t)
    procs = snapshot.processes
    ctx = policy.PolicyContext.from_snapshot(
        snapshot, protect=tuple(protect), stop_units=stop_units, is_sudo=is_sudo
    )
    listed = _listed_usage(snapshot)
    notes: list[str] = []

    invisible = tuple(
        sorted(
            (
                Invisible(app.pid, gpu.index, app.process_name, app.used_mib)
                for app in snapshot.compute_apps
                for gpu in [snapshot.gpu_by_uuid(app.gpu_uuid)]
                if gpu is not None and gpu.index in in_scope and app.pid not in procs
            ),
            key=lambda r: (r.gpu, r.pid),
        )
    )

    # 1-2: GPU evidence -> candidates, or refusals about the evidence itself.
    candidates: dict[int, _Candidate] = {}
    evidence_refusal: dict[int, tuple[str, str, tuple[int, ...]]] = {}
    for pid, (gpus, used) in sorted(listed.items()):
        proc = procs.get(pid)
        if proc is None or not in_scope & set(gpus):
            continue
        if not set(gpus) <= in_scope and not include_spanning:
            outside = fmt_gpus(set(gpus) - in_scope)
            evidence_refusal[pid] = (
                SPANNING,
                f"spans GPUs {fmt_gpus(gpus)} (GPU {outside} outside the scope; "
                "pass --include-spanning)",
                gpus,
            )
        else:
            candidates[pid] = _Candidate(proc, EVIDENCE_SMI, gpus, used)

    threshold = unattributed_mib + tolerance_mib
    roles = policy.holder_roles(snapshot, threshold)
    clients: dict[int, Client] = {}
    unreadable: list[Refusal] = []
    for holder in sorted(snapshot.holders, key=lambda h: h.pid):
        if holder.pid in listed:
            continue  # nvidia-smi's listing is the better evidence; judged above
        held = snapshot.holder_gpu_indices(holder)
        if not full and held and not in_scope & set(held):
            continue  # only other GPUs' device files: nothing to do with this scope
        proc = procs.get(holder.pid)
        if proc is None:
            if full or held:
                unreadable.append(
                    Refusal(holder.pid, "?", "holds NVIDIA device files but its process "
                            "details could not be read", UNREADABLE, held)
                )
            continue
        role = roles.get(holder.pid)
        if role is not None and role.role == policy.ROLE_CLIENT and \
                policy.never_signal_reason(proc, ctx) is None:
            clients[holder.pid] = Client(holder.pid, proc.name, held, role.reason)
            continue
        if full:
            candidates[holder.pid] = _Candidate(proc, EVIDENCE_DEVICE, held, None)
            continue
        if not snapshot.gpus:
            evidence_refusal[holder.pid] = (
                AMBIGUOUS,
                "ambiguous: nvidia-smi reported no GPUs, so device files cannot be mapped to "
                "GPU indices",
                held,
            )
            continue
        if not held:
            devs = ", ".join(holder.devices) or "no device"
            evidence_refusal[holder.pid] = (
                NO_EVIDENCE,
                f"holds only {devs} (no /dev/nvidiaN) and nvidia-smi does not list it: "
                "no GPU evidence; only a clean of every GPU takes it",
                held,
            )
            continue
        if not set(held) <= in_scope:
            evidence_refusal[holder.pid] = (
                AMBIGUOUS,
                f"ambiguous: holds /dev/nvidiaN of GPUs {fmt_gpus(held)} and nvidia-smi does "
                "not list it; a CUDA process opens every GPU's device file, so it may use "
                "GPUs outside the scope",
                held,
            )
            continue
        if not snapshot.nvidia_smi_ok:
            evidence_refusal[holder.pid] = (
                AMBIGUOUS,
                f"ambiguous: nvidia-smi failed, so who else uses GPUs {fmt_gpus(held)} is "
                "unknown",
                held,
            )
            continue
        others = sorted({a.pid for i in held for a in snapshot.apps_on(i)} - {holder.pid})
        if others:
            evidence_refusal[holder.pid] = (
                AMBIGUOUS,
                f"ambiguous: not listed by nvidia-smi, which lists other processes on GPUs "
                f"{fmt_gpus(held)} (PIDs {', '.join(map(str, others))})",
                held,
            )
            continue
        candidates[holder.pid] = _Candidate(proc, EVIDENCE_DEVICE, held, None)

    # 3-4: policy has the last word. Absolute protection and zombies outrank evidence reasons.
    refused: dict[int, Refusal] = {r.pid: r for r in unreadable}
    targets: dict[int, _Candidate] = {}
    for pid in sorted(set(candidates) | set(evidence_refusal)):
        proc = procs[pid]
        cand = candidates.get(pid)
        gpus = cand.gpus if cand is not None else evidence_refusal[pid][2]
        pol = policy.refusal(proc, ctx)
        if pol is not None and pol[0] in (policy.PROTECTED, policy.ZOMBIE):
            refused[pid] = Refusal(pid, proc.name, pol[1], pol[0], gpus)
        elif pid in evidence_refusal:
            kind, reason, _ = evidence_refusal[pid]
            refused[pid] = Refusal(pid, proc.name, reason, kind, gpus)
        elif pol is not None:
            refused[pid] = Refusal(pid, proc.name, pol[1], pol[0], gpus)
        else:
            targets[pid] = cand  # type: ignore[assignment]

    # 5: families and services, until nothing changes.
    children = _children(procs)

    def blocking_reason(pid: int) -> Optional[str]:
        """Why ending ``pid`` as a side effect (parent shutdown, unit stop) is not allowed."""
        if pid in targets:
            return None
        if pid in refused and refused[pid].kind not in _SOFT_KINDS:
            return "refused: " + refused[pid].reason
        if pid in listed and not set(listed[pid][0]) <= in_scope:
            return f"uses GPU {fmt_gpus(set(listed[pid][0]) - in_scope)}, outside the scope"
        proc = procs.get(pid)
        if proc is not None:
            why = policy.never_signal_reason(proc, ctx)
            return None if why is None else "refused: " + why
        return None

    changed = True
    while changed:
        changed = False
        for pid in sorted(targets):
            for d in _descendants(pid, children):
                why = blocking_reason(d)
                if why is not None:
                    proc = targets.pop(pid).proc
                    dname = procs[d].name if d in procs else "?"
                    refused[pid] = Refusal(
                        pid, proc.name,
                        f"signalling it would also end PID {d} ({dname}): {why}",
                        FAMILY, candidates[pid].gpus,
                    )
                    changed = True
                    break
        if not stop_units:
            continue
        for unit in sorted({policy.service_unit(c.proc) for c in targets.values()} - {None}):
            members = sorted(p.pid for p in procs.values() if p.unit == unit)
            blocker = next(
                ((m, blocking_reason(m)) for m in members if blocking_reason(m) is not None), None
            )
            if blocker is None:
                continue
            m, why = blocker
            for pid in [p for p, c in targets.items() if c.proc.unit == unit]:
                proc = targets.pop(pid).proc
                refused[pid] = Refusal(
                    pid, proc.name,
                    f"belongs to {unit}, which also runs PID {m} ({procs[m].name}): {why}; "
                    "not stopping it",
                    policy.UNIT, candidates[pid].gpus,
                )
                changed = True

    # A device-file holder refused as ambiguous is resolved by its family: when every GPU
    # process below it is a target (and nothing below is protected), it is the family's root
    # (vLLM's EngineCore above its Workers): signalled first so it can shut its children down.
    # nvidia-smi lists no memory of its own, so ending it frees nothing outside the scope.
    gpu_evidence_pids = set(listed) | {h.pid for h in snapshot.holders}
    promoted = True
    while promoted and snapshot.nvidia_smi_ok:
        promoted = False
        for pid in sorted(p for p, r in refused.items() if r.kind == AMBIGUOUS and p not in listed):
            proc = procs.get(pid)
            below = _descendants(pid, children)
            if proc is None or not any(d in targets for d in below):
                continue
            if any(d in gpu_evidence_pids and d not in targets for d in below):
                continue
            if any(blocking_reason(d) is not None for d in below):
                continue
            if policy.refusal(proc, ctx) is not None:
                continue
            gpus = tuple(sorted({g for d in below if d in targets for g in targets[d].gpus}))
            del refused[pid]
            targets[pid] = _Candidate(proc, EVIDENCE_FAMILY, gpus, None)
            candidates[pid] = targets[pid]
            promoted = True

    approved_units = {policy.service_unit(c.proc) for c in targets.values()} - {None}

    # include_parents: walk up from each family root while the parent is safe to add.
    if include_parents:
        gpu_evidence = set(listed) | {h.pid for h in snapshot.holders}
        for root in sorted(targets):
            cur = targets[root].proc
            while cur.ppid is not None and cur.ppid not in targets:
                parent = procs.get(cur.ppid)
                if parent is None or parent.pid in listed:
                    break
                soft = (AMBIGUOUS, NO_EVIDENCE)
                if parent.pid in refused and refused[parent.pid].kind not in soft:
                    break
                if parent.session is None or parent.session != cur.session:
                    break
                if parent.pid == parent.session or policy.refusal(parent, ctx) is not None:
                    break
                unit = policy.service_unit(parent)
                if unit is not None and unit not in approved_units:
                    break
                below = _descendants(parent.pid, children)
                if any(blocking_reason(d) is not None for d in below):
                    break
                if any(d in gpu_evidence and d not in targets for d in below):
                    break
                gpus = tuple(sorted({g for d in below if d in targets for g in targets[d].gpus}))
                # An ambiguous holder is resolved by its family: every GPU process below it
                # is a target, and nvidia-smi lists none of its own memory.
                refused.pop(parent.pid, None)
                targets[parent.pid] = _Candidate(parent, EVIDENCE_PARENT, gpus, None)
                cur = parent

    # Zombie children of anything in the plan: shown, so nobody hunts them as GPU holders.
    in_plan = set(targets) | set(refused)
    for proc in sorted(procs.values(), key=lambda p: p.pid):
        if policy.is_zombie(proc) and proc.ppid in in_plan and proc.pid not in in_plan:
            refused[proc.pid] = Refusal(
                proc.pid, proc.name, policy.zombie_reason(proc, ctx), policy.ZOMBIE
            )

    # Waves: the topmost target of each parent/child chain goes first.
    out_targets = []
    for pid, cand in targets.items():
        root = pid
        seen = {pid}
        while True:
            ppid = procs[root].ppid
            if ppid is None or ppid not in targets or ppid in seen:
                break
            seen.add(ppid)
            root = ppid
        proc = cand.proc
        out_targets.append(
            Target(
                pid=pid,
                starttime=proc.starttime,
                name=proc.name,
                cmdline=proc.cmdline,
                gpus=cand.gpus,
                evidence=cand.evidence,
                wave=0 if root == pid else 1,
                family_root=root,
                used_mib=cand.used_mib,
                user=proc.user,
                unit=proc.unit,
            )
        )
    out_targets.sort(key=lambda t: (t.wave, t.pid))

    units: list[UnitStop] = []
    if stop_units:
        by_unit: dict[str, list[int]] = {}
        for t in out_targets:
            unit = policy.service_unit(procs[t.pid])
            if unit is not None:
                by_unit.setdefault(unit, []).append(t.pid)
        units = [UnitStop(u, disable_units, tuple(sorted(p))) for u, p in sorted(by_unit.items())]

    facts = snapshot.facts
    if not snapshot.nvidia_smi_ok:
        notes.append(
            f"nvidia-smi failed ({snapshot.nvidia_smi_error or 'no reason given'}): targets come "
            "from device files only and memory cannot be checked"
        )
    if facts.wsl2:
        notes.append(
            "WSL2: nvidia-smi gives no per-process memory (and may list no processes) and "
            "there is no /dev/nvidiaN; /dev/dxg holders are targets only when the scope is "
            "every GPU"
        )
    if facts.in_container:
        notes.append(
            f"the agent runs in container {facts.container or '?'}: processes of other PID "
            "namespaces cannot be signalled from here"
        )
    fd_note = unreadable_fds_note(snapshot)
    if fd_note is not None:
        notes.append(fd_note)
    for row in ledger(snapshot):
        if row.index in in_scope and (row.unattributed_mib or 0) > threshold:
            notes.append(
                f"GPU {row.index}: {row.unattributed_mib} MiB used that nvidia-smi attributes to "
                "no process (other PID namespace, WSL2, display clients or a driver leak)"
            )
    if invisible:
        mib = sum(r.used_mib or 0 for r in invisible)
        notes.append(
            f"{len({r.pid for r in invisible})} process(es) listed by nvidia-smi are not visible "
            f"here ({mib} MiB on scope GPUs); they cannot be signalled from this PID namespace"
        )
    spanning = [t for t in out_targets if not set(t.gpus) <= in_scope]
    if spanning:
        notes.append(
            "include_spanning: PIDs " + ", ".join(str(t.pid) for t in spanning)
            + " also hold memory on GPUs outside the scope; it is freed too"
        )
    # Siblings are not a parent's children: ending a target does not signal them, but a job
    # (process group) often dies as one. Say so rather than guess application behaviour.
    for t in out_targets:
        proc = procs[t.pid]
        if proc.pgid is None or t.wave != 0:
            continue
        outside = sorted(
            p.pid for p in procs.values()
            if p.pgid == proc.pgid and p.session == proc.session and p.pid not in targets
            and p.pid in listed and not set(listed[p.pid][0]) <= in_scope
        )
        if outside:
            notes.append(
                f"PID {t.pid} shares process group {proc.pgid} with PIDs "
                f"{', '.join(map(str, outside))} on GPUs outside the scope; ending it may bring "
                "down that whole job"
            )
    if clients:
        notes.append(
            f"{len(clients)} GPU client(s) with device files open but no evidence of GPU memory "
            "(monitors, exporters, nvidia-smi runs) are left alone: "
            + ", ".join(f"{c.pid} {c.name}" for c in sorted(clients.values(), key=lambda c: c.pid))
        )
    if snapshot.holders_vanished:
        notes.append(
            f"{len(snapshot.holders_vanished)} process(es) with device files open exited before "
            "their details were read (short runs such as a concurrent nvidia-smi); not holders"
        )
    if not out_targets:
        notes.append("nothing to signal")

    for pid, reason in untrusted.items():  # a row is no evidence; family ties may still be
        if pid not in targets and (full or set(listed_as[pid]) & in_scope):
            refused[pid] = Refusal(pid, procs[pid].name, reason, UNTRUSTED_ROW, listed_as[pid])
    return Plan(
        host=host,
        scope=scope_t,
        full_scope=full,
        targets=tuple(out_targets),
        refused=tuple(sorted(refused.values(), key=lambda r: r.pid)),
        units_to_stop=tuple(units),
        invisible=invisible,
        threshold_mib={i: threshold for i in scope_t},
        notes=tuple(notes),
        clients=tuple(sorted(clients.values(), key=lambda c: c.pid)),
    )


def unreadable_fds_note(snapshot: Snapshot) -> Optional[str]:
    """Why some processes' open files could not be read -- the true reason (root in a
    container is refused PID 1's fds; hidepid hides other users), not a guess."""
    facts = snapshot.facts
    if facts.can_read_all_fds:
        return None
    if facts.hidepid:
        return ("/proc is mounted hidepid and the agent is not root: other users' processes, "
                "and device-file holders among them, are hidden")
    if snapshot.fd_unreadable:
        shown = snapshot.fd_unreadable[:5]
        more = len(snapshot.fd_unreadable) - len(shown)
        return ("cannot read the open files of PID "
                + ", ".join(f"{u.pid} ({u.comm or '?'}): {u.reason}" for u in shown)
                + (f" and {more} more" if more > 0 else "")
                + "; device-file holders among them would be missing")
    if not facts.is_root:
        return ("cannot read every process's file descriptors (not root): other users' "
                "device-file holders may be missing")
    return ("cannot read every process's file descriptors (this agent did not say which; "
            "running as root): device-file holders among them may be missing")


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
        "targets": [
            {"pid": t.pid, "starttime": t.starttime, "wave": t.wave} for t in plan.targets
        ],
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
