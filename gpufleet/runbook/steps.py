"""The runbook step executors: one function per step kind, run on one host's open session.

Internal to gpufleet.runbook.run (import from there). An executor returns a one-line detail or
raises ``StepFailed``; it is bounded by its step's ``end`` (monotonic): waits poll here
(``wait_free``) or on the host (``wait_http``), never unbounded.

Nothing from the runbook or the inventory becomes shell text: ``systemctl`` and the health
probe are argv lists, the probe's URL travels as JSON on stdin, and ``shell`` steps were
quoted at load time (gpufleet.runbook.load).
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.core.hostlock import lock_failure
from gpufleet.core.hostwarnings import host_warnings
from gpufleet.core.model import HostResult, Snapshot, SnapshotError, parse_snapshot
from gpufleet.runbook.model import Step
from gpufleet.runbook.checks import (StepFailed, _chosen, check_conditions, gpu_metrics,
                                     health_outcome, report_lines)
from gpufleet.core.gpus import format_gpu_ranges as format_gpu_list
from gpufleet.remote import PYTHON_FLAGS, SAFE_PATH  # the probe starts isolated, as the agent does
# The controller waits MARGIN_S longer than a host-side bound; a snapshot's agent ends itself
# DEADLINE_MARGIN_S inside its bound: one definition each, in the ops that own them.
from gpufleet.ops.clean import AGENT_MARGIN_S as MARGIN_S
from gpufleet.ops.collect import DEADLINE_MARGIN_S


# --------------------------------------------------------------------------- host-side probes

WAIT_HTTP_FILE = "wait_http.py"  # beside the agent in gpufleet/remote/


def wait_http_source() -> str:
    """The `wait_http` probe (gpufleet/remote/wait_http.py), read at send time like the agent:
    it runs on the host as ``PYTHON -c SOURCE``, its request as JSON on stdin. SAFE_PATH comes
    first: nothing it imports may come from the working directory."""
    from importlib import resources

    return SAFE_PATH + "\n" + resources.files("gpufleet.remote").joinpath(
        WAIT_HTTP_FILE).read_text(encoding="utf-8")


# --------------------------------------------------------------------------- execution


class _HostRun:
    """State of one host while its steps run: the session, the start and latest snapshots."""

    def __init__(self, host: Host, session: Any, operator: str, audit_log: Optional[str]):
        self.host = host
        self.session = session
        self.operator = operator
        self.audit_log = audit_log
        self.baseline: Optional[Snapshot] = None
        self.latest: Optional[Snapshot] = None  # None when a step since may have changed things
        self.end = 0.0  # the running step's deadline (monotonic)
        self.warnings: list[str] = []  # the snapshots' warning lines, each once (CLI: stderr)

    # -- transport helpers

    def snapshot(self, timeout: float, require_gpus: bool = True) -> Snapshot:
        from gpufleet.ops.collect import snapshot_request

        request = snapshot_request(self.host)
        bound = max(1.0, min(float(self.host.command_timeout), timeout))
        request["deadline_s"] = max(1.0, bound - DEADLINE_MARGIN_S)
        request["smi_timeout_s"] = max(1.0, min(request["smi_timeout_s"], bound / 2))
        reply = self.session.run_agent(request, timeout=bound)
        if not reply.ok or reply.doc is None:
            raise StepFailed(f"snapshot failed: {reply.error or 'agent failed'}")
        try:
            snap = parse_snapshot(reply.doc)
        except SnapshotError as exc:
            raise StepFailed(f"snapshot unreadable: {exc}") from None
        for line in host_warnings(self.host.name, snap, int(self.host.unattributed_mib or 0)):
            if line not in self.warnings:
                self.warnings.append(line)
        if require_gpus and not snap.nvidia_smi_ok:
            raise StepFailed(f"{snap.gpu_reader} failed: {snap.nvidia_smi_error or '?'}")
        self.latest = snap
        return snap

    def argv(self, argv: Sequence[str], timeout: float, stdin: bytes = b"",
             sudo: bool = False) -> tuple[int, str, str]:
        code, out, err = self.session.run_argv(list(argv), stdin=stdin, timeout=timeout, sudo=sudo)
        return code, _text(out), _text(err)

    def systemctl(self, step: Step, *args: str) -> tuple[int, str, str]:
        """systemctl as an argv (sudo -n for the system manager when the host says sudo)."""
        p = step.params
        argv = [p["systemctl"]] + (["--user"] if p["user"] else []) + ["--no-ask-password"] + list(args)
        return self.argv(argv, max(1.0, _remaining(self.end)), sudo=bool(self.host.sudo) and not p["user"])


def _text(data: Any) -> str:
    if isinstance(data, bytes):
        return data.decode("utf-8", "replace")
    return str(data or "")


def _last_line(*texts: str) -> str:
    for text in texts:
        lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
        if lines:
            return lines[-1]
    return ""


def _remaining(end: float) -> float:
    return end - time.monotonic()


def _step_stop_units(ctx: _HostRun, step: Step, end: float) -> str:
    p = step.params
    units = list(p["units"])
    verbs = ["stop"] + (["disable"] if p["disable"] else [])
    for verb in verbs:
        code, out, err = ctx.systemctl(step, verb, "--", *units)
        if code != 0:
            raise StepFailed(f"systemctl {verb} exited {code}: {_last_line(err, out) or 'no output'}")
    code, out, err = ctx.systemctl(step, "is-active", "--", *units)
    states = [s.strip() for s in out.splitlines() if s.strip()]
    still = [f"{u} {s}" for u, s in zip(units, states) if s in ("active", "activating", "reloading")]
    if still:
        raise StepFailed(f"still running after stop: {', '.join(still)}")
    done = "stopped and disabled" if p["disable"] else "stopped"
    return f"{done} {', '.join(units)}" + (f" ({', '.join(states)})" if states else "")


def _step_start_unit(ctx: _HostRun, step: Step, end: float) -> str:
    p = step.params
    unit = p["unit"]
    code, out, err = ctx.systemctl(step, "start", "--", unit)
    if code != 0:
        raise StepFailed(f"systemctl start exited {code}: {_last_line(err, out) or 'no output'}")
    code, out, err = ctx.systemctl(step, "is-active", "--", unit)
    state = _last_line(out) or "unknown"
    if state != "active":
        raise StepFailed(f"{unit} is {state} after start")
    return f"started {unit} (active)"


def _step_clean(ctx: _HostRun, step: Step, end: float) -> str:
    from gpufleet.ops.clean import CleanOptions, execute_plan, plan_host as plan_clean

    p = step.params
    opts = CleanOptions(
        gpus="all" if p["gpus"] is None else format_gpu_list(p["gpus"]),
        grace_s=p["grace"], timeout_s=step.timeout, tolerance_mib=p["tolerance_mib"],
        protect=tuple(p["protect"]), protect_label="the step's protect",
        include_spanning=p["include_spanning"],
        stop_units=p["stop_units"], disable_units=p["disable_units"], shm=p["shm"],
        reset=p["reset"], audit_log=ctx.audit_log, operator=ctx.operator)
    if opts.grace_s > opts.timeout_s:
        raise StepFailed(f"grace ({opts.grace_s:g}s) is longer than the timeout ({opts.timeout_s:g}s)")
    planned = plan_clean(ctx.host, ctx.session, opts)
    if not planned.ok or planned.plan is None:
        raise StepFailed(f"plan: {planned.error or planned.reason or planned.verdict}")
    plan = planned.plan
    result = execute_plan(ctx.host, ctx.session, planned, opts)
    ctx.latest = result.after if isinstance(result.after, Snapshot) else None
    doc = result.agent_doc or {}
    sent = {(s.get("pid"), s.get("signal")) for s in doc.get("signals") or () if s.get("outcome") == "sent"}
    terms = sum(1 for _, sig in sent if sig == "TERM")
    kills = sum(1 for _, sig in sent if sig == "KILL")
    counts = f"GPUs {format_gpu_list(plan.scope)}: {len(plan.targets)} target(s), TERM {terms}, KILL {kills}"
    if not result.ok or result.verdict != "clean":
        why = result.error or "; ".join((result.reason or "").splitlines()) or result.verdict
        raise StepFailed(f"{result.verdict}: {why}; {counts}")
    parts = [counts]
    if plan.refused:
        parts.append("refused " + ", ".join(f"{r.pid} {r.name} ({r.reason})" for r in plan.refused))
    if doc.get("shm_removed"):
        parts.append(f"removed {len(doc['shm_removed'])} /dev/shm file(s)")
    return f"{result.verdict}: " + "; ".join(parts)


def _step_wait_free(ctx: _HostRun, step: Step, end: float) -> str:
    p = step.params
    started = time.monotonic()
    polls = 0
    last = ""
    while True:
        polls += 1
        snap = ctx.snapshot(max(1.0, _remaining(end)))
        indices, missing = _chosen(snap, p["gpus"])
        if missing:
            raise StepFailed(f"no GPU {format_gpu_list(missing)} on this host")
        metrics = gpu_metrics(snap, int(ctx.host.unattributed_mib or 0))
        short = []
        for i in indices:
            m = metrics[i]
            if p["min_free_mib"] is not None:
                value, want = m["free_mib"], p["min_free_mib"]
                text = "n/a" if value is None else f"{value} MiB"
            else:
                value, want = m["free_fraction"], p["min_free_fraction"]
                text = "n/a" if value is None else f"{value:.1%}"
            if value is None or value < want:
                short.append(f"GPU {i} {text}")
        if not short:
            return (f"GPU {format_gpu_list(indices)} free after {time.monotonic() - started:.1f}s "
                    f"({polls} snapshot{'s' if polls > 1 else ''})")
        last = ", ".join(short)
        if _remaining(end) <= p["poll"]:
            raise StepFailed(f"not free after {time.monotonic() - started:.0f}s: {last}")
        time.sleep(p["poll"])


def _step_clear_shm(ctx: _HostRun, step: Step, end: float) -> str:
    """The agent's clean mode with nothing to signal and shm on: only leftovers go."""
    bound = max(2.0, _remaining(end) - MARGIN_S)
    request = {
        "mode": "clean", "deadline_s": bound, "nvidia_smi": ctx.host.nvidia_smi,
        "gpu_source": ctx.host.gpu_source, "agent_cache": ctx.host.agent_cache,
        "smi_timeout_s": max(1.0, min(10.0, bound / 3)), "scope": [], "targets": [], "units": [],
        "grace_s": 0.0, "timeout_s": max(1.0, bound / 2), "poll_s": 0.1, "threshold_mib": {},
        "shm": True, "reset": False, "lock_path": None, "operator": ctx.operator,
    }
    reply = ctx.session.run_agent(request, timeout=bound + MARGIN_S)
    if not reply.ok or reply.doc is None:
        raise StepFailed(f"agent failed: {reply.error or '?'}")
    doc = reply.doc
    lock = lock_failure(doc, "nothing removed")
    if lock is not None:
        raise StepFailed(lock)
    if doc.get("error"):
        raise StepFailed(f"agent: {doc['error']}")
    try:
        ctx.latest = parse_snapshot(doc["after"]) if doc.get("after") else None
    except SnapshotError:
        ctx.latest = None
    removed = doc.get("shm_removed") or []
    warnings = [w for w in doc.get("warnings") or () if str(w).startswith("shm")]
    text = f"removed {len(removed)} file(s)" + (f": {', '.join(removed[:8])}" if removed else "")
    if len(removed) > 8:
        text += f", … ({len(removed) - 8} more)"
    if warnings:
        text += "; " + "; ".join(warnings[:3])
    return text


def _step_fit(ctx: _HostRun, step: Step, end: float) -> str:
    from gpufleet.errors import UsageError
    from gpufleet.core.fit import ModelNeed, dtype_bytes, fit_host, validate_need, weights_gib_from_params

    p = step.params
    dtype = p["dtype"] or "fp16"
    weights = p["weights_gib"] if p["weights_gib"] is not None else weights_gib_from_params(p["params"], dtype)
    need = validate_need(ModelNeed(weights_gib=weights, activations_gib=p["activations_gib"],
                                   non_torch_gib=p["non_torch_gib"], tp=p["tp"], params=p["params"],
                                   bytes_per_param=dtype_bytes(dtype)))
    snap = ctx.snapshot(max(1.0, _remaining(end)))
    result = HostResult(host=ctx.host.name, ok=True, snapshot=snap)
    try:
        hf = fit_host(result, need, p["util"], p["context_mib"], p["gpus"])
    except UsageError as exc:
        raise StepFailed(str(exc)) from None
    if hf.error is not None:
        raise StepFailed(hf.error)
    by_verdict: dict[str, list[int]] = {}
    for r in hf.results:
        by_verdict.setdefault(r.verdict, []).append(r.index)
    parts = [f"GPU {format_gpu_list(idx)}: {verdict}" for verdict, idx in by_verdict.items()]
    if not hf.ok:
        bad = [r for r in hf.results if not r.ok]
        extra = [s for r in bad[:1] for s in r.suggestions[:1]]
        raise StepFailed("does not fit: " + "; ".join(parts) + (f"; instead: {extra[0]}" if extra else ""))
    return "; ".join(parts)


def _step_health(ctx: _HostRun, step: Step, end: float) -> str:
    """The health gate: a lost GPU or an unloaded driver is a finding here, not a failed
    snapshot (the readings that failed are the verdict)."""
    p = step.params
    snap = ctx.snapshot(max(1.0, _remaining(end)), require_gpus=False)
    ctx.latest = None if not snap.nvidia_smi_ok else snap
    failed, detail = health_outcome(snap, ctx.host.name, p["gpus"], ctx.host.gpus,
                                    p["fail_on"], p["warn_on"])
    if failed:
        raise StepFailed("health: " + detail)
    return detail


def _step_wait_http(ctx: _HostRun, step: Step, end: float) -> str:
    p = step.params
    left = max(1.0, _remaining(end))
    margin = min(MARGIN_S, max(0.5, left * 0.1))  # the probe ends itself before we stop waiting
    wait_s = max(0.5, left - margin)
    request = {"url": p["url"], "status": p["status"], "interval": p["interval"],
               "attempt_s": max(1.0, min(10.0, p["interval"] * 2)), "wait_s": wait_s}
    started = time.monotonic()
    code, out, err = ctx.argv([ctx.host.python, *PYTHON_FLAGS, "-c", wait_http_source()], left,
                              stdin=json.dumps(request).encode())
    if code != 0:
        raise StepFailed(f"probe exited {code}: {_last_line(err, out) or 'no output'}")
    try:
        doc = json.loads(_last_line(out))
    except ValueError:
        raise StepFailed(f"probe printed no result: {_last_line(err, out) or 'no output'}") from None
    took = time.monotonic() - started
    if not doc.get("ok"):
        raise StepFailed(f"{p['url']} not HTTP {p['status']} after {took:.0f}s "
                         f"({doc.get('attempts')} attempts; last: {doc.get('last') or 'none'})")
    return f"{p['url']} answered HTTP {p['status']} after {took:.1f}s ({doc.get('attempts')} attempt(s))"


def _step_shell(ctx: _HostRun, step: Step, end: float) -> str:
    p = step.params
    argv = ["sh", "-c", p["command"]] if p["command"] is not None else list(p["argv"])
    code, out, err = ctx.argv(argv, max(1.0, _remaining(end)))
    last = _last_line(out, err)
    text = f"exit {code}" + (f": {last}" if last else "")
    if code not in p["expect_exit"]:
        raise StepFailed(f"{text} (expected {', '.join(str(c) for c in p['expect_exit'])})")
    return text


def _step_assert(ctx: _HostRun, step: Step, end: float) -> str:
    snap = ctx.latest if ctx.latest is not None else ctx.snapshot(max(1.0, _remaining(end)))
    found = check_conditions(step.params["that"], snap, ctx.baseline, int(ctx.host.unattributed_mib or 0))
    failed = [line for held, line in found if not held]
    if failed:
        raise StepFailed("; ".join(failed))
    return "; ".join(line for _, line in found)


def _step_report(ctx: _HostRun, step: Step, end: float) -> str:
    snap = ctx.snapshot(max(1.0, _remaining(end)))
    lines = report_lines(snap, step.params["gpus"], int(ctx.host.unattributed_mib or 0), snap.facts.wsl2)
    head = "WSL2; " if snap.facts.wsl2 else ""
    return head + "; ".join(lines)


from gpufleet.runbook.local import step_local_command, step_local_http  # noqa: E402 (on the controller)

EXECUTORS: dict[str, Callable[[_HostRun, Step, float], str]] = {
    "stop_units": _step_stop_units,
    "clean": _step_clean,
    "wait_free": _step_wait_free,
    "fit": _step_fit,
    "health": _step_health,
    "clear_shm": _step_clear_shm,
    "start_unit": _step_start_unit,
    "wait_http": _step_wait_http,
    "shell": _step_shell,
    "assert": _step_assert,
    "report": _step_report,
    "local_http": step_local_http,
    "local_command": step_local_command,
}
