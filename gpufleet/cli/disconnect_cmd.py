"""`gpufleet disconnect`: close the SSH connections gpufleet kept between commands (ssh_persist)."""
from __future__ import annotations

import os

import click

from gpufleet.cli import AppContext, cli, selection_options, terminal_safe


@cli.command()
@selection_options
@click.option("--list", "list_only", is_flag=True, help="Show the kept connections; close nothing.")
@click.pass_obj
def disconnect(app: AppContext, hosts, groups, tags, all_, list_only: bool) -> int:
    """Close the SSH connections kept for the next command (60 s by default; the inventory's `ssh_persist`).

    Without a host selection: every connection gpufleet keeps for this user, whatever the
    inventory. Each is asked to end over its own control socket; nothing is signalled. A
    kept connection also ends by itself once idle for `ssh_persist` seconds (default 60;
    `ssh_persist: 0` keeps none).
    """
    from gpufleet.transport import close_kept, kept_connections

    selected = app.select(hosts, groups, tags, all_) if (hosts or groups or tags or all_) else None
    found = kept_connections(selected)
    for kept in found:
        who = kept.name  # the host (and where it goes), not the socket's hashed name
        if kept.pid is None:  # a stale socket (removed when closing) or a master that hangs
            state = "no master answers"
            if not list_only:
                close_kept(kept.path)
                state += ": left in place" if os.path.exists(kept.path) else ": socket removed"
        elif list_only:
            state = f"kept (master pid {kept.pid})"
        else:
            pid = close_kept(kept.path)
            state = f"closed (master pid {pid})" if pid is not None else "already gone"
        click.echo(terminal_safe(f"{who}: {state}", one_line=True))
    if not list_only:
        from gpufleet.transport.kept import prune_labels

        prune_labels()
    live = sum(1 for k in found if k.pid is not None)
    summary = f"{live} kept connection{'s' if live != 1 else ''}" + ("" if list_only else " closed")
    click.echo(summary if found else "no kept connections")
    return 0
