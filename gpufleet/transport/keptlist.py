"""The connections kept between commands, listed (each named by its host: the inventory's, else
the label written beside its socket) and closed (`gpufleet disconnect`).

Internal to gpufleet.transport; where the sockets are and how they are named is
gpufleet.transport.kept's.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from gpufleet.errors import TransportError
from gpufleet.transport import sshconfig, sshcontrol, sshtarget
from gpufleet.transport.kept import label_of, sockets

ASK_S = 2.0  # how long a master has to answer `gpufleet disconnect`


@dataclass(frozen=True)
class Kept:
    """One kept connection: the inventory host it is for (None: found in the directory),
    its socket, its master's PID (None: no master answers there), and the label written
    beside it when it was made (the host's name and destination)."""

    host: Optional[str]
    path: str
    pid: Optional[int]
    label: Optional[str] = None

    @property
    def name(self) -> str:
        """How an operator knows it: the inventory host, else its label, else the socket."""
        return self.host or self.label or self.path


def socket_of(host: Any) -> Optional[str]:
    """Where ``host``'s kept connection is (whether or not one is up, whatever its
    ``ssh_persist`` now): None for a host not reached through OpenSSH."""
    ssh = sshconfig.ssh_client()
    if getattr(host, "connection", "ssh") != "ssh" or ssh is None \
            or not sshconfig.openssh_wanted(host):
        return None
    target = sshtarget.target_for(dataclasses.replace(host, ssh_persist=1.0), ssh)
    return target.kept if target is not None else None


def kept_connections(hosts: Optional[Sequence[Any]] = None) -> list[Kept]:
    """The kept connections of ``hosts`` (None: every socket in the directory)."""
    if hosts is None:
        return [Kept(None, path, sshcontrol.check(path, ASK_S).pid, label_of(path))
                for path in sockets()]
    found = []
    for host in hosts:
        try:
            path = socket_of(host)
        except TransportError:  # ssh -G refuses the host now: no socket can be named for it
            continue  # (one kept from before is still closed by a run without a selection)
        if path is not None and os.path.exists(path):
            found.append(Kept(host.name, path, sshcontrol.check(path, ASK_S).pid))
    return found


def close_kept(path: str) -> Optional[int]:
    """Ask the master at ``path`` to end (``ssh -O exit``); its PID, or None when none was
    there (a stale socket is removed; one held by a master that hangs is left)."""
    return sshcontrol.stop(path, ASK_S)
