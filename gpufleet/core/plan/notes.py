"""Step 5 of the plan: its notes, what an operator should know about this host and plan (pure).

Notes say what the planner cannot see or did on purpose; they never change a decision.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from gpufleet.core import mps, policy
from gpufleet.core.ledger import ledger
from gpufleet.core.model import ComputeApp, Snapshot
from gpufleet.core.plan.evidence import Evidence
from gpufleet.core.plan.types import Plan, PlanScope, Refusal, Target


@dataclass(frozen=True)
class NoteInputs:
    """What the notes are about: the host, the scope, the evidence and the final targets."""

    snapshot: Snapshot
    scope: PlanScope
    threshold_mib: int
    ev: Evidence
    targets: tuple[Target, ...]
    family_notes: tuple[str, ...] = ()
    untrusted_rows: tuple[ComputeApp, ...] = ()  # rows of refused listings (not in snapshot)
    host: str = "?"
    protect: tuple[tuple[str, str], ...] = ()  # (where it comes from, pattern)
    stuck: tuple[Refusal, ...] = ()  # refused as stuck: what can still be done is said


def plan_notes(inp: NoteInputs) -> tuple[str, ...]:
    """Every note, in the order the plan shows them."""
    return (tuple(protect_notes(inp)) + tuple(host_notes(inp.snapshot))
            + tuple(memory_notes(inp)) + tuple(target_notes(inp)) + tuple(leftover_notes(inp)))


def protect_notes(inp: NoteInputs) -> list[str]:
    """A protect pattern that matches no process here protects nothing: most often a typo
    (``train_dlfash``), which the operator would otherwise learn of from a killed job."""
    unmatched = set(policy.unmatched_protect(
        inp.snapshot.processes, tuple(p for _, p in inp.protect), inp.snapshot.facts.agent_pid))
    notes = []
    for source, pattern in inp.protect:
        if pattern in unmatched:
            unmatched.discard(pattern)  # once, under its first source
            notes.append(protect_note(source, pattern, inp.host))
    return notes


def protect_note(source: str, pattern: str, host: str) -> str:
    return f"{source} {pattern!r} matches no GPU process on {host}: a typo?"


def fleet_protect_notes(plans: Sequence[Plan], source: str, patterns: Sequence[str]
                        ) -> list[Plan]:
    """``plans`` without the "a typo?" note of a run's protect pattern that matched on some
    other planned host: one pattern is given to every host of a run, and a job it protects on
    one host says it is no typo. A pattern that matched on no host keeps its note on each."""
    def unmatched(plan: Plan, pattern: str) -> bool:
        return any(protect_note(src, pattern, plan.host) in plan.notes
                   for src in (source, "inventory protect"))

    matched = {p for p in patterns if any(not unmatched(plan, p) for plan in plans)}
    return [replace(plan, notes=tuple(n for n in plan.notes if n not in {
        protect_note(source, p, plan.host) for p in matched})) for plan in plans]


def host_notes(snapshot: Snapshot) -> list[str]:
    """What this host hides from the agent: a failed nvidia-smi, WSL2, a container, fds."""
    facts = snapshot.facts
    notes = []
    if not snapshot.nvidia_smi_ok:
        notes.append(
            f"{snapshot.gpu_reader} failed ({snapshot.nvidia_smi_error or 'no reason given'}): targets come "
            "from device files only and memory cannot be checked")
    if facts.wsl2:
        notes.append(
            "WSL2: nvidia-smi gives no per-process memory (and may list no processes) and "
            "there is no /dev/nvidiaN; /dev/dxg holders are targets only when the scope is "
            "every GPU")
    if facts.in_container:
        notes.append(
            f"the agent runs in container {facts.container or '?'}: processes of other PID "
            "namespaces cannot be signalled from here")
    fd_note = unreadable_fds_note(snapshot)
    if fd_note is not None:
        notes.append(fd_note)
    return notes


def memory_notes(inp: NoteInputs) -> list[str]:
    """Memory on scope GPUs that no visible process explains."""
    notes = []
    untrusted = untrusted_memory(inp)
    for row in ledger(inp.snapshot):
        if row.index not in inp.scope.indices:
            continue
        mib, pids = untrusted.get(row.index, (0, []))
        if pids:
            notes.append(
                f"GPU {row.index}: {'n/a' if mib is None else mib} MiB listed by "
                f"{inp.snapshot.gpu_reader} for PID{'s' if len(pids) > 1 else ''} "
                f"{', '.join(map(str, pids))} counts as unexplained: they do not hold this GPU "
                "(refused as untrusted rows)")
        rest = (row.unattributed_mib or 0) - (mib or 0)
        if rest > inp.threshold_mib + row.driver_allowance_mib:  # the driver's share is not hidden
            notes.append(
                f"GPU {row.index}: {rest} MiB used that nvidia-smi attributes to "
                "no process (other PID namespace, WSL2, display clients or a driver leak)")
    invisible = inp.ev.invisible
    if invisible:
        mib = sum(r.used_mib or 0 for r in invisible)
        notes.append(
            f"{len({r.pid for r in invisible})} process(es) listed by nvidia-smi are not visible "
            f"here ({mib} MiB on scope GPUs); they cannot be signalled from this PID namespace")
    return notes


def untrusted_memory(inp: NoteInputs) -> dict[int, tuple[Optional[int], list[int]]]:
    """GPU index -> (MiB the untrusted rows list on it, None if not available; their PIDs)."""
    out: dict[int, tuple[Optional[int], list[int]]] = {}
    for app in inp.untrusted_rows:
        gpu = inp.snapshot.gpu_by_uuid(app.gpu_uuid)
        if gpu is None:
            continue
        mib, pids = out.get(gpu.index, (0, []))
        mib = None if mib is None or app.used_mib is None else mib + app.used_mib
        out[gpu.index] = (mib, sorted(set(pids) | {app.pid}))
    return out


def target_notes(inp: NoteInputs) -> list[str]:
    """What signalling the targets reaches beyond the scope."""
    notes = []
    spanning = [t for t in inp.targets if not inp.scope.covers(t.gpus)]
    if spanning:
        notes.append(
            "include_spanning: PIDs " + ", ".join(str(t.pid) for t in spanning)
            + " also hold memory on GPUs outside the scope; it is freed too")
    notes.extend(inp.family_notes)
    for t in inp.targets:
        claim = policy.false_claim(inp.snapshot.processes[t.pid])
        if claim is not None:
            exe = inp.snapshot.processes[t.pid].exe or "?"
            notes.append(f"PID {t.pid} claims to be {claim}, but its executable is {exe}, not "
                         f"root's {claim}: it is signalled like any process that holds GPU "
                         "memory")
    # Siblings are not a parent's children: ending a target does not signal them, but a job
    # (process group) often dies as one. Say so rather than guess application behaviour.
    procs, listed = inp.snapshot.processes, inp.ev.listed
    chosen = {t.pid for t in inp.targets}
    for t in inp.targets:
        proc = procs[t.pid]
        if proc.pgid is None or t.wave != 0:
            continue
        outside = sorted(
            p.pid for p in procs.values()
            if p.pgid == proc.pgid and p.session == proc.session and p.pid not in chosen
            and p.pid in listed and not inp.scope.covers(listed[p.pid][0]))
        if outside:
            notes.append(
                f"PID {t.pid} shares process group {proc.pgid} with PIDs "
                f"{', '.join(map(str, outside))} on GPUs outside the scope; ending it may bring "
                "down that whole job")
    return notes


def leftover_notes(inp: NoteInputs) -> list[str]:
    """What is left alone on purpose: GPU clients, vanished holders, CUDA MPS (and how to stop
    it), or nothing at all."""
    notes = []
    clients = sorted(inp.ev.clients.values(), key=lambda c: c.pid)
    if clients:
        notes.append(
            f"{len(clients)} GPU client(s) with device files open but no evidence of GPU memory "
            "(monitors, exporters, nvidia-smi runs) are left alone: "
            + ", ".join(f"{c.pid} {c.name}" for c in clients))
    for ref in sorted(inp.stuck, key=lambda r: r.pid):
        advice = policy.reset_or_drain(inp.snapshot, ref.gpus or inp.scope.indices,
                                       inp.snapshot.facts.hostname or "?")
        notes.append(f"PID {ref.pid} ({ref.name}) is stuck: no signal ends it and nothing waits "
                     f"for it; {advice}")
    vanished = inp.snapshot.holders_vanished
    if vanished:
        notes.append(
            f"{len(vanished)} process(es) with device files open exited before "
            "their details were read (short runs such as a concurrent nvidia-smi); not holders")
    mps_note = mps.stop_note(inp.snapshot, inp.scope.indices)
    if mps_note is not None:
        notes.append(mps_note)
    if not inp.targets:
        notes.append("nothing to signal")
    return notes


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
