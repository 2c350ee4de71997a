"""`gpufleet run RUNBOOK`: YAML runbooks (model swaps, pre-training cleans, preflights), run on
every selected host at once, or rolled in batches (`serial`, `max_fail_percentage`)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import click

from gpufleet.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
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
@click.option("--serial", default=None, metavar="N|N%|LIST",
              help="Roll in batches of N hosts, N% of them, or a ramp like 1,2,25% (the last repeats); "
                   "overrides the runbook's serial.")
@click.option("--max-fail-percentage", "max_fail", default=None, metavar="PCT",
              help="Stop every later batch once more than PCT% of a batch failed (0: any failure); "
                   "overrides the runbook's max_fail_percentage.")
@click.option("--retry", is_flag=True,
              help="Only the hosts the last run of this runbook failed or did not run (its retry file, "
                   "~/.local/state/gpufleet/retry/RUNBOOK.hosts).")
@click.pass_obj
def run(app: AppContext, runbook_path: str, hosts, groups, tags, all_, extra_vars, dry_run: bool,
        yes: bool, as_json: bool, audit_log: Optional[str], serial: Optional[str],
        max_fail: Optional[str], retry: bool) -> int:
    """Run a runbook's steps on the selected hosts (hosts in parallel, steps in order).

    RUNBOOK is a file, or the name of a shipped one: model-swap, model-swap-rolling, pre-train,
    wsl2-preflight (the package's gpufleet/playbooks/; docs/runbooks.md in the source has the
    format).

    With serial (runbook key or --serial) the hosts go in batches, one finished before the next
    starts; more than max_fail_percentage of a batch failing stops every later batch.
    Steps that change hosts (stop_units, clean, clear_shm, start_unit, shell, local_command,
    local_http but GET) need the hosts named (--host, -g, --tag, --all or --retry; also for
    --dry-run) and --yes; without --yes the plan is printed and, on a terminal, confirmed. A
    read-only runbook runs on every host by default.

    Exit 0 every step ok; 1 a step failed, a host was unreachable or the roll stopped; 2
    runbook/usage error, no hosts named, or no --yes in a non-interactive run (nothing done);
    130 interrupted.
    """
    from gpufleet.runbook.load import find_runbook, load_runbook
    from gpufleet.runbook.retry import read_retry, retry_path
    from gpufleet.runbook.template import parse_extra_vars

    # Everything is validated before anything is contacted.
    found = find_runbook(runbook_path)
    runbook = _with_overrides(load_runbook(found, parse_extra_vars(extra_vars)), serial, max_fail)
    carried: list[str] = []  # hosts of the retry file this run leaves out (--retry narrowed)
    if retry:
        names = read_retry(retry_path(str(found)))
        selected = _retry_selection(app, names, hosts, groups, tags, all_)
        carried = [n for n in names if n not in {h.name for h in selected}]
    else:
        changing = ", ".join(sorted({s.kind for s in runbook.steps if s.mutating}))
        changes = f"runbook {runbook.name} changes hosts ({changing})" if runbook.mutating else ""
        selected = app.select(hosts, groups, tags, all_,
                              changes=terminal_safe(changes, one_line=True))

    if dry_run or (runbook.mutating and not yes):
        _print_plan(runbook, selected, as_json)
        if dry_run:
            return EXIT_OK
        if not _confirmed(runbook, selected, as_json):
            click.echo("nothing done")
            return EXIT_USAGE

    result = _execute(app, runbook, selected, audit_log, as_json)
    retry_file = _save_retry(runbook_path, runbook.source, result.retry_hosts + carried)
    _print_result(runbook, result, as_json, retry_file)
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if result.ok else EXIT_FAILED


def _confirmed(runbook: Any, selected: Sequence[Any], as_json: bool) -> bool:
    """Mutating steps without --yes: asked on a terminal, refused (exit 2) otherwise."""
    changing = ", ".join(sorted({s.kind for s in runbook.steps if s.mutating}))
    if as_json or not sys.stdin.isatty():
        raise UsageError(f"this runbook changes hosts ({changing}); not a terminal and no "
                         "--yes: plan shown, nothing done")
    return click.confirm(f"Run these steps ({changing}) on {len(selected)} host(s)?", default=False)


def _with_overrides(runbook: Any, serial: Optional[str], max_fail: Optional[str]) -> Any:
    """--serial and --max-fail-percentage win over the runbook's keys (checked the same way)."""
    from dataclasses import replace

    from gpufleet.runbook.values import v_percentage, v_serial

    def failer(flag: str) -> Any:
        def fail(message: str) -> Any:
            raise UsageError(f"{flag}: {message}")
        return fail

    rolling = runbook.rolling
    if serial is not None:
        rolling = replace(rolling, serial=v_serial(serial, failer("--serial")))
    if max_fail is not None:
        rolling = replace(rolling, max_fail_percentage=v_percentage(max_fail, failer("--max-fail-percentage")))
    return replace(runbook, rolling=rolling)


def _retry_selection(app: AppContext, names: Sequence[str], hosts, groups, tags, all_) -> list:
    """The retry file's hosts, in inventory order, narrowed by --host/-g/--tag/--all if given."""
    inventory_hosts = list(app.inventory().hosts)
    known = {h.name for h in inventory_hosts}
    missing = [n for n in names if n not in known]
    if missing:
        raise UsageError(f"--retry: the retry file names host(s) not in the inventory: {', '.join(missing)}")
    chosen = [h for h in inventory_hosts if h.name in set(names)]
    if hosts or groups or tags or all_:
        narrowed = {h.name for h in app.select(hosts, groups, tags, all_)}
        chosen = [h for h in chosen if h.name in narrowed]
        if not chosen:
            raise UsageError(f"--retry: none of the hosts to retry ({', '.join(names)}) is selected")
    return chosen


def _print_plan(runbook: Any, selected: Sequence[Any], as_json: bool) -> None:
    from gpufleet.render.runbook import plan_report, settings_text
    from gpufleet.runbook.roll import plan_batches
    from gpufleet.runbook.run import document, plan_host, table

    plans = [plan_host(runbook, h) for h in selected]
    rolling = runbook.rolling
    batches = plan_batches(selected, rolling)
    if as_json:
        doc = document(runbook, plans, dry_run=True)
        doc["batches"] = [{"batch": i, "hosts": [h.name for h in b]} for i, b in enumerate(batches, 1)]
        click.echo(to_json(doc))
        return
    head = f"runbook {runbook.name} ({runbook.source}) on {len(selected)} host(s)"
    if rolling.given:
        click.echo(terminal_safe(f"{head} in {len(batches)} batch(es) ({settings_text(rolling)}):"))
        click.echo(terminal_safe(plan_report(batches, plans)))
    else:
        click.echo(terminal_safe(f"{head}:"))
        click.echo(terminal_safe(table(plans)))


def _execute(app: AppContext, runbook: Any, selected: Sequence[Any], audit_log: Optional[str],
             as_json: bool) -> Any:
    """The run, batch by batch (one batch when the runbook does not roll); each finished
    batch's table is printed at once (not with --json)."""
    from gpufleet.cli.progress import HostProgress, echo_err
    from gpufleet.ops import audit
    from gpufleet.render.runbook import batch_report
    from gpufleet.runbook.roll import roll
    from gpufleet.runbook.run import FAILED, run_runbook

    operator = audit.operator_name()
    rolling = runbook.rolling.given
    ctrl_c: list[bool] = []  # the fan-out's first Ctrl-C: the running hosts finish, nothing more starts

    def run_hosts(book: Any, hosts: Sequence[Any], label: str) -> list:
        gate = "gate " if label.endswith("gate") else ""
        title = f"run {runbook.name}" + (f" {label}" if rolling else "")
        with HostProgress(hosts, title) as line:  # stderr, on a terminal only
            say = echo_err(line)

            def progress(host: str, step: Any, result: Any) -> None:
                say(terminal_safe(
                    f"{host}: {gate}step {step.index} {step.name!r} {result.outcome} "
                    f"({result.seconds:.1f}s){': ' + result.detail if result.outcome == FAILED else ''}"))

            return run_runbook(book, hosts, forks=app.forks, operator=operator, audit_log=audit_log,
                               on_step=progress, on_interrupt=lambda _waiting: ctrl_c.append(True),
                               **line.callbacks())

    def on_batch(batch: Any) -> None:
        if rolling and not as_json:
            click.echo(terminal_safe(batch_report(batch)) + "\n")
            sys.stdout.flush()

    def on_pause(seconds: float, next_index: int) -> None:
        echo_err(None)(f"pausing {seconds:g}s before batch {next_index}")

    return roll(runbook, selected, run_hosts, on_batch=on_batch, on_pause=on_pause,
                interrupted=lambda: bool(ctrl_c))


def _save_retry(runbook_path: str, source: str, names: Sequence[str]) -> Optional[str]:
    """Write (or remove) the retry file; a failure to write is one warning line."""
    from gpufleet.runbook.retry import retry_path, write_retry

    path = retry_path(runbook_path)
    warning = write_retry(path, names, str(Path(runbook_path).resolve()))
    if warning:
        click.echo(terminal_safe(f"gpufleet: warning: {warning}"), err=True)
        return None
    if names:
        click.echo(terminal_safe(f"to retry the {len(names)} host(s) failed or not run: gpufleet run "
                                 f"{source} --retry (hosts in {path})"), err=True)
        return str(path)
    return None


def _print_result(runbook: Any, result: Any, as_json: bool, retry_file: Optional[str]) -> None:
    from gpufleet.render.runbook import roll_summary
    from gpufleet.runbook.roll import roll_document
    from gpufleet.runbook.run import table

    if as_json:
        click.echo(to_json(roll_document(runbook, result, retry_file)))
    elif runbook.rolling.given:
        planned = result.batches[0].total if result.batches else 0
        click.echo(terminal_safe(roll_summary(result, runbook.rolling, planned)))
    else:
        click.echo(terminal_safe(table(result.runs)))
    from gpufleet.cli.output import warn

    # the hosts' warnings on stderr, as every command's: the rows above stay the rows
    warn(line for r in result.runs for line in getattr(r, "warnings", ()))
