#!/usr/bin/env python3
"""`gpufleet` exactly as the CLI runs, plus a record of every agent exchange (for fixtures).

The real-GPU scenario needs the raw agent documents behind each CLI output (the snapshot a
status table was rendered from, the clean document a verdict was made from), so the unit tests
can replay them through the pure core. This wraps ``Session.run_agent`` and appends one JSON line
per exchange to ``$GPUFLEET_CAPTURE``: ``{"request", "ok", "error", "seconds", "doc"}``.
Nothing else about the command changes: ``gpufleet.cli.main`` runs with the same argv.
"""
import json
import os
import sys
import threading

from gpufleet import transport

_LOCK = threading.Lock()
_ORIGINAL = transport.Session.run_agent


def _recording_run_agent(self, request, timeout=None):
    reply = _ORIGINAL(self, request, timeout)
    path = os.environ.get("GPUFLEET_CAPTURE")
    if path:
        line = json.dumps({"request": dict(request), "ok": reply.ok, "error": reply.error,
                           "seconds": round(reply.seconds, 4), "doc": reply.doc})
        with _LOCK, open(path, "a") as f:
            f.write(line + "\n")
    return reply


transport.Session.run_agent = _recording_run_agent

if __name__ == "__main__":
    from gpufleet.cli import main

    main(sys.argv[1:])
