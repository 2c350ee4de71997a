"""The transport: run the agent or an argv on one Host, over SSH, locally, or through an exec
prefix (the public face).

session: THE interface of a host's session; reach: THE table from a host's ``connection`` to
the module that reaches it (local, execprefix, openssh, paramikossh); reply: what a run gave
and why it failed, the same for every way; stream: a command read line by line, or to its end
(every one-shot run); conversation: one agent process answering several requests over one exec
(`clean`'s plan and act); sshtarget/sshconfig: what ``ssh`` is told (``ssh -G`` decides where);
kept/keptlist/sshcontrol: connections kept between commands (``ssh -S``, ``ssh -O``);
connection/dial/keyscan/auth/hostkeys/tcp: the paramiko path. Other packages import from here
only, and no module imports another's private names.

Lazy: a name is imported from its module when first asked for (PEP 562), and session, run and
dial import the SSH stack (paramiko, fabric, invoke: ~0.3 s) only when a host is reached over
SSH. So `gpufleet --help`, `hosts`, and any run whose hosts are all `connection: local` never
load it (tests/integration/test_startup_imports.py; bench/startup.py measures it).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpufleet.errors import TransportError

if TYPE_CHECKING:  # what mypy and readers see; at run time __getattr__ imports on demand
    from gpufleet.transport.connection import MAX_HOPS, connection_for, transport_error
    from gpufleet.transport.conversation import Conversation
    from gpufleet.transport.dial import Dialled, Predial, predial
    from gpufleet.transport.keptlist import Kept, close_kept, kept_connections
    from gpufleet.transport.keyscan import TrustResult, fetch_host_key, trust
    from gpufleet.transport.run import FIRST_START, INLINE_STDIN, KILL_AFTER_S, STDERR_KEEP
    from gpufleet.transport.local import LocalSession
    from gpufleet.transport.paramikossh import SshSession
    from gpufleet.transport.reach import open_session
    from gpufleet.transport.reply import AgentReply, ArgvResult, deadline_for
    from gpufleet.transport.session import Session
    from gpufleet.transport.stream import Stream

#: public name -> the module that defines it
_HOME = {
    "MAX_HOPS": "connection", "connection_for": "connection", "transport_error": "connection",
    "Conversation": "conversation",
    "Dialled": "dial", "Predial": "dial", "predial": "dial",
    "TrustResult": "keyscan", "fetch_host_key": "keyscan", "trust": "keyscan",
    "Kept": "keptlist", "close_kept": "keptlist", "kept_connections": "keptlist",
    "FIRST_START": "run", "INLINE_STDIN": "run", "KILL_AFTER_S": "run", "STDERR_KEEP": "run",
    "AgentReply": "reply", "ArgvResult": "reply", "deadline_for": "reply",
    "LocalSession": "local", "Session": "session", "SshSession": "paramikossh",
    "open_session": "reach", "Stream": "stream",
}

__all__ = [  # _HOME's names and TransportError (tests/integration/test_startup_imports.py)
    "FIRST_START", "INLINE_STDIN", "KILL_AFTER_S", "MAX_HOPS", "STDERR_KEEP", "AgentReply", "ArgvResult",
    "Conversation", "Dialled", "Kept", "LocalSession", "Predial", "Session", "SshSession", "Stream",
    "TransportError", "TrustResult", "close_kept", "connection_for", "deadline_for", "fetch_host_key",
    "kept_connections", "open_session", "predial", "transport_error", "trust",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used (then it is a plain global)."""
    home = _HOME.get(name)
    if home is None:  # also how `from gpufleet.transport import hostkeys` finds the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
