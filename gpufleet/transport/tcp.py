"""A TCP connect bounded in time, DNS included (getaddrinfo has no timeout of its own): what
the paramiko path dials (gpufleet.transport.connection, dial, keyscan), with the same kinds and
one-line messages as ssh's own connect failures.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any, Optional

from gpufleet import errors
from gpufleet.errors import TransportError


def _resolve(host: str, port: int, timeout: float) -> list:
    """getaddrinfo bounded by ``timeout`` (it has no timeout of its own)."""
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except ValueError:
        pass
    box: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            box["infos"] = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except BaseException as exc:
            box["exc"] = exc
        done.set()

    threading.Thread(target=work, name="gpufleet-dns", daemon=True).start()
    if not done.wait(timeout):
        raise TransportError(f"DNS lookup of {host} timed out after {timeout:g}s",
                             kind=errors.TIMEOUT)
    if "exc" in box:
        exc = box["exc"]
        reason = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
        raise TransportError(f"cannot resolve {host}: {reason}", kind=errors.DNS)
    return box["infos"]


def dial_tcp(host: str, port: int, timeout: float) -> socket.socket:
    """TCP connect to every address of ``host`` in turn, all within ``timeout``."""
    deadline = time.monotonic() + timeout
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    infos = _resolve(host, port, timeout)
    last: Optional[OSError] = None
    for family, socktype, proto, _name, addr in infos:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sock = socket.socket(family, socktype, proto)
        sock.settimeout(remaining)
        try:
            sock.connect(addr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    if last is None or isinstance(last, socket.timeout):
        raise TransportError(f"connect to {where} timed out after {timeout:g}s",
                             kind=errors.TIMEOUT)
    if isinstance(last, ConnectionRefusedError):
        raise TransportError(f"connection refused by {where}", kind=errors.REFUSED)
    reason = last.strerror or str(last)
    raise TransportError(f"cannot connect to {where}: {reason}", kind=errors.NETWORK)
