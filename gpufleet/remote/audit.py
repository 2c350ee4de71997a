"""The host's own record of every signal the clean sends: a piece of the remote agent.

The controller keeps its audit log, but a dropped SSH session (or a controller killed
mid-clean) would leave no trace of what the agent did; so each signal is also appended, as
one JSON line, to ``~/.local/state/gpufleet/agent-audit.jsonl`` of the agent's user (created
0700 / 0600). Best effort: a failure to write is a warning in the clean document, never a
reason to stop the sequence.
"""
import json
import os
import time


class Auditor(object):
    """Best-effort host-side record of every signal, so a dropped session still leaves one."""

    def __init__(self, operator):
        self.operator = operator
        self.path = os.path.join(os.path.expanduser("~"), ".local", "state", "gpufleet",
                                 "agent-audit.jsonl")
        self.error = None

    def record(self, pid, starttime, cmdline, sig, outcome):
        line = json.dumps({
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "epoch": round(time.time(), 3),
            "operator": self.operator, "host": os.uname()[1], "pid": pid,
            "starttime": starttime, "cmdline": cmdline, "signal": sig, "outcome": outcome,
        }) + "\n"
        try:
            d = os.path.dirname(self.path)
            if not os.path.isdir(d):
                os.makedirs(d, 0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except (OSError, IOError) as exc:
            self.error = "audit file %s: %s" % (self.path, exc)
