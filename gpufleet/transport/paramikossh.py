"""paramiko/fabric as the SSH client: for controllers with no OpenSSH client (python:slim has
none), ``ssh_client: paramiko``, and hosts behind ProxyJump / ProxyCommand (whose hops' host
keys gpufleet holds to its own policy; gpufleet.transport.openssh says why ssh cannot).

One way of reaching a host (gpufleet.transport.reach's table). The connection (ssh_config,
hops, host keys, timeouts) is gpufleet.transport.connection; each run is one exec channel on
it, a ``ChannelStream`` read to its end; each stream one more.
paramiko is imported here only when a session connects, never for a local host.
"""
from __future__ import annotations

import concurrent.futures as cf
import select
import shlex
import time
from typing import TYPE_CHECKING, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport.reply import remote_timeout
from gpufleet.transport.run import INLINE_STDIN, RawRun
from gpufleet.transport.session import Session
from gpufleet.transport.sshconfig import log
from gpufleet.transport.stream import Stream, transport_error

if TYPE_CHECKING:  # imported when a session connects, never for a local host
    import paramiko

    from gpufleet.transport.connection import HostConnection
    from gpufleet.transport.dial import Dialled


class SshSession(Session):
    """One SSH connection (through any ProxyJump hops), opened once, one exec per run.

    ``dial``: this host's Future from :func:`predial` (its TCP connect started with the
    command); used for the first connect only, a reconnect dials afresh.
    """

    def __init__(self, host: Host, dial: Optional[Dialled] = None):
        super().__init__(host)
        self.conn: Optional[HostConnection] = None
        self._was_open = False
        self._connect(dial)

    def _failed(self, exc: BaseException, prefix: str = "") -> None:
        failed = transport_error(exc)
        self.error, self.error_kind = prefix + str(failed), failed.kind

    def _connect(self, dial: Optional[Dialled] = None) -> None:
        started = time.monotonic()
        conn = None
        if dial is not None:
            try:
                conn = dial.result()  # bounded: the dial has the host's connect_timeout
            except cf.CancelledError:
                conn = None  # given up (interrupted): dial here, as without a pre-dial
            except Exception as exc:  # the dial failed: the same row error as dialling here
                self._failed(exc)
                self.connect_seconds = time.monotonic() - started
                return
        try:
            if conn is None:
                from gpufleet.transport.connection import connection_for

                conn = connection_for(self.host)
        except Exception as exc:
            self._failed(exc, "ssh config: ")
            self.error_kind = errors.SSHCONFIG
            return
        try:
            conn.open()
            self.conn = conn
            self._was_open = True
            self.error = self.error_kind = None
        except Exception as exc:
            try:
                conn.close()
            except Exception:
                pass
            self._failed(exc)
        finally:
            self.connect_seconds = time.monotonic() - started
            log.debug("%s: paramiko connect to %s:%s: %s after %.3fs", self.host.name,
                      getattr(conn, "host", "?"), getattr(conn, "port", "?"),
                      self.error or "connected", self.connect_seconds)

    @property
    def connected(self) -> bool:
        return self.conn is not None and self.conn.is_connected

    def _wrap_timeout(self, argv: list[str], timeout: float) -> list[str]:
        return remote_timeout(argv, timeout)

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
        if not self.connected and self._was_open:  # dropped since (host rebooted): once more
            self.close()
            self._connect()
        transport = self.conn.transport if self.conn is not None else None
        if self.error is not None or transport is None:
            raise TransportError(self.error or "not connected",
                                 kind=self.error_kind or errors.CLOSED)
        import paramiko

        try:
            return super()._run(argv, stdin, timeout)
        except TransportError:
            raise
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise TransportError(f"connection lost: {transport_error(exc)}",
                                 kind=errors.CLOSED) from None

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        transport = self.conn.transport if self.conn is not None else None
        if self.error is not None or transport is None or not self.connected:
            raise TransportError(self.error or "not connected", kind=self.error_kind or errors.CLOSED)
        return ChannelStream(transport, " ".join(shlex.quote(a) for a in argv), head, timeout,
                             as_run=as_run)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
            self.conn = None


class ChannelStream(Stream):
    """An exec channel on the host's open SSH connection."""

    def __init__(self, transport: paramiko.Transport, command: str, head: bytes,
                 timeout: float, as_run: bool = False):
        """``as_run``: a head the command did not take in (it ended at once) is left to its
        exit status and stderr, as a one-shot run reports it (a conversation's start)."""
        super().__init__()
        self.chan: Optional[paramiko.Channel] = None
        sending = False
        try:
            self.chan = transport.open_session(timeout=max(0.1, timeout))
            self.chan.settimeout(max(0.1, timeout))
            self.chan.exec_command(command)
            sending = True
            if as_run and len(head) > INLINE_STDIN:
                self.chan.settimeout(None)
                self._feed_later(head)
            else:
                self.chan.sendall(head)
                self.chan.settimeout(None)
        except Exception as exc:
            if as_run and sending and self.chan is not None:
                self.chan.settimeout(None)
                return
            if self.chan is not None:
                self.chan.close()
            self.chan = None
            failed = transport_error(exc)
            raise TransportError(f"stream refused: {failed}", kind=failed.kind) from None

    def _wait(self, timeout: float) -> bool:
        assert self.chan is not None
        if self.chan.recv_ready() or self.chan.recv_stderr_ready() or self.chan.closed:
            return True
        select.select([self.chan.fileno()], [], [], timeout)
        return True

    def _read(self) -> Optional[bytes]:
        assert self.chan is not None
        while self.chan.recv_stderr_ready():
            self._keep_err(self.chan.recv_stderr(65536))
        if self.chan.recv_ready():
            return self.chan.recv(65536) or None
        if self.chan.closed or self.chan.eof_received:
            return None
        return b""

    def _exit_code(self) -> Optional[int]:
        if self.chan is not None and self.chan.status_event.wait(1.0):
            code = self.chan.exit_status
            return None if code == -1 else code
        return None

    def _drain_err(self) -> None:
        if self.chan is not None:
            while self.chan.recv_stderr_ready():
                self._keep_err(self.chan.recv_stderr(65536))

    def send(self, data: bytes) -> None:
        assert self.chan is not None
        try:
            self.chan.settimeout(5.0)
            self.chan.sendall(data)
        except Exception as exc:
            raise TransportError(f"connection lost: {transport_error(exc)}",
                                 kind=errors.CLOSED) from None

    def _write_head(self, head: bytes) -> None:
        assert self.chan is not None
        self.chan.sendall(head)

    def _close_input(self) -> None:
        if self.chan is not None:
            try:
                self.chan.shutdown_write()
            except Exception:
                pass  # the command stopped reading; its exit status tells the rest

    def kill(self) -> None:
        """Closing the channel does not end the remote process: it bounds itself (``timeout``
        on the host, the agent's deadline); this side stops waiting."""
        if self.chan is not None:
            self.chan.close()

    def close(self) -> None:
        """stdin closed = EOF for the agent (it ends); then the channel."""
        if self.chan is None:
            return
        try:
            self.chan.shutdown_write()
        except Exception:
            pass
        try:
            self.chan.close()
        except Exception:
            pass
