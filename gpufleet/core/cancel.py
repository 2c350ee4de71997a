"""What a clean cancelled by the operator's second Ctrl-C did, and what it will still do, in the
words its row says (pure).

A report after an interrupt must be as true as one after a finished clean: which signals the
host sent (from the agent's own answer), which it did not send because it was told to stop, or,
when the cancel could not reach the agent, what the agent goes on to do and by when.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Optional

#: Where the agent keeps its own record of every signal (remote/audit.py Auditor), under the
#: home directory of the user it runs as.
HOST_RECORD = "~/.local/state/gpufleet/agent-audit.jsonl"


def _who(pid: Any, names: Mapping[int, str]) -> str:
    name = names.get(pid) if isinstance(pid, int) else None
    return f"PID {pid}" + (f" ({name})" if name else "")


def _signals(entries: Iterable[Mapping[str, Any]], names: Mapping[int, str]) -> list[str]:
    return [f"SIG{e.get('signal')} to {_who(e.get('pid'), names)}" for e in entries]


def cancelled_reason(doc: Mapping[str, Any], names: Mapping[int, str], host: str) -> str:
    """The row of a clean whose agent stopped at the operator's cancel: what it had sent (the
    ``signals`` it sent, as its audit file has them) and what it then did not send."""
    raw = doc.get("cancelled")
    cancelled: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    sent = _signals([s for s in doc.get("signals") or () if s.get("outcome") == "sent"], names)
    pending = _signals(cancelled.get("pending") or (), names)
    parts = ["pending signals cancelled: " + ("sent " + ", ".join(sent) if sent else "sent nothing"),
             "not sent: " + ", ".join(pending) if pending else "nothing was pending"]
    if doc.get("memory_wait") is None:
        parts.append(f"the memory was not verified: run `gpufleet status --host {host}`")
    return "; ".join(parts)


def clock(epoch: float) -> str:
    """A wall-clock time an operator compares with their own: HH:MM:SS, local time."""
    return time.strftime("%H:%M:%S", time.localtime(epoch))


def cancel_unanswered(cancelled_at: Optional[float]) -> str:
    """The cancel reached the agent, its report did not come back."""
    when = f" at {clock(cancelled_at)}" if cancelled_at is not None else ""
    return (f"the agent was told{when} to send no further signal, and its report of what it "
            f"had sent did not come back (the host keeps its own record: {HOST_RECORD})")


def cancel_undelivered(why: str, targets: Iterable[tuple[int, str]], grace_s: float,
                       asked_at: Optional[float], deadline_s: Optional[float]) -> str:
    """The cancel could not reach the agent: it goes on with the sequence it was given (a
    dropped session never cuts it short), so say what that is and by when it ends."""
    who = ", ".join(_who(pid, {pid: name}) for pid, name in targets) or "no process"
    end = (f", all by {clock(asked_at + deadline_s)} at the latest (its own deadline)"
           if asked_at is not None and deadline_s is not None else "")
    return (f"the cancel could not reach the agent ({why}): it goes on with its sequence, "
            f"SIGTERM then, {grace_s:g}s later, SIGKILL to whichever of {who} is still "
            f"alive{end}; its signals are in the host's own record ({HOST_RECORD})")
