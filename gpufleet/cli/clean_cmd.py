"""`gpufleet clean`: free GPUs by GPU evidence, signal by identity, verify the memory is back."""
from __future__ import annotations

import sys
from typing import Optional

import click

from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError
from gpufleet.render.status import to_json
from gpufleet.render.clean import clean_document, outcome_table, plan_text
from gpufleet.cli import AppContext, cli, selection_options, terminal_safe


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
@click.option("--protect", multiple=True, metavar="GLOB", help="Command lines never to signal (repeatable).")
@click.option("--include-spanning", is_flag=True, help="Also signal processes that use GPUs outside the scope.")
@click.option("--stop-units", is_flag=True, help="Stop the systemd units that own targets first.")
@click.option("--disable-units", is_flag=True, help="With --stop-units: also disable them.")
@click.option("--shm", is_flag=True, help="Remove known leftover /dev/shm files that no process has open.")
@click.option("--reset", is_flag=True, help="nvidia-smi --gpu-reset GPUs left with unattributed memory, when safe.")
@click.option("--audit-log", default=None, metavar="PATH",
              help="Audit log (default ~/.local/state/gpufleet/audit.jsonl).")
@click.pass_obj
def clean(app: AppContext, hosts, groups, tags, all_, gpus: str, dry_run: bool, yes: bool, as_json: bool,
          grace_s: float, timeout_s: float, tolerance_mib: int, protect, include_spanning: bool,
          stop_units: bool, disable_units: bool, shm: bool, reset: bool, audit_log: Optional[str]) -> int:
    """Free the GPUs in scope: TERM, grace, KILL; then wait until the memory is really back.

    Exit 0 all clean (or the plan, with --dry-run); 1 any host dirty, unreachable or failed;
    2 usage/inventory error or no --yes in a non-interactive run (nothing signalled).
    """
    from gpufleet.ops.clean import CleanOptions, clean_host, execute_plan, plan_host
    from gpufleet.ops.fanout import run_hosts
    from gpufleet.cli.progress import HostProgress
    from gpufleet.config.selection import parse_gpu_list
    from gpufleet.transport import open_session, predial

    if disable_units and not stop_units:
        raise UsageError("--disable-units needs --stop-units")
    if grace_s > timeout_s:
        raise UsageError(f"--grace ({grace_s:g}s) is longer than --timeout ({timeout_s:g}s)")
    parse_gpu_list(gpus)  # syntax errors before any connection
    selected = app.select(hosts, groups, tags, all_)
    opts = CleanOptions(gpus=gpus, grace_s=grace_s, timeout_s=timeout_s, tolerance_mib=tolerance_mib,
                        protect=tuple(protect), include_spanning=include_spanning, stop_units=stop_units,
                        disable_units=disable_units, shm=shm, reset=reset, audit_log=audit_log)
    interactive = sys.stdin.isatty() and not as_json
    interrupted: list = []
    phase: list = []  # the progress line (stderr, terminal only) of the fan-out running now
    fan = dict(forks=app.forks, on_interrupt=_on_interrupt(interrupted, phase), make_error=_not_run)

    def progress(items, label: str) -> HostProgress:
        phase[:] = [HostProgress(items, label)]
        return phase[0]

    if dry_run:
        # every TCP connect starts now, outside the forks bound, as for a real clean
        with predial(selected, app.forks) as dials, progress(selected, "clean: planning") as p:
            results = run_hosts(selected, lambda h: clean_host(h, opts, dry_run=True, dial=dials.take(h)),
                                **fan, **p.callbacks())
    else:
        # Plan everywhere first, holding each connection; act only when every host's plan is
        # valid (nothing is signalled on the strength of input that failed validation, e.g.
        # --gpus 9 on an 8-GPU host), after asking when there is no --yes; then act on the
        # same connections.
        sessions: dict[str, object] = {}

        def plan_only(h, dials):
            session = open_session(h, dials.take(h))
            sessions[h.name] = session.__enter__()
            return plan_host(h, sessions[h.name], opts)

        try:
            # every TCP connect starts now, outside the forks bound (unreachable hosts cost
            # one connect_timeout in all); handshakes and plans stay inside it
            with predial(selected, app.forks) as dials, progress(selected, "clean: planning") as p:
                results = run_hosts(selected, _as_value(lambda h: plan_only(h, dials)), **fan,
                                    **p.callbacks())
            if interrupted:  # Ctrl-C while planning: nothing is signalled anywhere
                results = [_value(h, r) for h, r in zip(selected, results)]
                click.echo(terminal_safe(outcome_table(results)))
                click.echo("gpufleet: interrupted while planning: nothing signalled on any host",
                           err=True)
                return EXIT_INTERRUPTED
            if not yes:
                _show_plans(results, as_json)
            bad_input = [r for r in results if r.usage_error]
            if bad_input:
                for r in bad_input:
                    click.echo(f"gpufleet: error: {r.error}", err=True)
                click.echo("gpufleet: nothing signalled on any host", err=True)
                return EXIT_USAGE
            if not yes:
                if not interactive:
                    click.echo("gpufleet: error: not a terminal and no --yes: plan shown, nothing signalled",
                               err=True)
                    return EXIT_USAGE
                if not any(r.plan and r.plan.targets for r in results):
                    click.echo("nothing to signal")
                elif not click.confirm("Signal the processes above?", default=False):
                    click.echo("nothing signalled")
                    return EXIT_USAGE
            by_host = {h.name: h for h in selected}
            with progress(selected, "clean") as p:
                results = run_hosts(
                    [_value(h, r) for h, r in zip(selected, results)],
                    lambda r: execute_plan(by_host[r.host], sessions[r.host], r, opts) if r.host in sessions else r,
                    **fan, **p.callbacks())
        finally:
            for session in sessions.values():
                try:
                    session.__exit__(None, None, None)
                except Exception:
                    pass

    results = [_value(h, r) for h, r in zip(selected, results)]
    if dry_run and not as_json:
        _show_plans(results, False)
    if as_json:
        click.echo(to_json(clean_document(results, dry_run)))
    else:
        click.echo(terminal_safe(outcome_table(results)))
    if interrupted:
        click.echo("gpufleet: interrupted: hosts already running finished their sequence (above); "
                   "no other host was started", err=True)
        return EXIT_INTERRUPTED
    if any(r.usage_error for r in results):
        return EXIT_USAGE
    if dry_run:
        return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED
    return EXIT_OK if all(r.verdict == "clean" for r in results) else EXIT_FAILED


def _show_plans(results, as_json: bool) -> None:
    if as_json:
        return
    for r in results:
        if r.plan is not None:
            click.echo(terminal_safe(plan_text(r.plan)))
            click.echo("")


def _on_interrupt(flag: list, phase: list):
    """Ctrl-C: say what is still being waited for (a clean in flight must report what it
    signalled); fanout starts no new host. ``phase``: the progress line to keep clear of."""
    from gpufleet.cli.progress import echo_err

    def say(in_flight) -> None:
        flag.append(True)
        names = ", ".join(getattr(h, "host", None) or getattr(h, "name", "?") for h in in_flight)
        echo_err(phase[0] if phase else None)(
            f"gpufleet: interrupted: waiting for {len(in_flight)} host(s) already running"
            f"{' (' + names + ')' if names else ''} to finish; no new host is started "
            "(Ctrl-C again to stop waiting)")

    return say


def _not_run(item, message: str):
    """fanout's value for a host it did not start, or stopped waiting for: a HostClean row
    (the work items are Hosts while planning, HostCleans while acting)."""
    from gpufleet.ops.clean import HostClean

    name = getattr(item, "host", None) if isinstance(item, HostClean) else getattr(item, "name", None)
    out = HostClean(host=str(name or item), ok=False, verdict="interrupted")
    if isinstance(item, HostClean):
        out.before, out.plan = item.before, item.plan
    out.error = message + ("; nothing signalled" if message.startswith("not started") else
                           f"; run `gpufleet status --host {out.host}`")
    return out


def _as_value(func):
    """Wrap a per-host function so any exception becomes that host's error row."""
    from gpufleet.ops.clean import HostClean

    def run(h):
        try:
            return func(h)
        except Exception as exc:
            return HostClean(host=h.name, ok=False, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)

    return run


def _value(host, result):
    from gpufleet.ops.clean import HostClean

    if isinstance(result, HostClean):
        return result
    return HostClean(host=host.name, ok=False, error=str(result) or "failed")
