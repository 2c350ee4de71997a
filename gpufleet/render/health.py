"""The health table and JSON document (pure: values in, text out).

One row per GPU: OK / WARN / CRITICAL, its findings, the action of the worst one. The JSON
document carries the codes (docs/health.md); keys may be added, never renamed.
"""
from __future__ import annotations

import textwrap
from typing import Any, Optional, Sequence

from gpufleet.core.health import (ACTION_TEXT, CRITICAL, OK, UNKNOWN, WARN, GpuHealth, HostHealth,
                                  tally)
from gpufleet.render.common import (column_room, error_cell, terminal_safe,  # noqa: F401
                                     to_json)  # (to_json re-exported)
from gpufleet.render.table import render_table

HEALTH_HEADERS = ["HOST", "GPU", "PCI", "HEALTH", "FINDINGS", "ACTION"]
DETAIL_MAX = 120


def _cell(text: str) -> str:
    return terminal_safe(text, one_line=True)


def findings_text(g: GpuHealth) -> str:
    """``code: message`` per finding (OK ones too: "not available" says so), worst first; an
    Xid's last kernel log line below it, escaped and cut: it is text anyone's process name can
    be part of."""
    lines = []
    for f in sorted(g.findings, key=lambda f: f.severity == OK):
        lines.append(_cell(f"{f.code}: {f.message}"))
        if f.detail:
            detail = f.detail if len(f.detail) <= DETAIL_MAX else f.detail[:DETAIL_MAX - 1] + "…"
            lines.append("  last: " + _cell(detail))
    return "\n".join(lines) if lines else "-"


def health_rows(report: Sequence[HostHealth]) -> list[list[str]]:
    rows: list[list[str]] = []
    for h in report:
        if not h.ok:
            rows.append([h.host, "-", "-", "-", error_cell(h.error), "-"])
            continue
        for g in h.gpus:
            gpu = "-" if g.index is None else str(g.index)
            rows.append([h.host, gpu, g.pci or "n/a", g.severity, findings_text(g),
                         ACTION_TEXT[g.action]])
        for f in h.host_findings:
            rows.append([h.host, "host", "-", f.severity, _cell(f"{f.code}: {f.message}"),
                         ACTION_TEXT[f.action]])
        if not h.gpus and not h.host_findings:
            rows.append([h.host, "-", "-", OK, "no GPUs", "-"])
    return rows


def summary_line(report: Sequence[HostHealth]) -> str:
    """Hosts, GPUs by severity and the hosts' own findings: a CRITICAL `gpu_count` is no GPU's,
    and a summary that left it out would read as all sound."""
    failed = sum(1 for h in report if not h.ok)
    gpus, hosts = tally(report)
    return (f"hosts: {len(report) - failed} ok, {failed} failed; GPUs: "
            + ", ".join(f"{gpus[sev]} {sev}" for sev in (OK, UNKNOWN, WARN, CRITICAL))
            + f"; host findings: {hosts[WARN]} WARN, {hosts[CRITICAL]} CRITICAL")


def health_summary(report: Sequence[HostHealth]) -> str:
    """``health: 15 OK, 1 UNKNOWN; host findings: 1 CRITICAL`` for `status` and `top`'s
    summary lines: the severities present, the hosts' own findings whenever there is one."""
    gpus, hosts = tally(report)
    text = "health: " + (", ".join(f"{n} {sev}" for sev, n in gpus.items() if n) or "no GPUs")
    found = ", ".join(f"{n} {sev}" for sev, n in hosts.items() if n)
    return text + (f"; host findings: {found}" if found else "")


FINDINGS = HEALTH_HEADERS.index("FINDINGS")
FINDINGS_FLOOR = 30  # below this a finding's message would be a word a line


def wrap_findings(rows: list[list[str]], width: int) -> None:
    """Each FINDINGS cell wrapped (in place) to what the other columns leave of ``width``: a
    finding's message can be 80 characters, and a table wider than the terminal wraps every
    row. Continuation lines are indented under their finding."""
    room = column_room(rows, HEALTH_HEADERS, FINDINGS, width, FINDINGS_FLOOR)
    for r in rows:
        lines = []
        for line in r[FINDINGS].split("\n"):
            lead = len(line) - len(line.lstrip(" "))
            lines += textwrap.wrap(line, room, subsequent_indent=" " * (lead + 2),
                                   break_on_hyphens=False) or [line]
        r[FINDINGS] = "\n".join(lines)


def health_table(report: Sequence[HostHealth], width: Optional[int] = None) -> str:
    """The table; ``width`` (a terminal's): FINDINGS wrapped so no line is wider; None (a
    pipe): each finding on one line, as long as it is."""
    rows = health_rows(report)
    if width:
        wrap_findings(rows, width)
    return render_table(rows, HEALTH_HEADERS) + "\n" + summary_line(report)


def gpu_doc(g: GpuHealth) -> dict[str, Any]:
    return {"index": g.index, "pci": g.pci, "uuid": g.uuid, "name": g.name,
            "severity": g.severity, "action": g.action, "action_text": ACTION_TEXT[g.action],
            "unknown": list(g.unknown), "findings": [f.as_dict() for f in g.findings]}


def health_document(report: Sequence[HostHealth]) -> dict[str, Any]:
    """``{"hosts": [{"host", "ok", "error", "severity", "reset_blocker", "gpus": [...],
    "findings": [...]}]}``."""
    return {"hosts": [{"host": h.host, "ok": h.ok, "error": h.error,
                       "severity": h.severity if h.ok else None,
                       "reset_blocker": h.reset_blocker,
                       "gpus": [gpu_doc(g) for g in h.gpus],
                       "findings": [f.as_dict() for f in h.host_findings]} for h in report]}
