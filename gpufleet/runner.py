"""Execute a validated runbook: hosts in parallel, steps in order, one SSH session per host.

Failures are values: a step that fails (or raises) is ``failed`` with a one-line detail, the
host's remaining steps are ``skipped`` (unless the step says ``continue_on_failure``), and the
other hosts carry on. Every step is bounded by its ``timeout``; waits run their polling loop
here (``wait_free``) or on the host (``wait_http``), never unbounded.

Nothing from the runbook or the inventory becomes shell text: ``systemctl`` and the health
probe are argv lists, the probe's URL travels as JSON on stdin, and ``shell`` steps were
quoted at load time (gpufleet.runbook). The pure parts (conditions, descriptions, the JSON
document) take values and return values so the unit tests need no host.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from .inventory import Host
from .model import HostResult, Snapshot, SnapshotError, ledger, parse_snapshot
from .runbook import Runbook, Step, describe
from .selection import format_gpu_list

OK, FAILED, SKIPPED, PLANNED = "ok", "failed", "skipped", "planned"
MARGIN_S = 5.0  # the controller waits this much longer than a host-side bound
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
class HostRun:
    host: str
    ok: bool
    error: Optional[str]
    steps: list[StepResult]
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.ok, "error": self.error,
                "seconds": round(self.seconds, 3), "steps": [s.as_dict() for s in self.steps]}


class StepFailed(Exception):
    """A step's own failure, with the one-line reason shown to the operator."""


def _short(text: Any, width: int = DETAIL_MAX) -> str:
    one = " ".join(str(text).split())
    return one if len(one) <= width else one[: width - 1] + "…"


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return _short(text.splitlines()[0] if text else type(exc).__name__)


# --------------------------------------------------------------------------- dry run


def plan_host(runbook: Runbook, host: Host) -> HostRun:
    """--dry-run: what each step would do on this host; nothing is contacted."""
    steps = []
    for step in runbook.steps:
        text = describe(step)
        if step.kind in ("stop_units", "start_unit") and host.sudo:
            text += " (sudo -n)"
        if step.kind == "wait_http":
            text += f" (up to {step.timeout:g}s)"
        steps.append(StepResult(step.name, step.kind, PLANNED, 0.0, text))
    return HostRun(host=host.name, ok=True, error=None, steps=steps)


# --------------------------------------------------------------------------- conditions (pure)


def _free_mib(gpu: Any) -> Optional[int]:
    if gpu.memory_free_mib is not None:
        return gpu.memory_free_mib
    if gpu.memory_total_mib is not None and gpu.memory_used_mib is not None:
        return max(0, gpu.memory_total_mib - gpu.memory_used_mib - (gpu.memory_reserved_mib or 0))
    return None


def gpu_metrics(snapshot: Snapshot, expected_unattributed_mib: int = 0) -> dict[int, dict[str, Any]]:
    """Per GPU index: the metrics an `assert` may bound (None = not available)."""
    rows = {row.index: row for row in ledger(snapshot, expected_unattributed_mib)}
    out = {}
    for gpu in snapshot.gpus:
        free = _free_mib(gpu)
        total = gpu.memory_total_mib
        row = rows[gpu.index]
        out[gpu.index] = {
            "free_mib": free,
            "used_mib": gpu.memory_used_mib,
            "free_fraction": (free / total) if free is not None and total else None,
            "unattributed_mib": row.unattributed_mib,
            "unexpected_unattributed_mib": row.unexpected_mib,
            "reserved_mib": gpu.memory_reserved_mib,
        }
    return out


def _chosen(snapshot: Snapshot, gpus: Optional[Sequence[int]]) -> tuple[list[int], list[int]]:
    have = [g.index for g in snapshot.gpus]
    if gpus is None:
        return have, []
    return [i for i in gpus if i in have], [i for i in gpus if i not in have]


def holders_on(snapshot: Snapshot, gpus: Iterable[int]) -> dict[int, set[int]]:
    """PIDs holding each GPU: nvidia-smi's listing (memory), plus device-file holders that
    nvidia-smi lists nowhere (another PID namespace, hidden PIDs). A listed process is NOT
    counted on a GPU it only has a file open on: CUDA opens every /dev/nvidiaN."""
    wanted = set(gpus)
    out: dict[int, set[int]] = {i: set() for i in wanted}
    for i in wanted:
        out[i].update(a.pid for a in snapshot.apps_on(i))
    listed = snapshot.listed_pids()
    for holder in snapshot.holders:
        if holder.pid in listed:
            continue
        proc = snapshot.processes.get(holder.pid)
        if proc is not None and proc.relation in ("self", "ancestor"):
            continue
        for i in snapshot.holder_gpu_indices(holder):
            if i in wanted:
                out[i].add(holder.pid)
    return out


def memory_holders(snapshot: Snapshot, gpus: Iterable[int]) -> set[tuple[int, Optional[int]]]:
    """(pid, starttime) of every process nvidia-smi attributes memory to on these GPUs."""
    out = set()
    for i in gpus:
        for app in snapshot.apps_on(i):
            proc = snapshot.processes.get(app.pid)
            out.add((app.pid, proc.starttime if proc is not None else None))
    return out


def _alive(snapshot: Snapshot, pid: int, starttime: Optional[int]) -> bool:
    proc = snapshot.processes.get(pid)
    return proc is not None and starttime is not None and proc.starttime == starttime


def _fmt(metric: str, value: float) -> str:
    return f"{value:.3f}" if metric == "free_fraction" else f"{value:g} MiB"


def check_conditions(that: Mapping[str, Any], snapshot: Snapshot, baseline: Optional[Snapshot],
                     expected_unattributed_mib: int = 0) -> list[tuple[bool, str]]:
    """One (held, what was found) per condition. Missing evidence never holds."""
    if not snapshot.nvidia_smi_ok:
        return [(False, f"nvidia-smi failed: {snapshot.nvidia_smi_error or '?'}")]
    return list(_conditions(that, snapshot, baseline, expected_unattributed_mib))


def _conditions(that: Mapping[str, Any], snapshot: Snapshot, baseline: Optional[Snapshot],
                expected_unattributed_mib: int) -> Iterable[tuple[bool, str]]:
    if that["bounds"]:
        indices, missing = _chosen(snapshot, that["gpus"])
        if missing:
            yield False, f"no GPU {format_gpu_list(missing)} on this host"
        metrics = gpu_metrics(snapshot, expected_unattributed_mib)
        for metric, (lo, hi) in that["bounds"].items():
            bad = []
            for i in indices:
                value = metrics[i][metric]
                if value is None:
                    bad.append(f"GPU {i} n/a")
                elif (lo is not None and value < lo) or (hi is not None and value > hi):
                    bad.append(f"GPU {i} {_fmt(metric, value)}")
            want = " and ".join(([f">= {_fmt(metric, lo)}"] if lo is not None else [])
                                + ([f"<= {_fmt(metric, hi)}"] if hi is not None else []))
            if bad:
                yield False, f"{metric} {want}: FAILED on {', '.join(bad)}"
            else:
                yield True, f"{metric} {want}: ok on GPU {format_gpu_list(indices) or '-'}"
    for key, gpus in that["sets"].items():
        indices, missing = _chosen(snapshot, gpus)
        if missing:
            yield False, f"{key}: no GPU {format_gpu_list(missing)} on this host"
        if key == "no_holders_on":
            found = holders_on(snapshot, indices)
            bad = [f"GPU {i}: {', '.join(_pid_name(snapshot, p) for p in sorted(pids))}"
                   for i, pids in sorted(found.items()) if pids]
            if bad:
                yield False, f"no holders on {format_gpu_list(gpus)}: FAILED, {'; '.join(bad)}"
            else:
                yield True, f"no holders on {format_gpu_list(gpus)}: ok"
        else:  # holders_alive_on
            if baseline is None:
                yield False, f"holders alive on {format_gpu_list(gpus)}: no snapshot from the start"
                continue
            before = memory_holders(baseline, gpus)
            if not before:
                yield False, (f"holders alive on {format_gpu_list(gpus)}: FAILED, nothing held "
                              "these GPUs at the start (nothing to prove)")
                continue
            gone = [(p, s) for p, s in sorted(before, key=lambda x: x[0]) if not _alive(snapshot, p, s)]
            names = ", ".join(_pid_name(baseline, p) for p, _ in sorted(before))
            if gone:
                yield False, (f"holders alive on {format_gpu_list(gpus)}: FAILED, gone or replaced: "
                              f"{', '.join(_pid_name(baseline, p) for p, _ in gone)}")
            else:
                yield True, f"holders alive on {format_gpu_list(gpus)}: ok ({names})"


def _pid_name(snapshot: Snapshot, pid: int) -> str:
    proc = snapshot.processes.get(pid)
    if proc is not None:
        return f"{proc.name} {pid}"
    app = next((a for a in snapshot.compute_apps if a.pid == pid), None)
    return f"{app.process_name if app else '?'} {pid}"


def report_lines(snapshot: Snapshot, gpus: Optional[Sequence[int]], expected_unattributed_mib: int,
                 wsl2: bool) -> list[str]:
    """Per GPU: used, free, total, reserved, unattributed (vs what the inventory expects)."""
    if not snapshot.nvidia_smi_ok:
        raise StepFailed(f"nvidia-smi failed: {snapshot.nvidia_smi_error or '?'}")
    indices, missing = _chosen(snapshot, gpus)
    if missing:
        raise StepFailed(f"no GPU {format_gpu_list(missing)} on this host")
    if not indices:
        raise StepFailed("no GPUs on this host")
    metrics = gpu_metrics(snapshot, expected_unattributed_mib)
    by_index = {g.index: g for g in snapshot.gpus}

    def mib(v: Optional[int]) -> str:
        return "n/a" if v is None else f"{v} MiB"

    lines = []
    for i in indices:
        g, m = by_index[i], metrics[i]
        unattr = m["unattributed_mib"]
        note = ""
        if unattr is not None:
            if m["unexpected_unattributed_mib"]:
                note = (f" (expected {expected_unattributed_mib}; if this is normal here, set "
                        f"unattributed_mib: {unattr} for this host)")
            elif expected_unattributed_mib:
                note = f" (expected {expected_unattributed_mib})"
        what = "reservation (unattributed)" if wsl2 else "unattributed"
        lines.append(f"GPU {i}: used {mib(g.memory_used_mib)} of {mib(g.memory_total_mib)}, "
                     f"free {mib(m['free_mib'])}, reserved {mib(g.memory_reserved_mib)}, "
                     f"{what} {mib(unattr)}{note}")
    return lines


# --------------------------------------------------------------------------- host-side probes

# Runs ON the host (Python 3.6+, stdlib): polls a URL until it answers the wanted status.
# Everything variable arrives as JSON on stdin; proxies are ignored (the URL is the host's own).
WAIT_HTTP_SOURCE = r"""
import json, sys, time, urllib.request, urllib.error
r = json.loads(sys.stdin.read())
end = time.monotonic() + r["wait_s"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
n, last = 0, None
while True:
    n += 1
    code = None
    try:
        left = max(0.2, min(r["attempt_s"], end - time.monotonic()))
        with opener.open(r["url"], timeout=left) as resp:
            code = resp.getcode()
    except urllib.error.HTTPError as e:
        code = e.code
    except Exception as e:
        last = (type(e).__name__ + ": " + str(e))[:200]
    if code is not None:
        last = "HTTP %d" % code
    if code == r["status"]:
        print(json.dumps({"ok": True, "attempts": n, "last": last}))
        break
    if time.monotonic() + r["interval"] >= end:
        print(json.dumps({"ok": False, "attempts": n, "last": last}))
        break
    time.sleep(r["interval"])
"""


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

    # -- transport helpers

    def snapshot(self, timeout: float) -> Snapshot:
        from .collect import snapshot_request

        request = snapshot_request(self.host)
        bound = max(1.0, min(float(self.host.command_timeout), timeout))
        request["deadline_s"] = max(1.0, bound - 2.0)
        request["smi_timeout_s"] = max(1.0, min(request["smi_timeout_s"], bound / 2))
        reply = self.session.run_agent(request, timeout=bound)
        if not reply.ok or reply.doc is None:
            raise StepFailed(f"snapshot failed: {reply.error or 'agent failed'}")
        try:
            snap = parse_snapshot(reply.doc)
        except SnapshotError as exc:
            raise StepFailed(f"snapshot unreadable: {exc}") from None
        if not snap.nvidia_smi_ok:
            raise StepFailed(f"nvidia-smi failed: {snap.nvidia_smi_error or '?'}")
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
    from .cleaning import CleanOptions, execute_plan, plan_host as plan_clean

    p = step.params
    opts = CleanOptions(
        gpus="all" if p["gpus"] is None else format_gpu_list(p["gpus"]),
        grace_s=p["grace"], timeout_s=step.timeout, tolerance_mib=p["tolerance_mib"],
        protect=tuple(p["protect"]), include_spanning=p["include_spanning"],
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
        why = result.error or result.reason or result.verdict
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
        "smi_timeout_s": max(1.0, min(10.0, bound / 3)), "scope": [], "targets": [], "units": [],
        "grace_s": 0.0, "timeout_s": max(1.0, bound / 2), "poll_s": 0.1, "threshold_mib": {},
        "shm": True, "reset": False, "lock_path": None, "operator": ctx.operator,
    }
    reply = ctx.session.run_agent(request, timeout=bound + MARGIN_S)
    if not reply.ok or reply.doc is None:
        raise StepFailed(f"agent failed: {reply.error or '?'}")
    doc = reply.doc
    if doc.get("lock") == "busy":
        raise StepFailed("another gpufleet clean holds this host's lock; nothing removed")
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
    from .cli.fit_cmd import fit_host
    from .errors import UsageError
    from .fit import ModelNeed, dtype_bytes, validate_need, weights_gib_from_params

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


def _step_wait_http(ctx: _HostRun, step: Step, end: float) -> str:
    p = step.params
    left = max(1.0, _remaining(end))
    margin = min(MARGIN_S, max(0.5, left * 0.1))  # the probe ends itself before we stop waiting
    wait_s = max(0.5, left - margin)
    request = {"url": p["url"], "status": p["status"], "interval": p["interval"],
               "attempt_s": max(1.0, min(10.0, p["interval"] * 2)), "wait_s": wait_s}
    started = time.monotonic()
    code, out, err = ctx.argv([ctx.host.python, "-c", WAIT_HTTP_SOURCE], left,
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


EXECUTORS: dict[str, Callable[[_HostRun, Step, float], str]] = {
    "stop_units": _step_stop_units,
    "clean": _step_clean,
    "wait_free": _step_wait_free,
    "fit": _step_fit,
    "clear_shm": _step_clear_shm,
    "start_unit": _step_start_unit,
    "wait_http": _step_wait_http,
    "shell": _step_shell,
    "assert": _step_assert,
    "report": _step_report,
}


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
    if _needs_baseline(runbook):
        try:
            ctx.baseline = ctx.snapshot(float(host.command_timeout))
        except Exception as exc:  # the host could not be read: nothing ran
            error = f"first snapshot: {_exc_text(exc)}"
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
        except Exception as exc:  # transport errors, timeouts: this step failed
            res = StepResult(step.name, step.kind, FAILED, time.monotonic() - t0, _exc_text(exc))
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
    return HostRun(host=host.name, ok=not failed and error is None, error=error, steps=results,
                   seconds=time.monotonic() - started)


def run_host(runbook: Runbook, host: Host, operator: str = "gpufleet", audit_log: Optional[str] = None,
             on_step: Optional[Callable[[str, Step, StepResult], None]] = None,
             open_session: Optional[Callable[[Host], Any]] = None) -> HostRun:
    """Open ONE session for the host and run every step through it."""
    if open_session is None:
        from .transport import open_session as default_open

        open_session = default_open
    started = time.monotonic()
    try:
        with open_session(host) as session:
            if getattr(session, "error", None):  # unreachable: nothing ran
                return HostRun(host=host.name, ok=False, error=_short(session.error),
                               steps=[StepResult(s.name, s.kind, SKIPPED) for s in runbook.steps],
                               seconds=time.monotonic() - started)
            return run_steps(runbook, host, session, operator, audit_log, on_step)
    except Exception as exc:  # could not connect (or the session broke on close)
        return HostRun(host=host.name, ok=False, error=_exc_text(exc),
                       steps=[StepResult(s.name, s.kind, SKIPPED) for s in runbook.steps],
                       seconds=time.monotonic() - started)


def run_runbook(runbook: Runbook, hosts: Sequence[Host], forks: int = 32, operator: str = "gpufleet",
                audit_log: Optional[str] = None,
                on_step: Optional[Callable[[str, Step, StepResult], None]] = None,
                open_session: Optional[Callable[[Host], Any]] = None) -> list[HostRun]:
    """Hosts in parallel (at most ``forks``), results in host order."""
    from .fanout import run_hosts

    def make_error(host: Host, message: str) -> HostRun:
        return HostRun(host=host.name, ok=False, error=message,
                       steps=[StepResult(s.name, s.kind, SKIPPED) for s in runbook.steps])

    return run_hosts(hosts, lambda h: run_host(runbook, h, operator, audit_log, on_step, open_session),
                     forks=forks, make_error=make_error)


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
    from tabulate import tabulate

    rows = []
    for run in runs:
        for n, s in enumerate(run.steps, 1):
            seconds = "-" if s.outcome in (SKIPPED, PLANNED) else f"{s.seconds:.1f}s"
            rows.append([run.host, n, s.name, s.kind, s.outcome, seconds, _short(s.detail or "-", width)])
    text = tabulate(rows, headers=["HOST", "#", "STEP", "KIND", "OUTCOME", "TIME", "DETAIL"],
                    disable_numparse=True)
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
