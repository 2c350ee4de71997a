"""The agent's entry point: the request, the one JSON document, the last-resort alarm.

The controller sends ``<k> <m>\\n<zlib(agent)><request JSON>`` on stdin to a constant
``python3 -c`` bootstrap (docs/DESIGN.md, "Running the agent"), which execs the agent (the
pieces of gpufleet/remote/ joined in order) with globals ``{"__name__": "gpufleet_agent",
"REQUEST": <request bytes>}``. For debugging, ``python3 -m gpufleet.remote.agent <
request.json`` runs the same joined payload here (an empty stdin means a snapshot).

In watch mode (remote/watch.py) it prints one snapshot line per interval until the
controller goes. Otherwise the agent prints exactly one JSON document on stdout and exits 0: its own failures are
values in that document. Everything it starts is bounded by the request's deadline.

Request keys beyond docs/DESIGN.md, for tests and odd hosts: ``systemctl`` (path),
``shm_dir`` (default /dev/shm), ``shm_min_age_s`` (default 10), ``lock_wait_s`` (default
timeout_s), ``default_threshold_mib`` (default 64), ``cuda_version`` (default true),
``wait_floor_mib`` ({"index": MiB} held by processes the plan does not signal: the memory
wait ends once only that is left, instead of waiting out the timeout), ``gpu_source`` (auto |
nvml | nvidia-smi: the inventory's), ``nvml_library`` (a path: load that libnvidia-ml.so.1),
``pidfd`` (default true; false: the exit wait polls every poll_s, as on a kernel without pidfds),
``agent_cache`` (default true; false: the loader neither reads nor writes its cache of the
compiled agent) and ``agent_cache_dir`` (that directory instead of the default), both read by
remote/loader.py before the agent runs.
"""
import json
import os
import signal
import sys
import time

from .clean import clean  # joined
from .jobs import Deadline  # joined
from .parse import AGENT_VERSION  # joined
from .snapshot import AGENT_CACHE_FACTS, GPU_SOURCES, snapshot  # joined
from .watch import watch  # joined


class AgentDeadline(BaseException):
    """Raised by the SIGALRM last-resort bound; BaseException so no `except Exception` eats it."""


def _number(req, key, default, minimum=0.0):
    value = req.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise ValueError("%s must be a number >= %g" % (key, minimum))
    return float(value)


def parse_request(raw):
    """Request bytes -> dict with defaults; ValueError on anything malformed."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8")
    req = json.loads(raw) if raw.strip() else {"mode": "snapshot"}
    if not isinstance(req, dict):
        raise ValueError("request is not a JSON object")
    if req.get("mode", "snapshot") not in ("snapshot", "clean", "watch"):
        raise ValueError("unknown mode %r" % (req.get("mode"),))
    req.setdefault("mode", "snapshot")
    req["deadline_s"] = _number(req, "deadline_s", 55.0, 0.1)
    req["smi_timeout_s"] = _number(req, "smi_timeout_s", 10.0, 0.1)
    if req.get("nvidia_smi") is not None and not isinstance(req["nvidia_smi"], str):
        raise ValueError("nvidia_smi must be a path or null")
    if req.get("gpu_source") not in (None,) + GPU_SOURCES:
        raise ValueError("gpu_source must be one of %s" % ", ".join(GPU_SOURCES))
    if req.get("nvml_library") is not None and not isinstance(req["nvml_library"], str):
        raise ValueError("nvml_library must be a path or null")
    if req["mode"] == "watch":
        req["interval_s"] = _number(req, "interval_s", 2.0, 0.05)
        req["keepalive_s"] = _number(req, "keepalive_s", 10.0, 0.5)
    if req["mode"] == "clean":
        req["grace_s"] = _number(req, "grace_s", 10.0)
        req["timeout_s"] = _number(req, "timeout_s", 60.0)
        req["poll_s"] = _number(req, "poll_s", 0.1, 0.001)
        for key in ("targets", "units", "scope"):
            if req.get(key) is not None and not isinstance(req[key], list):
                raise ValueError("%s must be a list" % key)
        if req.get("threshold_mib") is not None and not isinstance(req["threshold_mib"], dict):
            raise ValueError("threshold_mib must be an object")
    return req


def empty_clean_doc():
    return {"agent_version": AGENT_VERSION, "mode": "clean", "lock": None, "units_stopped": [],
            "signals": [], "survivors": [], "memory_wait": None, "after": None,
            "shm_removed": [], "reset": [], "warnings": [], "seconds": 0.0}


_EMITTED = []  # type: list


def emit(doc):
    """Print the one JSON document, at most once (the alarm path may race the normal one)."""
    if _EMITTED:
        return
    _EMITTED.append(True)
    try:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()
    except (OSError, IOError, ValueError):
        pass  # the session is gone; the audit file has the record


def python_too_old():
    """The agent's one requirement, checked before anything else runs: on an older python3
    it could fail in odd ways (or, worse, half work); say so in the one document instead."""
    if sys.version_info >= (3, 6):
        return None
    version = "%d.%d.%d" % tuple(sys.version_info[:3])
    return {"agent_version": AGENT_VERSION, "mode": None, "python_too_old": True,
            "python": version, "error": "Python %s is too old for the agent (needs 3.6+)"
            % version}


def main(raw_request):
    t0 = time.monotonic()
    too_old = python_too_old()
    if too_old is not None:
        emit(too_old)
        return
    try:
        req = parse_request(raw_request)
    except (ValueError, UnicodeDecodeError) as exc:
        emit({"agent_version": AGENT_VERSION, "mode": None, "error": "bad request: %s" % exc})
        return
    if req["mode"] == "watch":  # resident: ends itself (remote/watch.py), no alarm
        watch(req)
        os._exit(0)  # not interpreter shutdown: the keep-alive reader may hold stdin's lock
    deadline = Deadline(req["deadline_s"])
    if req["mode"] == "clean":
        doc = empty_clean_doc()
    else:  # what the controller gets if the snapshot cannot finish
        doc = {"agent_version": AGENT_VERSION, "mode": "snapshot",
               "nvidia_smi": {"ok": False, "error": None, "exit_code": None, "seconds": 0.0}}
    alarmed = []

    def on_alarm(signum, frame):
        if not alarmed:  # first: unwind with what we have
            alarmed.append(True)
            signal.alarm(2)
            raise AgentDeadline()
        doc["error"] = "agent deadline exceeded (stuck in a system call)"
        emit(doc)
        os._exit(0)

    try:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(req["deadline_s"]) + 3)
    except (ValueError, OSError):
        pass  # not the main thread: the per-call bounds still hold
    try:
        if req["mode"] == "snapshot":
            doc = snapshot(req, deadline)
        else:
            clean(req, deadline, doc)
    except AgentDeadline:
        doc["error"] = "agent deadline exceeded"
        if isinstance(doc.get("nvidia_smi"), dict) and not doc["nvidia_smi"].get("error"):
            doc["nvidia_smi"]["error"] = doc["error"]
    except Exception as exc:  # a bug must still come back as a document
        doc["error"] = "agent error: %s: %s" % (type(exc).__name__, exc)
        import traceback  # only here: ~4 ms of every start otherwise

        doc["traceback"] = traceback.format_exc()[-4000:]
    finally:
        try:
            signal.alarm(0)
        except (ValueError, OSError):
            pass
    if req["mode"] == "clean":
        doc["seconds"] = round(time.monotonic() - t0, 3)
    emit(doc)


def exit_now():
    """The document is out: end without the interpreter's teardown (finalising every module
    and object, ~5 ms of a ~40 ms exec), as watch mode does. Nothing is lost: what the agent
    writes besides stdout (the audit line) goes through os.write, locks go with the process."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, IOError, ValueError):
            pass
    os._exit(0)


if __name__ == "gpufleet_agent":
    AGENT_CACHE_FACTS.update(globals().get("AGENT_CACHE") or {})  # what the loader did
    main(globals()["REQUEST"])  # injected by the loader
    exit_now()
elif __name__ == "__main__":
    main(sys.stdin.buffer.read())
