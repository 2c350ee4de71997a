"""One bounded run of an argv, as raw bytes: an SSH exec channel, or a local subprocess.

Internal to gpufleet.transport (import from there); its sessions turn a ``RawRun`` into a reply
or a one-line error. Both ways stop waiting at ``timeout`` and report ``timed_out``: over SSH
the channel is closed (the remote side bounds itself, see gpufleet.transport); locally the
process runs in a new session and its process group is ended (TERM, then KILL).
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from gpufleet import errors
from gpufleet.errors import TransportError

if TYPE_CHECKING:  # the SSH stack is imported by exec_channel's callers, not by a local run
    import paramiko

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


def exec_channel(transport: paramiko.Transport, command: str, stdin: bytes, timeout: float
                 ) -> RawRun:
    """One exec channel: send stdin, read stdout/stderr until exit status or ``timeout``."""
    import paramiko

    from gpufleet.transport.connection import transport_error

    deadline = time.monotonic() + timeout
    chan = transport.open_session(timeout=max(0.1, timeout))
    watchdog = threading.Timer(timeout + 0.5, chan.close)  # backstop for exec_command's wait
    watchdog.daemon = True
    watchdog.start()
    out: list[bytes] = []
    err = bytearray()
    feeder: Optional[threading.Thread] = None
    try:
        try:
            chan.exec_command(command)
        except paramiko.SSHException as exc:
            if time.monotonic() >= deadline:
                return RawRun(None, b"", b"", timed_out=True)
            raise TransportError(f"exec refused: {transport_error(exc)}", kind=errors.SSH) from None

        def feed() -> None:
            try:
                chan.sendall(stdin)
                chan.shutdown_write()
            except Exception:
                pass  # the remote stopped reading; its exit status tells the rest

        if len(stdin) <= INLINE_STDIN:
            chan.settimeout(max(0.1, deadline - time.monotonic()))
            feed()
            chan.settimeout(None)
        else:
            feeder = threading.Thread(target=feed, name="gpufleet-stdin", daemon=True)
            feeder.start()
        fd = chan.fileno()
        while True:
            while chan.recv_ready():
                out.append(chan.recv(65536))
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                if len(err) > 2 * STDERR_KEEP:
                    del err[: len(err) - STDERR_KEEP]
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                break
            if chan.closed:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return RawRun(None, b"".join(out), bytes(err[-STDERR_KEEP:]), timed_out=True)
            if chan.eof_received:
                chan.status_event.wait(remaining)  # no more data; only the status to come
            else:
                select.select([fd], [], [], remaining)
        while chan.recv_ready():
            out.append(chan.recv(65536))
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
        code = chan.recv_exit_status() if chan.exit_status_ready() else -1
        return RawRun(code, b"".join(out), bytes(err[-STDERR_KEEP:]))
    finally:
        watchdog.cancel()
        chan.close()


def start_process(argv: Sequence[str]) -> subprocess.Popen:
    """THE start of a command process (``ssh``, a local or exec agent): pipes on all three
    ends, no shell, its own session (its group is ours to end), cwd /. Raises OSError."""
    proc = subprocess.Popen(
        list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, close_fds=True, cwd="/")
    FIRST_START.set()
    return proc


def run_local(argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
    """The same argv without SSH: no shell; the process group is ended at the timeout."""
    try:
        proc = start_process(argv)
    except FileNotFoundError:
        return RawRun(127, b"", f"{argv[0]}: not found".encode())
    except PermissionError:
        return RawRun(126, b"", f"{argv[0]}: Permission denied".encode())
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
        return RawRun(proc.returncode, out, err[-STDERR_KEEP:])
    except subprocess.TimeoutExpired:
        pass
    for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, KILL_AFTER_S)):
        try:
            os.killpg(proc.pid, sig)  # the group of the process we started (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            out, err = proc.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            out, err = b"", b""
    else:  # something left the group and holds our pipes: stop reading them
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
        proc.wait(timeout=KILL_AFTER_S)
    return RawRun(None, out or b"", (err or b"")[-STDERR_KEEP:], timed_out=True)
