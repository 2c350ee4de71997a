"""The key exchange alone, for `gpufleet trust`: what key a host presents, and recording it.

Internal to gpufleet.transport (import from there). Kept apart from connection.py because it
takes a pre-dialled socket (gpufleet.transport.dial) as a session does, and dial.py builds on
connection.py: here both are below it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import paramiko

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import TransportError
from gpufleet.transport import hostkeys
from gpufleet.transport.connection import connection_for, transport_error
from gpufleet.transport.tcp import dial_tcp
from gpufleet.transport.dial import Dialled, connection_from_dial, pending


def fetch_host_key(host: Host, dial: Optional[Dialled] = None
                   ) -> tuple[str, str, paramiko.PKey]:
    """(keytype, SHA256 fingerprint, key) the host presents, for `gpufleet trust`.

    Uses the same route as a real connection (ssh_config, ProxyJump: jump hops must pass the
    host key policy); only the key exchange is done, no authentication. Known key types for
    the name are asked for first. ``dial``: the host's :func:`predial` Future, else the one
    a pre-dial in progress holds (its TCP connect started with the command). Raises TransportError / HostKeyError.
    """
    if getattr(host, "connection", "ssh") != "ssh":
        raise TransportError(f"{host.name} uses connection: {host.connection}; it has no SSH host key",
                             kind=errors.SSHCONFIG)
    conn = connection_from_dial(dial if dial is not None else pending(host)) or connection_for(host)
    sock = None
    transport = None
    try:
        try:
            if conn.gateway:
                sock = conn.open_gateway()
            else:
                sock = conn.take_predialed() or dial_tcp(conn.host, int(conn.port),
                                                         conn.dial_timeout)
            transport = paramiko.Transport(sock)
            transport.banner_timeout = conn.dial_timeout
            known = [e.keytype for e in hostkeys.known_keys(conn.key_name, conn.known_hosts_files)]
            if known:
                opts = transport.get_security_options()
                want = []
                for kt in known:
                    want += ["rsa-sha2-512", "rsa-sha2-256", kt] if kt == "ssh-rsa" else [kt]
                first = [t for t in dict.fromkeys(want) if t in opts.key_types]
                opts.key_types = first + [t for t in opts.key_types if t not in first]
            transport.start_client(timeout=conn.dial_timeout)
            key = transport.get_remote_server_key()
        except TransportError:
            raise
        except Exception as exc:
            raise transport_error(exc) from None
        return key.get_name(), hostkeys.fingerprint(key), key
    finally:
        if transport is not None:
            transport.close()
        elif sock is not None:
            sock.close()
        conn.close()


@dataclass(frozen=True)
class TrustResult:
    name: str  # the known_hosts name: host or [host]:port
    keytype: str
    fingerprint: str
    path: str
    added: bool  # False: it was already known


def trust(host: Host, path: Optional[Union[str, os.PathLike[str]]] = None,
          fetched: Optional[tuple[str, str, paramiko.PKey]] = None) -> TrustResult:
    """Record the key ``host`` presents now in ``path`` (default ~/.config/gpufleet/known_hosts).

    ``fetched``: what :func:`fetch_host_key` returned (the key the operator was shown); None
    fetches it here. Refuses (HostKeyError) when a different key is already recorded for it
    anywhere: a changed key is never overwritten; the operator removes the old line first.
    """
    target = Path(path) if path else hostkeys.gpufleet_known_hosts()
    keytype, fp, key = fetched if fetched is not None else fetch_host_key(host)
    conn = connection_for(host)
    name = conn.key_name
    files = list(dict.fromkeys([*conn.known_hosts_files, target]))
    conn.close()
    verdict = hostkeys.check(name, keytype, key.asbytes(), files)
    if verdict.verdict == hostkeys.KNOWN:
        return TrustResult(name, keytype, fp, verdict.entry.path if verdict.entry else str(target), False)
    if verdict.verdict != hostkeys.UNKNOWN:
        raise hostkeys.refusal(name, keytype, key.asbytes(), verdict)
    verdict = hostkeys.record(name, key, target, files)
    if verdict.verdict != hostkeys.KNOWN:
        raise hostkeys.refusal(name, keytype, key.asbytes(), verdict)
    return TrustResult(name, keytype, fp, str(target), True)
