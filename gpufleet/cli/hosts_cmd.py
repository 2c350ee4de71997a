"""`gpufleet hosts`: the inventory as a table (no connection is made)."""
from __future__ import annotations

import click

from gpufleet.render.common import to_json
from gpufleet.render.table import render_table
from gpufleet.cli import AppContext, cli, selection_options


@cli.command()
@selection_options
@click.option("--json", "as_json", is_flag=True, help="Print the hosts as JSON.")
@click.pass_obj
def hosts(app: AppContext, hosts, groups, tags, all_, as_json: bool) -> int:
    """List inventory hosts: name, address, port, user, tags, groups."""
    selected = app.select(hosts, groups, tags, all_)
    if as_json:
        click.echo(to_json({"hosts": [
            {"name": h.name, "address": h.address, "port": h.port, "user": h.user,
             "connection": h.connection, "tags": list(h.tags), "groups": list(h.groups)}
            for h in selected]}))
        return 0
    rows = [
        [h.name, h.address if h.connection == "ssh" else f"({h.connection})", h.port or "-", h.user or "-",
         ",".join(h.tags) or "-", ",".join(h.groups) or "-"]
        for h in selected
    ]
    click.echo(render_table(rows, ["NAME", "ADDRESS", "PORT", "USER", "TAGS", "GROUPS"]))
    return 0
