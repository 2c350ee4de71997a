"""Run the agent on many hosts and turn every outcome into a HostResult value.

This is where the pure core meets the transport; the CLI and runbooks call it, and the core
modules (model, plan, render) never import it.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.errors import AGENT, INTERNAL, SnapshotError, first_line, kind_of
from gpufleet.ops.fanout import run_hosts
from gpufleet.transport import AgentReply, open_session, predial

if TYPE_CHECKING:  # the snapshot model is imported by the first reply (or cli.prefetch), not
    # before the agents start: a command loads it while it waits for the hosts
    from gpufleet.core.model import HostResult

DEADLINE_MARGIN_S = 2.0


def snapshot_request(host: Host) -> dict[str, Any]:
    """The agent bounds itself a little inside command_timeout so it ends before we give up."""
    timeout = float(host.command_timeout)
    return {
        "mode": "snapshot",
        "deadline_s": max(1.0, timeout - DEADLINE_MARGIN_S),
        "nvidia_smi": host.nvidia_smi,
        "gpu_source": host.gpu_source,
        "agent_cache": host.agent_cache,
        "smi_timeout_s": max(1.0, min(10.0, timeout / 2)),
    }


def result_from_reply(host: Host, reply: AgentReply, started: float) -> HostResult:
    """The host's row from the agent's reply; the reply's failure kind travels with it."""
    seconds = time.monotonic() - started  # the host's time, before this side parses
    from gpufleet.core.model import HostResult, parse_snapshot

    if not reply.ok or reply.doc is None:
        return HostResult(host=host.name, ok=False, error=reply.error or "agent failed",
                          seconds=seconds, error_kind=reply.error_kind or AGENT)
    try:
        snap = parse_snapshot(reply.doc)
    except SnapshotError as exc:
        return HostResult(host=host.name, ok=False, error=str(exc), seconds=seconds,
                          error_kind=exc.kind)
    return HostResult(host=host.name, ok=True, snapshot=snap, seconds=seconds)


def snapshot_host(host: Host) -> HostResult:
    """One SSH connection, one exec: everything the host knows."""
    started = time.monotonic()
    try:
        with open_session(host) as session:
            reply = session.run_agent(snapshot_request(host), timeout=float(host.command_timeout))
    except Exception as exc:  # a failed host is a value, whatever broke
        from gpufleet.core.model import HostResult

        return HostResult(host=host.name, ok=False, error=first_line(exc)[:300],
                          seconds=time.monotonic() - started, error_kind=kind_of(exc))
    return result_from_reply(host, reply, started)


def snapshot_hosts(hosts: Sequence[Host], forks: int = 32,
                   fn: Optional[Callable[[Host], HostResult]] = None,
                   on_start: Optional[Callable[[Host], None]] = None,
                   on_result: Optional[Callable[[Host, Any], None]] = None,
                   then: Optional[Callable[[Host, HostResult], None]] = None) -> list[HostResult]:
    """Every host's snapshot, at most ``forks`` SSH sessions at a time; every TCP connect
    starts at once (transport.predial), so unreachable hosts cost one connect_timeout in all.
    ``on_start`` / ``on_result``: run_hosts's (progress.HostProgress.callbacks). ``then(host,
    result)`` runs in the host's worker before the host counts as done (the CLI renders the
    host's output there, while other hosts are still answering); its errors are the caller's."""
    def one(h: Host) -> HostResult:
        result = fn(h) if fn is not None else snapshot_host(h)
        if then is not None:
            then(h, result)
        return result

    if fn is not None:
        out = run_hosts(hosts, one, forks=forks, on_start=on_start, on_result=on_result)
    else:
        with predial(hosts, forks):
            out = run_hosts(hosts, one, forks=forks, on_start=on_start, on_result=on_result)
    from gpufleet.core.model import HostResult

    return [
        r if isinstance(r, HostResult) else HostResult(host=h.name, ok=False, error=str(r),
                                                       error_kind=INTERNAL)
        for h, r in zip(hosts, out)
    ]
