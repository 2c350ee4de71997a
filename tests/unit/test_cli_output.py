"""gpufleet.cli.output.write_whole: a document reaches stdout's reader whole, also when a
write to a full pipe is cut short (a stop and continue, a handled signal) under
PYTHONUNBUFFERED, where click.echo / print drop the rest of the line."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from gpufleet.cli import output

REPO = Path(__file__).resolve().parent.parent.parent

# The child writes one 300 000-byte line and a second line into a pipe nobody reads yet:
# the first write(2) fills the pipe (64 KiB) and blocks inside the kernel.
CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
line = "x" * 300000 + "\\n"
if sys.argv[1] == "whole":
    from gpufleet.cli.output import write_whole
    write_whole(line)
    write_whole("END\\n")
else:
    import click
    click.echo(line, nl=False)
    click.echo("END")
"""


def pipe_bytes(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def stopped_while_writing(how: str) -> list[bytes]:
    """Lines the child wrote when it was stopped and continued while blocked in its write."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, how, str(REPO)],
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    try:
        end = time.monotonic() + 30
        while pipe_bytes(proc.stdout.fileno()) < 65536:  # full: the write is in the kernel
            assert time.monotonic() < end and proc.poll() is None, "the child never filled the pipe"
            time.sleep(0.01)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)  # the child this test started
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        data = proc.stdout.read()
    finally:
        proc.wait(timeout=30)
    return data.split(b"\n")


def test_a_stop_in_a_blocked_write_loses_nothing() -> None:
    lines = stopped_while_writing("whole")
    assert [len(x) for x in lines] == [300000, 3, 0]
    assert lines[1] == b"END"


def test_click_echo_is_the_bug_this_module_avoids() -> None:
    """What the watch wrote before (the same child through click.echo): the line cut at the
    pipe's size, the next one glued to it. If this stops failing, Python fixed it."""
    lines = stopped_while_writing("echo")
    assert len(lines[0]) < 300000 and lines[0].endswith(b"END")


def test_short_writes_and_eagain_are_continued(monkeypatch: pytest.MonkeyPatch) -> None:
    got = bytearray()
    calls = []

    def short_write(fd: int, data: memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 2:
            raise BlockingIOError(errno.EAGAIN, "would block")
        take = min(len(data), 7000)  # never all of it
        got.extend(bytes(data[:take]))
        return take

    waited = []
    monkeypatch.setattr(output.os, "write", short_write)
    monkeypatch.setattr(output.select, "select", lambda r, w, x: waited.append(w) or ([], w, []))
    doc = ("{" + ",".join('"k%d":%d' % (i, i) for i in range(5000)) + "}\n").encode()
    output.write_fd(99, doc)
    assert bytes(got) == doc
    assert waited == [[99]] and len(calls) > 3


def test_text_goes_through_the_fd_after_what_was_buffered(tmp_path: Path) -> None:
    path = tmp_path / "out"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("before ")  # still in the text layer's buffer
        output.write_whole("doc é\n", fh)
    assert path.read_text(encoding="utf-8") == "before doc é\n"


def test_a_stream_without_a_descriptor_gets_a_plain_write() -> None:
    import io

    buf = io.StringIO()
    output.write_whole("line\n", buf)
    assert buf.getvalue() == "line\n"
