"""``connection: local``: the agent runs on this machine, through subprocess, no shell, no SSH.

One way of reaching a host (gpufleet.transport.reach's table). A run is a process in a new
session whose process group is ended at the timeout (gpufleet.transport.run.run_local); a
stream is the same process kept open (gpufleet.transport.stream.ProcessStream).
"""
from __future__ import annotations

from typing import Callable, Sequence

from gpufleet.transport.reply import agent_command
from gpufleet.transport.run import RawRun, run_local
from gpufleet.transport.session import Session
from gpufleet.transport.stream import ProcessStream, Stream


class LocalSession(Session):
    """The same argv as over SSH, started here. ``_argv`` is the one hook a session that
    reaches the host through a local command (gpufleet.transport.execprefix) changes."""

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
        return run_local(self._argv(argv), stdin, timeout)

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        return ProcessStream(self._argv(argv), head, as_run=as_run)

    def _first_run(self, start: Callable[[], RawRun]) -> RawRun:
        first = self._argv(agent_command(self.host))[0]
        try:
            return start()
        except FileNotFoundError:  # as run_local reports it
            return RawRun(127, b"", f"{first}: not found".encode())
        except PermissionError:
            return RawRun(126, b"", f"{first}: Permission denied".encode())
