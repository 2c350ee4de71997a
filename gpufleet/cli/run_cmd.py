"""`gpufleet run RUNBOOK`: YAML runbooks (model swaps, pre-training cleans, preflights)."""
from __future__ import annotations

import sys
from typing import Optional

import click

from gpufleet.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from gpufleet.cli import AppContext, cli, selection_options
from gpufleet.render.common import terminal_safe, to_json


@cli.command("run")
@click.argument("runbook_path", metavar="RUNBOOK", type=click.Path(dir_okay=False))
@selection_options
@click.option("-e", "--extra-var", "extra_vars", multiple=True, metavar="KEY=VALUE",
              help="Set a runbook variable (repeatable; wins over the runbook's vars:).")
@click.option("--dry-run", is_flag=True, help="Print every step per host with what it would do; connect to nothing.")
@click.option("--yes", "-y", is_flag=True, help="Run steps that change hosts without asking.")
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON document.")
@click.option("--audit-log", default=None, metavar="PATH",
              help="Audit log of clean steps (default ~/.local/state/gpufleet/audit.jsonl).")
@click.pass_obj
def run(app: AppContext, runbook_path: str, hosts, groups, tags, all_, extra_vars, dry_run: bool,
        yes: bool, as_json: bool, audit_log: Optional[str]) -> int:
    """Run a runbook's steps on the selected hosts (hosts in parallel, steps in order).

    RUNBOOK is a file, or the name of a shipped one: model-swap, pre-train, wsl2-preflight.

    Steps that change hosts (stop_units, clean, clear_shm, start_unit, shell) need --yes;
    without it the plan is printed and, on a terminal, confirmed. The shipped runbooks (the
    package's gpufleet/playbooks/) are examples of every common step; docs/runbooks.md in the
    source has the format.
    Exit 0 every step ok; 1 a step failed or a host was unreachable; 2 runbook/usage error or
    no --yes in a non-interactive run (nothing done).
    """
    from gpufleet.ops import audit
    from gpufleet.runbook.load import find_runbook, load_runbook
    from gpufleet.runbook.template import parse_extra_vars
    from gpufleet.runbook.run import FAILED, document, plan_host, run_runbook, table

    # Everything is validated before anything is contacted.
    runbook = load_runbook(find_runbook(runbook_path), parse_extra_vars(extra_vars))
    selected = app.select(hosts, groups, tags, all_)

    if dry_run or (runbook.mutating and not yes):
        plans = [plan_host(runbook, h) for h in selected]
        if as_json:
            click.echo(to_json(document(runbook, plans, dry_run=True)))
        else:
            click.echo(f"runbook {runbook.name} ({runbook.source}) on {len(selected)} host(s):")
            click.echo(terminal_safe(table(plans)))
        if dry_run:
            return EXIT_OK
        changing = ", ".join(sorted({s.kind for s in runbook.steps if s.mutating}))
        if as_json or not sys.stdin.isatty():
            raise UsageError(f"this runbook changes hosts ({changing}); not a terminal and no "
                             "--yes: plan shown, nothing done")
        if not click.confirm(f"Run these steps ({changing}) on {len(selected)} host(s)?", default=False):
            click.echo("nothing done")
            return EXIT_USAGE

    from gpufleet.cli.progress import HostProgress, echo_err

    with HostProgress(selected, f"run {runbook.name}") as line:  # stderr, on a terminal only
        say = echo_err(line)

        def progress(host: str, step, result) -> None:
            say(terminal_safe(
                f"{host}: step {step.index} {step.name!r} {result.outcome} "
                f"({result.seconds:.1f}s){': ' + result.detail if result.outcome == FAILED else ''}"))

        runs = run_runbook(runbook, selected, forks=app.forks, operator=audit.operator_name(),
                           audit_log=audit_log, on_step=progress, **line.callbacks())
    if as_json:
        click.echo(to_json(document(runbook, runs, dry_run=False)))
    else:
        click.echo(terminal_safe(table(runs)))
    from gpufleet.cli.output import warn

    warn(line for r in runs for line in getattr(r, "warnings", ()))  # stderr, as every command's
    return EXIT_OK if all(r.ok for r in runs) else EXIT_FAILED
