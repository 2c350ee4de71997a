"""Append-only JSON-lines audit log of every signal gpufleet sent (controller side).

One line per signal: time, operator, host, pid, start time, cmdline, signal, outcome. Each
line is written with a single O_APPEND write, so concurrent gpufleet runs never interleave
partial lines. The agent keeps its own host-side copy for sessions that die mid-clean.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
import time
from typing import Any, Iterable, Mapping, Optional

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
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int((when % 1) * 1000):03d}Z",
            "operator": operator,
            "host": host,
            "pid": pid,
            "starttime": sig.get("starttime"),
            "cmdline": cmdlines.get(pid, ""),
            "signal": sig.get("signal"),
            "outcome": sig.get("outcome"),
        })
    return out
