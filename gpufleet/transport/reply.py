"""What a run on a host gave, as values: the agent's reply, another argv's result, and the
one-line reasons a run failed (sudo, a missing or too-old python, a timeout, output that is
not JSON), the same whichever way the host was reached.

Internal to gpufleet.transport: every session (gpufleet.transport.session and the ways of
reaching a host) and the conversation read their raw runs through here.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.transport.run import KILL_AFTER_S, RawRun


@dataclass(frozen=True)
class AgentReply:
    """What one agent run gave: the parsed document, or why there is none (``error``, and
    its ``error_kind``: gpufleet.errors kinds). Not a per-host row (core.results): it has no
    host; the rows are made from it (ops.collect.result_from_reply)."""

    ok: bool
    doc: Optional[dict] = None
    error: Optional[str] = None
    exit_code: Optional[int] = None
    seconds: float = 0.0
    stderr: bytes = b""
    error_kind: Optional[str] = None
    #: a conversation's request that certainly never reached the agent, or that it said it
    #: did not act on (it had ended, the connection was gone, it ended idle): nothing was done
    unsent: bool = False


class ArgvResult(NamedTuple):
    exit_code: int
    stdout: bytes
    stderr: bytes


_MISSING = (
    re.compile(r"command not found: (\S+)"),
    re.compile(r"(?:^|: )([^\s:]+): (?:command )?not found"),
    re.compile(r"(?:^|: )([^\s:]+): No such file or directory"),
)


def _missing_command(stderr: str) -> Optional[str]:
    for line in stderr.splitlines():
        for pattern in _MISSING:
            m = pattern.search(line)
            if m:
                return m.group(1)
    return None


def _last_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _command_error(raw: RawRun, host: Host, what: str, timeout: float) -> Optional[str]:
    """Why a run failed as one line, or None if it exited 0."""
    if raw.timed_out:
        return f"{what} timed out after {timeout:g}s"
    code = raw.exit_code
    if code == 0:
        return None
    text = raw.stderr.decode("utf-8", "replace")
    python = getattr(host, "python", "python3") or "python3"
    if "a password is required" in text or "a terminal is required" in text:
        user = getattr(host, "user", None) or "the login user"
        return (f"sudo needs a password for {user} on this host (gpufleet runs sudo -n and never "
                "prompts): allow it without a password or set sudo: false")
    if "sudoers" in text or "not allowed to execute" in text:
        return f"sudo refused: {_last_line(raw.stderr)}"
    if code == 1 and _PY2_STDIN in text:  # the bootstrap's sys.stdin.buffer under Python 2
        return _too_old(host, "Python 2")
    if code in (1, 126, 127):
        missing = _missing_command(text)
        if missing:
            base = os.path.basename(missing)
            if base == os.path.basename(python):
                return f"{python} not found on host (set python: in the inventory)"
            if base == "sudo":
                return "sudo not found on host (set sudo: false in the inventory)"
            if code == 127:
                return f"{missing} not found on host"
    if code == -1:
        return f"{what} ended without an exit status (killed by a signal, or connection lost)"
    tail = _last_line(raw.stderr)
    return f"{what} exited {code}" + (f": {tail}" if tail else "")


_PY2_STDIN = "'file' object has no attribute 'buffer'"


def _too_old(host: Host, what: str) -> str:
    python = getattr(host, "python", None) or "python3"
    return (f"{python} on {getattr(host, 'name', 'host')} is too old ({what}; gpufleet needs "
            "3.6+): set python: in the inventory")


def wrapper_error(raw: RawRun, sudo: bool, uses_timeout: bool) -> Optional[str]:
    text = raw.stderr.decode("utf-8", "replace")
    if sudo and ("a password is required" in text or "a terminal is required" in text):
        return ("sudo needs a password on this host (gpufleet runs sudo -n and never prompts)")
    if sudo and ("sudoers" in text or "not allowed to execute" in text):
        return f"sudo refused: {_last_line(raw.stderr)}"
    if raw.exit_code in (1, 126, 127):
        missing = os.path.basename(_missing_command(text) or "")
        if sudo and missing == "sudo":
            return "sudo not found on host"
        if uses_timeout and missing == "timeout":
            return "`timeout` (coreutils) not found on host"
    return None


def deadline_for(timeout: float) -> float:
    """The agent's own deadline: a little inside the controller's timeout, so it reports first."""
    margin = min(2.0, max(0.2, 0.1 * timeout))
    return max(0.1, timeout - margin)


def with_deadline(request: Mapping[str, Any], timeout: float) -> dict[str, Any]:
    """The request with the agent's own deadline: the caller's, if any, within
    ``deadline_for(timeout)``."""
    req = dict(request)
    own = deadline_for(timeout)
    given = req.get("deadline_s")
    req["deadline_s"] = own if given is None else min(float(given), own)
    return req


def agent_command(host: Host) -> list[str]:
    """The constant bootstrap command that runs the agent (its data comes on stdin)."""
    from gpufleet.remote import bootstrap_command

    return bootstrap_command(getattr(host, "python", None) or "python3", bool(getattr(host, "sudo", False)))


def remote_timeout(argv: list[str], timeout: float) -> list[str]:
    """``argv`` bounded on the host itself (coreutils/busybox ``timeout``): over SSH closing
    the channel does not end the remote process (see the module docstring)."""
    return ["timeout", "-k", str(KILL_AFTER_S), str(max(1, math.ceil(timeout)))] + argv


def agent_reply(raw: RawRun, host: Host, timeout: float, seconds: float) -> AgentReply:
    """One agent run's outcome as a reply: the wrappers' and the interpreter's failures
    (sudo, missing or too-old python, timeout), output that is not one JSON object, or the
    document (run_agent, and each answer of a conversation)."""

    def failed_run(message: str, kind: str, doc: Optional[dict] = None) -> AgentReply:
        return AgentReply(False, doc, message, raw.exit_code, seconds, raw.stderr, kind)

    error = _command_error(raw, host, "agent", timeout)
    if error is not None:
        return failed_run(error, errors.COMMAND)
    text = raw.stdout.decode("utf-8", "replace").strip()
    if not text:
        return failed_run("agent printed nothing", errors.AGENT)
    try:
        doc = json.loads(text)
    except ValueError:
        head = text.splitlines()[0][:80]
        return failed_run(f"agent output is not JSON: {head!r}", errors.AGENT)
    if not isinstance(doc, dict):
        return failed_run("agent output is not a JSON object", errors.AGENT)
    if doc.get("python_too_old"):  # the agent's own version check (3.0 - 3.5)
        return failed_run(_too_old(host, f"Python {doc.get('python')}"), errors.COMMAND, doc)
    return AgentReply(True, doc, None, raw.exit_code, seconds, raw.stderr)


