"""`gpufleet init`: write a commented fleet.yaml (an installed gpufleet ships no example)."""
from __future__ import annotations

import os
from typing import Optional

import click

from gpufleet.cli import AppContext, cli
from gpufleet.errors import UsageError


@cli.command()
@click.argument("path", required=False, metavar="[PATH]")
@click.option("--from-ssh-config/--no-ssh-config", "from_ssh", default=None,
              help="One host per concrete Host alias of ~/.ssh/config (no wildcards): only the "
                   "file is read, nothing is resolved or contacted [default: ask on a terminal].")
@click.pass_obj
def init(app: AppContext, path: Optional[str], from_ssh: Optional[bool]) -> int:
    """Write a commented fleet.yaml (PATH, else -i, else ./fleet.yaml); never overwrites.

    Its hosts are ~/.ssh/config's (--from-ssh-config; on a terminal you are asked when it
    has some), else this machine (connection: local); every other key is shown commented.
    Exit 0 written; 2 the file exists, cannot be written, or ~/.ssh/config has no host.
    """
    import shlex
    import sys

    from gpufleet.config.starter import ssh_config_aliases, starter_inventory

    if path and app.inventory_path and path != app.inventory_path:
        raise UsageError(f"two paths: -i {app.inventory_path} and {path}")
    target = path or app.inventory_path or "fleet.yaml"
    if os.path.lexists(target):  # before any question: the answer could not be used
        raise UsageError(f"{target} exists: not overwritten (remove it, or name another path)")
    aliases, unusable, include = ssh_config_aliases(_read_ssh_config(must=bool(from_ssh)))
    if from_ssh is None and aliases and sys.stdin.isatty():
        shown = ", ".join(aliases[:5]) + (f" +{len(aliases) - 5} more" if len(aliases) > 5 else "")
        from_ssh = click.confirm(f"~/.ssh/config names {len(aliases)} host(s) ({shown}): "
                                 "add them?", default=False)
    if from_ssh and not aliases:
        raise UsageError("~/.ssh/config names no concrete host (Host lines without * ? !): "
                         "nothing written; `gpufleet init` writes a file to fill by hand")
    if from_ssh:
        text = starter_inventory(aliases, tuple(unusable), include)
        what = f"{len(aliases)} host(s) from ~/.ssh/config"
    else:
        text = starter_inventory()
        what = "this machine (connection: local)"
    _write_new(target, text)
    click.echo(f"wrote {target}: {what}; check it with `gpufleet -i {shlex.quote(target)} hosts`")
    return 0


def _read_ssh_config(must: bool) -> str:
    """~/.ssh/config's text ("" when there is none and it was not asked for)."""
    config = os.path.expanduser("~/.ssh/config")
    try:
        with open(config, encoding="utf-8", errors="replace") as fh:
            return fh.read(1 << 20)
    except FileNotFoundError:
        if not must:
            return ""
        raise UsageError(f"{config}: not found: nothing written") from None
    except OSError as exc:
        if not must:
            return ""
        raise UsageError(f"{config}: cannot read: {exc.strerror or exc}") from None


def _write_new(target: str, text: str) -> None:
    """Create ``target`` (and its folder) with ``text``; an existing file is never touched:
    O_EXCL, so a file that appears meanwhile is not overwritten either."""
    try:
        folder = os.path.dirname(os.path.abspath(target))
        os.makedirs(folder, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise UsageError(f"{target} exists: not overwritten (remove it, or name another path)") from None
    except OSError as exc:
        raise UsageError(f"{target}: cannot write: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
