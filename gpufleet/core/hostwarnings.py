"""A host's warnings worth a line to the operator (pure): one rule for every command.

The agent's document keeps every warning (status --json's ``warnings``); a line on stderr is
for those that could matter here: "cannot read the open files of ..." only when some GPU has
memory nothing visible explains (inside a container the runtime's PID 1 is always unreadable;
saying so on every run cries wolf), plus one line per listed process the policy refuses as an
untrusted row. Commands print them on stderr, never among their stdout rows, which scripts
cut with grep and awk.
"""
from __future__ import annotations

from gpufleet.core import policy
from gpufleet.core.model import FD_DENIED_WARNING, Snapshot

#: the memory above the expected that makes unreadable processes worth a warning
BUSY_TOLERANCE_MIB = policy.DEFAULT_TOLERANCE_MIB


def screen_warnings(snapshot: Snapshot, expected_mib: int = 0) -> list[str]:
    """The agent's warnings worth a line (the unreadable-fds one only when it could matter)."""
    quiet = not policy.unreadable_could_matter(snapshot, expected_mib + BUSY_TOLERANCE_MIB)
    return [w for w in snapshot.warnings if not (quiet and w.startswith(FD_DENIED_WARNING))]


def listing_warnings(snapshot: Snapshot) -> list[str]:
    """One line per listed process that holds nothing of its GPU (policy.listing_check)."""
    return [f"PID {c.pid} is an untrusted row: {c.reason}; its memory counts as unattributed"
            for c in policy.refused_listings(snapshot).values()]


def host_warnings(host: str, snapshot: Snapshot, expected_mib: int = 0) -> list[str]:
    """``HOST: warning: ...`` lines for one host's snapshot, in the agent's order."""
    return [f"{host}: warning: {w}"
            for w in screen_warnings(snapshot, expected_mib) + listing_warnings(snapshot)]
