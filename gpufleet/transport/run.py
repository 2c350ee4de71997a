"""What one run gave (``RawRun``), and THE start of a command process.

Internal to gpufleet.transport (import from there). A run is a stream read to its end
(gpufleet.transport.stream.Stream.run_to_end); the sessions turn its ``RawRun`` into a reply or
a one-line error. Every way stops waiting at ``timeout`` and reports ``timed_out``: over SSH
the channel or ``ssh`` is ended (the remote side bounds itself, see
gpufleet.transport.session); locally the process's group is ended (TERM, then KILL).
"""
from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

KILL_AFTER_S = 2  # `timeout -k`: SIGKILL this long after SIGTERM
STDERR_KEEP = 64 * 1024
INLINE_STDIN = 1 << 20  # below the SSH window: sendall cannot block on a remote not reading
#: Set once this process has started its first command process (``start_process``: an
#: ``ssh``, a local agent): the CLI's background imports wait for it, so that they do not take
#: the GIL from the thread still setting that first session up (~30 ms of a 1-host status).
#: Set in that one place; the paramiko path starts no process (the CLI waits at most 1 s).
FIRST_START = threading.Event()


@dataclass
class RawRun:
    """What one run gave, uninterpreted (the session says what it means)."""

    exit_code: Optional[int]
    stdout: bytes
    stderr: bytes
    timed_out: bool = False


def start_process(argv: Sequence[str]) -> subprocess.Popen:
    """THE start of a command process (``ssh``, a local or exec agent): pipes on all three
    ends, no shell, its own session (its group is ours to end), cwd /. Raises OSError."""
    proc = subprocess.Popen(
        list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, close_fds=True, cwd="/")
    FIRST_START.set()
    return proc
