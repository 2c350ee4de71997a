"""Whole writes to stdout: a document reaches the reader to its last byte, or the write fails.

Why not click.echo / print: under PYTHONUNBUFFERED (or ``python -u``, common in containers)
sys.stdout's binary layer is the raw file, and TextIOWrapper ignores how much a raw write
took. A write to a full pipe returns short when the writer is interrupted (a handled signal,
a stop and continue: Ctrl-Z, a debugger attaching, a cgroup freezer), so the rest of the line
was dropped without a word: one `status --watch --json` line ended at byte 65536 (the pipe's
size) and the next document went on in the same line. Here every short write is followed
by the rest, and a non-blocking stdout (left so by another program sharing it) is waited for.
"""
from __future__ import annotations

import io
import os
import select
import sys
from typing import IO, Any, Iterable, Optional, Union


def write_whole(text: Union[str, bytes], stream: Optional[IO[Any]] = None) -> None:
    """Write ``text`` (and flush) to ``stream`` (sys.stdout): its file descriptor takes
    every byte, in as many writes as it needs. A stream without one (a test runner's capture)
    gets a plain write. BrokenPipeError (the reader went away) is raised as from print."""
    stream = stream if stream is not None else sys.stdout
    stream.flush()  # whatever went through the text layer before comes first
    binary = getattr(stream, "buffer", None)
    if binary is not None:
        binary.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        fd = -1
    if isinstance(text, str):
        if fd < 0:
            stream.write(text)
            stream.flush()
            return
        data = text.encode(getattr(stream, "encoding", None) or "utf-8",
                           getattr(stream, "errors", None) or "strict")
    else:
        data = bytes(text)
        if fd < 0:
            target: Any = binary if binary is not None else stream
            target.write(data)
            stream.flush()
            return
    write_fd(fd, data)


def write_fd(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd``: short writes continued, EAGAIN waited out."""
    view = memoryview(data)
    while view:
        try:
            done = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        view = view[done:]


def warn(lines: Iterable[str]) -> None:
    """Host warnings (``HOST: warning: ...``), one terminal-safe line each, on stderr: stdout
    holds only the rows scripts cut with grep and awk (core.hostwarnings says which)."""
    import click

    from gpufleet.render.common import terminal_safe

    for line in lines:
        click.echo(terminal_safe(line, one_line=True), err=True)


def snapshot_warnings(results: Iterable[Any], hosts: Iterable[Any]) -> list[str]:
    """The warning lines of snapshot results (HostResult), with each host's expected
    unattributed memory from the inventory ``hosts``."""
    from gpufleet.core.hostwarnings import host_warnings

    expected = {h.name: int(getattr(h, "unattributed_mib", 0) or 0) for h in hosts}
    return [line for r in results if getattr(r, "snapshot", None) is not None
            for line in host_warnings(r.host, r.snapshot, expected.get(r.host, 0))]
