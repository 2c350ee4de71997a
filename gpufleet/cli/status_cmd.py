"""`gpufleet status`: one table across hosts; GPUs, memory, who holds it, what no one holds."""
from __future__ import annotations

import time
from typing import Any, Optional

import click

from gpufleet.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError
from gpufleet.ops.fanout import ABANDONED, NOT_STARTED
from gpufleet.cli import AGENT_PAYLOAD, AppContext, cli, prefetch, selection_options
from gpufleet.cli.output import snapshot_warnings, warn, write_whole


def parse_interval(text: Optional[str], option: str) -> Optional[float]:
    """Seconds > 0 (a refresh interval), or a one-line UsageError; checked before anything
    connects."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"{option} must be a number of seconds > 0, not {text!r}")
    return value


@cli.command()
@selection_options
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON document.")
@click.option("--wide", is_flag=True,
              help="Also TEMP (C) and POWER (W) per GPU (NVML's readings; n/a through nvidia-smi).")
@click.option("--watch", "watch", default=None, metavar="SECONDS",
              help="Stay connected; print the status every SECONDS (with --json: NDJSON, one "
                   "document per line) until interrupted.")
@click.pass_obj
def status(app: AppContext, hosts, groups, tags, all_, as_json: bool, wide: bool,
           watch: Optional[str]) -> int:
    """GPUs, memory and holders of the selected hosts (one SSH exec per host).

    On a terminal the table fits its width (HOLDERS wrap); to a pipe it is whole.

    Exit 0 when every host answered, 1 when some host failed or has a CRITICAL finding of its
    own (the driver not loaded, fewer GPUs than the inventory's `gpus:`: a `host` row), 2 on
    usage errors.
    """
    prefetch(AGENT_PAYLOAD)  # compressed (GIL released) while the modules and the inventory load
    from gpufleet.ops.collect import snapshot_hosts
    from gpufleet.cli.progress import HostProgress

    interval = parse_interval(watch, "--watch")
    selected = app.select(hosts, groups, tags, all_)
    if interval is not None:
        from gpufleet.cli.watch import watch_status

        return watch_status(selected, interval, as_json, app.forks, wide)
    started = time.monotonic()
    prefetch("gpufleet.core.model", "gpufleet.render.status",  # loaded while the agents run
             after_first_start=True)
    expected = {h.name: int(h.unattributed_mib or 0) for h in selected}
    expected_gpus = {h.name: h.gpus for h in selected}
    entries: dict[str, str] = {}

    def encode(host: Any, result: Any) -> None:  # in the host's worker (ops.collect)
        from gpufleet.render.status import host_json

        entries[host.name] = host_json(result, expected[host.name], expected_gpus[host.name])

    with HostProgress(selected, "status") as progress:  # stderr, on a terminal only
        results = snapshot_hosts(selected, forks=app.forks, then=encode if as_json else None,
                                 **progress.callbacks())
    from gpufleet.render.status import failing_hosts, host_json, status_json, status_table

    if as_json:  # hosts that never ran (Ctrl-C) are encoded here
        text = status_json([entries.get(r.host) or host_json(r, expected[r.host], expected_gpus[r.host])
                            for r in results], round(time.monotonic() - started, 3))
        write_whole(text + "\n")  # JSON escapes control characters: nothing to strip
    else:
        from gpufleet.cli.tty import styled, table_width

        table = status_table(results, expected, expected_gpus, wide, table_width())
        write_whole(styled(table, "STATUS") + "\n")
        warn(snapshot_warnings(results, selected))  # --json: in the document's warnings
    if any(r.error in (NOT_STARTED, ABANDONED) for r in results):
        click.echo("gpufleet: interrupted: rows above are what was gathered", err=True)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failing_hosts(results, expected_gpus) else EXIT_OK
