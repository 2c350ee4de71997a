"""The agent's entry point: the request, the one JSON document, the last-resort alarm.

The controller sends ``<k> <m>\\n<zlib(agent)><request JSON>`` on stdin to a constant
``python3 -c`` bootstrap (docs/DESIGN.md, "Running the agent"), which execs the agent (the
pieces of gpufleet/remote/ joined in order) with globals ``{"__name__": "gpufleet_agent",
"REQUEST": <request bytes>}``. For debugging, ``python3 -m gpufleet.remote.agent <
request.json`` runs the same joined payload here (an empty stdin means a snapshot).

In watch mode (remote/watch.py) it prints one snapshot line per interval until the
controller goes. Otherwise the agent prints exactly one JSON document on stdout and exits 0: its own failures are
values in that document. Everything it starts is bounded by the request's deadline.

Stay mode (a conversation: `clean` plans and acts through ONE agent process per host): a
snapshot request with ``"stay": true`` keeps the process after its document; it then reads the
next request from stdin, framed ``<m>\\n<request JSON: m bytes>``, answers it the normal way
(one document), and ends after a clean, on EOF, on a bad frame (a ``stay_end`` document says
why), or when no request came within ``idle_s`` seconds (default 3600; a ``stay_end``
document), so an orphan never lingers. A request is either answered or certainly never acted
on: the idle bound and the frame's arrival are decided under one lock (``NextRequest``).
While a conversation's clean runs, its stdin is still read (``CancelWatch``): a line
``cancel`` (the operator's second Ctrl-C) stops the sequence before any further signal, and the
document says what was sent and what was not (``cancelled``); an EOF changes nothing (a
dropped session must not cut the sequence short).

Request keys for tests and odd hosts (docs/protocol.md lists every key): ``systemctl`` (path),
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
import threading
import time

from .clean import clean  # joined
from .jobs import Deadline, start_daemon  # joined
from .parse import AGENT_VERSION  # joined
from .snapshot import AGENT_CACHE_FACTS, GPU_SOURCES, snapshot  # joined
from .watch import watch  # joined


#: A conversation's default idle bound (request key ``idle_s``): the agent ends when no next
#: request came within it (an operator who never answered, a controller gone without an EOF).
IDLE_S = 3600.0
#: A next request larger than this is a bad frame (a clean request is a few KB).
MAX_FRAME = 16 * 1024 * 1024
#: The line that cancels a conversation's running clean (remote.CANCEL_LINE, controller side).
CANCEL = b"cancel"


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
    if req.get("stay") not in (None, True, False):
        raise ValueError("stay must be true or false")
    req["idle_s"] = _number(req, "idle_s", IDLE_S, 0.01)
    if req["mode"] == "watch":
        req["interval_s"] = _number(req, "interval_s", 2.0, 0.05)
        req["keepalive_s"] = _number(req, "keepalive_s", 10.0, 0.5)
        req["hold_first_s"] = _number(req, "hold_first_s", 0.0)
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
    """Print a request's JSON document, at most once (the alarm path may race the normal one)."""
    if _EMITTED and _EMITTED[-1] is doc:
        return
    _EMITTED.append(doc)
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
    emit(answer(req, t0))
    if req["mode"] == "snapshot" and req.get("stay"):
        converse(req["idle_s"], sys.stdin.buffer)


def answer(req, t0, cancel=None):
    """One snapshot or clean request's document, bounded by its deadline (SIGALRM: the last
    resort, which emits what it has and ends the process). ``cancel``: a clean's CancelWatch."""
    deadline = Deadline(req["deadline_s"])
    if req["mode"] == "clean":
        doc = empty_clean_doc()
    else:  # what the controller gets if the snapshot cannot finish
        doc = {"agent_version": AGENT_VERSION, "mode": "snapshot",
               "nvidia_smi": {"ok": False, "error": None, "exit_code": None, "seconds": 0.0}}
    box = [doc]
    alarmed = []

    def on_alarm(signum, frame):
        if not alarmed:  # first: unwind with what we have
            alarmed.append(True)
            signal.alarm(2)
            raise AgentDeadline()
        box[0]["error"] = "agent deadline exceeded (stuck in a system call)"
        emit(box[0])
        os._exit(0)

    try:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(req["deadline_s"]) + 3)
    except (ValueError, OSError):
        pass  # not the main thread: the per-call bounds still hold
    try:
        if req["mode"] == "snapshot":
            doc = box[0] = snapshot(req, deadline)
        else:
            clean(req, deadline, doc, cancel=cancel)
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
    return doc


def read_frame(stream):
    """The next request of a conversation: ``<m>\\n`` then m bytes of JSON. (bytes, None);
    (None, None) at EOF before a frame; (None, why) for a bad frame."""
    head = stream.readline(32)
    if not head:
        return None, None
    text = head.strip()
    if not head.endswith(b"\n") or not text.isdigit():
        return None, "bad frame: header %r" % (head[:32],)
    size = int(text)
    if size > MAX_FRAME:
        return None, "bad frame: %d bytes is more than %d" % (size, MAX_FRAME)
    body = stream.read(size)
    if len(body) != size:
        return None, "bad frame: stdin ended after %d of %d bytes" % (len(body), size)
    return body, None


class NextRequest(object):
    """Reads one frame on a thread (stdin is buffered: select on its descriptor could miss
    bytes already read ahead); ``take`` waits for it at most ``idle_s``. Whether the frame or
    the idle bound wins is decided under one lock: a frame that comes later is never acted on."""

    def __init__(self, stream):
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.result = None
        self.abandoned = False
        start_daemon("gpufleet-next", self._read, stream)

    def _read(self, stream):
        try:
            result = read_frame(stream)
        except (OSError, IOError, ValueError) as exc:
            result = (None, "bad frame: %s" % (exc,))
        with self.lock:
            if not self.abandoned:
                self.result = result
        self.done.set()

    def take(self, idle_s):
        """read_frame's (body, why), or (None, "idle: ...") when nothing came within idle_s."""
        self.done.wait(min(idle_s, threading.TIMEOUT_MAX))
        with self.lock:
            if self.result is None:
                self.abandoned = True
                return None, "idle: no request within %gs" % idle_s
            return self.result


class CancelWatch(object):
    """A conversation's stdin while its clean runs, read on a thread: a line ``cancel`` sets
    the flag and wakes the exit wait (``fd``: readable from then on). EOF sets nothing: sshd
    closes stdin when the session drops, and a dropped session must not cut the sequence
    short (the host's audit file keeps its record). Started only once the clean's frame was
    read whole, so no other thread reads stdin then."""

    def __init__(self, stream):
        self.flag = threading.Event()
        self.at = None
        self.fd, self._wake = os.pipe()
        start_daemon("gpufleet-cancel", self._read, stream)

    def is_set(self):
        return self.flag.is_set()

    def _read(self, stream):
        try:
            while True:
                line = stream.readline(256)
                if not line:
                    return
                if line.strip() == CANCEL:
                    self.at = time.monotonic()
                    self.flag.set()
                    os.write(self._wake, b"c")
                    return
        except (OSError, IOError, ValueError):
            return


def stay_end(reason):
    """A conversation's last document when a request will not be answered: nothing was done."""
    return {"agent_version": AGENT_VERSION, "mode": "stay_end", "reason": reason}


def converse(idle_s, stdin):
    """Stay mode: answer the requests that follow on stdin, one document each; end after a
    clean, on EOF, on a bad frame or request, or after ``idle_s`` without a request."""
    while True:
        body, why = NextRequest(stdin).take(idle_s)
        if body is None:
            if why is not None:
                emit(stay_end(why))
            return
        t0 = time.monotonic()
        try:
            req = parse_request(body)
        except (ValueError, UnicodeDecodeError) as exc:
            emit({"agent_version": AGENT_VERSION, "mode": None, "error": "bad request: %s" % exc})
            return
        if req["mode"] == "watch":
            emit(stay_end("bad request: watch mode cannot follow in a conversation"))
            return
        cancel = CancelWatch(stdin) if req["mode"] == "clean" else None
        emit(answer(req, t0, cancel))
        if req["mode"] == "clean" or not req.get("stay"):
            return
        idle_s = req["idle_s"]


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
