"""`gpufleet slurm prolog|epilog|undrain`: Slurm's Prolog/Epilog on every node, and resuming
the nodes they drained once they are clean (docs/slurm.md)."""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import click

from gpufleet.cli import AppContext, cli, selection_options, terminal_safe
from gpufleet.core.policy import DEFAULT_TOLERANCE_MIB
from gpufleet.core.slurm import DEFAULT_BUDGET_S, DEFAULT_GRACE_S


@cli.group()
def slurm() -> None:
    """Slurm: Prolog/Epilog that free and check a job's GPUs; undrain clean nodes."""


def node_options(func: Callable) -> Callable:
    """What the prolog and the epilog share."""
    options = [
        click.option("--budget", "budget_s", type=click.FloatRange(3, 3600), default=DEFAULT_BUDGET_S,
                     show_default=True, help="Seconds the whole run may take (slurmd kills a Prolog/Epilog at PrologEpilogTimeout: keep it below that)."),
        click.option("--tolerance-mib", type=click.IntRange(0, 1 << 20), default=DEFAULT_TOLERANCE_MIB,
                     show_default=True, help="MiB above the expected unattributed memory still free."),
        click.option("--unattributed-mib", type=click.IntRange(0, 1 << 20), default=0, show_default=True,
                     help="MiB this node's GPUs show with nothing running."),
        click.option("--protect", multiple=True, metavar="PATTERN",
                     help="Never signal a command line or name containing PATTERN (with * ? [: "
                          "a glob over the whole)."),
        click.option("--dcgm-job-map", metavar="DIR", default=None,
                     help="dcgm-exporter's --hpc-job-mapping-dir: prolog adds the job id, epilog removes it."),
        click.option("--drain-reason", is_flag=True,
                     help="On failure also set the node's drain reason through scontrol (off: see docs)."),
        click.option("--nvidia-smi", metavar="PATH", default=None, help="nvidia-smi to run."),
        click.option("--log-file", metavar="PATH", default=None, help="Also append the line to this file."),
        click.option("--no-syslog", is_flag=True, help="Do not send the line to syslog."),
        click.option("--scontrol", default="scontrol", show_default=True, metavar="PATH",
                     help="scontrol to run for --drain-reason."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _options(grace_s: float, audit_log: Optional[str], kw: dict[str, Any]) -> Any:
    from gpufleet.ops.slurm import SlurmOptions

    return SlurmOptions(
        budget_s=kw["budget_s"], grace_s=grace_s, tolerance_mib=kw["tolerance_mib"],
        unattributed_mib=kw["unattributed_mib"], protect=tuple(kw["protect"]),
        audit_log=audit_log, drain_reason=kw["drain_reason"], dcgm_job_map=kw["dcgm_job_map"],
        nvidia_smi=kw["nvidia_smi"], log_file=kw["log_file"], syslog=not kw["no_syslog"],
        scontrol=kw["scontrol"])


def _report(out: Any) -> int:
    """Exit 0 when the job's GPUs are free; otherwise the one line on stderr and exit 1
    (notes, such as the drain done, go to stdout: stderr stays that one line)."""
    for note in out.notes:
        click.echo(terminal_safe(f"gpufleet: {note}"))
    if out.ok:
        click.echo(terminal_safe(f"gpufleet: {out.line} ({out.seconds:.2f}s)"))
        return 0
    click.echo(terminal_safe(out.line), err=True)
    return 1


@slurm.command()
@node_options
@click.option("--grace", "grace_s", type=click.FloatRange(0, 600), default=DEFAULT_GRACE_S,
              show_default=True, help="Seconds between SIGTERM and SIGKILL.")
@click.option("--audit-log", default=None, metavar="PATH",
              help="Audit log (default $GPUFLEET_AUDIT_LOG, else /var/log/gpufleet/audit.jsonl).")
def epilog(grace_s: float, audit_log: Optional[str], **kw: Any) -> int:
    """Slurm Epilog: free the job's GPUs of the job user's leftovers, memory-verified.

    Exit 0 the job's GPUs are back; 1 they are not (one line on stderr and in the node's log:
    Slurm drains the node); 2 not run by Slurm, or its environment is unusable (nothing
    signalled).
    """
    from gpufleet.ops.slurm import run_epilog

    return _report(run_epilog(os.environ, _options(grace_s, audit_log, kw)))


@slurm.command()
@node_options
def prolog(**kw: Any) -> int:
    """Slurm Prolog: the job's GPUs must be free (no holders, memory as expected).

    Exit 0 free; 1 not (the line says who holds what; Slurm requeues the job and drains the
    node); 2 not run by Slurm, or its environment is unusable.
    """
    from gpufleet.ops.slurm import run_prolog

    return _report(run_prolog(os.environ, _options(DEFAULT_GRACE_S, None, kw)))


@slurm.command()
@selection_options
@click.option("--dry-run", is_flag=True, help="Show what would be resumed; resume nothing.")
@click.option("--reason", "reasons", multiple=True, metavar="GLOB",
              help="Also nodes drained with a reason matching this (e.g. 'Epilog error').")
@click.option("--tolerance-mib", type=click.IntRange(0, 1 << 20), default=DEFAULT_TOLERANCE_MIB,
              show_default=True, help="MiB above the expected unattributed memory still clean.")
@click.option("--scontrol", default="scontrol", show_default=True, metavar="PATH")
@click.pass_obj
def undrain(app: AppContext, hosts, groups, tags, all_, dry_run: bool, reasons, tolerance_mib: int,
            scontrol: str) -> int:
    """Resume the nodes drained with a gpufleet reason whose GPUs are clean now.

    The nodes must be named (--host, -g, --tag, or --all: every drained node, those the
    inventory lacks listed as such), also for --dry-run. Nodes are matched to inventory hosts
    by name; a still-dirty node, or one the inventory lacks, stays drained. Exit 0 every such
    node resumed (or would be); 1 some stay drained; 2 usage, or no nodes named.
    """
    from gpufleet.ops.slurm import SlurmOptions, drained_nodes
    from gpufleet.ops.slurm import undrain as run_undrain

    opts = SlurmOptions(tolerance_mib=tolerance_mib, scontrol=scontrol)
    selected = app.select(hosts, groups, tags, all_, changes="slurm undrain resumes Slurm nodes")
    wanted = {h.name for h in selected}
    nodes = [n for n in drained_nodes(opts, tuple(reasons))
             if n.name in wanted or all_]
    if not nodes:
        click.echo("no node is drained with a gpufleet reason")
        return 0
    rows = run_undrain(nodes, {h.name: h for h in app.inventory().hosts}, opts, dry_run, app.forks)
    width = max(len(r.node) for r in rows)
    for r in rows:
        click.echo(terminal_safe(f"{r.node:<{width}}  {r.action:<16}  {r.detail}"))
    return 0 if all(r.action in ("resumed", "would resume") for r in rows) else 1
