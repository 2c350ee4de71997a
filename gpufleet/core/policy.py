"""THE one place that says which processes may be signalled (pure).

Targets are chosen elsewhere (gpufleet/core/plan/) from GPU evidence only. This module answers the
other question: is there a reason this process must never be signalled, whatever the evidence?
Process names appear here ONLY to protect (sshd, driver daemons, display servers), never to
target. Every refusal is a short reason an operator can read in a table.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from gpufleet.core import mps
from gpufleet.core.evidence import (MAPS_CLIENT, MAPS_CUDA, MPS_CONTROL, MPS_SERVER,
                                    exe_basename, is_mps_daemon, maps_kind, mps_server)
from gpufleet.core.ledger import ledger
from gpufleet.core.model import COMM_MAX, Holder, ProcessInfo, Snapshot

# Kinds of refusal; render/verdict group by them, the reason text is for people.
PROTECTED = "protected"  # the never-signal list: absolute, no option overrides it
ZOMBIE = "zombie"  # a true zombie: no thread left, holds nothing
STUCK = "stuck"  # main thread gone, every thread left in uninterruptible sleep: no signal ends it
OWNER = "owner"
CONTAINER = "container"
UNIT = "unit"
IDENTITY = "identity"
JOB_OWNER = "job-owner"  # a Slurm epilog's job GPUs: only the job user's processes are its

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
    # CUDA MPS: the control daemon and the servers it starts serve every MPS client on the
    # host; both have comm "nvidia-cuda-mps" (cut at 15 bytes), so a comm claims both names.
    "nvidia-cuda-mps-control": "CUDA MPS control daemon",
    "nvidia-cuda-mps-server": "CUDA MPS server",
}

# OpenSSH >= 9.8 splits the daemon into sshd-session / sshd-auth; all of them are sshd.
SSHD_COMMS = frozenset({"sshd", "sshd-session", "sshd-auth"})

RELATIONS = {
    "self": "the gpufleet agent itself",
    "ancestor": "an ancestor of the gpufleet agent (its SSH session)",
    "session": "in the gpufleet agent's own session",
}

# GPU memory a clean leaves per GPU above the host's expected unattributed memory and still
# calls clean (clean --tolerance-mib, runbook clean steps, status's "busy"): the one default.
DEFAULT_TOLERANCE_MIB = 64


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
    job_uid: Optional[int] = None  # a Slurm job's user: every other user's process is refused

    @classmethod
    def from_snapshot(
        cls,
        snapshot: Snapshot,
        *,
        protect: tuple[str, ...] = (),
        stop_units: bool = False,
        is_sudo: bool = False,
        job_uid: Optional[int] = None,
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
            job_uid=job_uid,
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
        if n == name or (len(n) == COMM_MAX and name.startswith(n)):
            return True
    return False


# The executables a protected name may run as (the kernel's /proc/PID/exe, symlinks resolved:
# /usr/bin/X is a link to Xorg).
EXE_NAMES: Mapping[str, frozenset[str]] = {"X": frozenset({"Xorg"}),
                                           "Xorg": frozenset({"Xorg"})}


def runs_as(proc: ProcessInfo, name: str, exe_names: frozenset[str]) -> Optional[bool]:
    """Whether a process that carries a protected ``name`` really is that program: True when
    its executable is root's binary of that name, False when the evidence says otherwise (a
    user's python titled "sshd: alice@pts/3"), None when there is no evidence (an older agent,
    or not readable): then the name alone protects, as the safe side."""
    if proc.exe is None or proc.exe_root is None:
        return None
    return exe_basename(proc) in exe_names


def claims_sshd(proc: ProcessInfo) -> bool:
    """The NAME says sshd: comm, or a title starting with sshd ('sshd: alice@pts/0')."""
    if proc.comm in SSHD_COMMS:
        return True
    cmd = proc.cmdline
    return cmd.startswith("sshd") or cmd.startswith("/usr/sbin/sshd")


def is_sshd(proc: ProcessInfo) -> bool:
    """sshd on evidence: it claims the name and runs the host's sshd binary (OpenSSH >= 9.8's
    sshd-session and sshd-auth too). A per-session sshd runs as the user it serves, so who
    owns the process proves nothing; the executable does."""
    return claims_sshd(proc) and runs_as(proc, "sshd", SSHD_COMMS) is not False


def claimed_daemons(proc: ProcessInfo) -> tuple[str, ...]:
    """Every protected daemon this process NAMES itself as (comm or argv[0]), evidence aside:
    a comm cut at 15 bytes can be several ("nvidia-cuda-mps": the MPS control daemon and the
    MPS server). Whole names first, then those a cut name begins."""
    exact = [n for n in PROTECTED_DAEMONS if n in _names(proc)]
    return tuple(exact + [n for n in PROTECTED_DAEMONS if n not in exact and _is_named(proc, n)])


def claimed_daemon(proc: ProcessInfo) -> Optional[str]:
    """The protected daemon this process names itself as first (claimed_daemons)."""
    claims = claimed_daemons(proc)
    return claims[0] if claims else None


def protected_daemon(proc: ProcessInfo) -> Optional[str]:
    """The protected daemon this process is: a name it claims, and its executable root's
    binary of that name (runs_as). Every claimed name is tried, so the one the executable
    confirms wins. Used only to protect."""
    for name in claimed_daemons(proc):
        if runs_as(proc, name, EXE_NAMES.get(name, frozenset({name}))) is not False:
            return name
    return None


def false_claim(proc: ProcessInfo) -> Optional[str]:
    """The protected name a process claims without the evidence (shown in the plan: "claims
    to be sshd"), or None."""
    if claims_sshd(proc) and not is_sshd(proc):
        return "sshd"
    name = claimed_daemon(proc)
    if name is not None and protected_daemon(proc) is None:
        return name
    return None


# A protect pattern with one of these is a glob; without, a word to find (protect_matches).
GLOB_CHARS = frozenset("*?[")


def protect_matches(pattern: str, text: str) -> bool:
    """Whether a protect pattern matches one text (a command line or a comm), case-sensitive.

    A plain word matches where it occurs, as pgrep does: an operator who types
    ``--protect train_dflash`` means ``python3 train_dflash.py``, and a whole-text match
    silently protected nothing. A pattern with ``*``, ``?`` or ``[`` is an fnmatch glob over
    the whole text, as it always was (``*train*``, ``prec*`` keep their meaning). An empty
    pattern matches nothing (inputs refuse it before this)."""
    if not pattern:
        return False
    if GLOB_CHARS.isdisjoint(pattern):
        return pattern in text
    return fnmatch.fnmatchcase(text, pattern)


def matching_glob(proc: ProcessInfo, patterns: tuple[str, ...]) -> Optional[str]:
    """First protect pattern matching the cmdline or the comm (protect_matches)."""
    for pattern in patterns:
        if protect_matches(pattern, proc.cmdline) or protect_matches(pattern, proc.comm):
            return pattern
    return None


def unmatched_protect(processes: Mapping[int, ProcessInfo], patterns: tuple[str, ...],
                      agent_pid: Optional[int] = None) -> tuple[str, ...]:
    """The protect patterns that match none of ``processes`` (a snapshot's: its GPU holders
    and the agent's own line), in order: most likely a typo, which protects nothing. The
    agent, its ancestors and its session do not count: they are never signalled anyway, and
    a word such as ``python`` would match the agent's own command line."""
    others = [p for p in processes.values()
              if p.pid != agent_pid and p.relation not in RELATIONS]
    return tuple(pattern for pattern in dict.fromkeys(patterns)
                 if not any(matching_glob(p, (pattern,)) for p in others))


def is_kernel_thread(proc: ProcessInfo) -> bool:
    return proc.kernel_thread or proc.pid == 2 or proc.ppid == 2


def _exited_leader(proc: ProcessInfo) -> bool:
    return (proc.state or "")[:1] in ("Z", "X")


def leader_gone(proc: ProcessInfo) -> bool:
    """The main thread exited while other threads run on: the leader shows Z, the process
    still holds what its threads hold (its fds and maps), and SIGKILL of the PID ends them
    all -- recorded on an H200: a torch process after pthread_exit, NVML listing its 5638 MiB,
    freed 0.13 s after SIGKILL (tests/fixtures/real-h200/clean-cases/probe-1.log, part D)."""
    return _exited_leader(proc) and (proc.threads or 0) > 1


def is_zombie(proc: ProcessInfo) -> bool:
    """A true zombie: exited with no thread left (or an older agent that did not count them:
    the safe side). It holds nothing; a signal cannot reach it."""
    return _exited_leader(proc) and not leader_gone(proc)


def stuck_reason(proc: ProcessInfo) -> Optional[str]:
    """Why no signal can end ``proc``: its main thread is gone and every thread still running
    sleeps uninterruptibly (D), as a killed process's threads stuck in the driver do; None when
    a signal can (some thread still runs: SIGKILL ends it, and the clean reports what stays)."""
    if not leader_gone(proc) or not proc.stuck_threads:
        return None
    live = proc.live_threads if proc.live_threads is not None else (proc.threads or 1) - 1
    if len(proc.stuck_threads) < live:
        return None
    shown = proc.stuck_threads[:3]
    tids = ", ".join(str(t.tid) for t in shown)
    more = f" and {len(proc.stuck_threads) - len(shown)} more" if len(proc.stuck_threads) > 3 \
        else ""
    where = ", ".join(sorted({t.wchan or "?" for t in proc.stuck_threads}))
    return (f"stuck: main thread gone, thread{'s' if len(proc.stuck_threads) > 1 else ''} "
            f"{tids}{more} in D state in {where}; signals cannot end it")


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


def user_unit_reason(proc: ProcessInfo) -> Optional[str]:
    """A unit of a user's own systemd (under ``user@UID.service``) is that user's, never the
    system's: stopping a system unit of the same name would stop something else. As for the
    system's units, only a service is its processes' owner (a scope, such as a terminal's,
    restarts nothing). gpufleet stops no user units itself; it says how."""
    if not proc.user_unit or proc.user_unit_uid is None or \
            not proc.user_unit.endswith(".service"):
        return None
    uid = proc.user_unit_uid
    return (f"belongs to {proc.user_unit} of uid {uid}'s own systemd (a user unit, not the "
            f"system's): stop it with systemctl --user -M {uid}@ stop {proc.user_unit}")


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
    if daemon is None and is_mps_daemon(proc):  # the executable alone says so
        daemon = MPS_CONTROL
    if daemon is None and mps_server(proc, ctx.processes):
        daemon = MPS_SERVER
    if daemon is not None:
        return f"{daemon} ({PROTECTED_DAEMONS[daemon]}, never signalled)"
    glob = matching_glob(proc, ctx.protect)
    if glob is not None:
        return f"protected by {glob!r}"
    return None


def gpu_reset_blockers(snapshot: Snapshot, index: int) -> list[str]:
    """Why `--reset` would not reset GPU ``index`` here, the agent's own rule (remote/reset.py
    reset_refusal): root, the host itself (not a container), not WSL2, and no process with its
    /dev/nvidiaN open -- in words that name no process (a monitor's open files block a reset,
    yet it holds no memory)."""
    facts = snapshot.facts
    out = []
    if not facts.is_root:
        out.append("not root")
    if facts.in_container:
        out.append(f"in container {facts.container or '?'}")
    if facts.wsl2:
        out.append("WSL2 has no GPU reset")
    gpu = next((g for g in snapshot.gpus if g.index == index), None)
    dev = f"/dev/nvidia{gpu.minor if gpu is not None and gpu.minor is not None else index}"
    n = len({h.pid for h in snapshot.holders if dev in h.devices and h.pid != facts.agent_pid})
    if n:
        out.append(f"its device file is open in {n} process{'es' if n > 1 else ''}")
    return out


def reset_or_drain(snapshot: Snapshot, gpus: tuple[int, ...], node: Optional[str] = None
                   ) -> str:
    """What can still be done for memory no signal frees (a stuck process, a driver's leak):
    a GPU reset where --reset could do it, else draining the node (with ``node``: how, in
    Slurm) and a reboot."""
    blockers: list[str] = []
    for index in gpus:
        blockers += [b for b in gpu_reset_blockers(snapshot, index) if b not in blockers]
    if not blockers:
        return "a GPU reset frees it: clean again with --reset"
    how = f" (Slurm: scontrol update nodename={node} state=drain reason=...)" if node else ""
    return f"no GPU reset here ({'; '.join(blockers)}): drain the node{how} and reboot"


def zombie_reason(proc: ProcessInfo, ctx: PolicyContext) -> str:
    """A true zombie's refusal: it holds nothing, so memory on its GPUs is someone else's."""
    parent = ctx.processes.get(proc.ppid) if proc.ppid is not None else None
    pname = parent.name if parent is not None else "?"
    return (f"zombie (exited, no thread left), parent PID "
            f"{proc.ppid if proc.ppid is not None else '?'} ({pname}): holds nothing; any "
            "memory on its GPUs is held elsewhere (another process, or the driver)")


def signal_refusal(proc: ProcessInfo, ctx: PolicyContext) -> Optional[tuple[str, str]]:
    """(kind, reason) if policy refuses to signal ``proc``, else None. Order: most final first.
    (The plan turns it into a ``Refusal`` entry; kinds are the constants above.)"""
    reason = never_signal_reason(proc, ctx)
    if reason is not None:
        return PROTECTED, reason
    if is_zombie(proc):
        return ZOMBIE, zombie_reason(proc, ctx)
    stuck = stuck_reason(proc)
    if stuck is not None:
        return STUCK, stuck
    job = job_owner_reason(proc, ctx)
    if job is not None:
        return JOB_OWNER, job
    if not ctx.privileged:
        if proc.uid is None or ctx.uid is None:
            return OWNER, "owner unknown; connect as root or with sudo"
        if proc.uid != ctx.uid:
            who = proc.user or f"uid {proc.uid}"
            return OWNER, f"owned by {who}; connect as root or with sudo"
    container = foreign_container(proc, ctx)
    if container is not None:
        return CONTAINER, f"runs in container {container}; stop the container"
    user_unit = user_unit_reason(proc)
    if user_unit is not None:
        return UNIT, user_unit
    unit = service_unit(proc)
    if unit is not None and not ctx.stop_units:
        return UNIT, f"belongs to {unit}; stop the unit or pass --stop-units"
    if proc.starttime is None:
        return IDENTITY, "start time unknown; cannot guard against PID reuse"
    return None


def job_owner_reason(proc: ProcessInfo, ctx: PolicyContext) -> Optional[str]:
    """A Slurm epilog frees its job's GPUs of the job's own processes only: another user's
    process there (a second job sharing the GPU, someone's shell) is refused and reported,
    even though the epilog runs as root; an owner that cannot be read is refused too."""
    if ctx.job_uid is None:
        return None
    if proc.uid is None:
        return f"owner unknown; only the job user's (uid {ctx.job_uid}) processes are signalled"
    if proc.uid != ctx.job_uid:
        who = f"{proc.user} (uid {proc.uid})" if proc.user else f"uid {proc.uid}"
        return f"owned by {who}, not the job's user (uid {ctx.job_uid})"
    return None


def refusal_reason(proc: ProcessInfo, ctx: PolicyContext) -> Optional[str]:
    """Why ``proc`` must not be signalled, or None when policy allows it."""
    found = signal_refusal(proc, ctx)
    return None if found is None else found[1]


def may_signal(proc: ProcessInfo, ctx: PolicyContext) -> bool:
    return signal_refusal(proc, ctx) is None


# ------------------------------------------------------------------ GPU clients (never targets)
#
# A process with NVIDIA device files open that nvidia-smi does not list is either a GPU memory
# holder nvidia-smi cannot show (another PID namespace, hidepid, WSL2) or a GPU *client*: an
# NVML monitor or exporter (nvtop, nvitop, gpustat, dcgm-exporter, `watch nvidia-smi`) that
# opens /dev/nvidiactl and every /dev/nvidiaN, has no CUDA context and holds no memory.
# Open files cannot tell them apart (recorded: same files); /proc/PID/maps can: a CUDA context
# maps /dev/nvidia-uvm (and its GPU's /dev/nvidiaN and nvidiactl); an NVML client maps none or
# only nvidiactl, a running nvidia-smi nothing or only nvidiactl, and a process that only
# called cuInit maps /dev/nvidia0 and nvidiactl but no nvidia-uvm, holds no memory and is not
# listed (recorded/logs/h200-clients-and-timings.log, recorded/probe/h200-clients-probe3.log).
# So a mapped nvidia-uvm is the evidence of a context; a mapped nvidiaN alone is not.

ROLE_HOLDER = "holder"
ROLE_CLIENT = "client"

# Names only ADD protection (a client by name is never a target); they never make a target.
CLIENT_NAMES = frozenset({
    "nvtop", "nvitop", "gpustat", "nvidia-smi", "nvidia_gpu_exporter", "dcgm-exporter", "dcgmi",
})

@dataclass(frozen=True)
class HolderRole:
    """What an unlisted device-file holder is: a memory holder (may be a target) or a client."""

    role: str
    reason: str


def client_name(proc: ProcessInfo) -> Optional[str]:
    """The GPU monitor/exporter this process is by name (comm, argv[0..2], `python -m X`),
    unless its executable says otherwise: a binary monitor (nvtop, nvidia-smi, dcgm-exporter)
    runs root's binary of that name. A Python monitor (nvitop, gpustat) runs python, which
    proves nothing: for it the name does not protect, and its maps decide (holder_role)."""
    known = _client_by_name(proc)
    if known is None or runs_as(proc, known, frozenset({known})) is False:
        return None
    return known


def _client_by_name(proc: ProcessInfo) -> Optional[str]:
    words = proc.cmdline.split()[:3]
    names = [proc.comm] + [os.path.basename(w) for w in words[:2]]
    if len(words) == 3 and words[1] == "-m":
        names.append(words[2])
    for n in names:
        for known in CLIENT_NAMES:
            if n == known or (len(n) == COMM_MAX and known.startswith(n)):
                return known
    return None


def listing_gap(snapshot: Snapshot) -> Optional[str]:
    """Why nvidia-smi's process list may miss memory holders here, or None when it cannot."""
    facts = snapshot.facts
    if not snapshot.nvidia_smi_ok:
        return "nvidia-smi failed"
    if facts.wsl2:
        return "WSL2"
    if facts.in_container:
        return f"the agent runs in container {facts.container or '?'} (other PID namespace)"
    if facts.hidepid:
        return "/proc is mounted hidepid"
    if any(a.pid not in snapshot.processes for a in snapshot.compute_apps):
        return "nvidia-smi lists PIDs this /proc does not have (other PID namespace)"
    return None


def unexplained_mib(snapshot: Snapshot, gpus: tuple[int, ...], threshold_mib: int
                    ) -> Optional[dict[int, Optional[int]]]:
    """Per GPU of ``gpus`` (every GPU when empty): memory above the threshold that nothing
    visible here accounts for -- unattributed, plus what nvidia-smi lists for PIDs not in this
    /proc. None value = unknown (not available); only GPUs above the threshold (or unknown)
    are in the result; an empty dict means no memory is unexplained."""
    rows = {r.index: r for r in ledger(snapshot)}
    wanted = gpus or tuple(rows)
    out: dict[int, Optional[int]] = {}
    if not snapshot.nvidia_smi_ok or not rows:
        return None
    for i in wanted:
        row = rows.get(i)
        if row is None:
            continue
        if row.unattributed_mib is None:
            out[i] = None
            continue
        hidden: Optional[int] = row.unattributed_mib
        for app in snapshot.apps_on(i):
            if app.pid not in snapshot.processes:
                hidden = None if hidden is None or app.used_mib is None else hidden + app.used_mib
        # the driver's own share for the listed processes explains itself (core/ledger.py)
        if hidden is None or hidden > threshold_mib + row.driver_allowance_mib:
            out[i] = hidden
    return out


def has_listed_descendant(snapshot: Snapshot, pid: int) -> bool:
    """Whether processes nvidia-smi lists descend from ``pid``: it is their family root."""
    listed = snapshot.listed_pids()
    children: dict[int, list[int]] = {}
    for p in snapshot.processes.values():
        if p.ppid is not None and p.ppid != p.pid:
            children.setdefault(p.ppid, []).append(p.pid)
    stack, seen = list(children.get(pid, ())), {pid}
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur in listed:
            return True
        stack.extend(children.get(cur, ()))
    return False


def holder_role(snapshot: Snapshot, holder_pid: int, threshold_mib: int) -> HolderRole:
    """THE rule for a device-file holder nvidia-smi does not list: it is a (possible) memory
    holder only on evidence that it holds memory, otherwise a GPU client, never a target.

    Evidence, in order:
    1. a client by name (CLIENT_NAMES): client (names add protection, never a target);
    2. it is the family root of processes nvidia-smi lists (vLLM's EngineCore above its
       Workers), or a CUDA MPS client a verified daemon lists (NVML counts its memory in the
       server's row): holder -- the plan's family rule decides whether it is signalled;
    3. its maps show no nvidia-uvm (an NVML client maps nothing or nvidiactl, a running
       nvidia-smi nothing or nvidiactl, a cuInit-only process nvidia0 and nvidiactl): client;
    4. memory above ``threshold_mib`` on its GPUs that nothing visible here explains (the
       GPUs whose /dev/nvidiaN it maps, else those it has open, else every GPU): holder when
       its maps show a CUDA context, or when the host cannot list every memory holder
       (listing_gap: nvidia-smi failed, WSL2, container, hidepid, PIDs not in this /proc);
    5. otherwise (nvidia-smi lists everyone and no memory is unexplained, or its maps are not
       available and the host can list): client.
    Maps not available (older agents, unreadable maps) therefore never make a holder a target
    by themselves: the memory evidence (4) and the family rule (2) decide.
    """
    holder = next((h for h in snapshot.holders if h.pid == holder_pid), None)
    proc = snapshot.processes.get(holder_pid)
    if holder is None:
        return HolderRole(ROLE_CLIENT, "holds no NVIDIA device file")
    if proc is not None:
        name = client_name(proc)
        if name is not None:
            return HolderRole(ROLE_CLIENT, f"a GPU monitor ({name}): never signalled")
        if has_listed_descendant(snapshot, holder_pid):
            return HolderRole(ROLE_HOLDER, "parent of processes nvidia-smi lists (family root)")
        mps_client = _mps_client_reason(snapshot, holder_pid)
        if mps_client is not None:
            return HolderRole(ROLE_HOLDER, mps_client)
    kind = maps_kind(holder.mapped, snapshot.facts.wsl2)
    if kind == MAPS_CLIENT:
        shown = ", ".join(holder.mapped or ()) or "no NVIDIA device"
        return HolderRole(ROLE_CLIENT, f"maps {shown} (no nvidia-uvm): no CUDA context, an NVML "
                          "client such as a monitor or exporter")
    mapped_gpus = snapshot.device_gpu_indices(holder.mapped) if kind == MAPS_CUDA and \
        holder.mapped else ()
    gpus = mapped_gpus or snapshot.holder_gpu_indices(holder)
    unexplained = unexplained_mib(snapshot, gpus, threshold_mib)
    gap = listing_gap(snapshot)
    if unexplained is None or unexplained:
        where = "memory unknown" if unexplained is None else "; ".join(
            f"GPU {i}: {'n/a' if v is None else v} MiB" for i, v in sorted(unexplained.items()))
        daemon = protected_daemon(proc) if proc is not None else None
        if daemon is not None and PROTECTED_DAEMONS[daemon].startswith("display"):
            # graphics memory is never in compute-apps; protected anyway, never signalled
            return HolderRole(ROLE_HOLDER, f"display server, and memory is unexplained ({where})")
        if kind == MAPS_CUDA:
            return HolderRole(ROLE_HOLDER, f"maps nvidia-uvm (a CUDA context) and memory is "
                              f"unexplained ({where})")
        if gap is not None:
            return HolderRole(ROLE_HOLDER, f"{gap}, and memory is unexplained ({where})")
    if kind == MAPS_CUDA:
        return HolderRole(ROLE_CLIENT, "maps nvidia-uvm (a CUDA context), but nvidia-smi lists no "
                          "memory of it and no memory on its GPUs is unexplained")
    return HolderRole(ROLE_CLIENT, "open device files only: nvidia-smi lists no memory of it "
                      "and no memory on its GPUs is unexplained (a GPU client)")


def _mps_client_reason(snapshot: Snapshot, pid: int) -> Optional[str]:
    """Why an unlisted holder is a CUDA MPS client whose memory NVML counts in its server's
    row (the verified daemon's own list, core/mps.py), or None."""
    if not snapshot.mps:
        return None
    server = mps.unlisted_clients(snapshot).get(pid)
    if server is None:
        return None
    return mps.client_reason(server, snapshot.gpu_indices_of_app(server))


def holder_roles(snapshot: Snapshot, threshold_mib: int) -> dict[int, HolderRole]:
    """holder_role of every device-file holder nvidia-smi does not list (not the agent and
    its ancestors)."""
    return {h.pid: holder_role(snapshot, h.pid, threshold_mib)
            for h in snapshot.unlisted_holders()}


def unreadable_could_matter(snapshot: Snapshot, threshold_mib: int) -> bool:
    """Whether processes whose open files cannot be read could hide a GPU memory holder: only
    when some GPU has memory above the threshold that nothing visible explains (or memory is
    not known). Inside a container the runtime's PID 1 is always unreadable; saying so on
    every run, with every GPU's memory accounted for, is a warning that cries wolf."""
    unexplained = unexplained_mib(snapshot, (), threshold_mib)
    return unexplained is None or bool(unexplained)


# ------------------------------------------------ listed processes: do they hold their GPU?
#
# The GPU reader's process list (nvidia-smi --query-compute-apps, NVML) is the best evidence of
# who holds GPU memory, but a row is only a PID: a stale driver entry names a PID since reused,
# and nvidia-smi prints a process's chosen name into its CSV (newlines verbatim; commas as '?'
# on driver 580, other drivers unrecorded), where a title could forge rows naming any PID (the
# agent no longer asks for names). So a listed process is trusted as a holder of GPU N only when it has GPU N's device
# file (/dev/nvidia<minor>) open -- the agent reads a zombie leader's through its threads --
# and, where its maps are readable, /dev/nvidia-uvm mapped: every CUDA context maps it; an NVML
# client and a cuInit-only process do not (recorded/probe/h200-clients-probe3.log). Where that
# cannot be checked (its open files refused, WSL2's /dev/dxg, the GPU's minor unknown) the row
# counts as before and says "unverified".

LISTING_VERIFIED = "verified"
LISTING_UNVERIFIED = "unverified"
LISTING_REFUSED = "refused"  # not a holder of that GPU: never a target, its memory unexplained

_UVM = "/dev/nvidia-uvm"


@dataclass(frozen=True)
class ListingCheck:
    """Whether a listed process holds the GPUs it is listed on, and why (for the operator)."""

    pid: int
    trust: str  # LISTING_VERIFIED | LISTING_UNVERIFIED | LISTING_REFUSED
    reason: str
    gpus: tuple[int, ...]
    reader: str = "nvidia-smi"

    @property
    def evidence_reason(self) -> str:
        """The whole evidence in one line: who lists it where, and what its files say."""
        gpus = ",".join(str(i) for i in self.gpus)
        return f"listed by {self.reader} on GPU {gpus}; {self.reason}"


def fds_readable(snapshot: Snapshot, proc: ProcessInfo) -> bool:
    """Whether the agent could read ``proc``'s open files: the agent says so (fds_readable);
    for older agents, what its facts imply (root, every fd read, or the agent's own user)."""
    if proc.fds_readable is not None:
        return proc.fds_readable
    if any(u.pid == proc.pid for u in snapshot.fd_unreadable):
        return False
    facts = snapshot.facts
    return bool(facts.is_root or facts.can_read_all_fds
                or (facts.uid is not None and proc.uid == facts.uid))


def listing_check(snapshot: Snapshot, pid: int,
                  holders: Optional[Mapping[int, Holder]] = None) -> Optional[ListingCheck]:
    """THE rule for a process the GPU reader lists (the comment above): verified, unverified
    or refused. None when it is not listed on a known GPU or not in this /proc (an invisible
    row, reported as such). ``holders``: the snapshot's holders by pid, when already made."""
    gpus = snapshot.gpu_indices_of_app(pid)
    proc = snapshot.processes.get(pid)
    if proc is None or not gpus:
        return None

    def check(trust: str, reason: str) -> ListingCheck:
        return ListingCheck(pid, trust, reason, gpus, snapshot.gpu_reader)

    listed = f"listed by {snapshot.gpu_reader} on GPU"
    if holders is None:
        holders = {h.pid: h for h in snapshot.holders}
    holder = holders.get(pid)
    if not fds_readable(snapshot, proc):
        return check(LISTING_UNVERIFIED, "unverified: its open files could not be read")
    if holder is None and is_zombie(proc):
        return check(LISTING_UNVERIFIED, "unverified: a zombie, its open files are gone")
    by_index = {g.index: g for g in snapshot.gpus}
    if holder is None:
        minor = by_index[gpus[0]].minor
        what = "NVIDIA device file" if snapshot.facts.wsl2 or minor is None else \
            f"/dev/nvidia{minor}"
        return check(LISTING_REFUSED, f"{listed} {gpus[0]} but has no {what} open")
    if snapshot.facts.wsl2:
        return check(LISTING_UNVERIFIED, "unverified: WSL2 has no /dev/nvidiaN (its GPUs are "
                     "/dev/dxg)")
    devices = []
    for index in gpus:
        minor = by_index[index].minor
        if minor is None:
            return check(LISTING_UNVERIFIED, f"unverified: the minor number of GPU {index} "
                         "(its /dev/nvidiaN) is unknown")
        devices.append(f"/dev/nvidia{minor}")
        if devices[-1] not in holder.devices:
            return check(LISTING_REFUSED, f"{listed} {index} but has no {devices[-1]} open")
    opened = ", ".join(devices)
    if holder.mapped is None:
        return check(LISTING_VERIFIED, f"has {opened} open (its maps not available)")
    if _UVM not in holder.mapped:
        return check(LISTING_REFUSED, f"{listed} {','.join(map(str, gpus))} but has no CUDA "
                     f"context ({_UVM} not mapped)")
    return check(LISTING_VERIFIED, f"has {opened} open and {_UVM} mapped")


def listing_checks(snapshot: Snapshot) -> dict[int, ListingCheck]:
    """listing_check of every listed process in this /proc, by pid."""
    out = {}
    holders = {h.pid: h for h in snapshot.holders}
    for pid in sorted(snapshot.listed_pids()):
        found = listing_check(snapshot, pid, holders)
        if found is not None:
            out[pid] = found
    return out


def refused_listings(snapshot: Snapshot) -> dict[int, ListingCheck]:
    """The listed processes that hold nothing of the GPUs they are listed on."""
    return {p: c for p, c in listing_checks(snapshot).items() if c.trust == LISTING_REFUSED}


def without_refused_listings(snapshot: Snapshot, drop_holders: bool = True) -> Snapshot:
    """The snapshot as the plan may trust it: the rows of refused listings dropped (their
    memory counts as unattributed, unexplained) and, with ``drop_holders``, those PIDs no
    device-file holders either (so they cannot come back as device-file candidates)."""
    refused = refused_listings(snapshot)
    if not refused:
        return snapshot
    holders = snapshot.holders
    if drop_holders:
        holders = tuple(h for h in holders if h.pid not in refused)
    return replace(snapshot, holders=holders,
                   compute_apps=tuple(a for a in snapshot.compute_apps if a.pid not in refused))


# ------------------------------------------------------------------ owners (never signalled by default)
#
# Killing a process that something restarts frees its memory for a second: a supervisor
# (supervisord respawns about 1 s after SIGKILL), a shell loop, torchrun's elastic agent, ray's
# raylet, a systemd unit, a container runtime or a Kubernetes pod start it again, and the
# memory comes back (measured on an H200: a restarted torch child is listed by NVML 3.5-4.0 s
# after its predecessor's SIGKILL, tests/fixtures/real-h200/clean-cases/). So the plan names
# each target's owner, from evidence, and the clean watches for the GPU being retaken. An owner
# is never signalled unless the operator names it (clean --owner).

OWNER_UNIT = "unit"
OWNER_USER_UNIT = "user-unit"
OWNER_CONTAINER = "container"
OWNER_POD = "pod"
OWNER_SLURM = "slurm-job"
OWNER_SUPERVISOR = "supervisor"  # a parent that restarts it, on evidence
OWNER_PARENT = "parent"  # a live parent with no evidence that it restarts anything

# Programs whose job is to restart what they started (names ADD evidence of restarting; they
# never make anything a target).
SUPERVISOR_NAMES = frozenset({
    "supervisord", "runsv", "runsvdir", "s6-supervise", "containerd-shim",
    "containerd-shim-runc-v2", "conmon", "raylet", "pm2", "circusd", "gunicorn",
})
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "ksh", "busybox"})
SHELL_LOOPS = ("while ", "while:", "until ", "for ")


@dataclass(frozen=True)
class Owner:
    """Whatever may start a target again, and what the operator can do about it."""

    kind: str
    name: str  # "vllm.service", "PID 134 sh", "docker:0123456789ab", "pod 1234-..."
    pid: Optional[int] = None
    starttime: Optional[int] = None
    restarts: Optional[bool] = None  # True on evidence; None: not known
    evidence: str = ""
    action: str = ""


def _script_restarts(parent: ProcessInfo, child: ProcessInfo) -> bool:
    """A ``sh -c SCRIPT`` whose script is a loop that runs the child's program."""
    words = parent.cmdline.split(" ", 2)
    if len(words) < 3 or os.path.basename(words[0]) not in SHELLS or words[1] != "-c":
        return False
    script = words[2]
    if not any(loop in script for loop in SHELL_LOOPS):
        return False
    names = {child.comm, _argv0(child)} | {os.path.basename(w) for w in child.cmdline.split()[:2]}
    return any(n and n in script for n in names)


def _supervisor_evidence(parent: ProcessInfo, child: ProcessInfo) -> Optional[str]:
    """Why ``parent`` restarts ``child``, or None when nothing says it does."""
    names = {parent.comm, _argv0(parent), exe_basename(parent) or ""}
    known = sorted(n for n in names if n in SUPERVISOR_NAMES or n.startswith("containerd-shim"))
    if known:
        return f"{known[0]} restarts what it supervises"
    if "torch.distributed.run" in parent.cmdline or _argv0(parent) == "torchrun":
        return "torchrun's elastic agent restarts its workers"
    if _script_restarts(parent, child):
        return "its shell script is a loop that runs it again"
    return None


def _pod_uid(cgroup: Optional[str]) -> Optional[str]:
    """The pod UID in a kubelet cgroup path (``/kubepods/burstable/pod<uid>/...`` or
    ``.../kubepods-burstable-pod<uid>.slice/...``; systemd's driver writes its dashes as _)."""
    comps = [c for c in (cgroup or "").split("/") if c]
    if not comps or not comps[0].startswith("kubepods"):
        return None
    for comp in comps:
        name = comp[:-len(".slice")] if comp.endswith(".slice") else comp
        if name.startswith("pod"):
            return name[3:].replace("_", "-") or None
        if "-pod" in name:
            return name[name.rindex("-pod") + 4:].replace("_", "-") or None
    return None


def _slurm_job(cgroup: Optional[str]) -> Optional[str]:
    for comp in (cgroup or "").split("/"):
        if comp.startswith("job_") and comp[4:].isdigit():
            return comp[4:]
    return None


def owner_of(proc: ProcessInfo, processes: Mapping[int, ProcessInfo],
             targets: frozenset[int] = frozenset()) -> Optional[Owner]:
    """THE rule for what may start ``proc`` again, from evidence: its systemd unit (systemd's
    own answer), a user's unit, a Kubernetes pod, a container, a Slurm job, or the nearest
    live ancestor that is no target, not PID 1, not sshd and not the agent's own session:
    an owner that restarts it when its program or script says so (SUPERVISOR_NAMES, torchrun,
    a shell loop that runs it), else only its parent (an interactive shell that started a
    job does not restart it). None: nothing but init is above it."""
    unit = service_unit(proc)
    if unit is not None:
        return Owner(OWNER_UNIT, unit, restarts=None, evidence="systemd says it owns the process",
                     action=f"stop the unit ({unit}) or pass --stop-units")
    if proc.user_unit and proc.user_unit_uid is not None and proc.user_unit.endswith(".service"):
        uid = proc.user_unit_uid
        return Owner(OWNER_USER_UNIT, f"{proc.user_unit} (uid {uid})", restarts=None,
                     evidence="a unit of the user's own systemd",
                     action=f"systemctl --user -M {uid}@ stop {proc.user_unit}")
    pod = _pod_uid(proc.cgroup) if (proc.container or "").startswith(("k8s", "kubepods")) else None
    if pod is not None:
        return Owner(OWNER_POD, f"pod {pod} ({proc.container})", restarts=True,
                     evidence="Kubernetes restarts a pod's containers",
                     action="delete or scale down the pod (kubectl)")
    if proc.container:
        policy = proc.container_restart
        restarts = None if policy is None else policy != "no"
        why = (f"its restart policy is {policy} (the runtime's inspect)" if policy else
               "the container runtime may restart it (its restart policy was not read)")
        return Owner(OWNER_CONTAINER, proc.container, restarts=restarts, evidence=why,
                     action=f"stop the container ({proc.container})")
    job = _slurm_job(proc.cgroup)
    if job is not None:
        return Owner(OWNER_SLURM, f"Slurm job {job}", restarts=None,
                     evidence="the process is in the job's cgroup",
                     action=f"scancel {job}")
    return _parent_owner(proc, processes, targets)


def _parent_owner(proc: ProcessInfo, processes: Mapping[int, ProcessInfo],
                  targets: frozenset[int]) -> Optional[Owner]:
    child, seen = proc, {proc.pid}
    parent = processes.get(proc.ppid) if proc.ppid is not None else None
    while parent is not None and parent.pid in targets and parent.pid not in seen:
        seen.add(parent.pid)
        child = parent
        parent = processes.get(parent.ppid) if parent.ppid is not None else None
    if parent is None or parent.pid <= 1 or parent.relation in RELATIONS or is_sshd(parent) \
            or is_kernel_thread(parent):
        return None
    name = f"PID {parent.pid} {parent.name}"
    why = _supervisor_evidence(parent, child)
    if why is not None:
        return Owner(OWNER_SUPERVISOR, name, parent.pid, parent.starttime, True, why,
                     f"stop it, or pass --owner {parent.pid} to include it")
    return Owner(OWNER_PARENT, name, parent.pid, parent.starttime, None,
                 "its parent; nothing says it restarts it",
                 f"if it starts {child.name} again, stop it or pass --owner {parent.pid}")
