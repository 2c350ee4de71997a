"""Why a target is still there after its signals, in words an operator can act on.

A piece of the remote agent. A process can survive its signals as a zombie its parent does not
reap (it holds no GPU memory), as a leader whose threads still tear a CUDA context down, stuck
in the driver (D state: only a GPU reset or a reboot frees it), or because it was refused or
not ours to signal; the clean document lists each, with its state and wait channel.
"""
import os

from .jobs import read_text  # joined
from .parse import ParseError, parse_stat  # joined
from .procfs import PROC, read_stat  # joined


def classify_survivor(state, wchan, ppid, parent_comm, outcomes, threads=1):
    """Why a target is still there, in words an operator can act on."""
    if state == "Z" and threads > 1:
        return "exiting: main thread gone, %d thread(s) still tearing down" % (threads - 1)
    if state == "Z":
        return "zombie: exited, not reaped by parent %s (%s); holds no GPU memory" % (
            ppid, parent_comm or "?")
    if state == "D":
        return ("uninterruptible sleep (D) in %s: stuck in the driver, needs GPU reset or reboot"
                % (wchan or "?"))
    for o in outcomes:
        if o.startswith("refused"):
            return o
    if "permission denied" in outcomes:
        return "permission denied (EPERM): needs root or the process owner"
    if "sent" in outcomes:
        return "still running after signals"
    return "still running"


def stuck_thread(pid, st, proc=PROC):
    """(state, wchan) of the process, or of its first thread in D state: after a signal the
    leader may be a zombie while a worker thread is stuck in the driver."""
    def wchan_of(path):
        w = (read_text(path + "/wchan") or "").strip()
        return w if w not in ("", "0") else None

    base = "%s/%d" % (proc, pid)
    if st["state"] != "D" and st["num_threads"] > 1:
        try:
            tids = sorted(os.listdir(base + "/task"), key=lambda x: (len(x), x))
        except OSError:
            tids = []
        for tid in tids[:512]:
            tst = read_text("%s/task/%s/stat" % (base, tid))
            try:
                tstate = parse_stat(tst)["state"] if tst else None
            except ParseError:
                tstate = None
            if tstate == "D":
                return "D", wchan_of("%s/task/%s" % (base, tid))
    return st["state"], wchan_of(base)


def record_survivors(targets, res, proc):
    """Every target still there (same start time), with why, in res["survivors"]."""
    for t in targets:
        if not isinstance(t["pid"], int) or isinstance(t["pid"], bool):
            continue
        st = read_stat(t["pid"], proc)
        if st is None or st["starttime"] != t["starttime"]:
            continue
        state, wchan = stuck_thread(t["pid"], st, proc)
        parent = read_stat(st["ppid"], proc) if st["ppid"] > 0 else None
        res["survivors"].append({
            "pid": t["pid"], "starttime": t["starttime"], "state": state, "wchan": wchan,
            "ppid": st["ppid"], "comm": st["comm"], "threads": st["num_threads"],
            "reason": classify_survivor(state, wchan, st["ppid"],
                                        parent["comm"] if parent else None, t["outcomes"],
                                        st["num_threads"]),
        })
