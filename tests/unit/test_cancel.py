"""After the operator's second Ctrl-C: the words of a cancelled clean's row (core/cancel.py),
the row of a clean whose report was abandoned (never "0 signalled": unknown), and the row made
from an agent's cancelled document, with its audit lines."""
from __future__ import annotations

import json
import time
from pathlib import Path

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.core import cancel
from gpufleet.core.model import HostResult
from gpufleet.core.plan import Plan, Target
from gpufleet.core.results import Failure
from gpufleet.ops.clean import CleanOptions, HostClean, finish_clean, not_run
from gpufleet.ops.fanout import ABANDONED, NOT_STARTED
from gpufleet.render.clean import outcome_rows
from gpufleet.transport import AgentReply

NAMES = {8: "stubborn", 9: "worker"}


def doc(signals, pending, memory_wait=None):
    return {"mode": "clean", "lock": "acquired", "signals": signals,
            "cancelled": {"t": 1.2, "pending": pending}, "memory_wait": memory_wait,
            "after": None, "survivors": []}


def test_cancelled_reason_lists_what_was_sent_and_what_was_not():
    text = cancel.cancelled_reason(doc(
        [{"pid": 8, "signal": "TERM", "outcome": "sent"},
         {"pid": 9, "signal": "TERM", "outcome": "gone"}],  # not sent: not listed as sent
        [{"pid": 8, "starttime": 1, "signal": "KILL"}, {"pid": 12, "starttime": 2,
                                                       "signal": "TERM"}]), NAMES, "h1")
    assert text == ("pending signals cancelled: sent SIGTERM to PID 8 (stubborn); not sent: "
                    "SIGKILL to PID 8 (stubborn), SIGTERM to PID 12; the memory was not "
                    "verified: run `gpufleet status --host h1`")


def test_cancelled_reason_before_anything_and_after_everything():
    assert cancel.cancelled_reason(doc([], [{"pid": 8, "signal": "TERM"}]), NAMES, "h1") == (
        "pending signals cancelled: sent nothing; not sent: SIGTERM to PID 8 (stubborn); "
        "the memory was not verified: run `gpufleet status --host h1`")
    late = doc([{"pid": 8, "signal": "TERM", "outcome": "sent"}], [], {"ok": True})
    assert cancel.cancelled_reason(late, NAMES, "h1") == (
        "pending signals cancelled: sent SIGTERM to PID 8 (stubborn); nothing was pending")


def test_a_cancel_that_could_not_reach_the_agent_says_what_it_still_does_and_by_when():
    asked = time.mktime((2026, 5, 4, 10, 0, 0, 0, 0, -1))
    text = cancel.cancel_undelivered("its conversation had already ended",
                                     [(8, "stubborn"), (9, "worker")], 20.0, asked, 95.0)
    assert text == (
        "the cancel could not reach the agent (its conversation had already ended): it goes "
        "on with its sequence, SIGTERM then, 20s later, SIGKILL to whichever of PID 8 "
        "(stubborn), PID 9 (worker) is still alive, all by 10:01:35 at the latest (its own "
        "deadline); its signals are in the host's own record "
        "(~/.local/state/gpufleet/agent-audit.jsonl)")
    assert cancel.cancel_unanswered(asked + 3).startswith(
        "the agent was told at 10:00:03 to send no further signal, and its report")


def planned_row() -> HostClean:
    target = Target(pid=8, starttime=1, name="stubborn", cmdline="stubborn", gpus=(0,),
                    evidence="nvidia-smi", wave=0, family_root=8, used_mib=5000)
    plan = Plan(host="h1", scope=(0,), full_scope=True, targets=(target,), refused=(),
                units_to_stop=(), invisible=(), threshold_mib={0: 64})
    return HostClean(host="h1", verdict="planned", plan=plan,
                     before=HostResult(host="h1", ok=True))


def test_an_abandoned_clean_is_unknown_never_zero_signalled():
    """The operator stopped waiting for a host mid-sequence: SIGNALLED is "?", as for a lost
    connection, not the 0 of a report that never came (the host may have signalled)."""
    abandoned = not_run(planned_row(), Failure(errors.INTERRUPTED, ABANDONED))
    assert abandoned.outcome_unknown and abandoned.verdict == "interrupted"
    assert outcome_rows([abandoned])[0][2] == "?"
    never = not_run(planned_row(), Failure(errors.INTERRUPTED, NOT_STARTED))
    assert not never.outcome_unknown and outcome_rows([never])[0][2] == 0


def test_a_cancelled_document_is_a_cancelled_row_and_its_signals_are_audited(tmp_path: Path):
    log = tmp_path / "audit.jsonl"
    opts = CleanOptions(audit_log=str(log), operator="op@laptop")
    answer = doc([{"pid": 8, "starttime": 1, "signal": "TERM", "outcome": "sent", "t": 0.1}],
                 [{"pid": 8, "starttime": 1, "signal": "KILL"}])
    row = finish_clean(Host(name="h1", connection="local"), planned_row(),
                       AgentReply(True, answer, None, 0, 1.0), opts, time.monotonic())
    assert (row.ok, row.verdict, row.error) == (False, "cancelled", None)
    assert row.reason.startswith("pending signals cancelled: sent SIGTERM to PID 8 (stubborn); "
                                 "not sent: SIGKILL to PID 8 (stubborn)")
    assert outcome_rows([row])[0][2] == 1
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x.get("event"), x.get("pid"), x.get("signal"), x.get("outcome"), x.get("verdict"))
            for x in lines] == [(None, 8, "TERM", "sent", None),
                                ("verdict", None, None, None, "cancelled")]
