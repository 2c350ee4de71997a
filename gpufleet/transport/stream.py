"""A command's stream: its stdout read line by line with its stdin kept open (a resident
agent), or read to its end (``run_to_end``: THE one-shot run, every way's ``Session._run``).

Internal to gpufleet.transport (sessions open streams: ``Session.stream_agent``). The agent's
watch mode (gpufleet/remote/watch.py) prints a line per interval and ends itself when stdin
closes or keep-alives stop, so :meth:`Stream.close` only has to close stdin (and the channel).
Over paramiko the stream is an exec channel on the host's existing connection; otherwise a
process (``ssh``, the local agent, an exec prefix) in its own session (its process group is
ended on close if it lingers). Every
failure is a TransportError with a kind, from ``connection.transport_error`` (the one place
lower-level errors get their kind).
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from typing import Optional, Sequence

from gpufleet import errors
from gpufleet.errors import TransportError
from gpufleet.transport.run import KILL_AFTER_S, STDERR_KEEP, RawRun, start_process


def transport_error(exc: BaseException) -> TransportError:
    """gpufleet.transport.connection.transport_error, imported when a failure is classified
    (it knows paramiko's exceptions; a local run must not import paramiko to start). The one
    lazy door to it: session.py uses this one too. A TransportError is one already: a run
    whose host was unreachable over OpenSSH does not import paramiko for it."""
    if isinstance(exc, TransportError):
        return exc
    from gpufleet.transport.connection import transport_error as classify

    return classify(exc)


PIPE_INLINE = 1 << 16  # a pipe's buffer: a larger head is written by a thread
MAX_LINE = 64 << 20  # a snapshot line longer than this is not one: the stream is broken


class Stream:
    """Lines from a resident command. ``readline`` -> a line (bytes, no newline), or None
    when ``timeout`` passed first; raises TransportError(kind closed) once the command ended."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._err = bytearray()
        self.ended = False

    # subclass interface: wait for data, read it; send; end
    def _wait(self, timeout: float) -> bool:
        raise NotImplementedError

    def _read(self) -> Optional[bytes]:
        """Whatever is there (b"" is nothing yet, None is end of stream)."""
        raise NotImplementedError

    def _exit_code(self) -> Optional[int]:
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    _feeding: Optional[threading.Lock] = None  # set while a thread writes the head
    _fed = True
    _eof_wanted = False

    def _feed_later(self, head: bytes) -> None:
        """The head written by a thread: a command that writes before it reads (more than a
        pipe or an SSH window holds) must not wait on us while we wait on it."""
        self._feeding, self._fed = threading.Lock(), False
        threading.Thread(target=self._feed, args=(head,), daemon=True,
                         name="gpufleet-stdin").start()

    def _feed(self, head: bytes) -> None:
        try:
            self._write_head(head)
        except Exception:
            pass  # the command stopped reading; its exit status tells the rest
        assert self._feeding is not None
        with self._feeding:
            self._fed, eof = True, self._eof_wanted
        if eof:
            self._close_input()

    def _write_head(self, head: bytes) -> None:
        self.send(head)

    def _close_input(self) -> None:
        raise NotImplementedError

    def end_input(self) -> None:
        """No more input: the command sees EOF once its head is written (a one-shot run)."""
        if self._feeding is not None:
            with self._feeding:
                self._eof_wanted = True
                if not self._fed:
                    return  # the feeding thread ends the input once the head is written
        self._close_input()

    def kill(self) -> None:
        """End the command now (a one-shot run past its timeout)."""
        raise NotImplementedError

    def run_to_end(self, timeout: float) -> RawRun:
        """THE one-shot run: the command's input ended, its output read to its end (exit
        status, stdout, stderr); at ``timeout`` it is ended and the run is ``timed_out``.
        Every way's run is its stream read this way; the stream is closed after."""
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            self.end_input()
            while not self.ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    return RawRun(None, bytes(self._buf), bytes(self._err[-STDERR_KEEP:]),
                                  timed_out=True)
                if self._wait(left):
                    self._take()
            return self.ended_run()
        finally:
            self.close()

    def readline(self, timeout: float) -> Optional[bytes]:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            at = self._buf.find(b"\n")
            if at >= 0:
                line = bytes(self._buf[:at])
                del self._buf[: at + 1]
                return line
            if len(self._buf) > MAX_LINE:
                raise TransportError("agent line too long", kind=errors.AGENT)
            if self.ended:
                raise self._ended_error()
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait(left):
                if time.monotonic() >= deadline:
                    return None
                continue
            self._take()

    def poll(self) -> None:
        """Take in whatever the command wrote, without waiting (a conversation looks before it
        writes its next request: the agent may have ended, or said why it will)."""
        while not self.ended and self._wait(0):
            if not self._take():
                return

    def _take(self) -> bool:
        """One read into the buffer; False when nothing was there yet (the end counts as
        something: ``ended`` is set)."""
        try:
            chunk = self._read()
        except Exception as exc:
            raise TransportError(f"connection lost: {transport_error(exc)}",
                                 kind=errors.CLOSED) from None
        if chunk is None:
            self.ended = True
        elif chunk:
            self._buf += chunk
        return chunk is None or bool(chunk)

    def ended_run(self) -> RawRun:
        """The ended command as a one-shot run gives it (exit status, -1 when none came; the
        stdout not taken as lines; stderr), for the same failure lines as a one-shot run."""
        code = self._exit_code()
        self._drain_err()
        return RawRun(-1 if code is None else code, bytes(self._buf), bytes(self._err))

    def _drain_err(self) -> None:
        """Read the rest of stderr once the command ended (its last line names the failure)."""

    def _ended_error(self) -> TransportError:
        code = self._exit_code()
        self._drain_err()
        tail = [ln.strip() for ln in self._err.decode("utf-8", "replace").splitlines()
                if ln.strip()]
        text = "agent ended" + (f" (exit {code})" if code is not None else "") + (
            f": {tail[-1][:200]}" if tail else "")
        return TransportError(text, kind=errors.CLOSED if code is None else errors.COMMAND)

    def _keep_err(self, data: bytes) -> None:
        self._err += data
        if len(self._err) > 2 * STDERR_KEEP:
            del self._err[: len(self._err) - STDERR_KEEP]


class PipeStream(Stream):
    """Lines from a command's stdout pipe, its stderr pipe kept (the last lines name a
    failure): a local process, or an ``ssh`` process (gpufleet.transport.openssh)."""

    def _pipes(self) -> tuple[Optional[int], Optional[int]]:
        """(stdout, stderr) descriptors, non-blocking; None once closed."""
        raise NotImplementedError

    _err_open = True

    def _send_head(self, head: bytes, as_run: bool) -> None:
        """The command's first input; one that ended before taking it is its end's error,
        unless ``as_run`` (a run, a conversation's start) leaves that to its exit status and
        stderr. A head larger than a pipe is written by a thread (``_feed_later``)."""
        if as_run and len(head) > PIPE_INLINE:
            self._feed_later(head)
            return
        try:
            self.send(head)
        except TransportError:
            if not as_run:  # it ended before taking its input: say why it ended (ssh's line)
                self.ended = True
                raise self._ended_error() from None

    def _wait(self, timeout: float) -> bool:
        out, err = self._pipes()
        fds = [fd for fd in (out, err if self._err_open else None) if fd is not None]
        ready, _, _ = select.select(fds, [], [], timeout)
        return bool(ready)

    def _read(self) -> Optional[bytes]:
        out, err_fd = self._pipes()
        if self._err_open and err_fd is not None:
            err = read_some(err_fd)
            if err is None:
                self._err_open = False
            elif err:
                self._keep_err(err)
        return read_some(out) if out is not None else None

    def _drain_err(self) -> None:
        _, err_fd = self._pipes()
        while self._err_open and err_fd is not None:
            ready, _, _ = select.select([err_fd], [], [], 0.2)
            if not ready:
                return  # held open by something the command left behind: enough is here
            err = read_some(err_fd)
            if err is None:
                self._err_open = False
            elif not err:
                return
            else:
                self._keep_err(err)


class ProcessStream(PipeStream):
    """``connection: local``: the same argv as a subprocess (no shell), its own session."""

    def __init__(self, argv: Sequence[str], head: bytes, as_run: bool = False):
        """``as_run`` (a conversation's start): failures reported as a one-shot run reports
        them: a command that cannot start raises its OSError (127, 126), a head it did not
        take in (it ended at once) is left to its exit status and stderr."""
        super().__init__()
        try:
            self.proc = start_process(argv)
        except OSError as exc:
            if as_run:
                raise
            raise TransportError(f"{argv[0]}: {exc.strerror or exc}", kind=errors.COMMAND) from None
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        os.set_blocking(self.proc.stdout.fileno(), False)
        os.set_blocking(self.proc.stderr.fileno(), False)
        self._send_head(head, as_run)

    def _pipes(self) -> tuple[Optional[int], Optional[int]]:
        assert self.proc.stdout and self.proc.stderr
        return self.proc.stdout.fileno(), self.proc.stderr.fileno()

    def _exit_code(self) -> Optional[int]:
        try:
            return self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def send(self, data: bytes) -> None:
        assert self.proc.stdin
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:  # its stdin closed: the process has ended
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise TransportError(f"agent gone: {why}", kind=errors.CLOSED) from None

    def _close_input(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except (OSError, ValueError):  # ValueError: closed while the feeding thread wrote
            pass

    def kill(self) -> None:
        """Its process group ended now: TERM, then KILL (the group we started)."""
        self._end_group((signal.SIGTERM, signal.SIGKILL))

    def close(self) -> None:
        """stdin closed: the agent ends itself; its process group is ended if it lingers."""
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if pipe:
                    pipe.close()
            except (OSError, ValueError):  # a buffered pipe closed while a thread writes to
                pass  # it raises ValueError; its file descriptor is closed all the same
        self._end_group((None, signal.SIGTERM, signal.SIGKILL))

    def _end_group(self, signals: Sequence[Optional[signal.Signals]]) -> None:
        """Wait for the process, each signal (None: none) sent to its group (the one we
        started: start_new_session) before the next wait of ``KILL_AFTER_S``."""
        for sig in signals:
            if sig is not None:
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.wait(timeout=KILL_AFTER_S)
                return
            except subprocess.TimeoutExpired:
                continue


def read_some(fd: int) -> Optional[bytes]:
    """b"" nothing yet, None at end of file."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return b""
    return data or None


def run_process(argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
    """One local process as a one-shot run (no shell, its group ended at the timeout); one
    that cannot start is 127 / 126 with the shell's words, as a host reports it."""
    try:
        stream = ProcessStream(argv, stdin, as_run=True)
    except FileNotFoundError:
        return RawRun(127, b"", f"{argv[0]}: not found".encode())
    except PermissionError:
        return RawRun(126, b"", f"{argv[0]}: Permission denied".encode())
    return stream.run_to_end(timeout)
