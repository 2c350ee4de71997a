"""The thin click CLI. Errors become one line and an exit code here, and only here.

Exit codes: 0 ok; 1 some host failed / dirty / does not fit; 2 usage, inventory or runbook
error (nothing was done); 130 interrupted.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import click

from gpufleet.errors import EXIT_INTERRUPTED, EXIT_USAGE, GpufleetError, UsageError
from gpufleet.errors import lines as error_lines
from gpufleet.render.common import terminal_safe  # the one definition; commands import it from here


@dataclass
class AppContext:
    inventory_path: Optional[str]
    forks: int
    _inventory: object = field(default=None, repr=False)

    def inventory(self):
        """Loaded lazily so `gpufleet --help` never touches the disk."""
        if self._inventory is None:
            from gpufleet.config.inventory import IMPLICIT_HINT, find_inventory, load_inventory

            self._inventory = load_inventory(find_inventory(self.inventory_path))
            if self._inventory.implicit:
                click.echo(IMPLICIT_HINT, err=True)
        return self._inventory

    def select(self, hosts: Sequence[str], groups: Sequence[str], tags: Sequence[str], all_: bool):
        from gpufleet.config.selection import select

        return select(self.inventory(), hosts=list(hosts), groups=list(groups), tags=list(tags), all_=all_)


def selection_options(func: Callable) -> Callable:
    """--host/-g/--tag/--all, shared by every command that acts on hosts."""
    func = click.option("--all", "all_", is_flag=True, help="Every host in the inventory.")(func)
    func = click.option("--tag", "tags", multiple=True, metavar="TAG", help="Hosts with this tag (repeatable).")(func)
    func = click.option("-g", "--group", "groups", multiple=True, metavar="GROUP", help="Hosts of this group (repeatable).")(func)
    func = click.option("--host", "hosts", multiple=True, metavar="NAME", help="Host name or glob (repeatable).")(func)
    return func


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-i", "--inventory", "inventory_path", type=click.Path(dir_okay=False), default=None,
              help="Inventory file (default: $GPUFLEET_INVENTORY, ./fleet.yaml, ~/.config/gpufleet/fleet.yaml).")
@click.option("--forks", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Hosts worked on in parallel.")
@click.version_option(package_name="gpufleet")
@click.pass_context
def cli(ctx: click.Context, inventory_path: Optional[str], forks: int) -> None:
    """Show what holds the GPUs of your hosts, and free them safely."""
    ctx.obj = AppContext(inventory_path=inventory_path, forks=forks)


def _register() -> None:
    from gpufleet.cli import hosts_cmd, status_cmd  # noqa: F401  (importing registers the commands)
    del hosts_cmd, status_cmd

    for optional in ("clean_cmd", "export_cmd", "fit_cmd", "health_cmd", "run_cmd", "slurm_cmd", "top",
                     "trust_cmd"):
        try:
            __import__(f"{__name__}.{optional}")
        except ImportError as exc:
            if exc.name != f"{__name__}.{optional}":
                raise


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point: every GpufleetError is one line on stderr and its exit code, never a traceback."""
    _register()
    try:
        rc = cli.main(args=list(argv) if argv is not None else None, prog_name="gpufleet", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("gpufleet: aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code)
    except GpufleetError as exc:
        for line in error_lines(exc):
            click.echo(line, err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("gpufleet: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        sys.exit(1)
    if rc == EXIT_INTERRUPTED or argv is None:
        _exit_now(rc or 0)
    sys.exit(rc or 0)


def _exit_now(code: int) -> None:
    """End the process once its output is flushed, without the interpreter's teardown.

    After Ctrl-C: the operator stopped waiting for hosts still connecting (a blackholed
    connect can take its whole timeout); their worker threads must not hold the exit. After
    a command run as the program (``gpufleet``, ``python -m gpufleet``: ``argv`` None): every
    session is closed and every file written by then, and tearing down the ~400 modules
    loaded costs 25-60 ms on a busy 2-core machine (bench/clean_tail.py), time a clean's
    caller would wait after the GPU's memory is back. ``main(argv)`` called in-process
    raises SystemExit as before. Output that could not be written (a full disk, a closed
    pipe) makes a successful exit 1, as the interpreter's own final flush would (120)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            code = code or 1
    os._exit(code)


__all__ = ["cli", "main", "selection_options", "terminal_safe", "AppContext", "UsageError"]
