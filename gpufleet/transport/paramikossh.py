"""paramiko/fabric as the SSH client: for controllers with no OpenSSH client (python:slim has
none), ``ssh_client: paramiko``, and hosts behind ProxyJump / ProxyCommand (whose hops' host
keys gpufleet holds to its own policy; gpufleet.transport.openssh says why ssh cannot).

One way of reaching a host (gpufleet.transport.reach's table). The connection (ssh_config,
hops, host keys, timeouts) is gpufleet.transport.connection; each run is one exec channel on
it, a stream (stream.ChannelStream) read to its end; each stream one more.
paramiko is imported here only when a session connects, never for a local host.
"""
from __future__ import annotations

import concurrent.futures as cf
import shlex
import time
from typing import TYPE_CHECKING, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport.reply import remote_timeout
from gpufleet.transport.run import RawRun
from gpufleet.transport.session import Session
from gpufleet.transport.stream import ChannelStream, Stream, transport_error

if TYPE_CHECKING:
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


