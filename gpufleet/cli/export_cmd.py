"""`gpufleet export` and `gpufleet serve`: the fleet as Prometheus metrics (docs/prometheus.md)."""
from __future__ import annotations

import gc
import signal
import sys
import threading
from typing import Any, Callable, Optional

import click

from gpufleet.cli import AppContext, cli, selection_options
from gpufleet.core.metrics import (DEFAULT_MAX_PROCESSES, MODEL_LABELS, PROCESS_LABELS,
                                   ExportOptions)
from gpufleet.errors import EXIT_OK, UsageError


def metric_options(func: Callable) -> Callable:
    """The choices that shape the series, shared by export and serve."""
    func = click.option("--audit-log", default=None, metavar="PATH",
                        help="Audit log the last clean per host is read from "
                             "(default ~/.local/state/gpufleet/audit.jsonl).")(func)
    func = click.option("--max-processes", default=str(DEFAULT_MAX_PROCESSES), metavar="N",
                        show_default=True,
                        help="With --per-process: at most N process series per host.")(func)
    func = click.option("--process-labels", default=",".join(PROCESS_LABELS), metavar="LABELS",
                        show_default=True,
                        help="With --per-process: the labels of a process series (pid, name, user).")(func)
    func = click.option("--per-process", is_flag=True,
                        help="Also export each process's GPU memory (opt-in: more series).")(func)
    func = click.option("--model-label", default=MODEL_LABELS[0], metavar="NAME", show_default=True,
                        help="Label name of the GPU model: model_name (lint-clean for promtool) or "
                             "modelName (dcgm-exporter's own, camelCase).")(func)
    return func


def export_options(model_label: str, per_process: bool, process_labels: str,
                   max_processes: str) -> ExportOptions:
    """The options, checked (UsageError: one line, exit 2) before any host is contacted."""
    if model_label not in MODEL_LABELS:
        raise UsageError(f"--model-label {model_label!r}: expected one of {', '.join(MODEL_LABELS)}")
    labels = tuple(p.strip() for p in process_labels.split(",") if p.strip())
    unknown = [p for p in labels if p not in PROCESS_LABELS]
    if unknown or not labels:
        raise UsageError(f"--process-labels {process_labels!r}: expected some of "
                         f"{', '.join(PROCESS_LABELS)}, comma-separated")
    if not max_processes.strip().isdigit() or not 0 < int(max_processes) <= 10000:
        raise UsageError(f"--max-processes {max_processes!r}: expected a whole number from 1 "
                         "to 10000")
    return ExportOptions(model_label=model_label, per_process=per_process,
                         process_labels=labels, max_processes=int(max_processes))


@cli.command()
@selection_options
@click.option("--textfile", "textfile", default=None, metavar="DIR",
              help="Write DIR/gpufleet.prom atomically (node_exporter's textfile collector) "
                   "instead of printing.")
@metric_options
@click.pass_obj
def export(app: AppContext, hosts, groups, tags, all_, textfile: Optional[str], model_label: str,
           per_process: bool, process_labels: str, max_processes: str,
           audit_log: Optional[str]) -> int:
    """Print the fleet's metrics in Prometheus's text format, or write them for node_exporter.

    One snapshot per host (as `status`). A host that fails is `gpufleet_up 0` with its
    reason, not an exit code: exit 0 when the text was written, 1 when the write failed,
    2 on usage errors (nothing contacted).
    """
    from gpufleet.ops.export import check_textfile_dir, export_once, write_textfile
    from gpufleet.render.prometheus import exposition

    opts = export_options(model_label, per_process, process_labels, max_processes)
    directory = check_textfile_dir(textfile) if textfile is not None else None
    selected = app.select(hosts, groups, tags, all_)
    results: list[Any] = []
    data = exposition(export_once(selected, opts, audit_log, forks=app.forks, seen=results))
    from gpufleet.cli.output import snapshot_warnings, warn, write_whole

    if directory is None:
        write_whole(data)  # a scrape's worth of text: every byte, even after a short write
    else:
        write_textfile(directory, data)
    warn(snapshot_warnings(results, selected))  # stderr: the text format stays the text format
    return EXIT_OK


@cli.command()
@selection_options
@click.option("--listen", default="127.0.0.1:9835", show_default=True, metavar="HOST:PORT",
              help="Address to serve on (loopback unless told otherwise; port 0: any free port).")
@click.option("--max-age", "max_age", default="15", show_default=True, metavar="SECONDS",
              help="The snapshot served is never older than this (set it to the scrape interval).")
@click.option("--request-timeout", "request_timeout", default="5", show_default=True,
              metavar="SECONDS",
              help="A client's request must arrive whole within this, and a kept-alive "
                   "connection may idle no longer: then it is closed.")
@click.option("--max-connections", "max_connections", default="64", show_default=True,
              metavar="N", help="HTTP connections at once; one more gets a 503 and is closed.")
@metric_options
@click.pass_obj
def serve(app: AppContext, hosts, groups, tags, all_, listen: str, max_age: str,
          request_timeout: str, max_connections: str, model_label: str, per_process: bool,
          process_labels: str, max_processes: str, audit_log: Optional[str]) -> int:
    """Serve /metrics and /healthz for Prometheus; refreshed in the background over one
    persistent SSH session per host, so a scrape never waits for a host.

    Runs until SIGTERM or Ctrl-C (exit 0); exit 2 on usage errors (a bad --listen, an address
    in use, a bad --max-age, --request-timeout or --max-connections), before any host is
    contacted. Each HTTP connection is a thread: --request-timeout and --max-connections bound
    what slow or idle clients can hold.
    """
    from gpufleet.ops.serve import Exporter, Fleet, bind, parse_limits, parse_listen, parse_max_age

    opts = export_options(model_label, per_process, process_labels, max_processes)
    parse_listen(listen)
    max_age_s = parse_max_age(max_age)
    limits = parse_limits(request_timeout, max_connections)
    selected = app.select(hosts, groups, tags, all_)
    fleet = Fleet(selected, forks=app.forks)
    exporter = Exporter(fleet, opts, audit_log, max_age_s)
    # A scrape needs the GIL a few times; while a refresh parses 100+ documents in pure
    # Python, a 5 ms switch interval makes each of those waits up to 5 ms x runnable threads.
    sys.setswitchinterval(0.0005)
    server = bind(listen, exporter, limits)
    # What is loaded by now (modules, sessions: ~10^5 objects) lives as long as the process:
    # out of the collector's sight, a full collection during a refresh (they stop every
    # thread, scrapes too) walks only what the refresh allocates.
    gc.collect()
    gc.freeze()
    host, port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"gpufleet: serving http://{shown}:{port}/metrics for {len(selected)} hosts, "
               f"snapshots at most {max_age_s:g}s old", err=True)
    _run_until_stopped(server, exporter)
    return EXIT_OK


def _run_until_stopped(server: Any, exporter: Any) -> None:
    """Serve and refresh in threads; the main thread waits for SIGTERM / SIGINT, then stops
    both and closes every session."""
    done = threading.Event()
    previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    web = threading.Thread(target=server.serve_forever, name="gpufleet-http", daemon=True)
    refresher = threading.Thread(target=exporter.run, name="gpufleet-refresh", daemon=True)
    web.start()
    refresher.start()
    try:
        while not done.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        exporter.stop.set()
        server.shutdown()
        server.server_close()
        refresher.join(timeout=5.0)
        exporter.fleet.close()
