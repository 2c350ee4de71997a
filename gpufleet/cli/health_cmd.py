"""`gpufleet health`: one row per GPU (OK / WARN / CRITICAL, findings, action)."""
from __future__ import annotations

import click

from gpufleet.cli import AGENT_PAYLOAD, AppContext, cli, prefetch, selection_options
from gpufleet.cli.output import snapshot_warnings, warn
from gpufleet.errors import EXIT_FAILED, EXIT_OK


@cli.command()
@selection_options
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document (codes).")
@click.option("--strict", is_flag=True,
              help="Exit 1 on WARN and UNKNOWN too (a GPU none of whose readings could be "
                   "taken), not only on CRITICAL.")
@click.pass_obj
def health(app: AppContext, hosts, groups, tags, all_, as_json: bool, strict: bool) -> int:
    """Is every selected GPU sound? ECC, remapped rows, Xid events, lost GPUs, the GPU count
    against the inventory's `gpus:`, throttling, PCIe link, persistence (one SSH exec per host).

    A reading that could not be taken is unknown, never OK: a GPU with none is UNKNOWN, one
    with some names the others (readings_missing).

    Exit 0 when every GPU is OK (or only WARN or UNKNOWN), 1 on any CRITICAL finding (a GPU's
    or the host's own, e.g. fewer GPUs than the inventory's `gpus:`), on WARN or UNKNOWN too
    with --strict, or when a host could not be read; 2 on usage errors.

    On a terminal (or with COLUMNS) the findings wrap to its width; to a pipe each is one line.
    """
    prefetch(AGENT_PAYLOAD)  # compressed (GIL released) while the modules and the inventory load
    from gpufleet.cli.progress import HostProgress
    from gpufleet.ops.collect import snapshot_hosts

    selected = app.select(hosts, groups, tags, all_)
    prefetch("gpufleet.core.model", "gpufleet.render.health",  # loaded while the agents run
             after_first_start=True)
    with HostProgress(selected, "health") as progress:  # stderr, on a terminal only
        results = snapshot_hosts(selected, forks=app.forks, **progress.callbacks())
    from gpufleet.core.health import CRITICAL, UNKNOWN, WARN, assess_result
    from gpufleet.render.health import health_document, health_table, to_json

    expected = {h.name: h.gpus for h in selected}
    report = [assess_result(r, expected.get(r.host)) for r in results]
    if as_json:
        click.echo(to_json(health_document(report)))
    else:
        from gpufleet.cli.tty import styled, table_width

        click.echo(styled(health_table(report, table_width()), "HEALTH"))
    warn(snapshot_warnings(results, selected))  # stderr: the rows above stay the rows
    failing = (CRITICAL, WARN, UNKNOWN) if strict else (CRITICAL,)
    bad = any(not h.ok or h.severity in failing for h in report)
    return EXIT_FAILED if bad else EXIT_OK
