"""`gpufleet slurm epilog|prolog|undrain`: Slurm runs gpufleet on every node.

The epilog is `clean` on this node (ops.clean.run_clean with a ``connection: local`` host, the
same agent, policy, identity checks and memory-verified verdict), scoped to the job's GPUs,
targets limited to the job user's processes (policy.job_owner_reason), inside one time budget
(core.slurm.split_budget). The prolog is the same snapshot and plan, signalling nothing: the
job's GPUs must be free. A failure is one line, on stderr and in the node's log (syslog,
facility daemon, tag ``gpufleet``; optionally a file too); Slurm drains the node on the
non-zero exit. ``undrain`` runs on an operator's machine: it resumes the nodes drained with a
gpufleet reason whose GPUs are free now.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import syslog
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.core import health
from gpufleet.core import slurm as core
from gpufleet.core.plan import Plan, make_plan
from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.core.model import Snapshot
from gpufleet.errors import SlurmConfigError, UsageError
from gpufleet.ops.clean import CleanOptions, HostClean, run_clean
from gpufleet.ops.collect import snapshot_host

DEFAULT_AUDIT_LOG = "/var/log/gpufleet/audit.jsonl"  # a node's audit log (root, no home dir)
SCONTROL_TIMEOUT_S = 5.0
FALLBACK_PATH = ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/bin", "/sbin")


@dataclass(frozen=True)
class SlurmOptions:
    budget_s: float = core.DEFAULT_BUDGET_S
    grace_s: float = core.DEFAULT_GRACE_S
    tolerance_mib: int = DEFAULT_TOLERANCE_MIB
    unattributed_mib: int = 0  # memory this node's GPUs show with nothing running
    protect: tuple[str, ...] = ()
    audit_log: Optional[str] = None
    drain_reason: bool = False
    dcgm_job_map: Optional[str] = None
    nvidia_smi: Optional[str] = None
    log_file: Optional[str] = None
    syslog: bool = True
    scontrol: str = "scontrol"


@dataclass
class SlurmOutcome:
    """What one prolog/epilog run found and did; ``line`` is what stderr and the log say."""

    ok: bool
    line: str
    job: Optional[core.JobEnv] = None
    gpus: tuple[int, ...] = ()
    problems: list[core.Held] = field(default_factory=list)
    clean: Optional[HostClean] = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def user_of(uid: int) -> Optional[str]:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def local_host(name: str, opts: SlurmOptions, snapshot_s: float) -> Host:
    """This node as a ``connection: local`` host: the agent runs under this interpreter (the
    Prolog/Epilog environment has no PATH), bounded by the budget's snapshot share."""
    return Host(name=name, connection="local", python=sys.executable,
                command_timeout=snapshot_s + 2.0, nvidia_smi=opts.nvidia_smi,
                unattributed_mib=opts.unattributed_mib, protect=opts.protect)


def _node_name(job: core.JobEnv) -> str:
    return job.node or socket.gethostname()


def _job_gpus_text(job: core.JobEnv, host: Host) -> str:
    """The clean's --gpus: the indices Slurm gave; GPU UUIDs are resolved from a snapshot."""
    tokens = job.gpus or ()
    if all(t.isdigit() for t in tokens):
        return ",".join(tokens)
    before = snapshot_host(host)
    if not before.ok or before.snapshot is None:
        raise SlurmConfigError(f"cannot map {job.gpu_source} to GPU indices: {before.error}")
    return ",".join(str(i) for i in core.resolve_gpus(
        job, [(g.index, g.uuid) for g in before.snapshot.gpus]))


# ------------------------------------------------------------------------------- epilog


def logged(run: Callable[[Mapping[str, str], SlurmOptions], SlurmOutcome]
           ) -> Callable[[Mapping[str, str], SlurmOptions], SlurmOutcome]:
    """A configuration error goes to the node's log too (then to stderr and exit 2 by the
    CLI): Slurm drains the node, and the log must say why."""

    def wrapped(env: Mapping[str, str], opts: SlurmOptions) -> SlurmOutcome:
        try:
            return run(env, opts)
        except SlurmConfigError as exc:
            node_log(opts, core.one_reason(f"{core.REASON_PREFIX} error: {exc}"), ok=False)
            raise

    wrapped.__doc__ = run.__doc__
    return wrapped


@logged
def run_epilog(env: Mapping[str, str], opts: SlurmOptions) -> SlurmOutcome:
    """Free the job's GPUs of the job user's leftovers; ok only when the memory is back."""
    started = time.monotonic()
    budget = core.split_budget(opts.budget_s, opts.grace_s)
    job = core.parse_job_env(env, user_of)
    if job.gpus is None:
        return _done(SlurmOutcome(True, f"job {job.job_id}: no GPUs on this node; nothing to "
                                  "do", job), opts, started)
    host = local_host(_node_name(job), opts, budget.snapshot_s)
    clean_opts = CleanOptions(
        gpus=_job_gpus_text(job, host), grace_s=budget.grace_s, timeout_s=budget.timeout_s,
        tolerance_mib=opts.tolerance_mib, protect=opts.protect, audit_log=audit_path(opts),
        operator=f"slurm-epilog job {job.job_id} user {job.who}", job_uid=job.uid,
        smi_timeout_s=budget.smi_s, release_wait_s=None,  # the ended job's memory may still be freed
        audit_extra=(("job_id", job.job_id), ("job_user", job.user), ("job_uid", job.uid)))
    try:
        run = run_clean([host], clean_opts, forks=1, confirm=_act_unless_free)
    except UsageError as exc:  # a GPU the node does not have: Slurm's configuration
        raise SlurmConfigError(str(exc).split("; nothing signalled")[0]) from None
    row = run.results[0]
    out = _epilog_outcome(job, row, declined=run.declined)
    if opts.dcgm_job_map:
        out.notes += job_map_remove(opts.dcgm_job_map, job.job_id, out.gpus)
    if not out.ok and opts.drain_reason:
        out.notes.append(drain(opts, _node_name(job), out.line))
    return _done(out, opts, started)


def _act_unless_free(results: list[HostClean]) -> bool:
    """run_clean's confirm step: act when the plan has targets or the memory is not back yet
    (a driver still releasing a dead process's memory: the agent's memory wait); when the
    GPUs are already free and nothing is to be signalled, the first snapshot is the verdict
    (no second agent run: the common case at every job end stays fast)."""
    for r in results:
        if r.plan is None or r.before is None or r.before.snapshot is None:
            continue
        if r.plan.targets or core.gpu_problems(r.before.snapshot, r.plan.scope,
                                               r.plan.threshold_mib):
            return True
    return False


def _epilog_outcome(job: core.JobEnv, row: HostClean, declined: bool) -> SlurmOutcome:
    plan = row.plan
    if plan is None or row.before is None or row.before.snapshot is None:
        line = core.one_reason(f"{core.REASON_PREFIX} {row.error or 'the clean failed'}")
        return SlurmOutcome(False, line, job, clean=row)
    if declined:  # nothing to signal: the first snapshot decides
        problems = core.gpu_problems(row.before.snapshot, plan.scope, plan.threshold_mib,
                                     core.plan_holders(plan, row.before.snapshot))
    elif row.verdict == "clean":
        problems = []
    else:
        problems = _dirty_problems(row, plan)
    signalled = len({s.get("pid") for s in (row.agent_doc or {}).get("signals") or ()})
    if problems or (not declined and row.verdict != "clean"):
        line = core.failure_line(problems, row.reason or row.error or row.verdict)
        return SlurmOutcome(False, line, job, plan.scope, problems, row)
    freed = row.verdict_detail.get("freed_mib")
    what = f"{signalled} process(es) signalled, {freed} MiB freed" if signalled else \
        "nothing left to signal"
    return SlurmOutcome(True, f"job {job.job_id}: GPU {core.describe_gpus(plan.scope)} free "
                        f"({what})", job, plan.scope, [], row)


def _dirty_problems(row: HostClean, plan: Plan) -> list[core.Held]:
    """What holds the job's GPUs after the clean, from the verdict and its after-snapshot."""
    after: Optional[Snapshot] = row.after
    if after is None:
        return []
    signals = (row.agent_doc or {}).get("signals") or ()
    last = " after KILL" if any(s.get("signal") == "KILL" for s in signals) else \
        (" after TERM" if signals else "")
    refused = {r.pid: r for r in plan.refused}
    holders = []
    for s in row.verdict_detail.get("survivors") or ():
        pid = int(s["pid"])
        why = f": {refused[pid].reason}" if pid in refused else \
            (last if s.get("kind") in ("survived", "stuck", "zombie") else f" ({s.get('kind')})")
        holders.append((pid, tuple(s.get("gpus") or ()), why))
    problems = core.gpu_problems(after, plan.scope, plan.threshold_mib, holders)
    return [core.Held(p.gpu, p.text + last) if "no process holds it" in p.text else p
            for p in problems]


# ------------------------------------------------------------------------------- prolog

# The checks a job's GPUs must pass before it starts, in order; each gives what is wrong
# (empty: passed): the GPUs are free, then they are healthy (core/health.job_refusal).
PrologGate = Callable[[Snapshot, tuple[int, ...], Plan, "SlurmOptions"], list[core.Held]]


def free_gate(snap: Snapshot, scope: tuple[int, ...], plan: Plan, opts: SlurmOptions
              ) -> list[core.Held]:
    """No process with GPU evidence on the job's GPUs, memory at or below the expected."""
    return core.gpu_problems(snap, scope, plan.threshold_mib, core.plan_holders(plan, snap))


def health_gate(snap: Snapshot, scope: tuple[int, ...], plan: Plan, opts: SlurmOptions
                ) -> list[core.Held]:
    """No CRITICAL health finding (docs/health.md) on the job's GPUs or on the node: a job
    must not start on a GPU with uncorrected ECC errors, a failed row remap, Xid 79, ..."""
    verdict = health.assess(snap.facts.hostname or "node", snap)
    why = health.job_refusal(verdict, scope)
    return [] if why is None else [core.Held(None, f"health: {why}")]


PROLOG_GATES: tuple[PrologGate, ...] = (free_gate, health_gate)


@logged
def run_prolog(env: Mapping[str, str], opts: SlurmOptions) -> SlurmOutcome:
    """The job's GPUs must be free before it starts; nothing is signalled."""
    started = time.monotonic()
    job = core.parse_job_env(env, user_of)
    if job.gpus is None:
        return _done(SlurmOutcome(True, f"job {job.job_id}: no GPUs on this node", job),
                     opts, started)
    host = local_host(_node_name(job), opts, max(1.0, opts.budget_s - core.STARTUP_S - 2.0))
    result = snapshot_host(host)
    if not result.ok or result.snapshot is None:
        line = core.one_reason(f"{core.REASON_PREFIX} cannot check the GPUs: {result.error}")
        return _done(SlurmOutcome(False, line, job), opts, started)
    snap = result.snapshot
    scope = core.resolve_gpus(job, [(g.index, g.uuid) for g in snap.gpus])
    plan = make_plan(snap, scope, protect=opts.protect, unattributed_mib=opts.unattributed_mib,
                     tolerance_mib=opts.tolerance_mib, host=host.name)
    problems = [p for gate in PROLOG_GATES for p in gate(snap, scope, plan, opts)]
    if problems:
        line = core.failure_line([core.Held(p.gpu, f"{p.text} before job {job.job_id}")
                                  for p in problems])
        out = SlurmOutcome(False, line, job, scope, problems)
        if opts.drain_reason:
            out.notes.append(drain(opts, host.name, line))
        return _done(out, opts, started)
    out = SlurmOutcome(True, f"job {job.job_id}: GPU {core.describe_gpus(scope)} free", job, scope)
    if opts.dcgm_job_map:
        out.notes += job_map_add(opts.dcgm_job_map, job.job_id, scope)
    return _done(out, opts, started)


# ------------------------------------------------------------------- logs, drain, maps


def audit_path(opts: SlurmOptions) -> str:
    return opts.audit_log or os.environ.get("GPUFLEET_AUDIT_LOG") or DEFAULT_AUDIT_LOG


def _done(out: SlurmOutcome, opts: SlurmOptions, started: float) -> SlurmOutcome:
    out.seconds = time.monotonic() - started
    node_log(opts, out.line if not out.ok else f"gpufleet: {out.line}", ok=out.ok)
    return out


def node_log(opts: SlurmOptions, line: str, ok: bool) -> None:
    """The node's log: syslog (daemon facility, tag gpufleet; journald reads /dev/log) and,
    with --log-file, one appended line there. Best effort: the exit code is what Slurm reads."""
    if opts.syslog:
        syslog.openlog("gpufleet", syslog.LOG_PID, syslog.LOG_DAEMON)
        syslog.syslog(syslog.LOG_INFO if ok else syslog.LOG_ERR, line)
        syslog.closelog()
    if opts.log_file:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            Path(opts.log_file).parent.mkdir(parents=True, exist_ok=True)
            with open(opts.log_file, "a", encoding="utf-8") as f:
                f.write(f"{stamp} {line}\n")
        except OSError:
            pass


def find_tool(name: str) -> str:
    """A Slurm command by name (the Prolog/Epilog environment has no PATH) or as given."""
    if os.sep in name:
        return name
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(FALLBACK_PATH)) or name


def scontrol(opts: SlurmOptions, args: Sequence[str]) -> Optional[str]:
    """Run scontrol (argv, never a shell); the error line, or None when it worked."""
    argv = [find_tool(opts.scontrol)] + list(args)
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    if res.returncode != 0:
        return f"scontrol exit {res.returncode}: {' '.join(res.stderr.split())[:200]}"
    return None


def drain(opts: SlurmOptions, node: str, line: str) -> str:
    """--drain-reason: DRAIN the node with gpufleet's reason (Slurm would drain it anyway on
    the exit code, with the reason "Epilog error"); what happened, for the notes."""
    failed = scontrol(opts, ["update", f"NodeName={node}", "State=DRAIN", f"Reason={line}"])
    return f"drain reason not set: {failed}" if failed else f"drained {node}: {line}"


def job_map_add(directory: str, job_id: str, gpus: Sequence[int]) -> list[str]:
    return _job_map(directory, gpus, lambda text: core.job_map_add(text, job_id))


def job_map_remove(directory: str, job_id: str, gpus: Sequence[int]) -> list[str]:
    return _job_map(directory, gpus, lambda text: core.job_map_remove(text, job_id))


def _job_map(directory: str, gpus: Sequence[int], change: Callable[[str], Optional[str]]
             ) -> list[str]:
    """dcgm-exporter's --hpc-job-mapping-dir: one file per GPU index, replaced atomically."""
    notes = []
    for index in gpus:
        path = Path(directory) / str(index)
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            text = path.read_text(encoding="ascii") if path.exists() else ""
            new = change(text)
            if new is None:
                path.unlink(missing_ok=True)
                continue
            tmp = path.with_name(f".{index}.{os.getpid()}.tmp")
            tmp.write_text(new, encoding="ascii")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            notes.append(f"dcgm job map {path}: {exc}")
    return notes


# ------------------------------------------------------------------------------ undrain


@dataclass(frozen=True)
class UndrainRow:
    node: str
    action: str  # resumed | would resume | left drained | not in inventory
    detail: str


def drained_nodes(opts: SlurmOptions, reasons: Sequence[str] = ()) -> list[core.SlurmNode]:
    """Nodes Slurm shows drained with a gpufleet reason (or one matching ``reasons`` globs)."""
    import fnmatch

    argv = [find_tool(opts.scontrol), "show", "node", "-o"]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S * 2,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"{argv[0]} show node: {exc}") from None
    if res.returncode != 0:
        raise UsageError(f"scontrol show node: exit {res.returncode}: "
                         f"{' '.join(res.stderr.split())[:200]}")
    nodes = core.parse_show_node(res.stdout)
    return [n for n in nodes if n.drained and (
        n.gpufleet_reason or any(fnmatch.fnmatchcase(n.reason, g) for g in reasons))]


def undrain(nodes: Sequence[core.SlurmNode], hosts: Mapping[str, Host], opts: SlurmOptions,
            dry_run: bool, forks: int = 32) -> list[UndrainRow]:
    """Check each drained node (its inventory host's snapshot, every GPU) and resume only the
    clean ones; a node the inventory lacks, or that is still dirty, stays drained."""
    from gpufleet.ops.collect import snapshot_hosts

    known = [hosts[n.name] for n in nodes if n.name in hosts]
    results = {r.host: r for r in snapshot_hosts(known, forks=forks)}
    rows = []
    for node in nodes:
        result = results.get(node.name)
        if result is None:
            rows.append(UndrainRow(node.name, "not in inventory", f"left drained ({node.reason})"))
            continue
        if not result.ok or result.snapshot is None:
            rows.append(UndrainRow(node.name, "left drained", f"not checked: {result.error}"))
            continue
        problems = node_problems(result.snapshot, hosts[node.name], opts)
        if problems:
            rows.append(UndrainRow(node.name, "left drained", core.failure_line(problems)))
        elif dry_run:
            rows.append(UndrainRow(node.name, "would resume", "GPUs free"))
        else:
            failed = scontrol(opts, ["update", f"NodeName={node.name}", "State=RESUME"])
            rows.append(UndrainRow(node.name, "left drained" if failed else "resumed",
                                   failed or "GPUs free"))
    return rows


def node_problems(snap: Snapshot, host: Host, opts: SlurmOptions) -> list[core.Held]:
    """The prolog's gates over every GPU of the node."""
    scope = tuple(g.index for g in snap.gpus)
    plan = make_plan(snap, scope, protect=tuple(host.protect) + opts.protect,
                     unattributed_mib=int(host.unattributed_mib or 0),
                     tolerance_mib=opts.tolerance_mib, host=host.name)
    return [p for gate in PROLOG_GATES for p in gate(snap, scope, plan, opts)]
