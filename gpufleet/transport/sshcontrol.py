"""OpenSSH's own control commands on a kept master's socket: ``ssh -O check`` (is a master
there, and its PID) and ``ssh -O exit`` (`gpufleet disconnect`).

Internal to gpufleet.transport. Why a check before a run through a kept master: a master that
hangs (stopped, its host unresponsive) takes a client's connect but never answers, and the
``ssh`` joining it would wait forever (ConnectTimeout does not cover the control socket). The
check is bounded by the host's connect timeout; a master that does not answer within it is
passed by, and that run connects on its own. The socket's directory is private (0700, ours:
gpufleet.transport.kept), so a master there is one of this user's.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from gpufleet.transport import sshconfig
from gpufleet.transport.run import RawRun
from gpufleet.transport.stream import run_process

_RUNNING = re.compile(rb"Master running \(pid=(\d+)\)")
#: ssh's words when nothing listens at the socket: a stale one, or none
_ABSENT = (b"Connection refused", b"No such file or directory")


@dataclass(frozen=True)
class Answer:
    """What answers at a socket: a master (``pid``), nothing (both None/False: a run may
    start one there), or something that did not answer within the bound (``hung``)."""

    pid: Optional[int] = None
    hung: bool = False


def _control(path: str, operation: str, timeout: float) -> RawRun:
    """``ssh -O OPERATION`` on ``path``; no ssh_config is read (-F /dev/null): the socket is
    all it needs, and a user's Match exec must not run for it."""
    ssh = sshconfig.ssh_client() or "ssh"
    argv = [ssh, "-F", "/dev/null", "-o", "BatchMode=yes", "-S", path, "-O", operation,
            "--", "gpufleet-kept"]
    return run_process(argv, b"", timeout)


def check(path: str, timeout: float) -> Answer:
    """The master at ``path``, asked within ``timeout`` seconds."""
    if not os.path.exists(path):
        return Answer()
    raw = _control(path, "check", timeout)
    if raw.timed_out:
        return Answer(hung=True)
    found = _RUNNING.search(raw.stderr)
    if raw.exit_code == 0 and found:
        return Answer(int(found.group(1)))
    return Answer(hung=not any(word in raw.stderr for word in _ABSENT))


def stop(path: str, timeout: float = 2.0) -> Optional[int]:
    """Ask the master at ``path`` to end (it closes its connection and its socket; nothing is
    signalled): its PID when one answered. A socket nobody listens on is removed, as ssh's
    ControlMaster=auto would before becoming the master there; one that hangs is left."""
    master = check(path, timeout)
    if master.pid is not None:
        _control(path, "exit", timeout)
    elif not master.hung:
        try:
            os.unlink(path)
        except OSError:
            pass
    return master.pid
