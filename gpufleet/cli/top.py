"""`gpufleet top`: every selected host on one live screen, with the safe clean."""
from __future__ import annotations

import sys
from typing import Optional

import click

from gpufleet.cli import AppContext, cli, selection_options
from gpufleet.errors import EXIT_OK, UsageError

NO_TERMINAL = ("gpufleet top needs a terminal; for scripts use "
               "`gpufleet status --watch SECONDS --json` (one JSON document per line)")


@cli.command()
@selection_options
@click.option("-n", "--interval", "interval", default="2", metavar="SECONDS", show_default=True,
              help="Seconds between refreshes.")
@click.option("--readonly", is_flag=True, help="No marks, no clean: only watch.")
@click.option("--audit-log", default=None, metavar="PATH",
              help="Audit log of a clean (default ~/.local/state/gpufleet/audit.jsonl).")
@click.pass_obj
def top(app: AppContext, hosts, groups, tags, all_, interval: str, readonly: bool,
        audit_log: Optional[str]) -> int:
    """Live screen of the selected hosts: GPUs, memory, holders; mark GPUs and clean them.

    Without --host, -g, --tag or --all it watches every host, and marks and clean are
    refused on the screen with how to select hosts (a clean needs the hosts named).

    Exit 0 on q; 2 on usage errors (no terminal, bad interval, empty selection).
    """
    from gpufleet.cli.status_cmd import parse_interval
    from gpufleet.config.selection import named, selection_flags

    seconds = parse_interval(interval, "--interval")  # bad input: one line, nothing connected
    selected = app.select(hosts, groups, tags, all_)
    refused = "" if readonly or named(hosts, groups, tags, all_) else (
        f"clean changes hosts: start top with {selection_flags(app.implicit_inventory())}")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(NO_TERMINAL)
    from gpufleet.cli import progress

    if progress.VERBOSE and sys.stderr.isatty():  # -v's lines would be drawn over the screen
        raise UsageError("-v writes on stderr, the terminal top draws on: send it to a file "
                         "(gpufleet top -v 2>top.log)")
    from gpufleet.cli.watch import first_round_limit, sigterm_as_interrupt
    from gpufleet.ops.live import LiveFleet

    every = float(seconds or 2.0)
    # at most --forks connecting at once; refreshes held until every host has answered once
    fleet = LiveFleet(selected, every, forks=app.forks,
                      hold_first_s=first_round_limit(selected, app.forks))
    with sigterm_as_interrupt():
        try:
            fleet.start()  # the hosts connect while the screen's modules (~50 ms) load
            from gpufleet.cli.topscreen import run_top

            return run_top(fleet, selected, every, readonly, audit_log, refused)
        except KeyboardInterrupt:
            return EXIT_OK
        finally:
            fleet.stop()  # every stream closed: the agents end on EOF
