"""`gpufleet trust HOST`: show a host's key fingerprint and record it (the strict policy's remedy)."""
from __future__ import annotations

from typing import Optional

import click

from gpufleet.errors import UsageError
from gpufleet.cli import AppContext, cli


@cli.command()
@click.argument("names", nargs=-1, required=True, metavar="HOST...")
@click.option("--known-hosts", "path", default=None, metavar="PATH",
              help="Where to record the key (default ~/.config/gpufleet/known_hosts).")
@click.option("--yes", "-y", is_flag=True, help="Record without asking (after you verified the fingerprint).")
@click.pass_obj
def trust(app: AppContext, names, path: Optional[str], yes: bool) -> int:
    """Fetch the key HOST presents, show its SHA256 fingerprint and record it.

    A key that differs from one already recorded is never overwritten (exit 1): remove the old
    line first if the change is expected.
    """
    import sys

    from gpufleet.transport import TransportError, fetch_host_key, predial, trust as record

    hosts = app.select(list(names), [], [], False)
    failed = False
    # Every TCP connect starts now (transport.predial): a dead host among many costs one
    # connect_timeout in all, not one more for each host after it.
    with predial(hosts, app.forks, openssh_too=True):
        for host in hosts:
            if host.connection != "ssh":
                click.echo(f"{host.name}: connection: {host.connection}, no host key")
                continue
            try:
                fetched = fetch_host_key(host)
                click.echo(f"{host.name}: {fetched[0]} {fetched[1]}")
                if not yes:
                    if not sys.stdin.isatty():
                        raise UsageError("not a terminal: verify the fingerprint above, then pass --yes")
                    if not click.confirm(f"Record this key for {host.name}?", default=False):
                        failed = True
                        continue
                result = record(host, path, fetched)  # the key shown above, not a new fetch
            except TransportError as exc:  # HostKeyError too: it is one
                click.echo(f"{host.name}: {exc}", err=True)
                failed = True
                continue
            state = "recorded in" if result.added else "already known in"
            click.echo(f"{host.name}: {result.name} {result.keytype} {result.fingerprint} {state} {result.path}")
    return 1 if failed else 0
