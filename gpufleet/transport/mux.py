"""A run or a stream through a kept OpenSSH master, spoken to over its control socket.

Internal to gpufleet.transport (gpufleet.transport.openssh uses it when ``ssh_persist`` kept
a host's connection from an earlier command, see gpufleet.transport.kept). Why not one more
``ssh -o ControlPath=...`` process per run: that process only passes its stdin, stdout and
stderr to the master and waits, yet it costs an exec, libcrypto and ssh_config's parsing
(5.5 ms of CPU per run on the lab machine, against 0.2 ms here; bench/RESULTS.md). This is the
client half of OpenSSH's own multiplexing protocol (PROTOCOL.mux in OpenSSH's source, version
4): a hello each way, ``MUX_C_NEW_SESSION`` with the command and the environment ssh would
send, then three pipe ends passed as SCM_RIGHTS, one per message, in the order stdin, stdout,
stderr (mux.c ``mux_client_request_session``); the master answers ``MUX_S_SESSION_OPENED``,
relays the session over its encrypted connection, and sends ``MUX_S_EXIT_MESSAGE`` with the
command's exit status before closing the control connection.

Where the connection goes was decided by the ``ssh`` that started the master (ssh_config
through ``ssh -G``, gpufleet's options); nothing here chooses a host. A socket is joined only
when it is a socket owned by this user in gpufleet's private directory and the process at the
other end runs as this user (SO_PEERCRED). A master that cannot take the session (none there,
a stale socket, a refusal, no answer within the connect timeout) raises ``NoMaster``: the
caller connects afresh with ``ssh`` as it would without a kept connection. Once a session is
open, its failures are the run's: a master that went away without the exit status is the
connection lost (kind ``closed``).
"""
from __future__ import annotations

import errno
import os
import select
import socket
import stat
import struct
import time
from typing import Optional, Sequence

from gpufleet import errors
from gpufleet.errors import TransportError
from gpufleet.transport.run import FIRST_START, STDERR_KEEP, RawRun
from gpufleet.transport.stream import PipeStream

VERSION = 4
MSG_HELLO = 0x00000001
C_NEW_SESSION = 0x10000002
C_ALIVE_CHECK = 0x10000004
C_TERMINATE = 0x10000005
S_OK = 0x80000001
S_PERMISSION_DENIED = 0x80000002
S_FAILURE = 0x80000003
S_EXIT_MESSAGE = 0x80000004
S_ALIVE = 0x80000005
S_SESSION_OPENED = 0x80000006
S_TTY_ALLOC_FAIL = 0x80000008
NO_ESCAPE = 0xFFFFFFFF
MAX_PACKET = 256 * 1024  # mux.c's own bound on a control message
NO_EXIT_STATUS = 255  # what ssh exits with when the session ended without one


class NoMaster(Exception):
    """No kept master took this session; nothing was sent to the host. ``bypass``: one is
    there but did not serve (no answer in time, a refusal, another user's): the caller
    connects on its own without the socket, as an ``ssh`` joining it would hang or fail too;
    else none is there (absent, stale) and an ``ssh`` may become the master."""

    def __init__(self, why: str, bypass: bool = False):
        super().__init__(why)
        self.bypass = bypass


def _u32(value: int) -> bytes:
    return struct.pack(">I", value)


def _string(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def packet(kind: int, *fields: bytes) -> bytes:
    """One control message: length, type, fields (already encoded)."""
    body = _u32(kind) + b"".join(fields)
    return _u32(len(body)) + body


def session_request(request_id: int, command: str, env: Sequence[str]) -> bytes:
    """MUX_C_NEW_SESSION as ``ssh -T -e none -x -a`` sends it: no tty, no X11, no agent, not a
    subsystem, no escape character, no terminal type; ``env`` the ``NAME=value`` strings
    (SendEnv's matches, then SetEnv) in ssh's order."""
    fields = [_u32(request_id), _string(b""), _u32(0), _u32(0), _u32(0), _u32(0),
              _u32(NO_ESCAPE), _string(b""), _string(command.encode("utf-8", "surrogateescape"))]
    fields += [_string(e.encode("utf-8", "surrogateescape")) for e in env]
    return packet(C_NEW_SESSION, *fields)


def parse(body: bytes) -> tuple[int, list[int], Optional[str]]:
    """(type, the u32 fields after it, the reason string of a refusal or failure)."""
    if len(body) < 4:
        raise ValueError("short control message")
    kind = struct.unpack(">I", body[:4])[0]
    if kind in (S_PERMISSION_DENIED, S_FAILURE):
        if len(body) < 12:
            raise ValueError("short refusal")
        rid, n = struct.unpack(">II", body[4:12])
        return kind, [rid], body[12:12 + n].decode("utf-8", "replace")
    count = {MSG_HELLO: 1, S_OK: 1, S_EXIT_MESSAGE: 2, S_ALIVE: 2, S_SESSION_OPENED: 2,
             S_TTY_ALLOC_FAIL: 1}.get(kind, 0)
    if len(body) < 4 + 4 * count:
        raise ValueError("short control message 0x%08x" % kind)
    return kind, list(struct.unpack(">%dI" % count, body[4:4 + 4 * count])), None


class Control:
    """One connection to a master's control socket, past the hello."""

    def __init__(self, path: str, timeout: float):
        """Raises NoMaster when ``path`` is not this user's live master."""
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise NoMaster(f"{path}: {exc.strerror}") from None
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise NoMaster(f"{path}: not a socket of this user", bypass=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(max(0.05, timeout))
        self._buf = bytearray()
        try:
            self.sock.connect(path)
            cred = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                        struct.calcsize("3i"))
            if struct.unpack("3i", cred)[1] != os.geteuid():
                raise NoMaster(f"{path}: the master runs as another user", bypass=True)
            self.sock.sendall(packet(MSG_HELLO, _u32(VERSION)))
            hello = self.read(timeout)
            if hello is None:
                raise NoMaster(f"{path}: the master closed the control connection")
            kind, fields, _ = parse(hello)
            if kind != MSG_HELLO or fields[0] != VERSION:
                raise NoMaster(f"{path}: not a mux protocol {VERSION} master", bypass=True)
        except NoMaster:
            self.sock.close()
            raise
        except (OSError, ValueError) as exc:
            self.sock.close()
            absent = isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ENOENT)
            if absent:
                _unlink_stale(path)
            raise NoMaster(f"{path}: {exc}", bypass=not absent) from None

    def read(self, timeout: float) -> Optional[bytes]:
        """The next message's body; None at end of connection; socket.timeout past ``timeout``."""
        deadline, tried = time.monotonic() + timeout, False
        while True:
            if len(self._buf) >= 4:
                n = struct.unpack(">I", self._buf[:4])[0]
                if n > MAX_PACKET:
                    raise ValueError("control message too long")
                if len(self._buf) >= 4 + n:
                    body = bytes(self._buf[4:4 + n])
                    del self._buf[:4 + n]
                    return body
            left = deadline - time.monotonic()
            if left <= 0 and tried:
                raise socket.timeout("no answer from the master")
            tried = True
            self.sock.settimeout(max(0.0, left))  # 0: what is there now, without waiting
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                raise socket.timeout("no answer from the master") from None
            if not chunk:
                return None
            self._buf += chunk

    def ask(self, message: bytes, timeout: float) -> tuple[int, list[int], Optional[str]]:
        self.sock.sendall(message)
        body = self.read(timeout)
        if body is None:
            raise NoMaster("the master closed the control connection")
        return parse(body)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _unlink_stale(path: str) -> None:
    """A socket nobody listens on (its master ended without removing it): what ssh's own
    ControlMaster=auto does before it becomes the master there."""
    try:
        os.unlink(path)
    except OSError:
        pass


def alive(path: str, timeout: float = 2.0) -> Optional[int]:
    """The master's PID (MUX_C_ALIVE_CHECK), or None: no live master at ``path``."""
    try:
        ctl = Control(path, timeout)
    except NoMaster:
        return None
    try:
        kind, fields, _ = ctl.ask(packet(C_ALIVE_CHECK, _u32(1)), timeout)
        return fields[1] if kind == S_ALIVE else None
    except (NoMaster, OSError, ValueError):
        return None
    finally:
        ctl.close()


def terminate(path: str, timeout: float = 2.0) -> Optional[int]:
    """Ask the master at ``path`` to end (MUX_C_TERMINATE: it closes its connection and its
    socket; no signal is sent to anything). Its PID when it was there, else None."""
    pid = alive(path, timeout)
    if pid is None:
        return None
    try:
        ctl = Control(path, timeout)
    except NoMaster:
        return pid
    try:
        ctl.sock.sendall(packet(C_TERMINATE, _u32(2)))
        try:
            ctl.read(timeout)  # MUX_S_OK, or the end of the connection as the master exits
        except (OSError, ValueError):
            pass
    except OSError:
        pass
    finally:
        ctl.close()
    return pid


class Channel:
    """One session through a master: our ends of its stdin, stdout and stderr pipes, and the
    control connection that brings its exit status."""

    def __init__(self, path: str, command: str, env: Sequence[str], open_timeout: float):
        """Raises NoMaster when the master does not open the session within ``open_timeout``
        (none there, refused, a master whose connection hangs)."""
        self.path = path
        self.ctl = Control(path, open_timeout)
        ours: list[int] = []
        theirs: list[int] = []
        try:
            for _ in range(3):
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
            ours[0], theirs[0] = theirs[0], ours[0]  # stdin: the master reads, we write
            self.ctl.sock.sendall(session_request(1, command, env))
            for fd in theirs:
                socket.send_fds(self.ctl.sock, [b"\0"], [fd])
        except OSError as exc:
            for fd in ours + theirs:
                os.close(fd)
            self.ctl.close()
            raise NoMaster(f"session request: {exc}", bypass=True) from None
        for fd in theirs:
            os.close(fd)
        self.stdin: Optional[int] = ours[0]
        self.stdout: Optional[int] = ours[1]
        self.stderr: Optional[int] = ours[2]
        self.exit_status: Optional[int] = None
        self.control_open = True
        try:
            body = self.ctl.read(open_timeout)
        except (OSError, ValueError) as exc:
            self.close()
            raise NoMaster(f"no session from the master: {exc}", bypass=True) from None
        if body is None:  # it ended (its connection was lost meanwhile): none there now
            self.close()
            raise NoMaster("the master closed the control connection")
        try:
            kind, fields, reason = parse(body)
        except ValueError as exc:
            self.close()
            raise NoMaster(f"the master's answer: {exc}", bypass=True) from None
        if kind != S_SESSION_OPENED:
            self.close()
            raise NoMaster(f"the master refused the session: {reason or hex(kind)}", bypass=True)
        self.session_id = fields[1]
        FIRST_START.set()

    def take_control(self, timeout: float) -> None:
        """Read the control messages that are there (within ``timeout``): the exit status,
        then the end of the control connection."""
        while self.control_open:
            try:
                body = self.ctl.read(timeout)
            except socket.timeout:
                return
            except (OSError, ValueError):
                body = None
            if body is None:
                self.control_open = False
                return
            try:
                kind, fields, _ = parse(body)
            except ValueError:
                continue
            if kind == S_EXIT_MESSAGE and fields[0] == self.session_id:
                self.exit_status = fields[1]
            timeout = 0.0

    def ended_status(self) -> tuple[int, Optional[TransportError]]:
        """Once the control connection ended: (exit status, the connection's own failure).
        Without an exit status the master either lost its connection (it is gone: closed) or
        the command ended by a signal, which ssh also reports as 255 with no status."""
        if self.exit_status is not None:
            return self.exit_status, None
        if alive(self.path, 1.0) is None:
            return NO_EXIT_STATUS, TransportError("the kept connection was lost",
                                                  kind=errors.CLOSED)
        return NO_EXIT_STATUS, None

    def close_stdin(self) -> None:
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None

    def close(self) -> None:
        """Our pipe ends and the control connection: the master ends the session's channel."""
        self.close_stdin()
        for name in ("stdout", "stderr"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        self.ctl.close()
        self.control_open = False


def run(path: str, command: str, env: Sequence[str], stdin: bytes, timeout: float,
        open_timeout: float) -> RawRun:
    """One command through the master at ``path``, as ``run_local`` runs ``ssh``: stdin
    written, stdout and stderr read to their end, the exit status; ``timed_out`` at
    ``timeout`` (the session is closed; the remote command bounds itself). Raises NoMaster
    before anything was sent to the host."""
    chan = Channel(path, command, env, min(open_timeout, timeout))
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    pending = memoryview(stdin)
    try:
        assert chan.stdin is not None and chan.stdout is not None and chan.stderr is not None
        os.set_blocking(chan.stdin, False)
        if not pending:
            chan.close_stdin()
        reading = {chan.stdout: out, chan.stderr: err}
        while reading or (chan.control_open and chan.exit_status is None):
            left = deadline - time.monotonic()
            if left <= 0:
                return RawRun(None, bytes(out), bytes(err[-STDERR_KEEP:]), timed_out=True)
            wfds = [chan.stdin] if chan.stdin is not None else []
            rfds = list(reading) + ([chan.ctl.sock.fileno()] if chan.control_open else [])
            ready_r, ready_w, _ = select.select(rfds, wfds, [], left)
            if ready_w:
                try:
                    pending = pending[os.write(chan.stdin, pending[:65536]):]  # type: ignore[arg-type]
                except BlockingIOError:
                    pass
                except OSError:  # the remote stopped reading: its exit status tells the rest
                    pending = memoryview(b"")
                if not pending:
                    chan.close_stdin()
            for fd in ready_r:
                if fd in reading:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        reading[fd] += chunk
                        if fd == chan.stderr and len(err) > 2 * STDERR_KEEP:
                            del err[: len(err) - STDERR_KEEP]
                    else:
                        del reading[fd]
                elif chan.control_open:
                    chan.take_control(0.0)
        code, lost = chan.ended_status()
        return RawRun(code, bytes(out), bytes(err[-STDERR_KEEP:]), lost=lost)
    finally:
        chan.close()


class MuxStream(PipeStream):
    """A resident command through a master (the agent's watch mode, a clean's conversation):
    the same reads and writes as ``ProcessStream`` over the session's pipes."""

    def __init__(self, path: str, command: str, env: Sequence[str], head: bytes,
                 open_timeout: float, as_run: bool = False):
        """Raises NoMaster before anything was sent to the host."""
        super().__init__()
        self.chan = Channel(path, command, env, open_timeout)
        assert self.chan.stdout is not None and self.chan.stderr is not None
        os.set_blocking(self.chan.stdout, False)
        os.set_blocking(self.chan.stderr, False)
        self._lost: Optional[TransportError] = None
        self._send_head(head, as_run)

    def _pipes(self) -> tuple[Optional[int], Optional[int]]:
        return self.chan.stdout, self.chan.stderr

    def _exit_code(self) -> Optional[int]:
        self.chan.take_control(1.0)
        if self.chan.exit_status is None and self.chan.control_open:
            return None
        code, self._lost = self.chan.ended_status()
        return code

    def ended_run(self) -> RawRun:
        raw = super().ended_run()
        raw.lost = self._lost
        return raw

    def _ended_error(self) -> TransportError:
        code = self._exit_code()
        if self._lost is not None:
            return self._lost
        if code == NO_EXIT_STATUS and self.chan.exit_status is None:
            self._drain_err()
            return TransportError("connection lost", kind=errors.CLOSED)
        return super()._ended_error()

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                if self.chan.stdin is None:
                    raise BrokenPipeError(errno.EPIPE, "stdin closed")
                view = view[os.write(self.chan.stdin, view):]
        except OSError as exc:
            raise TransportError(f"agent gone: {exc.strerror or exc}", kind=errors.CLOSED) from None

    def close(self) -> None:
        """stdin closed (the agent ends itself), then our ends and the control connection."""
        self.chan.close()

