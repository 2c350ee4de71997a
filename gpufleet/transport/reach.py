"""How a host is reached: one table from its ``connection`` to the module whose session
reaches it. THE place that decides it; every other module only implements a way.

A way's module is imported when a host of its kind opens: a run whose hosts are all local
never imports the SSH stack (tests/integration/test_startup_imports.py). With -v each host's
way is said on stderr (the logger ``gpufleet.transport``, gpufleet.cli.enable_verbose).
"""
from __future__ import annotations

import logging
import shlex
from typing import TYPE_CHECKING, Callable, Optional

from gpufleet.config.inventory import Host
from gpufleet.transport import sshconfig
from gpufleet.transport.session import Session
from gpufleet.transport.sshconfig import log

if TYPE_CHECKING:
    from gpufleet.transport.dial import Dialled

Opener = Callable[[Host, Optional["Dialled"], bool], Session]


def _local(host: Host, dial: Optional[Dialled], keep: bool) -> Session:
    from gpufleet.transport.local import LocalSession

    log.debug("%s: connection: local (this machine, no ssh)", host.name)
    return LocalSession(host)


def _exec(host: Host, dial: Optional[Dialled], keep: bool) -> Session:
    from gpufleet.transport.execprefix import ExecSession

    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: connection: exec (through %s, no ssh)", host.name,
                  shlex.join(str(a) for a in getattr(host, "exec", None) or ()))
    return ExecSession(host)


def _ssh(host: Host, dial: Optional[Dialled], keep: bool) -> Session:
    """OpenSSH's client where it can be used (not pre-dialled for paramiko, ``ssh`` on PATH,
    no hop); else paramiko's (gpufleet.transport.paramikossh says when and why)."""
    if dial is None and sshconfig.openssh_wanted(host):
        from gpufleet.transport import openssh

        session = openssh.open_session(host, keep=keep)
        if session is not None:
            if session.error is not None:
                log.debug("%s: not connected: %s", host.name, session.error)
            return session
    log.debug("%s: paramiko (ssh_client: paramiko, no ssh on PATH, or a ProxyJump/ProxyCommand)",
              host.name)
    from gpufleet.transport.dial import pending
    from gpufleet.transport.paramikossh import SshSession

    return SshSession(host, dial if dial is not None else pending(host))


#: connection -> how its session opens; each way is one module, imported when a host of that
#: kind opens (config/inventory.py validates the kinds)
WAYS: dict[str, Opener] = {"local": _local, "exec": _exec, "ssh": _ssh}


def open_session(host: Host, dial: Optional[Dialled] = None, keep: bool = False) -> Session:
    """Open the host's session (connects now over SSH); never raises for host failures.

    ``dial``: the host's pre-dialled paramiko connection; None: the one a pre-dial in progress
    holds for it (``with predial(hosts, forks):``, gpufleet.transport.dial), else dialled here.
    ``keep``: the caller runs several commands on it (OpenSSH then keeps a master for them; a
    paramiko session always keeps its connection).
    """
    return WAYS[getattr(host, "connection", "ssh") or "ssh"](host, dial, keep)
