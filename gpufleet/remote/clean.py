"""The clean mode: the sequence. Lock; stop units; signal by wave; wait for memory; report.

A piece of the remote agent. The controller decides what may be signalled
(gpufleet/core/policy.py); the agent runs the sequence here, and each step lives in a piece of
its own: the lock (lock.py), the units (units.py), the identity-checked signal (signals.py)
and its audit line (audit.py), the exit wait (pidfd.py), the memory wait (memwait.py), the
survivors' reasons (survivors.py), /dev/shm (shm.py) and the GPU reset (reset.py).
"""
import os
import signal
import time

from .jobs import read_bytes  # joined
from .parse import CMDLINE_MAX, format_cmdline  # joined
from .procfs import PROC, read_stat, self_context  # joined
from .snapshot import snapshot  # joined
from .lock import lock_for_clean  # joined
from .settle import restarts, settle  # joined
from .audit import Auditor  # joined
from .signals import exited, refusal, send_signal  # joined
from .pidfd import wait_exit  # joined
from .units import stop_units  # joined
from .memwait import before_locked, wait_memory  # joined
from .shm import clean_shm  # joined
from .reset import reset_gpus  # joined
from .survivors import record_survivors  # joined


def clean(req, deadline, res, proc=PROC, cancel=None):
    """Lock; stop units; TERM/KILL by wave with identity checks; wait for memory; report.
    ``cancel`` (remote/main.py CancelWatch): once set, no further signal is sent."""
    t0 = time.monotonic()
    res["started_at"] = round(time.time(), 3)  # signals' "t" count from here (audit times)
    for name in ("SIGHUP", "SIGPIPE"):  # a dropped SSH session must not cut the sequence
        try:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        except (ValueError, OSError, AttributeError):
            pass
    wait_s = min(float(req.get("lock_wait_s", req["timeout_s"])), max(0.0, deadline.remaining()))
    fd = lock_for_clean(req, wait_s, res, proc, cancel)
    if fd is None:  # busy, refused, or cancelled while waiting: nothing is done, res says why
        if res.get("lock") == "busy":
            note_cancel(cancel, _clean_targets(req), res, t0, proc)
        return res
    try:
        _clean_locked(req, deadline, res, t0, proc, cancel)
    finally:
        os.close(fd)
    return res


def _clean_locked(req, deadline, res, t0, proc, cancel=None):
    ctx = self_context(proc)
    auditor = Auditor(req.get("operator"))
    reserve = min(req["smi_timeout_s"] + 1.0, max(1.0, req["deadline_s"] * 0.15))
    work_end = time.monotonic() + req["timeout_s"]
    scope = [i for i in (req.get("scope") or []) if isinstance(i, int)]
    res["before_locked"] = before_locked(req, scope, deadline)
    targets = _clean_targets(req)
    if note_cancel(cancel, targets, res, t0, proc):
        return  # cancelled while it waited for the lock: nothing done
    stop_units(req.get("units") or [], req, deadline, reserve, res)

    def signal_one(t, signame):
        if cancel is not None and cancel.is_set():
            return "cancelled"  # the operator said stop: not sent, so not a signal
        return _signal_target(t, signame, ctx, auditor, res, t0, proc)

    res["exit_wait"] = {"pidfd": 0, "polled": 0, "reason": None}
    _signal_waves(req, targets, signal_one, deadline, res["exit_wait"], proc, cancel)
    if auditor.error:
        res["warnings"].append(auditor.error)
    if note_cancel(cancel, targets, res, t0, proc):
        record_survivors(targets, res, proc)
        return  # no memory wait, no after-snapshot: the operator wants the report now

    since = ctx["starttime"] or 0  # a child that started after this agent is a restart
    watch = res["settle"] = {"seconds": 0.0, "retaken": [], "listing": False}
    known = set()
    asked = [t for t in req.get("targets") or [] if isinstance(t, dict)]

    def retaken():
        watch["retaken"].extend(restarts(asked, since, known, proc))
        return bool(watch["retaken"])

    res["memory_wait"] = wait_memory(req, scope, min(work_end, deadline.end - reserve),
                                     deadline, retaken if req.get("settle_s") else None)
    if res["memory_wait"]["ok"] and not watch["retaken"]:
        settle(req, scope, since, deadline, watch, proc)

    record_survivors(targets, res, proc)
    late = note_cancel(cancel, targets, res, t0, proc)  # in the memory wait: no shm, no reset

    if req.get("shm") and not late:
        clean_shm(req, res, proc)

    after = None
    if req.get("reset") and scope and not late:
        pre = snapshot(req, deadline, proc)
        if not reset_gpus(req, scope, pre, deadline, res):
            after = pre
    res["after"] = after if after is not None else snapshot(req, deadline, proc)


def _signal_waves(req, targets, signal_one, deadline, stats, proc, cancel):
    """TERM each wave, wait out its grace, KILL those left; a cancel wakes the waits, and
    ``signal_one`` sends nothing once it came."""
    grace = float(req["grace_s"])
    poll = max(0.01, float(req["poll_s"]))
    allow = req.get("pidfd") is not False  # false (tests): poll, as on a kernel without pidfds
    wake = cancel.fd if cancel is not None else None
    for wave in sorted(set(t["wave"] for t in targets)):
        group = [t for t in targets if t["wave"] == wave]
        termed = [t for t in group if signal_one(t, "TERM") == "sent"]
        left = wait_exit(termed, grace, poll, deadline, proc, stats, allow, wake)
        killed = [t for t in left if signal_one(t, "KILL") == "sent"]
        wait_exit(killed, max(1.0, min(grace, 5.0)), poll, deadline, proc, stats, allow, wake)


def note_cancel(cancel, targets, res, t0, proc=PROC):
    """True once the operator cancelled (a conversation's ``cancel`` line), with
    res["cancelled"]: when it came ("t", seconds since the clean began) and the signals the
    sequence would still have sent (``pending``: the next one of each target still alive)."""
    if cancel is None or not cancel.is_set():
        return False
    pending = []
    for t in targets:
        if not all(isinstance(t[k], int) and not isinstance(t[k], bool)
                   for k in ("pid", "starttime")):
            continue
        if t["outcomes"] and t["outcomes"] != ["sent"]:
            continue  # KILL was tried, or TERM was not sent: the sequence had no more for it
        if not exited(t["pid"], t["starttime"], proc):
            pending.append({"pid": t["pid"], "starttime": t["starttime"],
                            "signal": "KILL" if t["outcomes"] else "TERM"})
    at = cancel.at if cancel.at is not None else time.monotonic()
    res["cancelled"] = {"t": round(at - t0, 3), "pending": pending}
    return True


def _clean_targets(req):
    """The request's targets as the signalling loop's records (a wave that is no int is 1)."""
    targets = []
    for t in req.get("targets") or []:
        if not isinstance(t, dict):
            continue
        wave = t.get("wave", 1)
        targets.append({"pid": t.get("pid"), "starttime": t.get("starttime"),
                        "wave": wave if isinstance(wave, int) and not isinstance(wave, bool) else 1,
                        "outcomes": [], "cmdline": None})
    return targets


def _signal_target(t, signame, ctx, auditor, res, t0, proc):
    """Signal one target (unless the last-resort guard refuses); record and audit the outcome."""
    why = refusal(t["pid"], ctx["self_pid"], ctx["ancestors"])
    if why is None and (not isinstance(t["starttime"], int) or isinstance(t["starttime"], bool)):
        why = "refused: no starttime"
    if why is not None:
        outcome = why
    else:
        if t["cmdline"] is None:  # for the audit line, only once it is known to be ours
            st = read_stat(t["pid"], proc)
            if st is not None and st["starttime"] == t["starttime"]:
                raw = read_bytes("%s/%d/cmdline" % (proc, t["pid"]), CMDLINE_MAX * 4)
                t["cmdline"] = format_cmdline(raw) if raw is not None else ""
        outcome = send_signal(t["pid"], t["starttime"], getattr(signal, "SIG" + signame), proc)
    t["outcomes"].append(outcome)
    res["signals"].append({"pid": t["pid"], "starttime": t["starttime"], "signal": signame,
                           "outcome": outcome, "t": round(time.monotonic() - t0, 3)})
    auditor.record(t["pid"], t["starttime"], t["cmdline"], signame, outcome)
    return outcome
