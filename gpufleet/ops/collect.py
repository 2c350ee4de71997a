"""Run the agent on many hosts and turn every outcome into a HostResult value.

This is where the pure core meets the transport; the CLI and runbooks call it, and the core
modules (model, plan, render) never import it.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Callable, Optional, Sequence

from gpufleet.ops.fanout import run_hosts
from gpufleet.config.inventory import Host
from gpufleet.core.model import HostResult, SnapshotError, parse_snapshot
from gpufleet.transport import open_session, predial

DEADLINE_MARGIN_S = 2.0


def snapshot_request(host: Host) -> dict[str, Any]:
    """The agent bounds itself a little inside command_timeout so it ends before we give up."""
    timeout = float(host.command_timeout)
    return {
        "mode": "snapshot",
        "deadline_s": max(1.0, timeout - DEADLINE_MARGIN_S),
        "nvidia_smi": host.nvidia_smi,
        "smi_timeout_s": max(1.0, min(10.0, timeout / 2)),
    }


def result_from_reply(host: Host, reply: Any, started: float) -> HostResult:
    seconds = time.monotonic() - started
    if not reply.ok or reply.doc is None:
        return HostResult(host=host.name, ok=False, error=reply.error or "agent failed", seconds=seconds)
    try:
        snap = parse_snapshot(reply.doc)
    except SnapshotError as exc:
        return HostResult(host=host.name, ok=False, error=str(exc), seconds=seconds)
    return HostResult(host=host.name, ok=True, snapshot=snap, seconds=seconds)


def snapshot_host(host: Host, dial: Optional[cf.Future] = None) -> HostResult:
    """One SSH connection, one exec: everything the host knows (``dial``: its pre-dialled
    connection, see transport.predial)."""
    started = time.monotonic()
    try:
        with open_session(host, dial) as session:
            reply = session.run_agent(snapshot_request(host), timeout=float(host.command_timeout))
    except Exception as exc:  # a failed host is a value, whatever broke
        return HostResult(host=host.name, ok=False, error=_short(exc), seconds=time.monotonic() - started)
    return result_from_reply(host, reply, started)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


def snapshot_hosts(hosts: Sequence[Host], forks: int = 32,
                   fn: Optional[Callable[[Host], HostResult]] = None,
                   on_start: Optional[Callable[[Host], None]] = None,
                   on_result: Optional[Callable[[Host, Any], None]] = None) -> list[HostResult]:
    """Every host's snapshot, at most ``forks`` SSH sessions at a time; every TCP connect
    starts at once (transport.predial), so unreachable hosts cost one connect_timeout in all.
    ``on_start`` / ``on_result``: run_hosts's (progress.HostProgress.callbacks)."""
    if fn is not None:
        out = run_hosts(hosts, fn, forks=forks, on_start=on_start, on_result=on_result)
    else:
        with predial(hosts, forks) as dials:
            out = run_hosts(hosts, lambda h: snapshot_host(h, dials.take(h)), forks=forks,
                            on_start=on_start, on_result=on_result)
    return [
        r if isinstance(r, HostResult) else HostResult(host=h.name, ok=False, error=str(r))
        for h, r in zip(hosts, out)
    ]
