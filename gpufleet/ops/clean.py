"""`gpufleet clean` over many hosts: snapshot -> plan -> (confirm) -> agent clean -> verdict.

ONE exec and one agent process per host (a conversation, ``Session.converse``): the agent
answers the snapshot the plan is made from and stays (its stay mode), then, once every host is
planned and the operator agreed, answers the clean request: the sequence (identity re-check,
TERM, grace, KILL, wait for memory, final snapshot) runs on the host in one go, so a slow link
adds nothing between signal and verification. Over OpenSSH that is one ``ssh`` process per
host and no master. If the conversation is gone before the clean request was written (the
agent's idle bound while the operator was slow, the network, an EOF), the row says nothing was
signalled; if it dies after, the outcome is unknown (the host keeps an audit record).

:func:`run_clean` is the whole command: every host's TCP connect starts at once (pre-dial),
every host is planned (its conversation held open), and only when every plan is valid and the
operator agreed (the CLI's ``confirm`` callback) is anything signalled, through the same
conversations. A dry run plans with one-shot runs (nothing stays). Runbooks call ``plan_host``
/ ``execute_plan`` on a session they already hold (two execs over their kept connection).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.config.selection import parse_gpu_list
from gpufleet.core import mps
from gpufleet.core.cancel import cancel_unanswered, cancel_undelivered, cancelled_reason
from gpufleet.core.hostlock import lock_failure
from gpufleet.core.model import HostResult, Snapshot, parse_snapshot
from gpufleet.core.plan import RELEASE_WAIT_S, Plan, make_plan, release_floors, to_request
from gpufleet.core.plan.notes import fleet_protect_notes
from gpufleet.core.results import Failure, HostOutcome
from gpufleet.errors import SnapshotError, UsageError, first_line, kind_of
from gpufleet.ops import audit
from gpufleet.ops.collect import result_from_reply, snapshot_request
from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.ops.fanout import NOT_STARTED, run_hosts
from gpufleet.transport import AgentReply, Conversation, Session, open_session, predial

AGENT_MARGIN_S = 5.0  # the controller waits this much longer than the agent's own deadline


@dataclass(frozen=True)
class CleanOptions:
    gpus: str = "all"
    grace_s: float = 10.0
    timeout_s: float = 60.0
    tolerance_mib: int = DEFAULT_TOLERANCE_MIB
    protect: tuple[str, ...] = ()
    protect_label: str = "--protect"  # what the plan's notes call ``protect`` (a runbook step's)
    include_spanning: bool = False
    stop_units: bool = False
    disable_units: bool = False
    shm: bool = False
    reset: bool = False
    audit_log: Optional[str] = None
    operator: str = field(default_factory=audit.operator_name)
    lock_path: Optional[str] = None
    job_uid: Optional[int] = None  # a Slurm job's user: nobody else's process is signalled
    smi_timeout_s: float = 10.0  # the after-snapshot's nvidia-smi bound
    idle_s: float = 3600.0  # the agent waits this long for the clean request after its plan
    # How long the memory wait gives memory nothing signalled can free (plan.release_floors):
    # every clean (the CLI, a runbook's step, top's) stops waiting on it after that; None: the
    # whole timeout (a Slurm epilog runs while the driver still frees the ended job's memory).
    release_wait_s: Optional[float] = RELEASE_WAIT_S
    audit_extra: tuple[tuple[str, Any], ...] = ()  # more audit keys (a Slurm job id, its user)
    owners: tuple[str, ...] = ()  # owners the operator names (PID or unit): planned first
    settle_s: Optional[float] = None  # None: the plan's default (plan/owners.py)


@dataclass
class HostClean(HostOutcome):
    """Everything one host's clean produced; failures are values (``error``, ``error_kind``)."""

    host: str
    ok: bool = True
    error: Optional[str] = None
    verdict: str = "error"
    reason: Optional[str] = None
    outcome_unknown: bool = False  # the clean ran but its report never came back
    before: Optional[HostResult] = None
    plan: Optional[Plan] = None
    agent_doc: Optional[dict[str, Any]] = None
    after: Optional[Snapshot] = None
    seconds: float = 0.0
    verdict_detail: dict[str, Any] = field(default_factory=dict)
    error_kind: Optional[str] = None

    @property
    def usage_error(self) -> bool:
        """The operator's input is wrong for this host (--gpus 9 on 8 GPUs): nothing may be
        signalled anywhere."""
        return self.error_kind == errors.USAGE

    def fail(self, failure: Failure, verdict: Optional[str] = None) -> "HostClean":
        """Mark it failed; the verdict, unless given, comes from the kind: "unreachable" when
        the host could not be reached at all, else "error"."""
        self.ok, self.error, self.error_kind = False, failure.message, failure.kind
        self.verdict = verdict or ("unreachable" if failure.unreachable else "error")
        return self


def plan_request(host: Host) -> dict[str, Any]:
    return dict(snapshot_request(host), cuda_version=False)  # the plan does not use it


def plan_host(host: Host, session: Session, opts: CleanOptions) -> HostClean:
    """Exec 1 (runbooks, dry runs): the snapshot, and the pure plan made from it."""
    started = time.monotonic()
    reply = session.run_agent(plan_request(host), timeout=float(host.command_timeout))
    return plan_from_reply(host, reply, opts, started)


def plan_conversation(host: Host, session: Session, opts: CleanOptions
                      ) -> tuple[HostClean, Conversation]:
    """The plan from the first answer of the host's conversation, which stays open for the
    clean request (closed here when the plan failed: nothing will be asked)."""
    started = time.monotonic()
    conv = session.converse(dict(plan_request(host), idle_s=opts.idle_s),
                            timeout=float(host.command_timeout))
    planned = plan_from_reply(host, conv.reply, opts, started)
    if not planned.ok:
        conv.close()
    return planned, conv


def plan_from_reply(host: Host, reply: AgentReply, opts: CleanOptions, started: float
                    ) -> HostClean:
    """The pure plan made from a snapshot reply (or the row's failure)."""
    before = result_from_reply(host, reply, started)
    out = HostClean(host=host.name, before=before)
    if not before.ok or before.snapshot is None:
        return out.fail(before.failure or Failure(errors.AGENT, "agent failed"))
    snap = before.snapshot
    if not snap.nvidia_smi_ok:
        return out.fail(Failure(errors.COMMAND, f"{snap.gpu_reader} failed: {snap.nvidia_smi_error}"))
    try:
        scope = parse_gpu_list(opts.gpus, available=[g.index for g in snap.gpus], host=host.name)
        out.plan = make_plan(
            snap, scope, protect=opts.protect, host_protect=tuple(host.protect),
            protect_label=opts.protect_label,
            include_spanning=opts.include_spanning, stop_units=opts.stop_units,
            disable_units=opts.disable_units, unattributed_mib=int(host.unattributed_mib or 0),
            tolerance_mib=opts.tolerance_mib, is_sudo=bool(host.sudo), host=host.name,
            job_uid=opts.job_uid, owners=opts.owners, settle_s=opts.settle_s)
    except UsageError as exc:
        return out.fail(Failure(errors.USAGE, str(exc)))
    out.verdict = "planned"
    out.seconds = time.monotonic() - started
    return out


def clean_request(host: Host, plan: Plan, opts: CleanOptions, before: Optional[Snapshot] = None
                  ) -> dict[str, Any]:
    request = to_request(plan, grace_s=opts.grace_s, timeout_s=opts.timeout_s, shm=opts.shm,
                         reset=opts.reset, operator=opts.operator, lock_path=opts.lock_path,
                         nvidia_smi=host.nvidia_smi, smi_timeout_s=opts.smi_timeout_s)
    request["gpu_source"] = host.gpu_source
    request["agent_cache"] = host.agent_cache
    # The verdict reads the after-snapshot's memory, processes and holders, never the CUDA
    # version: without it that snapshot skips a bare `nvidia-smi` run (110 ms on an H200)
    # between "the memory is back" and the document coming home.
    request["cuda_version"] = False
    if before is not None:
        request["wait_floor_mib"] = wait_floors(plan, before)
        if opts.release_wait_s is not None:
            request["release_floor_mib"] = release_floors(plan, before)
            request["release_wait_s"] = float(opts.release_wait_s)
    return request


def wait_floors(plan: Plan, before: Snapshot) -> dict[str, int]:
    """Per scope GPU, MiB that nvidia-smi lists for processes the plan will not signal (CUDA
    MPS servers aside: the threshold expects theirs already).

    That memory will not come back, so the agent stops waiting once only it is left. A GPU
    with a listed process of unknown memory (WSL2 n/a) gets no floor: wait the full time.
    """
    floors: dict[str, int] = {}
    targets = plan.target_pids | mps.expected_servers(before)
    for index in plan.scope:
        others = [a for a in before.apps_on(index) if a.pid not in targets]
        if not others or any(a.used_mib is None for a in others):
            continue
        floors[str(index)] = sum(a.used_mib or 0 for a in others)  # none is None (above)
    return floors


def execute_plan(host: Host, session: Session, planned: HostClean, opts: CleanOptions) -> HostClean:
    """Exec 2 (runbooks): the agent runs the whole sequence; the verdict is computed here."""
    if planned.plan is None or not planned.ok:
        return planned
    started = time.monotonic()
    request = clean_request(host, planned.plan, opts,
                            planned.before.snapshot if planned.before else None)
    reply = session.run_agent(request, timeout=float(request["deadline_s"]) + AGENT_MARGIN_S)
    return finish_clean(host, planned, reply, opts, started)


def execute_conversation(host: Host, conv: Conversation, planned: HostClean, opts: CleanOptions
                         ) -> HostClean:
    """The clean request as the conversation's next (its plan's agent answers it)."""
    if planned.plan is None or not planned.ok:
        return planned
    started = time.monotonic()
    request = clean_request(host, planned.plan, opts,
                            planned.before.snapshot if planned.before else None)
    try:
        reply = conv.ask(request, timeout=float(request["deadline_s"]) + AGENT_MARGIN_S)
    finally:
        conv.close()
    return finish_clean(host, planned, reply, opts, started)


def finish_clean(host: Host, planned: HostClean, reply: AgentReply, opts: CleanOptions,
                 started: float) -> HostClean:
    """The row from the clean's reply: its verdict, or what is known of a failure."""
    from gpufleet.core.verdict import make_verdict

    assert planned.plan is not None
    planned.seconds += time.monotonic() - started
    if not reply.ok and reply.unsent:  # the request never reached the agent: nothing happened
        kind = reply.error_kind or errors.AGENT
        return planned.fail(Failure(
            kind, f"{reply.error or 'agent failed'}; nothing was signalled: run the clean again "
            f"(`gpufleet clean --host {host.name}`)"),
            verdict="interrupted" if kind == errors.INTERRUPTED else "error")
    if not reply.ok or reply.doc is None:
        planned.outcome_unknown = True
        # the host was reached and may have signalled: never "unreachable"
        return planned.fail(Failure(
            reply.error_kind or errors.AGENT,
            f"{reply.error or 'agent failed'}; the outcome on the host is unknown: "
            f"run `gpufleet status --host {host.name}` (the host keeps an audit record)"),
            verdict="error")
    doc = reply.doc
    planned.agent_doc = doc
    _record_signals(host, planned, opts)
    if isinstance(doc.get("cancelled"), dict):  # the operator's second Ctrl-C reached it
        names = {t.pid: t.name for t in planned.plan.targets}
        planned.ok, planned.verdict = False, "cancelled"
        planned.reason = cancelled_reason(doc, names, host.name)
        _record_verdict(host, planned, opts)
        return planned
    lock = lock_failure(doc)
    if lock is not None:  # busy (who holds it) or refused (why it could be another's)
        busy = doc.get("lock") == "busy"
        planned.fail(Failure(errors.BUSY if busy else errors.COMMAND, lock),
                     verdict="busy" if busy else "error")
        _record_verdict(host, planned, opts)
        return planned
    try:
        planned.after = parse_snapshot(doc["after"]) if doc.get("after") else None
    except SnapshotError as exc:
        planned.after = None
        planned.error, planned.error_kind = f"final snapshot unreadable: {exc}", exc.kind
    assert planned.before is not None and planned.before.snapshot is not None
    result = make_verdict(planned.plan, doc, planned.before.snapshot)
    planned.verdict = result.verdict
    planned.reason = result.reason
    planned.verdict_detail = result.as_dict()
    planned.ok = result.verdict == "clean"
    _record_verdict(host, planned, opts)
    return planned


def _record_signals(host: Host, planned: HostClean, opts: CleanOptions) -> None:
    doc = planned.agent_doc or {}
    signals = [s for s in doc.get("signals") or () if s.get("signal")]
    if not signals:
        return
    snap = planned.before.snapshot if planned.before else None
    cmdlines = {pid: p.cmdline for pid, p in (snap.processes.items() if snap else ())}
    started_at = doc.get("started_at")
    records = audit.signal_records(
        host.name, opts.operator, signals, cmdlines,
        started_at=float(started_at) if isinstance(started_at, (int, float)) else None)
    audit.append(opts.audit_log, [dict(r, **dict(opts.audit_extra)) for r in records])


def _record_verdict(host: Host, planned: HostClean, opts: CleanOptions) -> None:
    """The clean's verdict line in the audit log (the host's last clean, for the exporter);
    only for a clean whose report came back: an unknown outcome is never written as one.
    Best effort, unlike a signal's line: a clean that signalled nothing must not fail on it."""
    doc = planned.agent_doc or {}
    signals = sum(1 for s in doc.get("signals") or () if s.get("signal"))
    try:
        audit.append(opts.audit_log, [dict(audit.verdict_record(
            host.name, opts.operator, planned.verdict, planned.reason or planned.error, signals),
            **dict(opts.audit_extra))])  # a Slurm job's verdict names the job too
    except OSError:
        pass


# --------------------------------------------------------------------------- the command


class ProgressLine(Protocol):
    """What the CLI's progress line gives run_hosts (cli.progress.HostProgress)."""

    def callbacks(self) -> Any: ...


# (work items, label) -> the progress line of one fan-out, as a context manager
ProgressFactory = Callable[[Sequence[Any], str], AbstractContextManager[ProgressLine]]


@dataclass
class CleanRun:
    """What `clean` did, for the CLI to render and turn into an exit code."""

    results: list[HostClean]
    dry_run: bool
    interrupted: Optional[str] = None  # "planning" (nothing signalled) or "acting"
    declined: bool = False  # the operator answered no: nothing signalled

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return errors.EXIT_INTERRUPTED
        if self.declined or any(r.usage_error for r in self.results):
            return errors.EXIT_USAGE
        if self.dry_run:
            return errors.EXIT_OK if all(r.ok for r in self.results) else errors.EXIT_FAILED
        return errors.EXIT_OK if all(r.verdict == "clean" for r in self.results) else errors.EXIT_FAILED


def run_clean(hosts: Sequence[Host], opts: CleanOptions, *, forks: int = 32, dry_run: bool = False,
              on_planned: Optional[Callable[[list[HostClean]], None]] = None,
              confirm: Optional[Callable[[list[HostClean]], bool]] = None,
              progress: Optional[ProgressFactory] = None,
              on_interrupt: Optional[Callable[[list[Any], bool], None]] = None,
              on_cancel: Optional[Callable[[list[Any], dict[str, Optional[str]]], None]] = None
              ) -> CleanRun:
    """Plan every host (sessions held), then, unless ``dry_run``, act on the same sessions.

    ``on_planned(planned)`` is called when every host is planned (not in a dry run: there
    the CLI shows the plans with the outcome); ``confirm(planned)`` once every plan is valid
    and before anything is
    signalled; False: nothing is signalled (``declined``); it may raise (UsageError: not a
    terminal and no --yes). Any host's invalid input (--gpus 9 on an 8-GPU host) raises
    UsageError before ``confirm``: nothing is signalled anywhere. Ctrl-C while planning:
    nothing is signalled; while acting: hosts already running finish (``on_interrupt(hosts,
    acting)`` hears which), no other host starts; a second Ctrl-C while acting cancels what
    their agents were still to send and waits for their reports (``on_cancel(hosts,
    {host: None once told, else why not})``), a third stops waiting.
    ``progress(items, label)``: the progress line.
    """
    state: dict[str, Any] = {"phase": "planning", "interrupted": None}

    def interrupted(in_flight: list[Any]) -> None:
        state["interrupted"] = state["phase"]
        if on_interrupt is not None:
            on_interrupt(in_flight, state["phase"] == "acting")

    fan: dict[str, Any] = dict(forks=forks, on_interrupt=interrupted, make_error=not_run)
    sessions: dict[str, tuple[Session, Conversation]] = {}
    try:
        results = _plan_all(hosts, opts, sessions if not dry_run else None, fan, progress)
        _fleet_notes(results, opts)
        if dry_run or state["interrupted"]:
            return CleanRun(results, dry_run, state["interrupted"])
        if on_planned is not None:
            on_planned(results)
        _refuse_bad_input(results)
        if confirm is not None and not confirm(results):
            return CleanRun(results, dry_run, declined=True)
        state["phase"] = "acting"
        acted = _act_all(hosts, results, sessions, opts, fan, progress, on_cancel)
        return CleanRun(acted, dry_run, state["interrupted"])
    finally:
        for session, conv in sessions.values():  # a conversation not asked: the agent ends at EOF
            for held in (conv, session):
                try:
                    held.close()
                except Exception:
                    pass


def _act_all(hosts: Sequence[Host], results: list[HostClean],
             sessions: dict[str, tuple[Session, Conversation]], opts: CleanOptions,
             fan: dict[str, Any], progress: Optional[ProgressFactory],
             on_cancel: Optional[Callable[[list[Any], dict[str, Optional[str]]], None]]
             ) -> list[HostClean]:
    """Every planned host's clean request through its conversation. The second Ctrl-C tells
    the agents still running to send no further signal and waits for their reports (what they
    sent); a row whose report never came says what is known of the agent after the cancel."""
    by_host = {h.name: h for h in hosts}
    cancels: dict[str, Optional[str]] = {}  # host -> None once told, else why it could not be

    def act(r: HostClean) -> HostClean:
        if r.host not in sessions:
            return r
        return execute_conversation(by_host[r.host], sessions[r.host][1], r, opts)

    def cancel(in_flight: list[Any]) -> None:
        for r in in_flight:
            held = sessions.get(r.host)
            cancels[r.host] = held[1].cancel() if held else "it had no conversation"
        if on_cancel is not None:
            on_cancel(in_flight, dict(cancels))

    with _progress(progress, results, "clean") as line:
        acted = run_hosts(results, act, on_cancel=cancel, **fan, **_callbacks(line))
    rows = [as_row(h, r) for h, r in zip(hosts, acted)]
    for row in rows:
        if row.host in cancels and row.outcome_unknown:
            _after_cancel(row, cancels[row.host], sessions[row.host][1], opts)
    return rows


def _after_cancel(row: HostClean, why_not: Optional[str], conv: Conversation,
                  opts: CleanOptions) -> None:
    """A row whose report did not come after a cancel: what the agent was told, or, when the
    cancel could not reach it, what it goes on to do and by when."""
    if why_not is None:
        extra = cancel_unanswered(conv.cancelled_at)
    else:
        targets = [(t.pid, t.name) for t in row.plan.targets] if row.plan else []
        extra = cancel_undelivered(why_not, targets, opts.grace_s, conv.asked_at,
                                   conv.asked_deadline_s)
    row.error = f"{row.error}; {extra}" if row.error else extra


def _plan_all(hosts: Sequence[Host], opts: CleanOptions,
              sessions: Optional[dict[str, tuple[Session, Conversation]]],
              fan: dict[str, Any], progress: Optional[ProgressFactory]) -> list[HostClean]:
    """Every host's plan, its session and conversation kept in ``sessions`` for acting (None:
    a dry run, one-shot plans, each session closed once planned). Every TCP connect starts
    now, outside the forks bound (unreachable hosts cost one connect_timeout in all);
    handshakes and plans stay inside it."""
    with predial(hosts, fan["forks"]):

        def plan(h: Host) -> HostClean:
            session: Optional[Session] = None
            try:
                session = open_session(h)
                if sessions is None:
                    return plan_host(h, session, opts)
                planned, conv = plan_conversation(h, session, opts)
                sessions[h.name] = (session, conv)
                return planned
            except Exception as exc:  # a failed host is a value
                return HostClean(host=h.name).fail(Failure(kind_of(exc), first_line(exc)))
            finally:
                if session is not None and (sessions is None or h.name not in sessions):
                    session.close()

        with _progress(progress, hosts, "clean: planning") as line:
            planned = run_hosts(hosts, plan, **fan, **_callbacks(line))
    return [as_row(h, r) for h, r in zip(hosts, planned)]


def _fleet_notes(results: Sequence[HostClean], opts: CleanOptions) -> None:
    """The plans' notes as the whole run sees them (core.plan.notes.fleet_protect_notes)."""
    planned = [r for r in results if r.plan is not None]
    fixed = fleet_protect_notes([r.plan for r in planned if r.plan is not None],
                                opts.protect_label, opts.protect)
    for row, plan in zip(planned, fixed):
        row.plan = plan


def _refuse_bad_input(results: Sequence[HostClean]) -> None:
    """Nothing is signalled anywhere on the strength of input that failed validation."""
    bad = [r.error or "invalid input" for r in results if r.usage_error]
    if bad:
        raise UsageError(bad[0], more=bad[1:], notes=("nothing signalled on any host",))


class _NoProgress:
    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def callbacks(self) -> dict[str, Any]:
        return {}


def _progress(factory: Optional[ProgressFactory], items: Sequence[Any], label: str
              ) -> AbstractContextManager[Any]:
    return factory(items, label) if factory is not None else _NoProgress()


def _callbacks(line: Any) -> dict[str, Any]:
    return dict(line.callbacks())


def not_run(item: Union[Host, HostClean], failure: Failure) -> HostClean:
    """fanout's value for a host it did not start, or stopped waiting for: a HostClean row
    (the work items are Hosts while planning, HostCleans while acting)."""
    name = item.host if isinstance(item, HostClean) else item.name
    out = HostClean(host=str(name))
    if isinstance(item, HostClean):
        out.before, out.plan = item.before, item.plan
    if failure.kind != errors.INTERRUPTED:  # the work function raised: an error row
        if isinstance(item, HostClean):  # while acting: what the host did is not known
            out.outcome_unknown = True
            failure = Failure(failure.kind, failure.message + f"; run `gpufleet status --host {out.host}`")
        return out.fail(failure)
    tail = ("; nothing signalled" if failure.message == NOT_STARTED else
            f"; run `gpufleet status --host {out.host}`")
    # stopped waiting for a clean request's answer: what it signalled is not known
    out.outcome_unknown = isinstance(item, HostClean) and failure.message != NOT_STARTED
    return out.fail(Failure(failure.kind, failure.message + tail), verdict="interrupted")


def as_row(host: Host, result: Any) -> HostClean:
    """Whatever fanout gave for ``host``, as its HostClean row."""
    if isinstance(result, HostClean):
        return result
    return HostClean(host=host.name).fail(Failure(errors.INTERNAL, str(result) or "failed"))
