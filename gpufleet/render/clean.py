"""Clean plans and outcomes as text and as the documented JSON document (pure)."""
from __future__ import annotations

from typing import Any, Optional, Sequence


from gpufleet.core.plan import Plan
from gpufleet.core.gpus import format_gpu_ranges
from gpufleet.render.command import command_summary
from gpufleet.render.common import TABLE_WIDTH, fit_column
from gpufleet.render.table import render_table

CLEAN_HEADERS = ["HOST", "GPUS", "SIGNALLED", "REFUSED", "FREED (MiB)", "LEFT (MiB)", "VERDICT", "TIME"]
PLAN_HEADERS = ["SIGNAL PID", "USER", "GPUS", "EVIDENCE", "ORDER", "MiB", "OWNER", "COMMAND"]


def _short(text: str, width: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def plan_text(plan: Plan) -> str:
    """What would be signalled, what is refused and why: the heart of --dry-run."""
    lines = [f"{plan.host}: GPUs {format_gpu_ranges(plan.scope) or '-'}"
             f"{' (every GPU)' if plan.full_scope else ''}"]
    for unit in plan.units_to_stop:
        lines.append(f"  stop unit {unit.unit}{' and disable it' if unit.disable else ''} first")
    if plan.targets:
        rows = [[t.pid, _short(t.user or "?", 12), format_gpu_ranges(t.gpus) or "-", t.evidence,
                 "root" if t.wave == 0 else f"child of {t.family_root}",
                 "-" if t.used_mib is None else t.used_mib, _owner_cell(t),
                 command_summary(t.cmdline, t.name, 60)]
                for t in sorted(plan.targets, key=lambda t: (t.wave, t.pid))]
        # what runs last, cut to what the width leaves (the plan is indented by 2)
        fit_column(rows, PLAN_HEADERS, len(PLAN_HEADERS) - 1, TABLE_WIDTH - 2, 20)
        table = render_table(rows, PLAN_HEADERS)
        lines.extend("  " + line for line in table.splitlines())
        if plan.settle_s > 0:
            lines.append(f"  then watch for {plan.settle_s:g} s that nothing takes the GPUs back "
                         "(a target has an owner that may start it again)")
    else:
        lines.append("  nothing to signal")
    for ref in plan.refused:
        lines.append(f"  refused {ref.pid} {_short(ref.name, 28)}: {ref.reason}")
    for inv in plan.invisible:
        lines.append(f"  GPU {inv.gpu}: pid {inv.pid} ({inv.process_name}, "
                     f"{'n/a' if inv.used_mib is None else inv.used_mib} MiB): {inv.reason}")
    for note in plan.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def _owner_cell(t: Any) -> str:
    """Who may start the target again: '-' for nobody but init; '(restarts)' on evidence."""
    o = t.owner
    if o is None:
        return "-"
    return _short(o.name, 24) + (" (restarts)" if o.restarts else "")


def _signalled(doc: Optional[dict]) -> int:
    if not doc:
        return 0
    return len({s.get("pid") for s in doc.get("signals") or () if s.get("outcome") == "sent"})


def outcome_rows(results: Sequence[Any]) -> list[list[Any]]:
    rows = []
    for r in results:
        plan = r.plan
        gpus = format_gpu_ranges(plan.scope) if plan else "-"
        refused = len(plan.refused) if plan else "-"
        detail = r.verdict_detail or {}
        freed = detail.get("freed_mib", "-") if detail else "-"
        left = detail.get("left_mib", "-") if detail else "-"
        verdict = r.verdict
        if r.verdict == "planned" and plan is not None:
            signalled: Any = f"({len(plan.targets)})"
        elif getattr(r, "outcome_unknown", False):
            signalled = "?"  # the host may have signalled; its report was lost
        else:
            signalled = _signalled(r.agent_doc)
        rows.append([r.host, gpus or "-", signalled, refused, freed, left, verdict, f"{r.seconds:.2f}s"])
    return rows


def outcome_table(results: Sequence[Any]) -> str:
    text = render_table(outcome_rows(results), CLEAN_HEADERS, numparse=False)
    reasons = []
    for r in results:
        if r.error:
            reasons.append(f"{r.host}: {r.error}")
        elif r.reason and r.verdict not in ("clean", "planned"):
            # a dirty verdict's reason is a line per GPU (and per problem): each its own line
            reasons.extend(f"{r.host}: {line}" for line in r.reason.splitlines())
    return text + ("\n" + "\n".join(reasons) if reasons else "")


def _mem(snapshot: Any, scope: Sequence[int]) -> list[dict[str, Any]]:
    if snapshot is None:
        return []
    return [{"index": g.index, "memory_used_mib": g.memory_used_mib} for g in snapshot.gpus if g.index in scope]


def _before(detail: dict[str, Any], snapshot: Any, scope: Sequence[int]) -> list[dict[str, Any]]:
    """The memory freed_mib counts from: the verdict's (what the agent read once it held the
    host's lock), else the plan's snapshot (no verdict: the clean never got that far)."""
    gpus = detail.get("gpus")
    if gpus:
        return [{"index": g["index"], "memory_used_mib": g["before_mib"]} for g in gpus]
    return _mem(snapshot, scope)


def host_document(r: Any) -> dict[str, Any]:
    """One host of `clean --json`; the key names are a contract (README)."""
    plan: Optional[Plan] = r.plan
    doc = r.agent_doc or {}
    scope = list(plan.scope) if plan else []
    detail = r.verdict_detail or {}
    before_snap = r.before.snapshot if r.before is not None else None
    return {
        "host": r.host,
        "ok": bool(r.ok),
        "error": r.error,
        **r.error_kind_field(),
        "verdict": r.verdict,
        "reason": r.reason,
        "outcome_unknown": bool(getattr(r, "outcome_unknown", False)),
        "gpus": scope,
        "seconds": round(r.seconds, 3),
        "targets": [
            {"pid": t.pid, "starttime": t.starttime, "name": t.name, "cmdline": t.cmdline,
             "gpus": list(t.gpus), "evidence": t.evidence, "wave": t.wave,
             "family_root": t.family_root, "used_mib": t.used_mib,
             "evidence_reason": t.evidence_reason}
            for t in (plan.targets if plan else ())
        ],
        "refused": [{"pid": x.pid, "name": x.name, "reason": x.reason, "kind": x.kind}
                    for x in (plan.refused if plan else ())],
        "invisible": [{"pid": x.pid, "gpu": x.gpu, "process_name": x.process_name,
                       "used_mib": x.used_mib, "reason": x.reason}
                      for x in (plan.invisible if plan else ())],
        "signals": [{"pid": s.get("pid"), "starttime": s.get("starttime"), "signal": s.get("signal"),
                     "outcome": s.get("outcome")} for s in doc.get("signals") or ()],
        "units_stopped": list(doc.get("units_stopped") or []),
        "survivors": list(doc.get("survivors") or []),
        "shm_removed": list(doc.get("shm_removed") or []),
        "reset": list(doc.get("reset") or []),
        "memory_wait": doc.get("memory_wait"),
        "lock_holder": doc.get("lock_holder"),  # busy: {pid, uid, user, cmdline, open}
        "cancelled": doc.get("cancelled"),  # a second Ctrl-C: {t, pending: [{pid, signal}]}
        "before": _before(detail, before_snap, scope),
        "after": _mem(r.after, scope),
        "freed_mib": detail.get("freed_mib"),
        "left_mib": detail.get("left_mib"),
        "verdict_detail": detail,
        "plan_notes": list(plan.notes) if plan else [],
        "clients": [{"pid": c.pid, "name": c.name, "gpus": list(c.gpus), "reason": c.reason}
                    for c in (plan.clients if plan else ())],
    }


def clean_document(results: Sequence[Any], dry_run: bool) -> dict[str, Any]:
    return {"command": "clean", "dry_run": dry_run, "hosts": [host_document(r) for r in results]}
