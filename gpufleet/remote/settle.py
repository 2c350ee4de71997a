"""Is the GPU retaken? What the clean watches once it has signalled: a piece of the agent.

A target that something restarts frees its memory for a moment only. Two kinds of evidence,
both from the kernel and the driver, never from a name alone:
- ``restarted``: the target's owner (a process the controller named by PID and start time:
  a supervisor, a shell loop, the target's parent) has a child that started after this agent
  and runs the target's program (same command line or the same name);
- ``listed``: NVML (or nvidia-smi) lists, on a GPU in scope, a PID it did not list before
  the clean.
The first is seen when the new process starts (0.5 s after SIGKILL for a supervisor that
waits 0.3 s, measured on an H200), the second once it has a CUDA context (3.5-4 s there).
"""
import os
import time

from .jobs import run_cmd, smi_failure  # joined
from .nvml import processes_of, read_bounded  # joined
from .procfs import PROC, read_stat  # joined
from .snapshot import gpu_source, nvml_timeout  # joined

#: How often the settle window looks for a restarted child (a /proc read per owner).
SETTLE_POLL_S = 0.1
#: How often it asks the driver for new PIDs: NVML calls cost well under a millisecond,
#: an nvidia-smi run ~30 ms.
LIST_POLL_NVML_S = 0.2
LIST_POLL_SMI_S = 0.5


def children_of(pid, proc=PROC):
    """PIDs whose parent is ``pid``: the kernel's children list when it has one, else a scan."""
    try:
        with open("%s/%d/task/%d/children" % (proc, pid, pid)) as f:
            return [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    out = []
    try:
        names = os.listdir(proc)
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            st = read_stat(int(name), proc)
            if st is not None and st["ppid"] == pid:
                out.append(int(name))
    return out


def _cmdline(pid, proc):
    try:
        with open("%s/%d/cmdline" % (proc, pid), "rb") as f:
            raw = f.read(65536)
    except OSError:
        return None
    return raw.replace(b"\0", b" ").rstrip(b" ").decode("utf-8", "replace")


def restarts(targets, since, known, proc=PROC):
    """Children of a target's owner that started at or after ``since`` (clock ticks, the
    agent's own start time) and run the target's program: [retake]. ``known`` holds the
    (pid, starttime) already reported."""
    found = []
    for t in targets:
        owner = t.get("owner")
        if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
            continue
        st = read_stat(owner["pid"], proc)
        if st is None or st["starttime"] != owner.get("starttime"):
            continue  # the owner is gone or is another process now
        for child in children_of(owner["pid"], proc):
            cst = read_stat(child, proc)
            if cst is None or cst["starttime"] < since or (child, cst["starttime"]) in known:
                continue
            cmd = _cmdline(child, proc)
            if cmd != t.get("cmdline") and cst["comm"] != t.get("name"):
                continue
            known.add((child, cst["starttime"]))
            found.append({"pid": child, "starttime": cst["starttime"], "how": "restarted",
                          "name": cst["comm"], "cmdline": cmd, "replaces": t.get("pid"),
                          "owner": owner.get("name"), "owner_pid": owner["pid"]})
    return found


def pid_lister(req, scope, deadline):
    """list() -> set of PIDs the driver lists on the scope GPUs, or None when it cannot."""
    source, nv, _ = gpu_source(req, deadline)
    if nv is not None:
        def list_nvml():
            pids = set()
            for index in scope:
                handle, rc = nv.handle(index)
                if rc != 0:
                    return None
                got, _, _ = read_bounded(nv, nvml_timeout(req, deadline), processes_of,
                                         handle, "compute")
                if got is None or got[1] != 0:
                    return None
                pids.update(p for p, _ in got[0])
            return pids
        return list_nvml, LIST_POLL_NVML_S
    smi = req.get("nvidia_smi") or "nvidia-smi"
    uuids = set(u for u in req.get("scope_uuids") or [] if isinstance(u, str))
    if source == "nvml" or not uuids:
        return None, None

    def list_smi():
        r = run_cmd([smi, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                    req["smi_timeout_s"], deadline, "nvidia-smi")
        if smi_failure(r) is not None:
            return None
        pids = set()
        for line in r.out.splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) == 2 and fields[0].isdigit() and fields[1] in uuids:
                pids.add(int(fields[0]))
        return pids
    return list_smi, LIST_POLL_SMI_S


def settle(req, scope, since, deadline, out, proc=PROC):
    """Watch for ``req["settle_s"]`` seconds (less if the deadline is near) for a retake;
    stop at the first one. out: {"seconds", "retaken": [...], "listing": bool}."""
    seconds = min(float(req.get("settle_s") or 0.0), max(0.0, deadline.remaining() - 1.0))
    out.update(seconds=0.0, retaken=[], listing=False)
    if seconds <= 0:
        return out
    targets = [t for t in req.get("targets") or [] if isinstance(t, dict)]
    before = set(p for p in req.get("listed_before") or [] if isinstance(p, int))
    before |= set(t.get("pid") for t in targets)
    lister, every = pid_lister(req, scope, deadline)
    out["listing"] = lister is not None
    t0 = time.monotonic()
    end, next_list, known = t0 + seconds, t0, set()
    while not out["retaken"]:
        out["retaken"].extend(restarts(targets, since, known, proc))
        now = time.monotonic()
        if lister is not None and now >= next_list and not out["retaken"]:
            pids = lister()
            next_list = now + every
            for pid in sorted((pids or set()) - before):
                st = read_stat(pid, proc)
                out["retaken"].append({"pid": pid, "how": "listed",
                                       "starttime": st["starttime"] if st else None,
                                       "name": st["comm"] if st else None,
                                       "cmdline": _cmdline(pid, proc)})
        if out["retaken"] or now + SETTLE_POLL_S > end:
            break
        time.sleep(SETTLE_POLL_S)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out
