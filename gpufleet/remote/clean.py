"""The clean mode: lock, stop units, signal by wave with identity checks, wait for memory.

A piece of the remote agent. The controller decides what may be signalled
(gpufleet/core/policy.py); here are only the last-resort guards (never PID 1, never the own
session, never a PID whose start time changed) and the evidence of what happened.
"""
import errno
import os
import stat as stat_mod
import time

from .jobs import (  # joined
    find_nvidia_smi,
    read_bytes,
    read_bytes_bounded,
    read_text,
    run_cmd,
    smi_failure,
    which,
)
from .parse import (  # joined
    CMDLINE_MAX,
    LazyRe,
    ParseError,
    check_complete,
    first_line,
    format_cmdline,
    has_exited,
    is_kernel_thread,
    json_dumps,
    parse_gpu_csv,
    parse_stat,
    signal,
)
from .procfs import PROC, read_stat, scan_fds, self_context  # joined
from .owners import SYSTEMCTL_FALLBACKS  # joined
from .nvml import memory_used, read_bounded  # joined
from .snapshot import gpu_source, nvml_timeout, snapshot  # joined
from .lock import lock_for_clean  # joined
from .settle import restarts, settle  # joined


UNIT_RE = LazyRe(
    r"^[A-Za-z0-9_][A-Za-z0-9:_.@\\-]*\."
    r"(?:service|scope|socket|target|timer|slice|mount|path|swap|automount|device)$"
)
SHM_LEFTOVER_RE = LazyRe(r"^(?:nccl-|psm_|torch_|vllm)")


def valid_unit(name):
    """Unit names are data passed as argv; still, refuse anything that is not a unit name."""
    return isinstance(name, str) and len(name) <= 255 and bool(UNIT_RE.match(name))


def refusal(pid, self_pid, ancestors):
    """The agent's last-resort guard; the real policy is controller-side (gpufleet/core/policy.py)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return "refused: pid <= 1"
    if pid == self_pid or pid in ancestors:
        return "refused: own session"
    return None


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


def reset_refusal(is_root, in_container, wsl2, holder_pids):
    """Why `nvidia-smi --gpu-reset` must not run on a GPU, or None when it may."""
    if not is_root:
        return "not root"
    if wsl2:
        return "WSL2: GPU reset is done by the Windows host"
    if in_container:
        return "in a container: reset the GPU from the host"
    if holder_pids:
        return "held by PID %s" % ", ".join(str(p) for p in sorted(holder_pids))
    return None


class Auditor(object):
    """Best-effort host-side record of every signal, so a dropped session still leaves one."""

    def __init__(self, operator):
        self.operator = operator
        self.path = os.path.join(os.path.expanduser("~"), ".local", "state", "gpufleet",
                                 "agent-audit.jsonl")
        self.error = None

    def record(self, pid, starttime, cmdline, sig, outcome):
        line = json_dumps({
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


def send_signal(pid, starttime, sig, proc=PROC):
    """Signal (pid, starttime) only if it still is that process; returns the outcome.

    With pidfd (Linux 5.1+, Python 3.9+) the identity check and the signal target the same
    process even if the PID is reused in between; otherwise the window is microseconds.
    """
    pidfd = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pidfd = None
    try:
        st = read_stat(pid, proc)
        if st is None:
            return "gone"
        if st["starttime"] != starttime:
            return "pid reused"
        if has_exited(st):
            return "gone"
        if is_kernel_thread(st):
            return "refused: kernel thread"
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "permission denied"
        except OSError as exc:
            return "error: %s" % (exc.strerror or exc)
        return "sent"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def exited(pid, starttime, proc=PROC):
    """Gone, reused, or a zombie (which holds no GPU memory) all count as exited."""
    st = read_stat(pid, proc)
    return st is None or st["starttime"] != starttime or has_exited(st)


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


#: pidfd_open(2)'s number where os.pidfd_open (3.9+) is missing: 434 on every architecture
#: below (x86_64 and i386: arch/x86/entry/syscalls/syscall_{64,32}.tbl; arm64, riscv and
#: loongarch: include/uapi/asm-generic/unistd.h; arm, powerpc, s390: their syscall.tbl; the
#: same number on this machine's asm/unistd_64.h). Elsewhere (mips, alpha, x32): polling.
PIDFD_OPEN_NR = {"x86_64": 434, "i386": 434, "i486": 434, "i586": 434, "i686": 434,
                 "aarch64": 434, "armv6l": 434, "armv7l": 434, "armv8l": 434, "ppc64le": 434,
                 "ppc64": 434, "ppc": 434, "s390x": 434, "riscv64": 434, "loongarch64": 434}
#: "off": why pidfd_open proved unusable on this host (ENOSYS: kernel older than 5.3; EPERM:
#: a seccomp filter), so every later wait polls; "syscall": the ctypes fallback, once.
PIDFD_STATE = {"off": None, "syscall": None}


def _pidfd_syscall():
    """libc's syscall(2) through ctypes, or None (no ctypes, unknown architecture)."""
    if PIDFD_STATE["syscall"] is None:
        fn = False
        nr = PIDFD_OPEN_NR.get(os.uname()[4])
        if nr is not None:
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                raw = libc.syscall
                raw.restype = ctypes.c_long

                def fn(pid, _nr=nr, _raw=raw, _ct=ctypes):
                    fd = _raw(_ct.c_long(_nr), _ct.c_int(pid), _ct.c_uint(0))
                    if fd < 0:
                        err = _ct.get_errno()
                        raise OSError(err, os.strerror(err))
                    return int(fd)
            except (ImportError, OSError, AttributeError):
                fn = False
        PIDFD_STATE["syscall"] = fn
    return PIDFD_STATE["syscall"] or None


def pidfd_open(pid):
    """A pidfd (a descriptor that becomes readable when the process exits) or OSError."""
    if PIDFD_STATE["off"]:
        raise OSError(errno.ENOSYS, PIDFD_STATE["off"])
    if hasattr(os, "pidfd_open"):
        return os.pidfd_open(pid)
    fn = _pidfd_syscall()
    if fn is None:
        raise OSError(errno.ENOSYS, "no os.pidfd_open and no syscall(2) for this architecture")
    return fn(pid)


def exit_watch(t, proc=PROC, allow_pidfd=True):
    """("gone", None) | ("fd", pidfd) | ("poll", why) for one target of the exit wait.

    The pidfd is opened only after the identity check, and the identity is checked again once
    the descriptor pins the pid: had the pid been reused in between, the descriptor would
    watch another process. Only the real /proc's pids can have a pidfd (tests pass a fake).
    """
    if exited(t["pid"], t["starttime"], proc):
        return "gone", None
    if proc != PROC:
        return "poll", "not the real /proc"
    if not allow_pidfd:
        return "poll", "pidfd disabled by the request"
    try:
        fd = pidfd_open(t["pid"])
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return "gone", None
        why = "pidfd_open: %s" % (exc.strerror or exc)
        if exc.errno in (errno.ENOSYS, errno.EPERM) and not PIDFD_STATE["off"]:
            PIDFD_STATE["off"] = why  # the same answer for every pid of this host
        return "poll", why
    if exited(t["pid"], t["starttime"], proc):
        os.close(fd)
        return "gone", None
    return "fd", fd


def wait_exit(targets, seconds, poll, deadline, proc=PROC, stats=None, allow_pidfd=True,
              wake=None):
    """Until every (pid, starttime) exited or seconds passed; returns those still there.

    Event-driven where the kernel has pidfds (Linux 5.3+): one poll(2) over a pidfd per target
    returns the moment one exits (a zombie whose threads are all gone counts, as in
    ``exited``); targets without one (old kernel, seccomp, fake /proc) are polled every
    ``poll`` s as before (``allow_pidfd=False``: all of them, the request's ``"pidfd": false``).
    ``stats`` counts each way: {"pidfd", "polled", "reason"} (the clean document's exit_wait).
    ``wake``: a descriptor that ends the wait once readable (the operator's cancel).
    """
    end = min(time.monotonic() + seconds, deadline.end)
    stats = stats if stats is not None else {}
    watched, polled = {}, []
    import select  # a clean's only: not loaded by a snapshot's start

    poller = select.poll()
    if wake is not None:
        poller.register(wake, select.POLLIN)
    try:
        for t in targets:
            how, what = exit_watch(t, proc, allow_pidfd)
            if how == "fd":
                watched[what] = t
                poller.register(what, select.POLLIN)
            elif how == "poll":
                polled.append(t)
                stats["reason"] = stats.get("reason") or what
        stats["pidfd"] = stats.get("pidfd", 0) + len(watched)
        stats["polled"] = stats.get("polled", 0) + len(polled)
        while True:
            polled = [t for t in polled if not exited(t["pid"], t["starttime"], proc)]
            now = time.monotonic()
            if (not watched and not polled) or now >= end:
                return [t for t in list(watched.values()) + polled
                        if not exited(t["pid"], t["starttime"], proc)]
            wait = min(poll, end - now) if polled else end - now
            for fd, _event in poller.poll(max(1, int(wait * 1000 + 0.999))):
                if fd == wake:
                    end = now  # cancelled: who is still there, at once
                    continue
                t = watched.pop(fd, None)
                poller.unregister(fd)
                os.close(fd)
                if t is not None and not exited(t["pid"], t["starttime"], proc):
                    polled.append(t)  # readable, yet /proc disagrees: do not spin on it
    finally:
        for fd in watched:
            os.close(fd)


def stop_units(units, req, deadline, reserve, res):
    systemctl = req.get("systemctl") or which("systemctl", SYSTEMCTL_FALLBACKS)
    for u in units:
        name = u.get("unit") if isinstance(u, dict) else None
        entry = {"unit": name, "ok": False, "error": None}
        res["units_stopped"].append(entry)
        if not valid_unit(name):
            entry["error"] = "invalid unit name"
            continue
        if systemctl is None:
            entry["error"] = "systemctl not found"
            continue
        steps = ["stop"] + (["disable"] if u.get("disable") else [])
        for verb in steps:
            r = run_cmd([systemctl, "--no-ask-password", verb, name],
                        max(0.0, deadline.remaining() - reserve), deadline, "systemctl " + verb)
            fail = smi_failure(r)
            if fail is not None:
                entry["error"] = "systemctl %s: %s" % (verb, fail[0])
                break
        else:
            entry["ok"] = True


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


def clean_shm(req, res, proc=PROC):
    """Remove known leftovers (NCCL, PSM, torch, vLLM) in /dev/shm that no live process has
    open or mapped. Unreadable fds or maps make it conservative, never bolder."""
    shm_dir = req.get("shm_dir") or "/dev/shm"
    min_age = float(req.get("shm_min_age_s", 10.0))
    prefix = shm_dir.rstrip("/") + "/"
    try:
        names = sorted(n for n in os.listdir(shm_dir) if SHM_LEFTOVER_RE.match(n))
    except OSError as exc:
        res["warnings"].append("shm: cannot list %s: %s" % (shm_dir, exc))
        return
    if not names:
        return
    used, denied = scan_fds(lambda t: _strip_deleted(t) if t.startswith(prefix) else None, (),
                            proc)
    in_use = set()
    for paths in used.values():
        in_use.update(paths)
    if not _shm_mapped(prefix, in_use, denied, res, proc):
        return
    _remove_shm(names, prefix, in_use, denied, min_age, res)


def _strip_deleted(path):
    """A path as /proc shows it, without the " (deleted)" of an unlinked file."""
    return path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path


def _shm_mapped(prefix, in_use, denied, res, proc):
    """Add to in_use the paths under prefix that any process maps (PIDs whose maps are
    unreadable to denied); False (and a warning) when a D-state process's maps could not be
    read in time: then nothing may be removed."""
    try:
        pids = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        pids = []
    for name in pids:
        path = proc + "/" + name + "/maps"
        st = read_stat(int(name), proc)
        if st is not None and st["state"] == "D":
            raw, timed_out = read_bytes_bounded(path, 1.0, 64 << 20)
            if timed_out:
                res["warnings"].append("shm: maps of PID %s unreadable (D state): nothing "
                                       "removed" % name)
                return False
        else:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except PermissionError:
                denied.append(int(name))
                continue
            except (OSError, IOError):
                continue
        if raw is None:
            continue
        for line in raw.decode("utf-8", "replace").splitlines():
            i = line.find(prefix)
            if i >= 0:
                in_use.add(_strip_deleted(line[i:].rstrip()))
    return True


def _remove_shm(names, prefix, in_use, denied, min_age, res):
    """Unlink the leftovers not in use: regular files older than min_age, and when some
    process could not be seen, only our own."""
    euid = os.geteuid()
    now = time.time()
    for name in names:
        path = prefix + name
        if path in in_use:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat_mod.S_ISREG(st.st_mode) or now - st.st_mtime < min_age:
            continue
        if denied and st.st_uid != euid:
            continue  # someone we cannot see might use it
        try:
            os.unlink(path)
            res["shm_removed"].append(path)
        except OSError as exc:
            res["warnings"].append("shm: cannot remove %s: %s" % (path, exc.strerror))


def reset_gpus(req, scope, snap, deadline, res):
    facts = snap.get("facts") or {}
    smi = facts.get("nvidia_smi")
    by_index = dict((g["index"], g) for g in snap.get("gpus") or ())
    attempted = False
    for index in scope:
        entry = {"index": index, "ok": False, "message": None}
        res["reset"].append(entry)
        gpu = by_index.get(index)
        if gpu is None:
            entry["message"] = "no GPU with index %s" % index
            continue
        minor = gpu.get("minor") if gpu.get("minor") is not None else index
        dev = "/dev/nvidia%d" % minor
        holders = [h["pid"] for h in snap.get("holders") or () if dev in h["devices"]]
        why = reset_refusal(bool(facts.get("is_root")), bool(facts.get("in_container")),
                            bool(facts.get("wsl2")), holders)
        if why is None and smi is None:
            why = "nvidia-smi not found"
        if why is not None:
            entry["message"] = "not reset: " + why
            continue
        attempted = True
        r = run_cmd([smi, "--gpu-reset", "-i", str(index)], max(req["smi_timeout_s"], 30.0),
                    deadline, "nvidia-smi --gpu-reset")
        fail = smi_failure(r)
        entry["ok"] = fail is None
        entry["message"] = fail[0] if fail else first_line(r.out, r.err)
    return attempted


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
        _record_survivors(targets, res, proc)
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

    _record_survivors(targets, res, proc)
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


def _record_survivors(targets, res, proc):
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
