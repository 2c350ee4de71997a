"""The clean's verdict: it waits for the GPUs' memory, not for the processes.

A piece of the remote agent. A process can be gone while the driver still releases its
memory (seconds on a large context), and memory can be held by something no signal reaches;
so after the signals the clean polls memory.used of each GPU in scope, through NVML when the
snapshot used it (well under a millisecond a read) or nvidia-smi otherwise, until every GPU is
under its threshold, or waiting can no longer change the answer (a target restarted, only
memory of processes not signalled left), or the time is up. ``before_locked`` is the same read
once the lock is held: the clean's own "before".
"""
import time

from .jobs import find_nvidia_smi, run_cmd, smi_failure  # joined
from .parse import ParseError, check_complete, parse_gpu_csv  # joined
from .nvml import memory_used, read_bounded  # joined
from .snapshot import gpu_source, nvml_timeout  # joined


def query_used(smi, req, deadline):
    """{index: memory.used MiB} for the memory wait; raises ParseError / returns error string."""
    r = run_cmd([smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                req["smi_timeout_s"], deadline, "nvidia-smi")
    fail = smi_failure(r)
    if fail is not None:
        return None, fail[0]
    try:
        check_complete(r.out, "--query-gpu")
        rows = parse_gpu_csv(r.out, ["index", "memory.used"])
    except ParseError as exc:
        return None, "unparsable nvidia-smi output: %s" % exc
    return dict((g["index"], g["memory_used_mib"]) for g in rows), None


#: The memory wait's poll through NVML: a read costs well under a millisecond, so the verdict
#: follows the driver within 10-20 ms of the memory coming back (nvidia-smi: 30 ms a run).
NVML_POLL_S = 0.015


def memory_reader(req, scope, deadline, out):
    """(read() -> ({index: MiB} or None, error), poll seconds), or (None, None) with
    out["error"] set: NVML when the snapshot's source is NVML, else nvidia-smi runs."""
    source, nv, reason = gpu_source(req, deadline)
    out["source"] = source
    if nv is not None:
        def read_nvml():
            got, why, _ = read_bounded(nv, nvml_timeout(req, deadline), memory_used, scope)
            return got if got is not None else (None, "NVML: %s" % why)
        return read_nvml, min(NVML_POLL_S, max(0.001, req["poll_s"]))
    if source == "nvml":
        out["error"] = reason
        return None, None
    smi = find_nvidia_smi(req.get("nvidia_smi"))
    if smi is None:
        out["error"] = "nvidia-smi not found"
        return None, None
    return (lambda: query_used(smi, req, deadline)), max(0.05, req["poll_s"])


def wait_memory(req, scope, end, deadline, retaken=None):
    """The verdict waits for memory, not for processes: poll memory.used per scope GPU.
    ``retaken()`` (the owners' restarts) is asked after each poll: a target started again
    ends the wait at once, as waiting cannot bring that memory back."""
    t0 = time.monotonic()
    out = {"ok": False, "seconds": 0.0, "polls": 0, "used_mib": {}, "error": None}
    if not scope:
        out["ok"] = True
        return out
    read, poll = memory_reader(req, scope, deadline, out)
    if read is None:
        return out
    thresholds = req.get("threshold_mib") or {}
    default = req.get("default_threshold_mib", 64)
    floors = req.get("wait_floor_mib") or {}
    while True:
        used, error = read()
        out["polls"] += 1
        if error is not None:
            out["error"] = error
            break
        out["used_mib"] = dict((str(i), used.get(i)) for i in scope)
        absent = [i for i in scope if i not in used]
        if absent:  # waiting cannot make a GPU appear
            out["error"] = "no GPU with index %s" % ", ".join(str(i) for i in absent)
            break
        pending = [i for i in scope
                   if used.get(i) is None or used[i] > thresholds.get(str(i), default)]
        if not pending:
            out["ok"] = True
            break
        if retaken is not None and retaken():
            out["error"] = "a target was started again: the GPU is retaken"
            out["retaken"] = True
            break
        # Memory of processes the plan does not signal will not come back: once only that is
        # left, waiting longer cannot change the verdict.
        if floors and all(str(i) in floors and used[i] <= thresholds.get(str(i), default)
                          + floors[str(i)] for i in pending):
            out["error"] = "GPU %s still above threshold: held by processes not signalled" % (
                ", ".join(str(i) for i in pending))
            out["held_by_others"] = True
            break
        if _beyond_signals(req, used, pending, thresholds, default, floors, t0):
            out["error"] = "GPU %s still above threshold: nothing signalled can free it" % (
                ", ".join(str(i) for i in pending))
            out["held_by_others"] = True
            break
        if time.monotonic() + poll > min(end, deadline.end):
            out["error"] = "GPU %s still above threshold" % ", ".join(str(i) for i in pending)
            break
        time.sleep(poll)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _beyond_signals(req, used, pending, thresholds, default, floors, t0):
    """Whether what is left over the thresholds is only memory no signalled process can free
    (the request's release_floor_mib: unattributed memory on GPUs no target could hold) and
    release_wait_s has passed: by then a driver releasing a process already gone is done,
    and a driver's leak or another PID namespace's process stays whatever the wait."""
    release_s = req.get("release_wait_s")
    if release_s is None or time.monotonic() - t0 < release_s:
        return False
    releasing = req.get("release_floor_mib") or {}
    return all(used[i] <= thresholds.get(str(i), default) + floors.get(str(i), 0)
               + releasing.get(str(i), 0) for i in pending)


def before_locked(req, scope, deadline):
    """memory.used per scope GPU, read once the lock is held: the clean's own "before". The
    plan's snapshot is older; another clean may have freed that memory while this one waited
    for the lock, and what it freed must not be reported as this clean's."""
    out = {"used_mib": None, "error": None}
    scratch = {}
    read, _poll = memory_reader(req, scope, deadline, scratch) if scope else (None, None)
    if read is None:
        out["error"] = scratch.get("error")
        if not scope:
            out["used_mib"] = {}
        return out
    used, error = read()
    if error is not None:
        out["error"] = error
    else:
        out["used_mib"] = dict((str(i), used.get(i)) for i in scope)
    return out
