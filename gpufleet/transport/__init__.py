"""The transport: run the agent or an argv on one Host, over SSH or locally (the public face).

session: one connection per host reused by several runs; connection: ssh_config, ProxyJump,
host keys, dialling; dial: pre-dialling (every TCP connect at once); keyscan: the key
exchange alone (`gpufleet trust`); auth: public-key auth only; hostkeys: strict / accept-new;
run: one bounded raw run on an exec channel or a local subprocess; stream: a resident run
read line by line (the agent's watch mode). Other packages import
from here only, and no module imports another's private names.
"""
from gpufleet.errors import TransportError
from gpufleet.transport.connection import MAX_HOPS, connection_for, transport_error
from gpufleet.transport.dial import Dialled, Predial, predial
from gpufleet.transport.keyscan import TrustResult, fetch_host_key, trust
from gpufleet.transport.run import INLINE_STDIN, KILL_AFTER_S, STDERR_KEEP
from gpufleet.transport.session import (
    AgentReply,
    ArgvResult,
    LocalSession,
    Session,
    SshSession,
    deadline_for,
    open_session,
)
from gpufleet.transport.stream import Stream

__all__ = [
    "INLINE_STDIN", "KILL_AFTER_S", "MAX_HOPS", "STDERR_KEEP", "AgentReply", "ArgvResult",
    "Dialled", "LocalSession", "Predial", "Session", "SshSession", "Stream", "TransportError",
    "TrustResult", "connection_for", "deadline_for", "fetch_host_key", "open_session",
    "predial", "transport_error", "trust",
]
