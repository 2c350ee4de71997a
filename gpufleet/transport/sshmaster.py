"""gpufleet's own OpenSSH master for a session that runs several commands on one host.

Internal to gpufleet.transport (gpufleet.transport.openssh uses it for ``open_session(...,
keep=True)``: a runbook's steps, `serve`'s refreshes; `clean` needs none, its plan and act
are one conversation over one ``ssh``). One ``ssh -M -N`` process per host, started by
gpufleet with its PID kept, its control socket in a private directory (mkdtemp: mode 0700) so
no other user can join it, ``ControlPersist=no`` so it ends with its connection, and ended
by :meth:`Master.close` (TERM to that PID, then KILL). The runs then are ``ssh -o
ControlPath=SOCKET`` clients: a channel on the open connection, no handshake. A user's own
masters (ssh_config ControlMaster/ControlPath) are never joined.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import IO, Optional, Sequence

from gpufleet.transport.run import KILL_AFTER_S, RawRun

SOCKET_MAX = 100  # sun_path is 108 bytes; a longer TMPDIR means no master (plain runs)


class Master:
    """A started (or failed) master; ``path`` is its control socket while it is up."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.dir: Optional[str] = None
        self.path: Optional[str] = None
        self._err: Optional[IO[bytes]] = None

    @property
    def up(self) -> bool:
        return (self.proc is not None and self.proc.poll() is None and self.path is not None
                and os.path.exists(self.path))

    def start(self, base: Sequence[str], dest: Sequence[str], timeout: float) -> RawRun:
        """Start ``ssh -M -N`` and wait until its control socket is there (authenticated):
        RawRun(0) then; else what the master said (its exit status, its stderr) for
        gpufleet.transport.openssh.ssh_failure, or timed_out. No master (RawRun(0), ``path``
        None) when the socket's path would be too long."""
        self.close()
        self.dir = tempfile.mkdtemp(prefix="gfssh-")
        path = os.path.join(self.dir, "s")
        if len(path.encode()) > SOCKET_MAX:
            self.close()
            return RawRun(0, b"", b"")
        self._err = open(os.path.join(self.dir, "err"), "w+b")
        argv = list(base) + ["-M", "-N", "-o", "ControlMaster=yes", "-o", f"ControlPath={path}",
                             "-o", "ControlPersist=no"] + list(dest)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=self._err, start_new_session=True, close_fds=True)
        except OSError as exc:
            self.close()
            return RawRun(127, b"", f"{argv[0]}: {exc.strerror or exc}".encode())
        deadline, pause = time.monotonic() + max(0.5, timeout), 0.001
        while time.monotonic() < deadline:
            if os.path.exists(path):
                self.path = path
                return RawRun(0, b"", b"")
            if self.proc.poll() is not None:
                raw = RawRun(self.proc.returncode, b"", self._stderr())
                self.close()
                return raw
            time.sleep(pause)
            pause = min(0.01, pause * 1.5)
        self.close()
        return RawRun(None, b"", b"", timed_out=True)

    def _stderr(self) -> bytes:
        if self._err is None:
            return b""
        self._err.seek(0)
        return self._err.read(64 * 1024)

    def close(self) -> None:
        """End the master we started (its recorded PID: TERM, then KILL) and its directory."""
        proc, self.proc, self.path = self.proc, None, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=KILL_AFTER_S)
        if self._err is not None:
            self._err.close()
            self._err = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
