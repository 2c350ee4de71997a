"""A rolling run: the selected hosts in batches (``serial``), one batch finished before the
next begins, stopping every later batch once a batch fails over its budget
(``max_fail_percentage``, or every host of it), so a fleet behind a load balancer keeps serving.

A batch runs like a whole plain run (its hosts in parallel, each host's steps in order); then
the ``gate`` steps (health, wait_http) run on each of its hosts that succeeded, a host whose
gate fails counts as failed; then the budget is checked; then ``pause_s``. The hosts of the
batches that never started are ``not_run``: nothing was done there, not even a connection.
How a batch is made and when it stops is gpufleet.runbook.batches (Ansible's rules).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.errors import INTERRUPTED
from gpufleet.runbook.batches import serial_text, split_batches, stop_reason
from gpufleet.runbook.model import Rolling, Runbook
from gpufleet.runbook.run import HostRun, StepResult, document

GATE_PREFIX = "gate: "

RunHosts = Callable[[Runbook, Sequence[Host], str], list[HostRun]]


@dataclass
class BatchRun:
    """One finished batch: its hosts' runs (gate steps appended), and whether it stops the run."""

    index: int  # 1-based
    total: int  # batches planned
    runs: list[HostRun]
    started: float  # seconds since the epoch
    seconds: float
    gated: bool = False
    stop: Optional[str] = None  # why no later batch may start (None: go on)

    @property
    def failed(self) -> list[str]:
        return [r.host for r in self.runs if not r.ok]

    def as_dict(self) -> dict[str, Any]:
        hosts = [r.host for r in self.runs]
        failed = self.failed
        return {"batch": self.index, "hosts": hosts, "ok": [h for h in hosts if h not in failed],
                "failed": failed, "failed_percent": round(100.0 * len(failed) / len(hosts), 1) if hosts else 0.0,
                "gate": self.gated, "stop": self.stop, "started": round(self.started, 3),
                "seconds": round(self.seconds, 3)}


@dataclass
class RollResult:
    batches: list[BatchRun] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # hosts of batches that never started
    stopped: Optional[str] = None  # one line: why the later batches did not run
    interrupted: bool = False

    @property
    def runs(self) -> list[HostRun]:
        return [r for b in self.batches for r in b.runs]

    @property
    def ok(self) -> bool:
        return not self.not_run and self.stopped is None and all(r.ok for r in self.runs)

    @property
    def retry_hosts(self) -> list[str]:
        """What a retry should run: the failed hosts, then those never run (batch order)."""
        return [r.host for r in self.runs if not r.ok] + list(self.not_run)


def plan_batches(hosts: Sequence[Host], rolling: Rolling) -> list[list[Host]]:
    return split_batches(hosts, rolling.serial)


def _with_gate(run: HostRun, gate: Optional[HostRun]) -> HostRun:
    """A host's run with its gate's steps appended (named ``gate: NAME``); a failed gate
    fails the host."""
    if gate is None:
        return run
    steps = run.steps + [StepResult(GATE_PREFIX + s.name, s.kind, s.outcome, s.seconds, s.detail, s.data)
                         for s in gate.steps]
    if gate.ok:
        return replace(run, steps=steps, seconds=run.seconds + gate.seconds)
    return replace(run, steps=steps, ok=False, error=GATE_PREFIX + (gate.error or "failed"),
                   error_kind=gate.error_kind, seconds=run.seconds + gate.seconds)


def _run_batch(runbook: Runbook, batch: Sequence[Host], index: int, total: int,
               run_hosts: RunHosts) -> BatchRun:
    started, t0 = time.time(), time.monotonic()
    runs = run_hosts(runbook, batch, f"batch {index}/{total}")
    gate = runbook.rolling.gate
    passed = [h for h, r in zip(batch, runs) if r.ok]
    gated = bool(gate and passed)
    if gated:
        gate_book = replace(runbook, steps=gate, rolling=Rolling())
        gate_runs = dict(zip([h.name for h in passed],
                             run_hosts(gate_book, passed, f"batch {index}/{total} gate")))
        runs = [_with_gate(r, gate_runs.get(r.host)) for r in runs]
    done = BatchRun(index, total, runs, started, time.monotonic() - t0, gated)
    done.stop = stop_reason(len(done.failed), len(runs), runbook.rolling.max_fail_percentage)
    return done


def roll(runbook: Runbook, hosts: Sequence[Host], run_hosts: RunHosts,
         on_batch: Optional[Callable[[BatchRun], None]] = None,
         on_pause: Optional[Callable[[float, int], None]] = None,
         sleep: Callable[[float], None] = time.sleep,
         interrupted: Callable[[], bool] = lambda: False) -> RollResult:
    """Every batch in turn; ``run_hosts(runbook, hosts, label)`` runs one (the plain run's
    parallel fan-out), ``on_batch`` is told of each as it finishes (its table is printed then).
    ``interrupted()``: whether a Ctrl-C came during the batch (the fan-out then lets the
    running hosts finish and returns): no later batch starts."""
    batches = plan_batches(hosts, runbook.rolling)
    result = RollResult()
    for index, batch in enumerate(batches, 1):
        done = _run_batch(runbook, batch, index, len(batches), run_hosts)
        result.batches.append(done)
        if on_batch is not None:
            on_batch(done)
        later = [h.name for b in batches[index:] for h in b]
        if interrupted() or any(r.error_kind == INTERRUPTED for r in done.runs):
            result.interrupted, done.stop = True, "interrupted"
        if done.stop is not None:
            if later:
                result.not_run, result.stopped = later, f"stopped after batch {index}: {done.stop}"
            return result
        if later and runbook.rolling.pause_s > 0:
            try:
                if on_pause is not None:
                    on_pause(runbook.rolling.pause_s, index + 1)
                sleep(runbook.rolling.pause_s)
            except KeyboardInterrupt:
                result.interrupted, done.stop = True, "interrupted during the pause"
                result.not_run, result.stopped = later, f"stopped after batch {index}: {done.stop}"
                return result
    return result


def roll_document(runbook: Runbook, result: RollResult, retry_file: Optional[str] = None) -> dict[str, Any]:
    """The run's JSON document (gpufleet.runbook.run.document) with the batches added."""
    doc = document(runbook, result.runs, dry_run=False)
    r = runbook.rolling
    doc.update({
        "rolling": {"serial": list(r.serial), "serial_text": serial_text(r.serial),
                    "max_fail_percentage": r.max_fail_percentage, "pause_s": r.pause_s,
                    "gate": [s.name for s in r.gate]} if r.given else None,
        "batches": [b.as_dict() for b in result.batches],
        "stopped": result.stopped,
        "not_run": list(result.not_run),
        "retry_file": retry_file,
        "ok": result.ok,
        "exit_code": 0 if result.ok else 1,
    })
    return doc


__all__ = ["GATE_PREFIX", "BatchRun", "RollResult", "plan_batches", "roll", "roll_document"]
