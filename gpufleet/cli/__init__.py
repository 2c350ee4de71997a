"""The thin click CLI. Errors become one line and an exit code here, and only here.

Exit codes: 0 ok; 1 some host failed / dirty / does not fit; 2 usage, inventory or runbook
error (nothing was done); 130 interrupted.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import click

from gpufleet.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, GpufleetError, UsageError
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

    def select(self, hosts: Sequence[str], groups: Sequence[str], tags: Sequence[str], all_: bool,
               changes: str = ""):
        """The selected hosts. ``changes`` (e.g. "clean changes hosts"): the command signals or
        changes hosts, so they must be named; checked before the inventory is read, so the
        refusal is the only line on stderr and nothing is contacted."""
        from gpufleet.config.selection import named, require_selection, select

        if changes and not named(hosts, groups, tags, all_):
            require_selection(changes, implicit=self.implicit_inventory())
        return select(self.inventory(), hosts=list(hosts), groups=list(groups), tags=list(tags), all_=all_)

    def implicit_inventory(self) -> bool:
        """No inventory file: gpufleet acts on this machine alone (nothing is read here)."""
        if self._inventory is not None:
            return bool(getattr(self._inventory, "implicit", False))
        from gpufleet.config.inventory import find_inventory

        return find_inventory(self.inventory_path) is None


def selection_options(func: Callable) -> Callable:
    """--host/-g/--tag/--all, shared by every command that acts on hosts; hosts named as
    arguments (`gpufleet status train-node`) are --host values, merged before the command
    runs, so they count wherever --host does."""

    command = func

    @functools.wraps(command)
    def merged(*args: Any, **kwargs: Any) -> Any:
        named: tuple[str, ...] = tuple(kwargs.pop("host_args", None) or ())
        if named:
            kwargs["hosts"] = tuple(kwargs.get("hosts") or ()) + named
        return command(*args, **kwargs)

    func = click.argument("host_args", nargs=-1, metavar="[HOST]...")(merged)
    func = click.option("--all", "all_", is_flag=True, help="Every host in the inventory.")(func)
    func = click.option("--tag", "tags", multiple=True, metavar="TAG", help="Hosts with this tag (repeatable).")(func)
    func = click.option("-g", "--group", "groups", multiple=True, metavar="GROUP", help="Hosts of this group (repeatable).")(func)
    func = click.option("--host", "hosts", multiple=True, metavar="NAME", help="Host name or glob (repeatable).")(func)
    return func


# Each command's module, imported only when that command runs or shows its own --help, and the
# first sentence of its help: what `gpufleet --help` lists without importing anything
# (tests/unit/test_cli_lazy.py holds the two to the modules' real help).
COMMANDS: dict[str, tuple[str, str]] = {
    "clean": ("clean_cmd", "Free the GPUs in scope: TERM, grace, KILL; then wait until the memory is "
                           "really back."),
    "disconnect": ("disconnect_cmd", "Close the SSH connections kept for the next command "
                                     "(60 s by default; the inventory's `ssh_persist`)."),
    "export": ("export_cmd", "Print the fleet's metrics in Prometheus's text format, or write them for "
                             "node_exporter."),
    "fit": ("fit_cmd", "Will this model fit on the selected GPUs? Exit 0 fits everywhere, 1 not "
                       "somewhere, 2 usage."),
    "health": ("health_cmd", "Is every selected GPU sound? ECC, remapped rows, Xid events, lost GPUs, "
                             "the GPU count against the inventory's `gpus:`, throttling, PCIe link, "
                             "persistence (one SSH exec per host)."),
    "hosts": ("hosts_cmd", "List inventory hosts: name, address, port, user, tags, groups."),
    "init": ("init_cmd", "Write a commented fleet.yaml (PATH, else -i, else ./fleet.yaml); never "
                         "overwrites."),
    "run": ("run_cmd", "Run a runbook's steps on the selected hosts (hosts in parallel, steps in order)."),
    "serve": ("export_cmd", "Serve /metrics and /healthz for Prometheus; refreshed in the background "
                            "over one persistent SSH session per host, so a scrape never waits for a host."),
    "slurm": ("slurm_cmd", "Slurm: Prolog/Epilog that free and check a job's GPUs; undrain clean nodes."),
    "status": ("status_cmd", "GPUs, memory and holders of the selected hosts (one SSH exec per host)."),
    "top": ("top", "Live screen of the selected hosts: GPUs, memory, holders; mark GPUs and clean them."),
    "trust": ("trust_cmd", "Fetch the key HOST presents, show its SHA256 fingerprint and record it."),
}


def _inventory_after_command(ctx: click.Context, _param: click.Parameter,
                             value: Optional[str]) -> Optional[str]:
    """`gpufleet status -i fleet.yaml`: the inventory named after the command counts as
    before it; two different ones are refused (acting on the wrong fleet is worse than
    asking)."""
    app = ctx.find_object(AppContext)
    if value is not None and app is not None:
        if app.inventory_path is not None and app.inventory_path != value:
            raise click.UsageError(f"two inventories: -i {app.inventory_path} before the command "
                                   f"and -i {value} after it")
        app.inventory_path = value
    return value


def _verbose(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        enable_verbose()
    return value


def enable_verbose() -> None:
    """-v: the transport's log (each host's ssh argv, what `ssh -G` answered, the timings) on
    stderr, one terminal-safe line each; the progress line stays off, these lines are it."""
    import logging

    from gpufleet.cli import progress

    progress.VERBOSE = True
    log = logging.getLogger("gpufleet")
    if any(getattr(h, "gpufleet_verbose", False) for h in log.handlers):
        return

    class SafeFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return terminal_safe(super().format(record))  # a host name is anyone's text

    handler = logging.StreamHandler(sys.stderr)
    handler.gpufleet_verbose = True  # type: ignore[attr-defined]
    handler.setFormatter(SafeFormatter("gpufleet: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


def _inventory_option() -> click.Option:
    return click.Option(["-i", "--inventory", "sub_inventory"], type=click.Path(dir_okay=False),
                        default=None, expose_value=False, callback=_inventory_after_command,
                        help="Inventory file (as before the command).")


def _verbose_option() -> click.Option:
    return click.Option(["-v", "--verbose"], is_flag=True, expose_value=False, callback=_verbose,
                        help="On stderr: each host's connection (ssh argv, what `ssh -G` "
                             "answered, timings).")


def with_common_options(command: Optional[click.Command]) -> Optional[click.Command]:
    """-i and -v after any command too (`gpufleet status -i fleet.yaml -v`): operators type
    them there; added once to every command, a group's subcommands included."""
    if command is None or getattr(command, "_gpufleet_common", False):
        return command
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_common_options(sub)
    else:
        command.params += [_inventory_option(), _verbose_option()]
    command._gpufleet_common = True  # type: ignore[attr-defined]
    return command


class LazyGroup(click.Group):
    """A group whose commands live in modules imported on first use: `gpufleet status` imports
    status_cmd, not clean_cmd, fit_cmd, slurm_cmd... (each costs milliseconds at every start).
    A module registers its commands on import (``@cli.command()``), as before."""

    listing = False  # True while --help lists the commands: stand-ins, nothing imported

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        if cmd_name in self.commands or cmd_name not in COMMANDS:
            return with_common_options(self.commands.get(cmd_name))
        module, short_help = COMMANDS[cmd_name]
        if self.listing:
            return click.Command(cmd_name, help=short_help)
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ImportError as exc:
            if exc.name != f"{__name__}.{module}":
                raise
        return with_common_options(self.commands.get(cmd_name))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self.listing = False

    def resolve_command(self, ctx: click.Context, args: list[str]):
        if args and args[0] not in self.commands and args[0] not in COMMANDS:
            _load_all()  # click's "No such command" (and "Did you mean") reads self.commands
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-i", "--inventory", "inventory_path", type=click.Path(dir_okay=False), default=None,
              help="Inventory file (default: $GPUFLEET_INVENTORY, ./fleet.yaml, ~/.config/gpufleet/fleet.yaml).")
@click.option("--forks", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Hosts worked on in parallel.")
@click.option("-v", "--verbose", is_flag=True, expose_value=False, callback=_verbose,
              help="On stderr: each host's connection (ssh argv, what `ssh -G` answered, timings).")
@click.version_option(package_name="gpufleet")
@click.pass_context
def cli(ctx: click.Context, inventory_path: Optional[str], forks: int) -> None:
    """Show what holds the GPUs of your hosts, and free them safely."""
    ctx.obj = AppContext(inventory_path=inventory_path, forks=forks)


def _load_all() -> None:
    """Import every command module (an unknown command's error lists them all, as before)."""
    for name in COMMANDS:
        cli.get_command(click.Context(cli), name)


# The agent payload every run sends (computed once per process, gpufleet.remote.once).
AGENT_PAYLOAD = "gpufleet.remote:compressed_agent"


#: How long a prefetch made to wait for the first command process waits at most (a run whose
#: hosts all fail before one starts still gets its modules).
PREFETCH_WAIT_S = 1.0


def prefetch(*targets: str, after_first_start: bool = False) -> threading.Thread:
    """Import modules (``"pkg.mod"``) or call a module's function (``"pkg.mod:fn"``) on a
    background thread, in order, for a command about to wait: what it needs only once the
    agents answer (the snapshot model, the renderers: ~25 ms of imports) loads while they run
    instead of after, and the agent's payload is compressed (zlib releases the GIL) while the
    inventory loads. ``after_first_start``: begin once the first ``ssh`` (or local agent) has
    started (transport.FIRST_START, at most PREFETCH_WAIT_S): imports hold the GIL, and before
    that they delayed the first session by about their own length. Import locks keep it safe:
    whoever needs a module first waits for it. The first failure ends the thread quietly: the
    real import or call raises it where it counts."""
    def load() -> None:
        if after_first_start:
            from gpufleet.transport import FIRST_START

            FIRST_START.wait(PREFETCH_WAIT_S)
        for target in targets:
            module, _, function = target.partition(":")
            try:
                loaded = importlib.import_module(module)
                if function:
                    getattr(loaded, function)()
            except BaseException:
                return

    thread = threading.Thread(target=load, name="gpufleet-prefetch", daemon=True)
    thread.start()
    return thread


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point: every GpufleetError is one line on stderr and its exit code, never a traceback."""
    try:
        rc = cli.main(args=list(argv) if argv is not None else None, prog_name="gpufleet", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("gpufleet: aborted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.exceptions.NoArgsIsHelpError as exc:  # `gpufleet` alone: the help, as before
        exc.show()
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        click.echo(usage_line(exc), err=True)
        sys.exit(EXIT_USAGE if isinstance(exc, click.UsageError) else exc.exit_code)
    except GpufleetError as exc:
        for line in error_lines(exc):
            click.echo(line, err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("gpufleet: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        _exit_unwritten(1, argv)
    except OSError as exc:  # the output could not be written (a full disk, a dead terminal)
        _say_output_failed(exc)
        _exit_unwritten(EXIT_FAILED, argv)
    if rc == EXIT_INTERRUPTED or argv is None:
        _exit_now(rc or 0)
    sys.exit(rc or 0)


def _exit_unwritten(code: int, argv: Optional[Sequence[str]]) -> None:
    """Exit after output that could not be written. Run as the program, never through the
    interpreter's teardown: stdout (block-buffered without PYTHONUNBUFFERED) still holds the
    text, its final flush fails again and Python turns the exit into 120 with a second message."""
    if argv is None:
        _exit_now(code)
    sys.exit(code)


def usage_line(exc: click.ClickException) -> str:
    """click's error as gpufleet's one line (click prints three: Usage, Try, Error), with
    where the command's help is."""
    from gpufleet.errors import one_line

    text = one_line(exc.format_message())
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        text += f" (see {ctx.command_path} --help)"
    return terminal_safe(f"gpufleet: error: {text}")


def _say_output_failed(exc: OSError) -> None:
    """One line on stderr, if stderr can still take it (it may be the same full disk)."""
    try:
        click.echo(f"gpufleet: error: output not written: {exc.strerror or exc}", err=True)
    except Exception:
        pass


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


__all__ = ["AGENT_PAYLOAD", "cli", "main", "prefetch", "selection_options", "terminal_safe", "AppContext", "UsageError"]
