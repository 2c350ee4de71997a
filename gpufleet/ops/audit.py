"""Append-only JSON-lines audit log of every signal gpufleet sent (controller side).

One line per signal: time, operator, host, pid, start time, cmdline, signal, outcome; and,
after each clean whose report came back, one verdict line (``"event": "verdict"``: time,
operator, host, verdict, reason, signals), which `gpufleet export`/`serve` read back as each
host's last clean (:func:`last_cleans`). Each line is written with a single O_APPEND write,
so concurrent gpufleet runs never interleave partial lines. The agent keeps its own host-side
copy for sessions that die mid-clean.
"""
from __future__ import annotations

import calendar
import getpass
import json
import os
import socket
import time
from typing import Any, Iterable, Mapping, Optional

from gpufleet.core.metrics import LastClean

DEFAULT_AUDIT_LOG = "~/.local/state/gpufleet/audit.jsonl"


def operator_name() -> str:
    """Who pressed the button: user@machine, as the audit trail should say."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def resolve_path(path: Optional[str]) -> str:
    return os.path.expanduser(path or os.environ.get("GPUFLEET_AUDIT_LOG") or DEFAULT_AUDIT_LOG)


def append(path: Optional[str], records: Iterable[Mapping[str, Any]]) -> int:
    """Append records; returns how many were written. A failure to write is raised: an
    unrecorded signal is worse than a loud error."""
    target = resolve_path(path)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    count = 0
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for rec in records:
            line = json.dumps(dict(rec), sort_keys=True, ensure_ascii=True) + "\n"
            os.write(fd, line.encode("ascii"))
            count += 1
    finally:
        os.close(fd)
    return count


def _stamp(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int((when % 1) * 1000):03d}Z"


def _parse_stamp(text: Any) -> Optional[float]:
    """The Unix time of one of our own stamps (``2026-12-01T12:00:00.250Z``), else None."""
    if not isinstance(text, str) or not text.endswith("Z"):
        return None
    head, _, frac = text[:-1].partition(".")
    try:
        whole = calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S"))
        return whole + (int(frac) / 10 ** len(frac) if frac else 0.0)
    except ValueError:
        return None


VERDICT_EVENT = "verdict"
READ_TAIL_BYTES = 16 << 20  # last_cleans reads at most this much of the log's end


def verdict_record(host: str, operator: str, verdict: str, reason: Optional[str],
                   signals: int, when: Optional[float] = None) -> dict:
    """The line that says how a clean of ``host`` ended (its signals have lines of their own)."""
    return {"time": _stamp(time.time() if when is None else when), "event": VERDICT_EVENT,
            "operator": operator, "host": host, "verdict": verdict, "reason": reason,
            "signals": int(signals)}


def last_cleans(path: Optional[str]) -> dict[str, LastClean]:
    """Per host, the last clean's verdict and time, and how many cleans by verdict, from the
    verdict lines of the log's last READ_TAIL_BYTES. A missing log is no cleans; a line that is
    not ours (torn, edited) is skipped, never an error."""
    target = resolve_path(path)
    try:
        with open(target, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - READ_TAIL_BYTES))
            data = fh.read(READ_TAIL_BYTES)
    except OSError:
        return {}
    last: dict[str, tuple[str, float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for line in data.splitlines()[1 if size > READ_TAIL_BYTES else 0:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("event") != VERDICT_EVENT:
            continue
        host, verdict, when = rec.get("host"), rec.get("verdict"), _parse_stamp(rec.get("time"))
        if not isinstance(host, str) or not isinstance(verdict, str) or when is None:
            continue
        by = counts.setdefault(host, {})
        by[verdict] = by.get(verdict, 0) + 1
        if host not in last or when >= last[host][1]:
            last[host] = (verdict, when)
    return {h: LastClean(v, t, dict(counts[h])) for h, (v, t) in last.items()}


def signal_records(host: str, operator: str, signals: Iterable[Mapping[str, Any]],
                   cmdlines: Mapping[int, str], started_at: Optional[float] = None) -> list[dict]:
    """Audit lines for the agent's `signals` list (only signals actually attempted)."""
    now = time.time()
    out = []
    for sig in signals:
        pid = int(sig.get("pid", -1))
        t = sig.get("t")
        when = (started_at + float(t)) if (started_at is not None and isinstance(t, (int, float))) else now
        out.append({
            "time": _stamp(when),
            "operator": operator,
            "host": host,
            "pid": pid,
            "starttime": sig.get("starttime"),
            "cmdline": cmdlines.get(pid, ""),
            "signal": sig.get("signal"),
            "outcome": sig.get("outcome"),
        })
    return out
