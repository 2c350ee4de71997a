"""Execute a validated runbook: hosts in parallel, steps in order, one SSH session per host.

Failures are values: a step that fails (or raises) is ``failed`` with a one-line detail, the
host's remaining steps are ``skipped`` (unless the step says ``continue_on_failure``), and the
other hosts carry on. Every step is bounded by its ``timeout``; waits run their polling loop
here (``wait_free``) or on the host (``wait_http``), never unbounded.

The step executors live in gpufleet.runbook.steps, what they look at in a snapshot (metrics,
conditions, reports: pure) in gpufleet.runbook.checks; import them from here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.core.results import Failure, HostOutcome
from gpufleet.errors import INTERNAL, first_line, kind_of, one_line
from gpufleet.runbook.kinds import describe
from gpufleet.runbook.model import Runbook, Step
from gpufleet.runbook.checks import (
    StepFailed,
    check_conditions,
    gpu_metrics,
    holders_on,
    memory_holders,
    report_lines,
)
from gpufleet.runbook.steps import EXECUTORS, MARGIN_S, _HostRun, wait_http_source

__all__ = [
    "DETAIL_MAX", "EXECUTORS", "FAILED", "MARGIN_S", "OK", "PLANNED", "SKIPPED",
    "HostRun", "StepFailed", "StepResult", "check_conditions", "document",
    "gpu_metrics", "holders_on", "memory_holders", "plan_host", "report_lines", "run_host",
    "run_runbook", "run_steps", "table", "wait_http_source",
]

OK, FAILED, SKIPPED, PLANNED = "ok", "failed", "skipped", "planned"
DETAIL_MAX = 2000  # JSON; the table cuts details to its width

# Kinds after which the host may have changed without a snapshot to show it.
_STALE_AFTER = frozenset({"stop_units", "start_unit", "shell", "wait_http"})


@dataclass
class StepResult:
    name: str
    kind: str
    outcome: str
    seconds: float = 0.0
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "kind": self.kind, "outcome": self.outcome,
               "seconds": round(self.seconds, 3), "detail": self.detail}
        if self.data:
            out["data"] = self.data
        return out


@dataclass
class HostRun(HostOutcome):
    """One host's run of a runbook; ``error_kind``: what stopped it (the first failed step's
    kind, or why the host could not be reached)."""

    host: str
    ok: bool
    error: Optional[str]
    steps: list[StepResult]
    seconds: float = 0.0
    error_kind: Optional[str] = None
    warnings: list[str] = field(default_factory=list)  # HOST: warning: ... (the CLI: stderr)

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.ok, "error": self.error, **self.error_kind_field(),
                "seconds": round(self.seconds, 3), "steps": [s.as_dict() for s in self.steps]}


def _short(text: Any, width: int = DETAIL_MAX) -> str:
    one = one_line(text)
    return one if len(one) <= width else one[: width - 1] + "…"


def _exc_text(exc: BaseException) -> str:
    return _short(first_line(exc))


# --------------------------------------------------------------------------- dry run


def plan_host(runbook: Runbook, host: Host) -> HostRun:
    """--dry-run: what each step would do on this host; nothing is contacted."""
    from gpufleet.runbook.local import host_values

    steps = []
    for step in runbook.steps:
        try:
            text = describe(step.for_host(host_values(host)))
        except StepFailed as exc:
            text = f"invalid for this host: {exc}"
        if step.kind in ("stop_units", "start_unit") and host.sudo:
            text += " (sudo -n)"
        if step.kind == "wait_http":
            text += f" (up to {step.timeout:g}s)"
        steps.append(StepResult(step.name, step.kind, PLANNED, 0.0, text))
    return HostRun(host=host.name, ok=True, error=None, steps=steps)


# --------------------------------------------------------------------------- execution


def _needs_baseline(runbook: Runbook) -> bool:
    return any(s.kind == "assert" and "holders_alive_on" in s.params["that"]["sets"]
               for s in runbook.steps)


def run_steps(runbook: Runbook, host: Host, session: Any, operator: str = "gpufleet",
              audit_log: Optional[str] = None,
              on_step: Optional[Callable[[str, Step, StepResult], None]] = None) -> HostRun:
    """Every step of ``runbook`` on one host, through one already-open session."""
    started = time.monotonic()
    ctx = _HostRun(host, session, operator, audit_log)
    results: list[StepResult] = []
    error: Optional[str] = None
    kind: Optional[str] = None
    if _needs_baseline(runbook):
        try:
            ctx.baseline = ctx.snapshot(float(host.command_timeout))
        except Exception as exc:  # the host could not be read: nothing ran
            error, kind = f"first snapshot: {_exc_text(exc)}", kind_of(exc)
    for step in runbook.steps:
        if error is not None:
            results.append(StepResult(step.name, step.kind, SKIPPED))
            continue
        t0 = time.monotonic()
        end = ctx.end = t0 + step.timeout
        try:
            detail = EXECUTORS[step.kind](ctx, step, end)
            res = StepResult(step.name, step.kind, OK, time.monotonic() - t0, _short(detail))
        except StepFailed as exc:
            res = StepResult(step.name, step.kind, FAILED, time.monotonic() - t0, _short(str(exc)))
            kind = kind or exc.kind
        except Exception as exc:  # transport errors, timeouts: this step failed
            res = StepResult(step.name, step.kind, FAILED, time.monotonic() - t0, _exc_text(exc))
            kind = kind or kind_of(exc)
        if step.kind in _STALE_AFTER:
            ctx.latest = None
        results.append(res)
        if on_step is not None:
            try:
                on_step(host.name, step, res)
            except Exception:
                pass
        if res.outcome == FAILED and not step.continue_on_failure:
            error = f"step {step.index} {step.name!r} failed"
    failed = [r for r in results if r.outcome == FAILED]
    if error is None and failed:
        error = f"{len(failed)} step(s) failed: " + ", ".join(repr(r.name) for r in failed)
    ok = not failed and error is None
    return HostRun(host=host.name, ok=ok, error=error, steps=results,
                   seconds=time.monotonic() - started, error_kind=None if ok else kind,
                   warnings=ctx.warnings)


def run_host(runbook: Runbook, host: Host, operator: str = "gpufleet", audit_log: Optional[str] = None,
             on_step: Optional[Callable[[str, Step, StepResult], None]] = None,
             open_session: Optional[Callable[[Host], Any]] = None) -> HostRun:
    """Open ONE session for the host and run every step through it."""
    if open_session is None:
        from gpufleet.transport import open_session as default_open

        def open_session(h: Host) -> Any:  # several steps: a connection kept for them
            return default_open(h, keep=True)
    started = time.monotonic()
    try:
        with open_session(host) as session:
            if getattr(session, "error", None):  # unreachable: nothing ran
                return HostRun(host=host.name, ok=False, error=_short(session.error),
                               steps=[StepResult(s.name, s.kind, SKIPPED) for s in runbook.steps],
                               seconds=time.monotonic() - started,
                               error_kind=getattr(session, "error_kind", None) or INTERNAL)
            return run_steps(runbook, host, session, operator, audit_log, on_step)
    except Exception as exc:  # could not connect (or the session broke on close)
        return HostRun(host=host.name, ok=False, error=_exc_text(exc),
                       steps=[StepResult(s.name, s.kind, SKIPPED) for s in runbook.steps],
                       seconds=time.monotonic() - started, error_kind=kind_of(exc))


def run_runbook(runbook: Runbook, hosts: Sequence[Host], forks: int = 32, operator: str = "gpufleet",
                audit_log: Optional[str] = None,
                on_step: Optional[Callable[[str, Step, StepResult], None]] = None,
                open_session: Optional[Callable[[Host], Any]] = None,
                **callbacks: Any) -> list[HostRun]:
    """Hosts in parallel (at most ``forks``), results in host order. ``callbacks``:
    run_hosts's ``on_start`` / ``on_result`` (progress.HostProgress.callbacks), ``on_interrupt``."""
    from gpufleet.ops.fanout import run_hosts

    def make_error(host: Host, failure: Failure) -> HostRun:
        return HostRun(host=host.name, ok=False, error=failure.message,
                       steps=[StepResult(s.name, s.kind, SKIPPED) for s in runbook.steps],
                       error_kind=failure.kind)

    def run(h: Host, opener: Optional[Callable[[Host], Any]]) -> HostRun:
        return run_host(runbook, h, operator, audit_log, on_step, opener)

    if open_session is not None:
        return run_hosts(hosts, lambda h: run(h, open_session), forks=forks, make_error=make_error,
                         **callbacks)
    # Every TCP connect starts now, outside the forks bound (unreachable hosts cost one
    # connect_timeout in all); each host's session, steps and all, stays inside it.
    from gpufleet.transport import open_session as default_open, predial

    with predial(hosts, forks):
        return run_hosts(hosts, lambda h: run(h, lambda host: default_open(host, keep=True)),
                         forks=forks, make_error=make_error, **callbacks)


# --------------------------------------------------------------------------- output (pure)


def document(runbook: Runbook, runs: Sequence[HostRun], dry_run: bool) -> dict[str, Any]:
    ok = all(r.ok for r in runs)
    return {
        "runbook": runbook.name,
        "source": runbook.source,
        "dry_run": dry_run,
        "vars": dict(runbook.vars),
        "hosts": [r.as_dict() for r in runs],
        "ok": ok,
        "exit_code": 0 if ok else 1,
    }


def table(runs: Sequence[HostRun], width: int = 120) -> str:
    from gpufleet.render.table import render_table

    rows = []
    for run in runs:
        for n, s in enumerate(run.steps, 1):
            seconds = "-" if s.outcome in (SKIPPED, PLANNED) else f"{s.seconds:.1f}s"
            rows.append([run.host, n, s.name, s.kind, s.outcome, seconds, _short(s.detail or "-", width)])
    text = render_table(rows, ["HOST", "#", "STEP", "KIND", "OUTCOME", "TIME", "DETAIL"], numparse=False)
    tail = []
    for run in runs:
        if run.error and not any(s.outcome == FAILED for s in run.steps):
            tail.append(f"{run.host}: {run.error}")
    if all(s.outcome == PLANNED for r in runs for s in r.steps):
        summary = f"plan for {len(runs)} host(s); nothing was done"
    else:
        ok = sum(1 for r in runs if r.ok)
        summary = f"{ok}/{len(runs)} host(s) ok"
    return "\n".join([text] + tail + [summary])
