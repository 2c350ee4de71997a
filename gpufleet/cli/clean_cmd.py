"""`gpufleet clean`: free GPUs by GPU evidence, signal by identity, verify the memory is back."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

import click

from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.cli import AppContext, cli, selection_options, terminal_safe
from gpufleet.cli.output import snapshot_warnings, warn
from gpufleet.cli.tty import styled
from gpufleet.errors import UsageError
from gpufleet.render.clean import clean_document, outcome_table, plan_text
from gpufleet.render.common import to_json


@cli.command()
@selection_options
@click.option("--gpus", default="all", show_default=True, help="GPUs in scope: 0-3, 0,2,5 or all.")
@click.option("--dry-run", is_flag=True, help="Show the plan (what would be signalled, what is refused, why).")
@click.option("--yes", "-y", is_flag=True, help="Act without asking.")
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON document.")
@click.option("--grace", "grace_s", type=click.FloatRange(0, 3600), default=10.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.5, 86400), default=60.0, show_default=True,
              help="Seconds the host may take until the memory is back.")
@click.option("--tolerance-mib", type=click.IntRange(0, 1 << 20), default=DEFAULT_TOLERANCE_MIB, show_default=True,
              help="MiB above the expected unattributed memory still counted as clean.")
@click.option("--protect", multiple=True, metavar="PATTERN",
              help="Never signal a process whose command line or name contains PATTERN (as pgrep "
                   "matches); with * ? [ it is a glob over the whole command line or name. "
                   "Repeatable; one that matches no process is a note in the plan.")
@click.option("--include-spanning", is_flag=True, help="Also signal processes that use GPUs outside the scope.")
@click.option("--stop-units", is_flag=True, help="Stop the systemd units that own targets first.")
@click.option("--disable-units", is_flag=True, help="With --stop-units: also disable them.")
@click.option("--shm", is_flag=True, help="Remove known leftover /dev/shm files that no process has open.")
@click.option("--reset", is_flag=True, help="nvidia-smi --gpu-reset GPUs left with unattributed memory, when safe.")
@click.option("--owner", "owners", multiple=True, metavar="PID|UNIT",
              help="Also stop this owner of a target (a supervisor's PID, first; or its unit), "
                   "as the plan names it (repeatable). Owners are never signalled otherwise.")
@click.option("--settle", "settle_s", type=click.FloatRange(0, 600), default=None,
              help="Seconds to watch for the GPU being retaken once the memory is back "
                   "[default: 5 when a target has an owner that may restart it, else 0].")
@click.option("--audit-log", default=None, metavar="PATH",
              help="Audit log (default ~/.local/state/gpufleet/audit.jsonl).")
@click.pass_obj
def clean(app: AppContext, hosts, groups, tags, all_, gpus: str, dry_run: bool, yes: bool, as_json: bool,
          grace_s: float, timeout_s: float, tolerance_mib: int, protect, include_spanning: bool,
          stop_units: bool, disable_units: bool, shm: bool, reset: bool, owners: tuple[str, ...],
          settle_s: Optional[float], audit_log: Optional[str]) -> int:
    """Free the GPUs in scope: TERM, grace, KILL; then wait until the memory is really back.

    The hosts must be named (--host, -g, --tag or --all), also for --dry-run.

    Exit 0 all clean (or the plan, with --dry-run); 1 any host dirty, retaken (a target was
    started again, or a new process took a GPU in scope), unreachable or failed; 2
    usage/inventory error, no hosts named, or no --yes in a non-interactive run (nothing
    signalled).
    """
    from gpufleet.cli.progress import HostProgress
    from gpufleet.config.selection import parse_gpu_list
    from gpufleet.ops.clean import CleanOptions, HostClean, run_clean

    if disable_units and not stop_units:
        raise UsageError("--disable-units needs --stop-units")
    if grace_s > timeout_s:
        raise UsageError(f"--grace ({grace_s:g}s) is longer than --timeout ({timeout_s:g}s)")
    parse_gpu_list(gpus)  # syntax errors before any connection
    check_protect(protect)
    selected = app.select(hosts, groups, tags, all_, changes="clean changes hosts")
    opts = CleanOptions(gpus=gpus, grace_s=grace_s, timeout_s=timeout_s, tolerance_mib=tolerance_mib,
                        protect=tuple(protect), include_spanning=include_spanning, stop_units=stop_units,
                        disable_units=disable_units, shm=shm, reset=reset, audit_log=audit_log,
                        owners=tuple(owners), settle_s=settle_s)
    phase: list[HostProgress] = []  # the progress line (stderr, terminal only) of the fan-out now

    def progress(items: Sequence[Any], label: str) -> HostProgress:
        phase[:] = [HostProgress(items, label)]
        return phase[0]

    warned: list[bool] = []

    def warn_once(results: Sequence[HostClean]) -> None:  # stderr, before any prompt
        if not warned:
            warned.append(True)
            warn(snapshot_warnings([r.before for r in results if r.before is not None], selected))

    def on_planned(results: list[HostClean]) -> None:
        if not yes:
            _show_plans(results, as_json)
            warn_once(results)

    run = run_clean(selected, opts, forks=app.forks, dry_run=dry_run, on_planned=on_planned,
                    confirm=_confirm(yes, interactive=sys.stdin.isatty() and not as_json),
                    progress=progress, on_interrupt=_on_interrupt(phase),
                    on_cancel=_on_cancel(phase))
    if run.interrupted == "planning" and not dry_run:  # nothing is signalled anywhere
        click.echo(styled(outcome_table(run.results), "CLEAN"))
        click.echo("gpufleet: interrupted while planning: nothing signalled on any host", err=True)
        return run.exit_code
    if run.declined:
        click.echo("nothing signalled")
        return run.exit_code
    if dry_run and not as_json:
        _show_plans(run.results, False)
    if as_json:
        click.echo(to_json(clean_document(run.results, dry_run)))
    else:
        click.echo(styled(outcome_table(run.results), "CLEAN"))
    warn_once(run.results)
    if run.interrupted:
        click.echo(_interrupted_line(run.results), err=True)
    return run.exit_code


def _interrupted_line(results: Sequence[Any]) -> str:
    """The last word after Ctrl-C while acting: what became of the hosts that were running."""
    cancelled = [r.host for r in results if r.verdict == "cancelled"]
    unknown = [r.host for r in results if r.verdict == "interrupted" and r.outcome_unknown]
    if not cancelled and not unknown:
        return ("gpufleet: interrupted: hosts already running finished their sequence (above); "
                "no other host was started")
    said = []
    if cancelled:
        said.append(f"pending signals cancelled on {', '.join(cancelled)} (what each had "
                    "sent is above and in the audit log)")
    if unknown:
        said.append(f"stopped waiting for {', '.join(unknown)} (what is known is above)")
    return "gpufleet: interrupted: " + "; ".join(said) + "; no other host was started"


def check_protect(patterns: Sequence[str]) -> None:
    """An empty or control-character --protect is a mistake (an unset shell variable), never
    a pattern: refused before anything is contacted."""
    from gpufleet.config.validators import has_control

    for pattern in patterns:
        if not pattern or has_control(pattern):
            raise UsageError(f"--protect {pattern!r}: expected a word or a glob of the command "
                             "lines never to signal")


def _confirm(yes: bool, interactive: bool) -> Callable[[list[Any]], bool]:
    """ops.clean's confirm step: --yes acts; otherwise ask on a terminal, refuse elsewhere."""

    def confirm(results: list[Any]) -> bool:
        if yes:
            return True
        if not interactive:
            raise UsageError("not a terminal and no --yes: plan shown, nothing signalled")
        if not any(r.plan and r.plan.targets for r in results):
            click.echo("nothing to signal")
            return True
        return click.confirm("Signal the processes above?", default=False)

    return confirm


def _show_plans(results: Sequence[Any], as_json: bool) -> None:
    if as_json:
        return
    for r in results:
        if r.plan is not None:
            click.echo(terminal_safe(plan_text(r.plan)))
            click.echo("")


def _names(hosts: Sequence[Any]) -> str:
    return ", ".join(str(getattr(h, "host", None) or getattr(h, "name", "?")) for h in hosts)


def _on_interrupt(phase: list[Any]) -> Callable[[list[Any], bool], None]:
    """Ctrl-C: say what is still being waited for (a clean in flight must report what it
    signalled) and what a second Ctrl-C does; fanout starts no new host. ``phase``: the
    progress line to keep clear of."""
    from gpufleet.cli.progress import echo_err

    def say(in_flight: list[Any], acting: bool) -> None:
        names = _names(in_flight)
        again = ("Ctrl-C again to cancel their pending signals" if acting and in_flight
                 else "Ctrl-C again to stop waiting")
        echo_err(phase[0] if phase else None)(
            f"gpufleet: interrupted: waiting for {len(in_flight)} host(s) already running"
            f"{' (' + names + ')' if names else ''} to finish; no new host is started "
            f"({again})")

    return say


def _on_cancel(phase: list[Any]) -> Callable[[list[Any], dict[str, Optional[str]]], None]:
    """The second Ctrl-C while acting: which agents were told to send no further signal, and
    which could not be told (they go on: their rows say with what)."""
    from gpufleet.cli.progress import echo_err

    def say(in_flight: list[Any], cancels: dict[str, Optional[str]]) -> None:
        write = echo_err(phase[0] if phase else None)
        told = [h for h in in_flight if cancels.get(h.host) is None]
        if told:
            write(f"gpufleet: cancelling: told {len(told)} host(s) ({_names(told)}) to send no "
                  "further signal; waiting for their report of what they sent "
                  "(Ctrl-C again to stop waiting)")
        for h in in_flight:
            if cancels.get(h.host) is not None:
                write(f"gpufleet: could not cancel on {h.host}: {cancels[h.host]}")

    return say
