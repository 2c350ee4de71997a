"""The watch mode: the agent stays resident and prints one snapshot line per interval.

A piece of the remote agent (`gpufleet top`, `gpufleet status --watch`). The controller keeps
the session's stdin open and writes a keep-alive line (any line) at least every
``keepalive_s / 3``. The agent ends on its own, never waiting for anyone to kill it:

* stdin closed (the controller exited, was killed, or closed the session): EOF;
* no keep-alive for ``keepalive_s`` (the controller lost the network, or stopped: no EOF
  ever comes then, and sshd sends no SIGHUP without a pty);
* stdout gone (a write fails), or any error of its own;
* a snapshot running past its deadline, or an exit that does not happen (a write blocked on
  a full pipe because nobody reads): a watchdog thread ends the process (``os._exit``).

With ``hold_first_s`` in the request the agent waits, after its first snapshot, for a line
``go`` (at most that long): the controller sends it once every host has answered, so the hosts
that answered first do not refresh while others still connect on the same CPUs.

Each line is the snapshot document (docs/protocol.md) plus ``watch_seq`` (0, 1, ...);
the last line, when stdout still takes it, is ``{"mode": "watch_end", "reason": ...}``.
"""
import json
import os
import sys
import threading
import time

from .jobs import Deadline, start_daemon  # joined
from .parse import AGENT_VERSION  # joined
from .snapshot import snapshot  # joined

#: The watchdog's grace after the agent decided to stop (or a snapshot's deadline passed)
#: before it ends the process itself.
WATCHDOG_GRACE_S = 3.0


class KeepAlive(object):
    """Reads the controller's keep-alive lines on a thread; says when it is gone (why). A line
    ``go`` is a keep-alive that also ends the hold after the first snapshot (``hold_first_s``)."""

    def __init__(self, stream, keepalive_s):
        self.stream = stream
        self.keepalive_s = keepalive_s
        self.last = time.monotonic()
        self.closed = False
        self.wake = threading.Event()
        self.go = threading.Event()
        start_daemon("gpufleet-keepalive", self._read)

    def _read(self):
        try:
            while True:
                line = self.stream.readline()
                if not line:
                    break
                self.last = time.monotonic()
                if line.strip() == b"go":
                    self.go.set()
        except (OSError, IOError, ValueError):
            pass
        self.closed = True
        self.wake.set()
        self.go.set()

    def gone(self):
        """Why the controller is gone, or None while it is there."""
        if self.closed:
            return "stdin closed"
        quiet = time.monotonic() - self.last
        if quiet > self.keepalive_s:
            return "no keep-alive for %.1fs" % quiet
        return None


class WatchState(object):
    """What the watchdog reads: when a snapshot started, when the loop decided to stop."""

    def __init__(self):
        self.snapshot_since = None
        self.stop_since = None


def watchdog(state, keepalive, snapshot_deadline_s):
    """The last resort: the process ends even when the main thread is stuck (a write to a
    pipe nobody reads, a call that ignores its deadline)."""
    while True:
        time.sleep(0.2)
        now = time.monotonic()
        if keepalive.gone() is not None and state.stop_since is None:
            state.stop_since = now
        late = state.snapshot_since is not None and (
            now - state.snapshot_since > snapshot_deadline_s + WATCHDOG_GRACE_S)
        if late or (state.stop_since is not None
                    and now - state.stop_since > WATCHDOG_GRACE_S + snapshot_deadline_s):
            try:
                sys.stderr.write("gpufleet agent: watch ended by its watchdog\n")
                sys.stderr.flush()
            except (OSError, IOError, ValueError):
                pass
            os._exit(3)


def watch_snapshot(req, deadline, cache):
    """One snapshot of the watch loop. What one snapshot learns for the next lives as long as
    the agent process: the NVML library is initialised once, its device handles and minor
    numbers are learned once (nvml.open_nvml, Nvml.handles / Nvml.minors), so a resident
    agent pays only for the readings. ``cache`` (one dict for the agent's life) is for
    anything else a later reader wants to keep."""
    return snapshot(req, deadline)


def _write_line(out, doc):
    """False when stdout is gone."""
    try:
        out.write((json.dumps(doc, separators=(",", ":")) + "\n").encode("utf-8"))
        out.flush()
        return True
    except (OSError, IOError, ValueError):
        return False


def hold_first(keepalive, hold_s):
    """After the first snapshot, wait for the controller's ``go`` (it sends it once every host
    has answered: refreshes of the hosts that answered first would compete with the hosts
    still connecting for the same CPUs, and delay the first full view), at most ``hold_s``,
    and no longer than the controller is there (its keep-alives, stdin)."""
    end = time.monotonic() + hold_s
    while not keepalive.go.is_set() and keepalive.gone() is None:
        left = end - time.monotonic()
        if left <= 0:
            return
        keepalive.go.wait(min(left, 0.5))


def watch(req, stdin=None, out=None):
    """The loop: snapshot, write, wait for the next interval (or the controller's going)."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    out = out if out is not None else sys.stdout.buffer
    keepalive = KeepAlive(stdin, req["keepalive_s"])
    state = WatchState()
    start_daemon("gpufleet-watchdog", watchdog, state, keepalive, req["deadline_s"])
    cache = {}
    seq = 0
    reason = None
    while reason is None:
        reason = keepalive.gone()
        if reason is not None:
            break
        started = time.monotonic()
        state.snapshot_since = started
        try:
            doc = watch_snapshot(req, Deadline(req["deadline_s"]), cache)
        except Exception as exc:  # any error ends the watch: the controller reconnects
            import traceback  # only here: ~4 ms of every start otherwise

            reason = "agent error: %s: %s" % (type(exc).__name__, exc)
            _write_line(out, {"agent_version": AGENT_VERSION, "mode": "watch_end",
                              "reason": reason, "traceback": traceback.format_exc()[-2000:]})
            return reason
        state.snapshot_since = None
        doc["watch_seq"] = seq
        seq += 1
        if not _write_line(out, doc):
            return "stdout closed"
        if seq == 1 and req.get("hold_first_s"):
            hold_first(keepalive, req["hold_first_s"])
        left = req["interval_s"] - (time.monotonic() - started)
        keepalive.wake.wait(max(0.0, min(left, threading.TIMEOUT_MAX)))
        reason = keepalive.gone()
    state.stop_since = state.stop_since or time.monotonic()
    _write_line(out, {"agent_version": AGENT_VERSION, "mode": "watch_end", "reason": reason})
    return reason
