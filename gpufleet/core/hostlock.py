"""The agent's host lock, as the one line an operator reads when a clean did nothing for it
(pure).

The agent (gpufleet/remote/lock.py) reports ``lock``: "acquired", "busy" with
``lock_holder`` {pid, uid, user, cmdline, open} (from /proc/locks: who holds it, so the
operator can tell a clean still running from a stuck process), or "refused" with
``lock_refused`` {kind, path, reason} (the lock could be another user's, so it was not used).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

#: The agent's bootstrap names its loader so; a holder whose command line has it is one.
AGENT_MARK = "gpufleet-agent-loader"
#: How much of the holder's command line the message shows (the JSON has up to 512).
CMDLINE_SHOWN = 100
BUSY_UNKNOWN = "another gpufleet clean holds this host's lock"

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _shown(text: str, width: int) -> str:
    """A host-supplied string on one line, control characters escaped, cut to width."""
    flat = _CONTROL.sub(lambda m: "\\x%02x" % ord(m.group()), " ".join(str(text).split()))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def holder_text(holder: Optional[Mapping[str, Any]]) -> str:
    """Who holds the lock, for the busy message: PID, user and command line when known."""
    if not isinstance(holder, Mapping):
        return BUSY_UNKNOWN
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return "a process outside the agent's PID namespace holds this host's clean lock"
    cmdline = holder.get("cmdline")
    who = "another gpufleet clean" if AGENT_MARK in str(cmdline or "") else "another process"
    user = holder.get("user") or holder.get("uid")
    parts = [f"PID {pid}", f"user {_shown(str(user), 32) if user is not None else '?'}"]
    if cmdline:
        parts.append(f'command "{_shown(cmdline, CMDLINE_SHOWN)}"')
    if holder.get("open") is False:
        parts.append("no longer has the lock file open")
    return f"{who} holds this host's lock: " + ", ".join(parts)


def lock_failure(clean: Mapping[str, Any], done: str = "nothing was signalled") -> Optional[str]:
    """Why the agent did nothing because of its host lock, in one line ending in ``done``;
    None when the lock was taken (or the document says nothing of it)."""
    lock = clean.get("lock")
    if lock == "busy":
        return f"{holder_text(clean.get('lock_holder'))}; {done}"
    if lock == "refused":
        refused = clean.get("lock_refused")
        reason = refused.get("reason") if isinstance(refused, Mapping) else None
        return f"no safe clean lock: {_shown(reason or '?', 300)}; {done}"
    return None

