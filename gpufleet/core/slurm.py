"""Slurm's side of a node clean, pure: the job's environment, its GPUs, the time budget, the
prolog's "are these GPUs free" check, the one line a failure is told in (stderr, the node's
log, an optional drain reason), dcgm-exporter's job-map files and `scontrol show node`.

The epilog and prolog run as root on the node, started by slurmd with the job's environment
(recorded on Slurm 22.05.8, tests/fixtures/recorded/slurm/epilog-env.txt): SLURM_JOB_ID,
SLURM_JOB_UID, SLURM_JOB_USER, SLURM_JOB_GPUS (physical indices, e.g. ``0,1``),
CUDA_VISIBLE_DEVICES and GPU_DEVICE_ORDINAL (the same indices in the epilog),
SLURMD_NODENAME, SLURM_SCRIPT_CONTEXT (``prolog_slurmd`` / ``epilog_slurmd``), and no PATH.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

from gpufleet.core import mps, policy
from gpufleet.core.gpus import format_gpu_indices, format_gpu_ranges
from gpufleet.core.model import Snapshot
from gpufleet.core.plan import Plan
from gpufleet.errors import SlurmConfigError, UsageError

# Where the job's GPUs are read from, in order (the epilog's SLURM_JOB_GPUS holds physical
# indices; CUDA_VISIBLE_DEVICES / GPU_DEVICE_ORDINAL are the fallbacks of older Slurms).
GPU_VARS = ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")

# The time budget (seconds) and its parts; docs/slurm.md says why these numbers.
DEFAULT_BUDGET_S = 30.0  # well under UnkillableStepTimeout's 60 s default; see docs/slurm.md
DEFAULT_GRACE_S = 5.0  # SIGTERM -> SIGKILL (vLLM workers shut down in 1-3 s when they can)
MIN_BUDGET_S = 3.0
SNAPSHOT_SHARE = 0.25  # the first snapshot may take at most this share of the budget ...
SNAPSHOT_MAX_S = 10.0  # ... and never more than this (nvidia-smi hung in D state)
SMI_SHARE = 0.15  # the after-snapshot's nvidia-smi bound, as a share ...
SMI_MAX_S = 5.0  # ... and at most this
STARTUP_S = 1.0  # interpreter start-up and the agent's own start, kept out of the waits

REASON_PREFIX = "gpufleet:"
REASON_MAX = 200  # a drain reason people read in `sinfo -R`: one short line

_INDEX = re.compile(r"[0-9]+\Z")
_RANGE = re.compile(r"([0-9]+)-([0-9]+)\Z")
_UUID = re.compile(r"GPU-[0-9A-Fa-f-]+\Z")


@dataclass(frozen=True)
class JobEnv:
    """What the epilog/prolog knows about the job, from Slurm's environment."""

    job_id: str
    uid: int
    user: Optional[str]
    gpus: Optional[tuple[str, ...]]  # tokens (indices or GPU UUIDs); None: the job has none here
    gpu_source: Optional[str]  # the variable they came from
    node: Optional[str]
    context: Optional[str]

    @property
    def who(self) -> str:
        return f"{self.user or '?'} (uid {self.uid})"


def parse_job_env(env: Mapping[str, str], user_of: Callable[[int], Optional[str]]) -> JobEnv:
    """The job from Slurm's environment. No SLURM_JOB_ID: UsageError (run outside Slurm,
    nothing touched); a malformed or unknown value: SlurmConfigError. ``user_of(uid)`` is the
    passwd lookup (None: no such user on this node)."""
    job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    if not job_id:
        raise UsageError("not running under Slurm: SLURM_JOB_ID is not set (this command is "
                         "Slurm's Prolog/Epilog, run by slurmd with the job's environment); nothing touched")
    if not _INDEX.match(job_id):
        raise SlurmConfigError(f"SLURM_JOB_ID={job_id!r} is not a job id")
    raw_uid = (env.get("SLURM_JOB_UID") or env.get("SLURM_UID") or "").strip()
    if not _INDEX.match(raw_uid):
        raise SlurmConfigError(f"SLURM_JOB_UID={raw_uid!r} is not a user id" if raw_uid
                               else "SLURM_JOB_UID is not set")
    uid = int(raw_uid)
    user = user_of(uid)
    if user is None:
        raise SlurmConfigError(f"SLURM_JOB_UID={uid} has no passwd entry on this node")
    named = (env.get("SLURM_JOB_USER") or "").strip()
    if named and named != user:
        raise SlurmConfigError(f"SLURM_JOB_USER={named!r} is not uid {uid} ({user}) here")
    source = next((v for v in GPU_VARS if (env.get(v) or "").strip()), None)
    gpus = split_gpu_tokens(env[source], source) if source else None
    return JobEnv(job_id, uid, user, gpus, source, (env.get("SLURMD_NODENAME") or None),
                  (env.get("SLURM_SCRIPT_CONTEXT") or None))


def split_gpu_tokens(text: str, var: str) -> tuple[str, ...]:
    """``0,1,3`` / ``0-3`` / ``GPU-<uuid>,...`` -> tokens (indices as text, ranges expanded)."""
    out: list[str] = []
    for part in text.strip().split(","):
        part = part.strip()
        m = _RANGE.match(part)
        if _INDEX.match(part) or _UUID.match(part):
            out.append(str(int(part)) if _INDEX.match(part) else part)
        elif m and int(m.group(1)) <= int(m.group(2)) <= 1023:
            out.extend(str(i) for i in range(int(m.group(1)), int(m.group(2)) + 1))
        else:
            raise SlurmConfigError(f"{var}={text!r}: {part!r} is not a GPU index or GPU UUID "
                                   "(MIG instances are not supported)")
    return tuple(dict.fromkeys(out))


def resolve_gpus(job: JobEnv, gpus: Iterable[tuple[int, str]]) -> tuple[int, ...]:
    """The job's GPU indices on this node, from ``(index, uuid)`` of the node's GPUs; a GPU the
    node does not have is the configuration's fault."""
    have = {index: uuid for index, uuid in gpus}
    by_uuid = {uuid.lower(): index for index, uuid in have.items()}
    out = []
    for token in job.gpus or ():
        index = int(token) if _INDEX.match(token) else by_uuid.get(token.lower())
        if index is None or index not in have:
            has = f"has GPUs {format_gpu_ranges(have)}" if have else "has no GPUs"
            raise SlurmConfigError(f"{job.gpu_source}: GPU {token} does not exist on this "
                                   f"node ({has})")
        out.append(index)
    return tuple(sorted(set(out)))


# ---------------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class Budget:
    """How a budget of ``total_s`` is spent: the first snapshot, then TERM -> ``grace_s`` ->
    KILL and the memory wait (``timeout_s``, counted from the first signal), then the
    after-snapshot (nvidia-smi bounded by ``smi_s``). Their sum plus STARTUP_S is the total."""

    total_s: float
    snapshot_s: float
    grace_s: float
    timeout_s: float
    smi_s: float


def split_budget(total_s: float, grace_s: float = DEFAULT_GRACE_S) -> Budget:
    if total_s < MIN_BUDGET_S:
        raise UsageError(f"--budget {total_s:g}s is too short (at least {MIN_BUDGET_S:g}s)")
    snapshot = min(SNAPSHOT_MAX_S, total_s * SNAPSHOT_SHARE)
    smi = min(SMI_MAX_S, total_s * SMI_SHARE)
    timeout = total_s - snapshot - smi - STARTUP_S
    if grace_s >= timeout:
        raise UsageError(f"--grace {grace_s:g}s leaves no time to verify the memory inside "
                         f"--budget {total_s:g}s (the memory wait gets {timeout:.1f}s)")
    return Budget(total_s, round(snapshot, 3), grace_s, round(timeout, 3), round(smi, 3))


# ---------------------------------------------------------------------------- GPUs free?


@dataclass(frozen=True)
class Held:
    """Something that keeps one of the job's GPUs from being free."""

    gpu: Optional[int]
    text: str


def gpu_problems(snapshot: Snapshot, scope: Sequence[int], threshold_mib: Mapping[int, int],
                 holders: Iterable[tuple[int, Sequence[int], str]] = ()) -> list[Held]:
    """Why the GPUs in ``scope`` are not free: ``holders`` ((pid, GPUs, why) of processes with
    GPU evidence there: the plan's targets and refusals, a clean's survivors), each with who
    holds how much, then memory above a GPU's threshold (the host's expected unattributed
    memory + tolerance) that no holder above explains."""
    out: list[Held] = []
    for pid, gpus, why in holders:
        mine: list[Optional[int]] = list(sorted(set(gpus) & set(scope))) or [None]
        for where in mine:
            out.append(Held(where, f"{_gpu(where)}{holder_text(snapshot, pid, where)}{why}"))
    for index in scope:
        info = next((g for g in snapshot.gpus if g.index == index), None)
        used = info.memory_used_mib if info is not None else None
        limit = threshold_mib.get(index, 0)
        if used is None:
            out.append(Held(index, f"GPU {index}: memory used unknown"))
        elif used > limit and not any(h.gpu == index for h in out):
            out.append(Held(index, f"GPU {index}: {used} MiB used, no process holds it "
                                   f"(expected at most {limit} MiB)"))
    return out


# Refusals that hold no GPU memory by what they are: driver daemons, sshd and protected
# processes hold every device file on purpose (nvidia-persistenced on every real node), and a
# zombie holds none (measured); they keep a GPU from being free only when nvidia-smi lists
# them on it.
_NO_MEMORY_KINDS = (policy.PROTECTED, policy.ZOMBIE)


def plan_holders(plan: Plan, snapshot: Snapshot) -> list[tuple[int, Sequence[int], str]]:
    """Every process that keeps the plan's GPUs from being free: its targets, its refusals
    (with their reason; driver daemons and zombies only when nvidia-smi lists them there, CUDA
    MPS servers never: their memory is expected) and processes nvidia-smi lists that this PID
    namespace cannot see."""
    out: list[tuple[int, Sequence[int], str]] = [(t.pid, t.gpus, "") for t in plan.targets]
    listed = {a.pid for i in plan.scope for a in snapshot.apps_on(i)}
    expected = mps.expected_servers(snapshot)  # in the plan's threshold: a job can start
    out += [(r.pid, r.gpus, f": {r.reason}") for r in plan.refused
            if (r.kind not in _NO_MEMORY_KINDS or r.pid in listed) and r.pid not in expected]
    out += [(i.pid, (i.gpu,), " (not visible from this PID namespace)") for i in plan.invisible]
    return out


def _gpu(gpu: Optional[int]) -> str:
    return f"GPU {gpu}: " if gpu is not None else ""


def holder_text(snapshot: Snapshot, pid: int, gpu: Optional[int]) -> str:
    """``716 MiB held by pid 4711 VLLM::Worker (uid 1001)`` from the snapshot."""
    proc = snapshot.processes.get(pid)
    mib = None
    if gpu is not None:
        mib = sum((a.used_mib or 0) for a in snapshot.apps_on(gpu) if a.pid == pid) or None
    name = proc.name if proc is not None else next(
        (a.process_name for a in snapshot.compute_apps if a.pid == pid), "?")
    uid = f" (uid {proc.uid})" if proc is not None and proc.uid is not None else ""
    held = f"{mib} MiB held" if mib is not None else "held"
    return f"{held} by pid {pid} {name}{uid}"


def failure_line(problems: Sequence[Held], fallback: str = "failed") -> str:
    """The one line (stderr, node log, drain reason): ``gpufleet: GPU 1: ... after KILL``."""
    first = problems[0].text if problems else fallback
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return one_reason(f"{REASON_PREFIX} {first}{more}")


def one_reason(text: str) -> str:
    """One line of at most REASON_MAX characters, nothing a shell or scontrol would split on
    mis-read (it travels as one argv word anyway)."""
    line = " ".join(str(text).split())
    return line if len(line) <= REASON_MAX else line[: REASON_MAX - 3] + "..."


# ---------------------------------------------------------------------- dcgm-exporter map


def job_map_add(text: str, job_id: str) -> str:
    """dcgm-exporter's job-map file of one GPU (named by its index; one job id per line,
    NVIDIA/dcgm-exporter README "File Conventions"), with ``job_id`` added once."""
    jobs = [j for j in text.split() if j]
    if job_id not in jobs:
        jobs.append(job_id)
    return "".join(j + "\n" for j in jobs)


def job_map_remove(text: str, job_id: str) -> Optional[str]:
    """The file without ``job_id``; None when no job is left (remove the file)."""
    jobs = [j for j in text.split() if j and j != job_id]
    return "".join(j + "\n" for j in jobs) if jobs else None


# ------------------------------------------------------------------ scontrol show node -o


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # e.g. IDLE+DRAIN
    reason: str  # "" when none

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state.replace("*", "").split("+")

    @property
    def gpufleet_reason(self) -> bool:
        return self.reason.startswith(REASON_PREFIX)


def parse_show_node(text: str) -> list[SlurmNode]:
    """`scontrol show node -o` (one node a line, recorded in tests/fixtures/recorded/slurm/):
    NodeName= first; Reason= is the last field and may hold spaces, ending in ``[user@time]``."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("NodeName="):
            continue
        reason = ""
        at = line.find(" Reason=")
        if at >= 0:
            reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*\Z", "", line[at + len(" Reason="):]).strip()
            line = line[:at]
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        out.append(SlurmNode(fields.get("NodeName", "?"), fields.get("State", "?"), reason))
    return out


def describe_gpus(indices: Iterable[int]) -> str:
    return format_gpu_indices(indices) or "none"
