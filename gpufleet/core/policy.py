"""THE one place that says which processes may be signalled (pure).

Targets are chosen elsewhere (gpufleet/plan.py) from GPU evidence only. This module answers the
other question: is there a reason this process must never be signalled, whatever the evidence?
Process names appear here ONLY to protect (sshd, driver daemons, display servers), never to
target. Every refusal is a short reason an operator can read in a table.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

from gpufleet.core.model import ProcessInfo, Snapshot

# Kinds of refusal; render/verdict group by them, the reason text is for people.
PROTECTED = "protected"  # the never-signal list: absolute, no option overrides it
ZOMBIE = "zombie"
OWNER = "owner"
CONTAINER = "container"
UNIT = "unit"
IDENTITY = "identity"

# Daemons that hold NVIDIA device files on purpose and must outlive any clean. The kernel
# truncates comm to 15 bytes ("nvidia-persiste"), so names are compared both ways.
PROTECTED_DAEMONS: Mapping[str, str] = {
    "nvidia-persistenced": "NVIDIA persistence daemon",
    "nv-hostengine": "DCGM host engine",
    "nv-fabricmanager": "NVIDIA fabric manager",
    "dcgm-exporter": "DCGM exporter",
    "Xorg": "display server",
    "Xwayland": "display server",
    "X": "display server",
    "gnome-shell": "display compositor",
    "kwin_wayland": "display compositor",
    "kwin_x11": "display compositor",
    "sway": "display compositor",
    "Hyprland": "display compositor",
    "weston": "display compositor",
}

# OpenSSH >= 9.8 splits the daemon into sshd-session / sshd-auth; all of them are sshd.
SSHD_COMMS = frozenset({"sshd", "sshd-session", "sshd-auth"})

RELATIONS = {
    "self": "the gpufleet agent itself",
    "ancestor": "an ancestor of the gpufleet agent (its SSH session)",
    "session": "in the gpufleet agent's own session",
}

COMM_LEN = 15  # TASK_COMM_LEN - 1


@dataclass(frozen=True)
class PolicyContext:
    """What policy needs to know about the connection, beyond the process itself."""

    processes: Mapping[int, ProcessInfo] = field(default_factory=dict)
    agent_pid: Optional[int] = None
    uid: Optional[int] = None
    is_root: bool = False
    is_sudo: bool = False
    protect: tuple[str, ...] = ()
    stop_units: bool = False
    own_container: Optional[str] = None

    @classmethod
    def from_snapshot(
        cls,
        snapshot: Snapshot,
        *,
        protect: tuple[str, ...] = (),
        stop_units: bool = False,
        is_sudo: bool = False,
    ) -> "PolicyContext":
        facts = snapshot.facts
        return cls(
            processes=snapshot.processes,
            agent_pid=facts.agent_pid,
            uid=facts.uid,
            is_root=bool(facts.is_root),
            is_sudo=is_sudo,
            protect=tuple(protect),
            stop_units=stop_units,
            own_container=facts.container if facts.in_container else None,
        )

    @property
    def privileged(self) -> bool:
        return self.is_root or self.is_sudo


def _argv0(proc: ProcessInfo) -> str:
    return os.path.basename(proc.cmdline.split(" ", 1)[0]) if proc.cmdline else ""


def _names(proc: ProcessInfo) -> tuple[str, ...]:
    return tuple(n for n in (proc.comm, _argv0(proc)) if n)


def _is_named(proc: ProcessInfo, name: str) -> bool:
    for n in _names(proc):
        if n == name or (len(n) == COMM_LEN and name.startswith(n)):
            return True
    return False


def is_sshd(proc: ProcessInfo) -> bool:
    """sshd by comm, or by a cmdline that starts with sshd (its title: 'sshd: alice@pts/0')."""
    if proc.comm in SSHD_COMMS:
        return True
    cmd = proc.cmdline
    return cmd.startswith("sshd") or cmd.startswith("/usr/sbin/sshd")


def protected_daemon(proc: ProcessInfo) -> Optional[str]:
    """The protected daemon this process is, by name (used only to protect)."""
    for name in PROTECTED_DAEMONS:
        if _is_named(proc, name):
            return name
    return None


def matching_glob(proc: ProcessInfo, globs: tuple[str, ...]) -> Optional[str]:
    """First protect glob matching the cmdline or the comm (fnmatch, case-sensitive)."""
    for glob in globs:
        if fnmatch.fnmatchcase(proc.cmdline, glob) or fnmatch.fnmatchcase(proc.comm, glob):
            return glob
    return None


def is_kernel_thread(proc: ProcessInfo) -> bool:
    return proc.kernel_thread or proc.pid == 2 or proc.ppid == 2


def is_zombie(proc: ProcessInfo) -> bool:
    return bool(proc.state) and proc.state[:1] in ("Z", "X")


def service_unit(proc: ProcessInfo) -> Optional[str]:
    """The systemd service that owns the process, if stopping it is what ends the process.

    Sessions (session-N.scope), init.scope and the per-user manager (user@UID.service) are not
    services someone deployed; their processes are plain processes.
    """
    unit = proc.unit
    if not unit or not unit.endswith(".service"):
        return None
    if unit.startswith("user@") or unit.startswith("user-runtime-dir@"):
        return None
    return unit


def foreign_container(proc: ProcessInfo, ctx: PolicyContext) -> Optional[str]:
    """The container the process runs in, when it is not the agent's own."""
    if not proc.container:
        return None
    if ctx.own_container is not None and proc.container == ctx.own_container:
        return None
    return proc.container


def never_signal_reason(proc: ProcessInfo, ctx: PolicyContext) -> Optional[str]:
    """The absolute list: no evidence and no option makes these targets."""
    if proc.pid <= 1:
        return "PID 1 (init)" if proc.pid == 1 else "not a process"
    if is_kernel_thread(proc):
        return "kernel thread"
    if ctx.agent_pid is not None and proc.pid == ctx.agent_pid:
        return RELATIONS["self"]
    if proc.relation in RELATIONS:
        return RELATIONS[proc.relation]
    if is_sshd(proc):
        return "sshd (never signalled)"
    daemon = protected_daemon(proc)
    if daemon is not None:
        return f"{daemon} ({PROTECTED_DAEMONS[daemon]}, never signalled)"
    glob = matching_glob(proc, ctx.protect)
    if glob is not None:
        return f"protected by {glob!r}"
    return None


def zombie_reason(proc: ProcessInfo, ctx: PolicyContext) -> str:
    parent = ctx.processes.get(proc.ppid) if proc.ppid is not None else None
    pname = parent.name if parent is not None else "?"
    return f"zombie, parent PID {proc.ppid if proc.ppid is not None else '?'} ({pname})"


def refusal(proc: ProcessInfo, ctx: PolicyContext) -> Optional[tuple[str, str]]:
    """(kind, reason) if policy refuses to signal ``proc``, else None. Order: most final first."""
    reason = never_signal_reason(proc, ctx)
    if reason is not None:
        return PROTECTED, reason
    if is_zombie(proc):
        return ZOMBIE, zombie_reason(proc, ctx)
    if not ctx.privileged:
        if proc.uid is None or ctx.uid is None:
            return OWNER, "owner unknown; connect as root or with sudo"
        if proc.uid != ctx.uid:
            who = proc.user or f"uid {proc.uid}"
            return OWNER, f"owned by {who}; connect as root or with sudo"
    container = foreign_container(proc, ctx)
    if container is not None:
        return CONTAINER, f"runs in container {container}; stop the container"
    unit = service_unit(proc)
    if unit is not None and not ctx.stop_units:
        return UNIT, f"belongs to {unit}; stop the unit or pass --stop-units"
    if proc.starttime is None:
        return IDENTITY, "start time unknown; cannot guard against PID reuse"
    return None


def refusal_reason(proc: ProcessInfo, ctx: PolicyContext) -> Optional[str]:
    """Why ``proc`` must not be signalled, or None when policy allows it."""
    found = refusal(proc, ctx)
    return None if found is None else found[1]


def may_signal(proc: ProcessInfo, ctx: PolicyContext) -> bool:
    return refusal(proc, ctx) is None
