"""A rolling run as text: each batch's header and table (printed as the batch finishes), the
batch plan of a dry run, and the summary that ends the run (pure; the caller makes it
terminal-safe). The plain one-batch run keeps gpufleet.runbook.run.table's output as it was.
"""
from __future__ import annotations

from typing import Sequence

from gpufleet.config.inventory import Host
from gpufleet.runbook.batches import serial_text
from gpufleet.runbook.model import Rolling
from gpufleet.runbook.roll import BatchRun, RollResult
from gpufleet.runbook.run import HostRun, table


def settings_text(rolling: Rolling) -> str:
    """``serial 1,2,25%; max_fail_percentage 0%; gate: GPUs sound, healthy; pause 10s``."""
    parts = [f"serial {serial_text(rolling.serial)}"]
    if rolling.max_fail_percentage is not None:
        parts.append(f"max_fail_percentage {rolling.max_fail_percentage:g}%")
    if rolling.gate:
        parts.append("gate: " + ", ".join(s.name for s in rolling.gate))
    if rolling.pause_s:
        parts.append(f"pause {rolling.pause_s:g}s")
    return "; ".join(parts)


def batch_header(index: int, total: int, names: Sequence[str]) -> str:
    """``batch 1/4 (canary, 1 host): node-1``."""
    what = f"{len(names)} host{'s' if len(names) != 1 else ''}"
    if index == 1 and len(names) == 1 and total > 1:
        what = "canary, " + what
    return f"batch {index}/{total} ({what}): {', '.join(names)}"


def batch_report(batch: BatchRun) -> str:
    """A finished batch: its header, its table, and the stop when it stops the run."""
    lines = [batch_header(batch.index, batch.total, [r.host for r in batch.runs]), table(batch.runs)]
    if batch.stop is not None and batch.index < batch.total:
        lines.append(f"batch {batch.index} stops the run: {batch.stop}")
    return "\n".join(lines)


def plan_report(batches: Sequence[Sequence[Host]], plans: Sequence[HostRun]) -> str:
    """--dry-run (or the plan before confirming) of a rolling run: each batch's plan."""
    by_host = {p.host: p for p in plans}
    out = []
    for index, batch in enumerate(batches, 1):
        out.append(batch_header(index, len(batches), [h.name for h in batch]))
        out.append(table([by_host[h.name] for h in batch]))
    return "\n".join(out)


def roll_summary(result: RollResult, rolling: Rolling, planned: int) -> str:
    """The run's last lines: batches run, hosts ok / failed / not run, why it stopped."""
    runs = result.runs
    ok = [r.host for r in runs if r.ok]
    failed = [r.host for r in runs if not r.ok]
    head = (f"rolled {len(result.batches)} of {planned} batch(es) ({settings_text(rolling)}): "
            f"{len(ok)}/{len(runs) + len(result.not_run)} host(s) ok")
    if failed:
        head += f", {len(failed)} failed ({', '.join(failed)})"
    if result.not_run:
        head += f", {len(result.not_run)} not run"
    lines = [head]
    if result.stopped:
        lines.append(result.stopped)
    if result.not_run:
        lines.append(f"not run (nothing done there, never contacted): {', '.join(result.not_run)}")
    return "\n".join(lines)


__all__ = ["batch_header", "batch_report", "plan_report", "roll_summary", "settings_text"]
