"""`gpufleet status --watch SECONDS`: the live fleet as text or NDJSON, no screen.

One persistent session per host (gpufleet.ops.live), at most --forks of them connecting at a
time; the first document once every host has answered or failed (at most one connect +
command timeout per wave of --forks hosts), then one per interval, until
Ctrl-C or SIGTERM (exit 0), or until stdout closes. Every stream is closed on the way out,
so the agents end at once (and by their keep-alive deadline if this process is killed).
"""
from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from gpufleet.config.inventory import Host
from gpufleet.core.live import STALE
from gpufleet.errors import EXIT_OK
from gpufleet.cli import prefetch, terminal_safe
from gpufleet.cli.output import snapshot_warnings, warn, write_whole


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends a watch as Ctrl-C does: through the finally blocks that close streams."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def first_round_limit(hosts: Sequence[Host], forks: int) -> float:
    """How long the first document waits for every host: one connect + command timeout for
    each wave of ``forks`` hosts (a host waits for a connect slot as `status` for a fork)."""
    waves = -(-len(hosts) // max(1, forks))
    return waves * max((float(h.connect_timeout) + float(h.command_timeout) for h in hosts),
                       default=1)


def wait_first_round(fleet: Any, hosts: Sequence[Host], forks: int) -> None:
    """Until every host answered or failed, at most ``first_round_limit``."""
    end = time.monotonic() + first_round_limit(hosts, forks)
    generation = -1
    while not fleet.answered() and time.monotonic() < end:
        generation = fleet.wait_change(generation, 0.2)


def watch_status(hosts: Sequence[Host], interval: float, as_json: bool, forks: int,
                 wide: bool = False) -> int:
    from gpufleet.ops.live import LiveFleet

    expected = {h.name: int(h.unattributed_mib or 0) for h in hosts}
    expected_gpus = {h.name: h.gpus for h in hosts}
    docs: list[Any] = []  # render.status.HostDocs, once the renderers have loaded

    def prepare(result: Any) -> None:  # in the host's thread, as its snapshot arrives
        if docs:
            docs[0].doc(result)

    fleet = LiveFleet(hosts, interval, forks=forks, on_result=prepare if as_json else None,
                      hold_first_s=first_round_limit(hosts, forks))
    with sigterm_as_interrupt():
        try:
            fleet.start()  # first: the imports below load while the sessions connect
            prefetch("gpufleet.core.model", "gpufleet.render.status")
            from gpufleet.render.status import HostDocs, watch_document

            docs.append(HostDocs(expected))
            wait_first_round(fleet, hosts, forks)

            seq = 0
            next_at = time.monotonic()
            while True:
                now = time.monotonic()
                views = fleet.view()
                if as_json:
                    doc = watch_document(views, expected, now, seq, docs[0])
                    doc["time"] = round(time.time(), 3)
                    write_whole(json.dumps(doc, separators=(",", ":")) + "\n")
                else:
                    write_whole(_text(views, expected, expected_gpus, now, interval, wide)
                                + "\n")
                    warn(snapshot_warnings([v.as_result() for v in views], hosts))
                seq += 1
                next_at = max(next_at + interval, now)
                time.sleep(max(0.0, next_at - time.monotonic()))
        except KeyboardInterrupt:
            return EXIT_OK
        finally:
            fleet.stop()


def _text(views: Sequence[Any], expected: dict[str, int], expected_gpus: dict[str, Any],
          now: float, interval: float, wide: bool) -> str:
    from gpufleet.cli.tty import colour, styled, table_width
    from gpufleet.render.status import status_table

    head = time.strftime("%H:%M:%S") + f"  (every {interval:g}s; Ctrl-C ends)"
    table = status_table([v.as_result() for v in views], expected, expected_gpus, wide,
                         table_width())
    notes = []
    for view in views:
        if view.state(now) == STALE:
            age = view.age_s(now) or 0.0
            why = view.failure.message if view.failure else "no new snapshot"
            notes.append((view.host, terminal_safe(
                f"{view.host}: stale, last snapshot {age:.0f}s ago: {why}")))
    if colour():
        from gpufleet.render.style import paint_stale

        notes = [(host, paint_stale(line, terminal_safe(host))) for host, line in notes]
    return "\n".join([head, styled(table, "STATUS")] + [line for _, line in notes]) + "\n"
