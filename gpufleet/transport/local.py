"""``connection: local``: the agent runs on this machine, through subprocess, no shell, no SSH.

One way of reaching a host (gpufleet.transport.reach's table). A run is a process in a new
session (gpufleet.transport.stream.ProcessStream) read to its end, its process group ended at
the timeout; a stream is the same process kept open.
"""
from __future__ import annotations

from typing import Callable, Sequence

from gpufleet.transport.reply import agent_command
from gpufleet.transport.run import RawRun
from gpufleet.transport.session import Session
from gpufleet.transport.stream import ProcessStream, Stream


class LocalSession(Session):
    """The same argv as over SSH, started here. ``_argv`` is the one hook a session that
    reaches the host through a local command (gpufleet.transport.execprefix) changes."""

    def _argv(self, argv: Sequence[str]) -> list[str]:
        return list(argv)

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
        return _started(self._argv(argv)[0], lambda: super(LocalSession, self)._run(
            argv, stdin, timeout))

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        return ProcessStream(self._argv(argv), head, as_run=as_run)

    def _first_run(self, start: Callable[[], RawRun]) -> RawRun:
        return _started(self._argv(agent_command(self.host))[0], start)


def _started(first: str, start: Callable[[], RawRun]) -> RawRun:
    """``start()``; a program that cannot start is 127 / 126 with a shell's words, as a host
    reports it over SSH (the same one-line failures follow)."""
    try:
        return start()
    except FileNotFoundError:
        return RawRun(127, b"", f"{first}: not found".encode())
    except PermissionError:
        return RawRun(126, b"", f"{first}: Permission denied".encode())
