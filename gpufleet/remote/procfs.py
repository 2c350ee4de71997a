"""What /proc says: who holds NVIDIA device files (fds, maps), process details, containers.

A piece of the remote agent. Processes vanish mid-scan: every read tolerates that; a read that
is refused is reported with its true reason, never guessed.
"""
import os
import pwd
import re

from .jobs import read_bytes, read_bytes_bounded, read_text  # joined
from .parse import (  # joined
    CMDLINE_MAX,
    ParseError,
    container_from_cgroup_text,
    format_cmdline,
    is_device_path,
    is_kernel_thread,
    normalize_bus_id,
    parse_cgroup,
    parse_maps_devices,
    parse_proc_information,
    parse_stat,
    parse_status_uid,
    cgroup_units,
)

PROC = "/proc"
DEV = "/dev"
#: podman's /run/.containerenv: the container's name on a line ``name="..."``.
CONTAINERENV_NAME_RE = re.compile(r'^name="([^"]*)"', re.M)


def device_target(target):
    return target if is_device_path(target) else None


def scan_fds(want, exclude=(), proc=PROC):
    """{pid: set(want(link))} over /proc/*/fd with plain listdir/readlink (fast at 5,000
    processes); processes vanishing mid-scan are skipped; returns (found, [denied pids])."""
    found = {}
    denied = []
    try:
        names = os.listdir(proc)
    except OSError:
        return found, [-1]
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in exclude:
            continue
        fd_dir = proc + "/" + name + "/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            denied.append(pid)
            continue
        except OSError:
            continue
        if not fds:
            fd_dirs = leader_gone_fd_dirs(pid, proc)
        else:
            fd_dirs = [(fd_dir, fds)]
        hits = None
        for fd_dir, fds in fd_dirs:
            hits = _readlinks(fd_dir, fds, want, hits)
            if hits is False:
                denied.append(pid)
                hits = None
                break
        if hits:
            found[pid] = hits
    return found, denied


MAPS_LIMIT = 16 << 20  # a big CUDA process maps ~10k areas, well under 2 MiB of text
MAPS_TIMEOUT_S = 0.5


def mapped_devices(pid, proc=PROC, timeout=MAPS_TIMEOUT_S):
    """The NVIDIA device files PID has mapped: a CUDA context maps /dev/nvidiaN and
    /dev/nvidia-uvm, an NVML client maps none, a running nvidia-smi only /dev/nvidiactl
    (recorded). A zombie leader's own maps are empty while its threads still run (recorded on
    the H200): a live thread's maps are the process's. None = not available: unreadable, too
    big, too slow (a D-state process holds its memory lock), a zombie with no thread left."""
    st = read_stat(pid, proc)
    if st is None:
        return None
    path = "%s/%d/maps" % (proc, pid)
    if st["state"] in ("Z", "X"):
        live = live_threads(pid, st, proc)
        if not live:
            return None
        path = "%s/%d/task/%d/maps" % (proc, pid, live[0][0])
    raw, timed_out = read_bytes_bounded(path, timeout, MAPS_LIMIT + 1)
    if timed_out or raw is None or len(raw) > MAPS_LIMIT:
        return None
    return parse_maps_devices(raw.decode("utf-8", "replace"))


def denied_reasons(denied, proc=PROC):
    """[{pid, comm, reason}] for processes whose open files could not be read: the true
    reason, not a guess (as root it is a container runtime's process, or another user
    namespace, that ptrace-style access is refused for)."""
    euid = os.geteuid()
    out = []
    for pid in denied[:20]:
        if pid <= 0:
            out.append({"pid": pid, "comm": None, "reason": "cannot list /proc"})
            continue
        comm = (read_text(proc + "/%d/comm" % pid, 256) or "").strip() or None
        if euid == 0:
            reason = ("permission denied although the agent is root (no CAP_SYS_PTRACE here, "
                      "or the process belongs to another user namespace)")
        else:
            uid = parse_status_uid(read_text(proc + "/%d/status" % pid) or "")
            reason = "permission denied: owned by %s, the agent runs as %s (not root)" % (
                user_name(uid) if uid is not None else "another user", user_name(euid))
        out.append({"pid": pid, "comm": comm, "reason": reason})
    return out


def denied_warning(denied, proc=PROC):
    """Say WHOSE device files could not be read: as root that is usually only PID 1 of a
    container runtime, which an operator can judge; a bare "may be hidden" cannot be."""
    names = []
    for pid in denied[:5]:
        comm = (read_text(proc + "/%d/comm" % pid, 256) or "").strip() or "?"
        names.append("%d (%s)" % (pid, comm) if pid > 0 else "/proc")
    more = " and %d more" % (len(denied) - 5) if len(denied) > 5 else ""
    return ("cannot read the open files of %d process(es): %s%s; GPU holders among them "
            "would be hidden" % (len(denied), ", ".join(names), more))


def _readlinks(fd_dir, fds, want, hits):
    """want(target) of every fd link; False when reading them is not permitted."""
    for fd in fds:
        try:
            target = os.readlink(fd_dir + "/" + fd)
        except PermissionError:
            return False
        except OSError:
            continue
        hit = want(target)
        if hit:
            if hits is None:
                hits = set()
            hits.add(hit)
    return hits


def leader_gone_fd_dirs(pid, proc=PROC):
    """A zombie leader has no fd table of its own, but threads that still run share one:
    read it through /proc/PID/task/TID/fd (kernel threads and real zombies yield nothing)."""
    st = read_stat(pid, proc)
    if st is None or st["state"] not in ("Z", "X") or st["num_threads"] <= 1:
        return []
    try:
        tids = [t for t in os.listdir("%s/%d/task" % (proc, pid)) if t != str(pid)]
    except OSError:
        return []
    for tid in tids:
        d = "%s/%d/task/%s/fd" % (proc, pid, tid)
        try:
            fds = os.listdir(d)
        except OSError:
            continue
        if fds:
            return [(d, fds)]
    return []


TASKS_MAX = 512  # threads read under one zombie leader (a torch process runs ~20-100)


def live_threads(pid, st, proc=PROC):
    """[(tid, stat)] of the threads still running under a zombie leader (none for a live
    leader, a true zombie or a kernel thread): after the main thread exits (pthread_exit, or
    a kill whose threads are stuck in the driver) they hold what the process holds."""
    if st["state"] not in ("Z", "X") or st["num_threads"] <= 1:
        return []
    try:
        tids = sorted(int(t) for t in os.listdir("%s/%d/task" % (proc, pid)) if t.isdigit())
    except OSError:
        return []
    out = []
    for tid in tids[:TASKS_MAX]:
        if tid == pid:
            continue
        text = read_text("%s/%d/task/%d/stat" % (proc, pid, tid))
        try:
            tst = parse_stat(text) if text else None
        except ParseError:
            tst = None
        if tst is not None and tst["state"] not in ("Z", "X"):
            out.append((tid, tst))
    return out


def thread_facts(pid, st, proc=PROC):
    """Under a zombie leader: how many threads still run, and those in uninterruptible sleep
    (D) with their wchan -- a killed process's threads stuck in the driver, which no signal
    ends. {} for any other process (nothing read)."""
    live = live_threads(pid, st, proc)
    if not live:
        return {}
    stuck = []
    for tid, tst in live:
        if tst["state"] == "D":
            w = (read_text("%s/%d/task/%d/wchan" % (proc, pid, tid)) or "").strip()
            stuck.append({"tid": tid, "wchan": w if w not in ("", "0") else None})
    return {"live_threads": len(live), "stuck_threads": stuck}


def read_stat(pid, proc=PROC):
    text = read_text("%s/%d/stat" % (proc, pid))
    if text is None:
        return None
    try:
        return parse_stat(text)
    except ParseError:
        return None


def ancestors_of(pid, proc=PROC):
    """Parent chain of pid up to and including pid 1 (or the namespace's top)."""
    out = []
    seen = set([pid])
    st = read_stat(pid, proc)
    while st is not None and st["ppid"] > 0 and st["ppid"] not in seen:
        out.append(st["ppid"])
        seen.add(st["ppid"])
        st = read_stat(st["ppid"], proc)
    return out


_USERS = {}  # type: dict


def user_name(uid):
    if uid is None:
        return None
    if uid not in _USERS:
        try:
            _USERS[uid] = pwd.getpwuid(uid).pw_name
        except (KeyError, OverflowError):
            _USERS[uid] = str(uid)
    return _USERS[uid]


def exe_evidence(pid, proc=PROC):
    """(executable path, root's) of a process: the kernel's /proc/PID/exe link, and whether the
    file it runs (stat through the link: the very inode, in any mount namespace) belongs to
    root and is writable by no one else -- a binary only root could have put there. A user can
    title a process anything ("sshd: alice@pts/3"); it cannot make its executable root's
    sshd. (None, None): not readable here (another user's process for a non-root agent, a
    zombie, a kernel thread)."""
    link = "%s/%d/exe" % (proc, pid)
    try:
        path = os.readlink(link)
        st = os.stat(link)
    except OSError:
        return None, None
    return path, st.st_uid == 0 and not st.st_mode & 0o022


def process_entry(pid, ctx, proc=PROC):
    """Everything the controller needs to name, attribute and judge one process; None if gone."""
    base = "%s/%d/" % (proc, pid)
    st = read_stat(pid, proc)
    if st is None:
        return None
    status = read_text(base + "status") or ""
    uid = parse_status_uid(status)
    comm = read_text(base + "comm")
    comm = comm[:-1] if comm and comm.endswith("\n") else comm
    if st["state"] == "D":
        raw, timed_out = read_bytes_bounded(base + "cmdline", 1.0, CMDLINE_MAX * 4)
        if timed_out:
            ctx.setdefault("warnings", []).append(
                "cmdline of PID %d unreadable (D state, memory lock held)" % pid)
    else:
        raw = read_bytes(base + "cmdline", CMDLINE_MAX * 4)
    cgroup_text = read_text(base + "cgroup") or ""
    cgroup = parse_cgroup(cgroup_text)
    wchan = (read_text(base + "wchan") or "").strip()
    exe, exe_root = exe_evidence(pid, proc)
    entry = {
        "pid": pid,
        "ppid": st["ppid"],
        "starttime": st["starttime"],
        "state": st["state"],
        "uid": uid,
        "user": user_name(uid),
        "comm": comm if comm is not None else st["comm"],
        "cmdline": format_cmdline(raw) if raw is not None else "",
        "exe": exe,
        "exe_root": exe_root,
        "cgroup": cgroup,
        "unit": None,  # systemd's answer, confirm_units
        "unit_claims": cgroup_units(cgroup)[0],
        "user_unit": None,
        "user_unit_uid": None,
        "container": container_from_cgroup_text(cgroup_text),
        "session": st["session"],
        "pgid": st["pgid"],
        "kernel_thread": is_kernel_thread(st),
        "wchan": wchan if wchan not in ("", "0") else None,
        "relation": relation_of(pid, st, ctx),
        "threads": st["num_threads"],  # > 1 with state Z: its threads still hold
    }
    entry.update(thread_facts(pid, st, proc))  # live_threads, stuck_threads: zombie leaders
    return entry


def relation_of(pid, st, ctx):
    """The process's relation to the agent: self, ancestor, session, or None."""
    if pid == ctx.get("self_pid"):
        return "self"
    if pid in ctx.get("ancestors", ()):
        return "ancestor"
    if ctx.get("session") is not None and st["session"] == ctx.get("session"):
        return "session"
    return None


def self_context(proc=PROC):
    me = os.getpid()
    st = read_stat(me, proc)
    return {
        "self_pid": me,
        "starttime": st["starttime"] if st else None,
        "session": st["session"] if st else None,
        "ancestors": ancestors_of(me, proc),
        "warnings": [],
    }


def hidepid_active(proc=PROC):
    text = read_text(proc + "/mounts") or ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == proc and "hidepid=" in parts[3]:
            return "hidepid=0" not in parts[3] and "hidepid=off" not in parts[3]
    return False


def gpu_minors_from_proc(proc=PROC):
    """{normalized bus id: minor} from /proc/driver/nvidia/gpus/*/information (bare metal)."""
    base = proc + "/driver/nvidia/gpus"
    out = {}
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        text = read_text(base + "/" + name + "/information")
        if text is None:
            continue
        bus, minor = parse_proc_information(text)
        bus = bus or normalize_bus_id(name)
        if bus is not None and minor is not None:
            out[bus] = minor
    return out


def container_facts(proc=PROC):
    """(in_container, container name or None) from the usual marks a runtime leaves."""
    name = container_from_cgroup_text(read_text(proc + "/self/cgroup") or "") or \
        container_from_cgroup_text(read_text(proc + "/1/cgroup") or "")
    inside = name is not None
    if os.path.exists("/.dockerenv"):
        inside = True
        name = name or "docker"
    if os.path.exists("/run/.containerenv"):
        inside = True
        m = CONTAINERENV_NAME_RE.search(read_text("/run/.containerenv") or "")
        name = name or ("podman:" + m.group(1) if m and m.group(1) else "podman")
    env1 = read_bytes(proc + "/1/environ") or b""
    for item in env1.split(b"\0"):
        if item.startswith(b"container="):
            inside = True
            name = name or item[len(b"container="):].decode("utf-8", "replace") or None
    if os.environ.get("container"):
        inside = True
        name = name or os.environ["container"]
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        inside = True
        name = name or "k8s"
    return inside, name


def is_wsl2(proc=PROC):
    osrelease = (read_text(proc + "/sys/kernel/osrelease") or "").lower()
    return "microsoft" in osrelease or os.path.exists(DEV + "/dxg")
