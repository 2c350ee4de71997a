# gpufleet remote agent. Standard library only; must run on Python 3.6+.
"""What one host knows about its GPUs, gathered in one exec; and the clean sequence.

The controller sends ``<len>\\n<this source><request JSON>`` on stdin to a constant
``python3 -c`` bootstrap (docs/DESIGN.md, "Running the agent"), which execs this source with
globals ``{"__name__": "gpufleet_agent", "REQUEST": <request bytes>}``. For debugging,
``python3 agent.py < request.json`` works too (an empty stdin means a snapshot).

The agent prints exactly one JSON document on stdout and exits 0: its own failures are
values in that document. Everything it starts is bounded by the request's deadline because
nvidia-smi can hang in D state when the driver is wedged (then it cannot even be reaped).

Parsing lives in small pure functions (``parse_*``, ``split_row``, ``unit_of``, ...) so the
unit tests can feed them recorded nvidia-smi output (tests/fixtures/recorded/).

Request keys beyond docs/DESIGN.md, for tests and odd hosts: ``systemctl`` (path),
``shm_dir`` (default /dev/shm), ``shm_min_age_s`` (default 10), ``lock_wait_s`` (default
timeout_s), ``default_threshold_mib`` (default 64), ``cuda_version`` (default true),
``wait_floor_mib`` ({"index": MiB} held by processes the plan does not signal: the memory
wait ends once only that is left, instead of waiting out the timeout).
"""
import errno
import fcntl
import json
import os
import pwd
import re
import signal
import socket
import stat as stat_mod
import subprocess
import sys
import threading
import time
import traceback

AGENT_VERSION = 1
PROC = "/proc"
DEV = "/dev"
CMDLINE_MAX = 4096
PF_KTHREAD = 0x00200000
SMI_FALLBACKS = (
    "/usr/bin/nvidia-smi",
    "/usr/local/nvidia/bin/nvidia-smi",
    "/usr/lib/wsl/lib/nvidia-smi",
)
SYSTEMCTL_FALLBACKS = ("/usr/bin/systemctl", "/bin/systemctl")
DEFAULT_LOCK = "/tmp/gpufleet-clean.lock"

GPU_FIELDS = (
    "index", "uuid", "name", "pci.bus_id", "memory.used", "memory.total", "memory.free",
    "utilization.gpu", "driver_version",
)
OPTIONAL_GPU_FIELDS = ("memory.reserved",)
REQUIRED_GPU_FIELDS = ("index", "uuid")
APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")
GPU_KEYS = {
    "index": "index",
    "uuid": "uuid",
    "name": "name",
    "pci.bus_id": "pci_bus_id",
    "memory.used": "memory_used_mib",
    "memory.total": "memory_total_mib",
    "memory.free": "memory_free_mib",
    "memory.reserved": "memory_reserved_mib",
    "utilization.gpu": "utilization_pct",
    "driver_version": "driver_version",
}
INT_FIELDS = frozenset(
    ["index", "memory.used", "memory.total", "memory.free", "memory.reserved", "utilization.gpu"]
)

DEVICE_RE = re.compile(
    r"^/dev/(?:nvidia[0-9]+|nvidiactl|nvidia-uvm|nvidia-uvm-tools|nvidia-caps/[^/]+|dxg)$"
)
GPU_DEVICE_RE = re.compile(r"^/dev/nvidia([0-9]+)$")
INVALID_FIELD_RE = re.compile(r'Field "([^"]+)" is not a valid field to query')
INT_RE = re.compile(r"^(-?[0-9]+)(?:\s*(?:MiB|%))?$")
BUS_RE = re.compile(r"^\s*([0-9A-Fa-f]+):([0-9A-Fa-f]+):([0-9A-Fa-f]+)\.([0-9A-Fa-f]+)\s*$")
Q_HEADER_RE = re.compile(r"^GPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s*$")
Q_KV_RE = re.compile(r"^\s*([^:]+?)\s*:\s*(.*?)\s*$")
CUDA_RE = re.compile(r"CUDA Version\s*:\s*([0-9][0-9.]*)")
DRIVER_RE = re.compile(r"Driver Version\s*:\s*([0-9][0-9.]*)")
UNIT_RE = re.compile(
    r"^[A-Za-z0-9_][A-Za-z0-9:_.@\\-]*\."
    r"(?:service|scope|socket|target|timer|slice|mount|path|swap|automount|device)$"
)
SHM_LEFTOVER_RE = re.compile(r"^(?:nccl-|psm_|torch_|vllm)")


class ParseError(ValueError):
    """Output that is not what nvidia-smi (or /proc) is known to print."""


class AgentDeadline(BaseException):
    """Raised by the SIGALRM last-resort bound; BaseException so no `except Exception` eats it."""


# ----------------------------------------------------------------------------- pure parsing


def na(value):
    """nvidia-smi's "not available" spellings -> None; anything else stripped."""
    if value is None:
        return None
    v = value.strip()
    if not v or v in ("N/A", "n/a", "Not Supported", "Unknown Error"):
        return None
    if v.startswith("[") and v.endswith("]"):  # [N/A], [Not Supported], [GPU requires reset]
        return None
    return v


def parse_int(value):
    """A number from nvidia-smi (units tolerated), None when not available; garbage raises."""
    v = na(value)
    if v is None:
        return None
    m = INT_RE.match(v)
    if not m:
        raise ParseError("not a number: %r" % v[:40])
    return int(m.group(1))


def split_row(line, n, free=None):
    """Split one nvidia-smi CSV row into n fields; field ``free`` may itself contain commas.

    nvidia-smi does not quote, so a process or GPU name with a comma would shift every
    following column; taking the fixed columns from both ends keeps the free one intact.
    """
    if free is None:
        parts = line.split(",")
    else:
        head = line.split(",", free)
        if len(head) <= free:
            raise ParseError("expected %d fields, got %d: %r" % (n, len(head), line[:80]))
        parts = head[:free] + head[free].rsplit(",", n - free - 1)
    parts = [p.strip() for p in parts]
    if len(parts) != n:
        raise ParseError("expected %d fields, got %d: %r" % (n, len(parts), line[:80]))
    return parts


def _data_lines(text):
    for line in text.splitlines():
        if not line.strip() or line.startswith("WARNING"):
            continue
        yield line


def check_complete(text, what):
    """nvidia-smi ends every CSV row with a newline: output that does not is cut short (a
    broken pipe, a dying driver), and a cut row can still parse -- as a smaller number or a
    shorter GPU UUID. Refuse it rather than report a smaller truth."""
    if text and not text.endswith("\n"):
        tail = text.rsplit("\n", 1)[-1]
        raise ParseError("truncated nvidia-smi %s output (no final newline after %r)"
                         % (what, tail[-40:]))


def parse_gpu_csv(text, fields):
    """Rows of ``--query-gpu=<fields> --format=csv,noheader,nounits`` -> dicts keyed by GPU_KEYS."""
    fields = list(fields)
    free = fields.index("name") if "name" in fields else None
    gpus = []
    for line in _data_lines(text):
        parts = split_row(line, len(fields), free)
        row = {}
        for f, v in zip(fields, parts):
            key = GPU_KEYS.get(f, f.replace(".", "_"))
            row[key] = parse_int(v) if f in INT_FIELDS else na(v)
        if "index" in fields and row.get("index") is None:
            raise ParseError("GPU row without index: %r" % line[:80])
        if "uuid" in fields and not row.get("uuid"):
            raise ParseError("GPU row without uuid: %r" % line[:80])
        gpus.append(row)
    return gpus


def parse_apps_csv(text):
    """Rows of ``--query-compute-apps=pid,process_name,used_memory,gpu_uuid`` -> (apps, skipped).

    Rows without a PID (seen in some containers) are skipped and counted, not fatal.
    nvidia-smi prints process_name (argv[0]) verbatim: a name holding a newline splits its
    row, so a line with too few fields is joined with the next (one user's odd process
    title must not make the whole host unreadable).
    """
    apps = []
    skipped = 0
    pending = None
    for line in _data_lines(text):
        if pending is None and line.strip().lower().startswith("no running"):
            continue
        if pending is not None:
            line = pending + "\n" + line
            pending = None
        if line.count(",") < 3:
            pending = line
            continue
        pid_s, name, used, uuid = split_row(line, 4, 1)
        pid = parse_int(pid_s)
        uuid = na(uuid)
        if uuid is None:
            raise ParseError("compute app without GPU UUID: %r" % line[:80])
        if pid is None:
            skipped += 1
            continue
        apps.append({"pid": pid, "process_name": na(name) or "", "used_mib": parse_int(used),
                     "gpu_uuid": uuid})
    if pending is not None:
        split_row(pending, 4, 1)  # raises: a row cut short
    return apps, skipped


def normalize_bus_id(value):
    """00000000:00:06.0 (nvidia-smi) and 0000:00:06.0 (/proc/driver) -> 0000:00:06.0."""
    if not value:
        return None
    m = BUS_RE.match(value)
    if not m:
        return None
    d, b, s, f = (int(g, 16) for g in m.groups())
    return "%04x:%02x:%02x.%x" % (d, b, s, f)


def parse_proc_information(text):
    """/proc/driver/nvidia/gpus/BUS/information -> (normalized bus id, minor) (either may be None)."""
    bus = None
    minor = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "Bus Location":
            bus = normalize_bus_id(value.strip())
        elif key == "Device Minor":
            try:
                minor = parse_int(value)
            except ParseError:
                minor = None
    return bus, minor


def parse_q_minors(text):
    """``nvidia-smi -q`` -> {normalized bus id: minor or None}.

    A block starts at a "GPU 0000...:..." header; grep'd output without headers pairs each
    "Minor Number" with the "Bus Id" that follows it.
    """
    missing = object()
    blocks = []
    cur = None
    for line in text.splitlines():
        m = Q_HEADER_RE.match(line)
        if m:
            cur = {"header": m.group(1), "minor": missing, "bus": None}
            blocks.append(cur)
            continue
        kv = Q_KV_RE.match(line)
        if not kv:
            continue
        key, value = kv.group(1), kv.group(2)
        if key == "Minor Number":
            if cur is None or cur["minor"] is not missing:
                cur = {"header": None, "minor": missing, "bus": None}
                blocks.append(cur)
            try:
                cur["minor"] = parse_int(value)
            except ParseError:
                cur["minor"] = None
        elif key == "Bus Id":
            if cur is None:
                cur = {"header": None, "minor": missing, "bus": None}
                blocks.append(cur)
            if cur["bus"] is None:
                cur["bus"] = value
    out = {}
    for b in blocks:
        bus = normalize_bus_id(b["header"] or b["bus"] or "")
        if bus is not None and b["minor"] is not missing:
            out[bus] = b["minor"]
    return out


def parse_versions(text):
    """Driver and CUDA version from the bare ``nvidia-smi`` table header (or ``-q``)."""
    cuda = CUDA_RE.search(text)
    driver = DRIVER_RE.search(text)
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None)


def parse_stat(text):
    """/proc/PID/stat -> dict. comm sits between the first '(' and the LAST ')' because a
    process may name itself anything, ') ' included."""
    left = text.find("(")
    right = text.rfind(")")
    if left < 0 or right < left:
        raise ParseError("stat without (comm)")
    try:
        pid = int(text[:left].strip())
        rest = text[right + 2:].split()
        if len(rest) < 20:
            raise ParseError("stat has %d fields after comm" % len(rest))
        # rest[0] is field 3 (state): field N of proc(5) is rest[N - 3]
        return {
            "pid": pid,
            "comm": text[left + 1:right],
            "state": rest[0],
            "ppid": int(rest[1]),
            "pgid": int(rest[2]),
            "session": int(rest[3]),
            "flags": int(rest[6]),
            "num_threads": int(rest[17]),
            "starttime": int(rest[19]),
        }
    except ValueError as exc:
        raise ParseError("bad stat: %s" % exc)


def has_exited(st):
    """Z/X with no thread left. A zombie LEADER whose other threads still run (seen on a real
    H200: a CUDA process shows "Z" right after SIGTERM while its threads tear the context
    down) still holds the GPU; a real zombie holds nothing."""
    return st["state"] in ("Z", "X", "x") and st.get("num_threads", 1) <= 1


def is_kernel_thread(st):
    """PF_KTHREAD in the stat flags; pid 2 / ppid 2 (kthreadd) when flags are unusable."""
    flags = st.get("flags")
    if isinstance(flags, int):
        return bool(flags & PF_KTHREAD)
    return st.get("pid") == 2 or st.get("ppid") == 2


def parse_status_uid(text):
    """Effective uid from /proc/PID/status ("Uid: real effective saved fs"), as ps shows."""
    for line in text.splitlines():
        if line.startswith("Uid:"):
            parts = line.split()[1:]
            try:
                return int(parts[1] if len(parts) > 1 else parts[0])
            except (IndexError, ValueError):
                return None
    return None


def format_cmdline(raw):
    """NUL-separated argv bytes -> one line, undecodable bytes replaced, at most CMDLINE_MAX chars."""
    text = raw.replace(b"\0", b" ").rstrip(b" ").decode("utf-8", "replace")
    return text[:CMDLINE_MAX]


def parse_cgroup(text):
    """/proc/PID/cgroup -> the most telling path: the v2 ("0::") line, else name=systemd."""
    v2 = None
    systemd = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "name=systemd" in controllers.split(","):
            systemd = path
    for cand in (v2, systemd):
        if cand and cand != "/":
            return cand
    return v2 if v2 is not None else systemd


def unit_of(path):
    """The systemd unit owning a cgroup path: its last component ending in .service/.scope."""
    if not path:
        return None
    for comp in reversed(path.split("/")):
        if comp.endswith(".service") or comp.endswith(".scope"):
            return comp
    return None


_CONTAINER_PATTERNS = (
    (re.compile(r"docker-([0-9a-f]{12,})\.scope"), "docker"),
    (re.compile(r"/docker/([0-9a-f]{12,})"), "docker"),
    (re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,})"), "podman"),
    (re.compile(r"cri-containerd-([0-9a-f]{12,})\.scope"), "containerd"),
    (re.compile(r"/containerd/([^/]+)"), "containerd"),
    (re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,})\.scope"), "crio"),
    (re.compile(r"/lxc\.payload[./]([^/]+)"), "lxc"),
    (re.compile(r"/lxc/([^/]+)"), "lxc"),
)
_HEX64_RE = re.compile(r"([0-9a-f]{64})")


def container_of(path):
    """A short container name from a cgroup path ("docker:0123456789ab", "k8s:...", "lxc:web")."""
    if not path:
        return None
    if "kubepods" in path:
        m = _HEX64_RE.search(path.rsplit("/", 1)[-1]) or _HEX64_RE.search(path)
        return "k8s:" + m.group(1)[:12] if m else "kubepods"
    for regex, kind in _CONTAINER_PATTERNS:
        m = regex.search(path)
        if m:
            ident = m.group(1)
            if kind != "lxc":
                ident = ident[:12]
            return kind + ":" + ident
    return None


def container_from_cgroup_text(text):
    """First container hint on any line of /proc/PID/cgroup (v1 hosts put it on every line)."""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            name = container_of(parts[2])
            if name:
                return name
    return None


def valid_unit(name):
    """Unit names are data passed as argv; still, refuse anything that is not a unit name."""
    return isinstance(name, str) and len(name) <= 255 and bool(UNIT_RE.match(name))


def refusal(pid, self_pid, ancestors):
    """The agent's last-resort guard; the real policy is controller-side (gpufleet/policy.py)."""
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


def first_line(*texts):
    for text in texts:
        for line in (text or "").splitlines():
            if line.strip():
                return line.strip()[:300]
    return None


def fmt_seconds(value):
    return "%g" % round(value, 1)


# ----------------------------------------------------------------------------- bounded I/O


class Deadline(object):
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def remaining(self):
        return self.end - time.monotonic()


def read_bytes(path, limit=1 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except (OSError, IOError):
        return None


def read_text(path, limit=1 << 20):
    data = read_bytes(path, limit)
    return None if data is None else data.decode("utf-8", "replace")


_STUCK_READERS = []


def read_bytes_bounded(path, timeout, limit=1 << 20):
    """Read in a daemon thread: /proc/PID/cmdline or maps of a D-state process can block on
    its memory lock (the way `ps` hangs on a wedged GPU host). Returns (data, timed_out)."""
    if len(_STUCK_READERS) >= 8:
        return None, True
    box = []

    def reader():
        box.append(read_bytes(path, limit))

    t = threading.Thread(target=reader)
    t.daemon = True
    t.start()
    t.join(timeout)
    if t.is_alive():
        _STUCK_READERS.append(t)
        return None, True
    return box[0], False


class CmdResult(object):
    def __init__(self, rc=None, out="", err="", error=None, timed_out=False, seconds=0.0):
        self.rc = rc
        self.out = out
        self.err = err
        self.error = error
        self.timed_out = timed_out
        self.seconds = seconds


class Job(object):
    """A child process that never outlives its bound: Popen, communicate(timeout), kill.

    Started in its own session so a kill reaches anything it forked; after a kill it is
    waited for only briefly, because a process in D state cannot be reaped.
    """

    def __init__(self, argv, timeout, deadline, name=None):
        self.name = name or os.path.basename(argv[0])
        self.limit = max(0.0, min(timeout, deadline.remaining()))
        self.t0 = time.monotonic()
        self.proc = None
        self.result = None
        if self.limit <= 0:
            self.result = CmdResult(error="deadline reached before %s ran" % self.name,
                                    timed_out=True)
            return
        env = dict(os.environ)
        env["LC_ALL"] = "C"
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, start_new_session=True, env=env)
        except (OSError, ValueError) as exc:
            self.result = CmdResult(error="cannot run %s: %s" % (self.name, exc))

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def finish(self):
        if self.result is not None:
            return self.result
        p = self.proc
        left = self.limit - (time.monotonic() - self.t0)
        try:
            out, err = p.communicate(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            self.kill()
            self.result = CmdResult(
                error="%s timed out after %ss (driver hung?)" % (self.name, fmt_seconds(self.limit)),
                timed_out=True, seconds=time.monotonic() - self.t0)
            return self.result
        except BaseException:
            self.kill()
            raise
        self.result = CmdResult(
            rc=p.returncode, out=out.decode("utf-8", "replace"),
            err=err.decode("utf-8", "replace"), seconds=time.monotonic() - self.t0)
        return self.result

    def kill(self):
        p = self.proc
        try:
            os.killpg(p.pid, signal.SIGKILL)  # own session: pgid == pid, not yet reaped
        except OSError:
            try:
                p.kill()
            except OSError:
                pass
        try:
            p.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass  # D state: leave it to init, never wait unboundedly
        for f in (p.stdout, p.stderr):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def run_cmd(argv, timeout, deadline, name=None):
    return Job(argv, timeout, deadline, name).finish()


def which(name, fallbacks):
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d:
            cand = os.path.join(d, name)
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    for cand in fallbacks:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def find_nvidia_smi(requested):
    if requested:
        if os.path.isfile(requested) and os.access(requested, os.X_OK):
            return requested
        return None
    return which("nvidia-smi", SMI_FALLBACKS)


# ----------------------------------------------------------------------------- /proc


def device_target(target):
    return target if target.startswith("/dev/") and DEVICE_RE.match(target) else None


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


def parse_maps_devices(text):
    """NVIDIA device files in /proc/PID/maps text (the pathname column), sorted."""
    found = set()
    for line in text.splitlines():
        i = line.find(" /dev/")
        if i < 0:
            continue
        path = line[i + 1:].rstrip()
        if path.endswith(" (deleted)"):
            path = path[:-len(" (deleted)")]
        if DEVICE_RE.match(path):
            found.add(path)
    return sorted(found)


def mapped_devices(pid, proc=PROC, timeout=MAPS_TIMEOUT_S):
    """The NVIDIA device files PID has mapped: a CUDA context maps /dev/nvidiaN and
    /dev/nvidia-uvm, an NVML client maps none, a running nvidia-smi only /dev/nvidiactl
    (recorded). None = not available: unreadable, too big, too slow (a D-state process holds
    its memory lock), or a zombie leader (its maps are empty while its threads still run)."""
    st = read_stat(pid, proc)
    if st is None or st["state"] in ("Z", "X"):
        return None
    raw, timed_out = read_bytes_bounded("%s/%d/maps" % (proc, pid), timeout, MAPS_LIMIT + 1)
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


_USERS = {}


def user_name(uid):
    if uid is None:
        return None
    if uid not in _USERS:
        try:
            _USERS[uid] = pwd.getpwuid(uid).pw_name
        except (KeyError, OverflowError):
            _USERS[uid] = str(uid)
    return _USERS[uid]


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
    if pid == ctx.get("self_pid"):
        relation = "self"
    elif pid in ctx.get("ancestors", ()):
        relation = "ancestor"
    elif ctx.get("session") is not None and st["session"] == ctx.get("session"):
        relation = "session"
    else:
        relation = None
    return {
        "pid": pid,
        "ppid": st["ppid"],
        "starttime": st["starttime"],
        "state": st["state"],
        "uid": uid,
        "user": user_name(uid),
        "comm": comm if comm is not None else st["comm"],
        "cmdline": format_cmdline(raw) if raw is not None else "",
        "cgroup": cgroup,
        "unit": unit_of(cgroup),
        "container": container_from_cgroup_text(cgroup_text),
        "session": st["session"],
        "pgid": st["pgid"],
        "kernel_thread": is_kernel_thread(st),
        "wchan": wchan if wchan not in ("", "0") else None,
        "relation": relation,
        "threads": st["num_threads"],  # > 1 with state Z: still tearing down, still holding
    }


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
        m = re.search(r'^name="([^"]*)"', read_text("/run/.containerenv") or "", re.M)
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


# ----------------------------------------------------------------------------- snapshot


def smi_failure(res):
    """(error, exit_code) of a failed nvidia-smi call, or None when it succeeded."""
    if res.error:
        return res.error, None
    if res.rc != 0:
        return (first_line(res.out, res.err) or "nvidia-smi exited %d" % res.rc), res.rc
    return None


def query_gpus(smi, req, deadline, first_job=None):
    """--query-gpu with optional fields dropped when this driver rejects them.

    Returns (gpus, error, exit_code, seconds)."""
    fields = list(GPU_FIELDS) + list(OPTIONAL_GPU_FIELDS)
    seconds = 0.0
    job = first_job
    for _ in range(len(fields)):
        if job is None:
            job = Job(gpu_query_argv(smi, fields), req["smi_timeout_s"], deadline, "nvidia-smi")
        res = job.finish()
        job = None
        seconds += res.seconds
        fail = smi_failure(res)
        if fail is None:
            try:
                check_complete(res.out, "--query-gpu")
                return parse_gpu_csv(res.out, fields), None, None, seconds
            except ParseError as exc:
                if str(exc).startswith("truncated"):
                    return [], str(exc), None, seconds
                return [], "unparsable nvidia-smi --query-gpu output: %s" % exc, None, seconds
        m = INVALID_FIELD_RE.search(res.out + "\n" + res.err)
        if m and m.group(1) in fields and m.group(1) not in REQUIRED_GPU_FIELDS:
            fields.remove(m.group(1))
            continue
        return [], fail[0], fail[1], seconds
    return [], "nvidia-smi rejected the query fields", None, seconds


def gpu_query_argv(smi, fields):
    return [smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"]


def snapshot(req, deadline, proc=PROC):
    """The snapshot document of gpufleet/model.py; every failure is a value in it."""
    t0 = time.monotonic()
    ctx = self_context(proc)
    warnings = ctx["warnings"]
    smi = find_nvidia_smi(req.get("nvidia_smi"))
    smi_doc = {"ok": False, "error": None, "exit_code": None, "seconds": 0.0}
    gpus = []
    apps = []
    driver = None
    cuda = None
    gpu_job = apps_job = None
    if smi is None:
        smi_doc["error"] = "nvidia-smi not found" + (
            ": %s" % req["nvidia_smi"] if req.get("nvidia_smi") else "")
    else:
        # both queries run while /proc is scanned: one moment, and half the wall time
        gpu_job = Job(gpu_query_argv(smi, list(GPU_FIELDS) + list(OPTIONAL_GPU_FIELDS)),
                      req["smi_timeout_s"], deadline, "nvidia-smi")
        apps_job = Job([smi, "--query-compute-apps=" + ",".join(APP_FIELDS),
                        "--format=csv,noheader,nounits"], req["smi_timeout_s"], deadline,
                       "nvidia-smi")
    own = set([ctx["self_pid"]])
    for job in (gpu_job, apps_job):
        if job is not None and job.pid is not None:
            own.add(job.pid)
    holders, denied = scan_fds(device_target, own, proc)
    # maps right after the fds, and the identity they belong to: a holder that is gone (or
    # whose PID was reused) by the time its details are read was no holder (nvidia-smi runs)
    seen_start = {}
    mapped = {}
    for pid in holders:
        st = read_stat(pid, proc)
        seen_start[pid] = st["starttime"] if st else None
        mapped[pid] = mapped_devices(pid, proc)
    hidden = hidepid_active(proc) and os.geteuid() != 0
    can_read_all = not denied and not hidden
    if hidden:
        warnings.append("/proc is mounted hidepid: other users' processes, and any GPU "
                        "holders among them, are hidden")
    elif denied:
        warnings.append(denied_warning(denied, proc))

    if smi is not None:
        gpus, error, code, secs = query_gpus(smi, req, deadline, gpu_job)
        smi_doc["seconds"] += secs
        ares = apps_job.finish()
        smi_doc["seconds"] += ares.seconds
        if error is not None:
            smi_doc.update(error=error, exit_code=code)
        else:
            smi_doc["ok"] = True
            fail = smi_failure(ares)
            if fail is not None:
                smi_doc.update(ok=False, error="compute apps: %s" % fail[0], exit_code=fail[1])
            else:
                try:
                    check_complete(ares.out, "--query-compute-apps")
                    apps, skipped = parse_apps_csv(ares.out)
                    if skipped:
                        warnings.append("%d compute app row(s) without a PID skipped" % skipped)
                except ParseError as exc:
                    smi_doc.update(ok=False, error=str(exc) if str(exc).startswith("truncated")
                                   else "unparsable nvidia-smi --query-compute-apps output: %s"
                                   % exc)
        for g in gpus:
            driver = driver or g.pop("driver_version", None)
            g.pop("driver_version", None)
            for key in GPU_KEYS.values():
                if key != "driver_version":
                    g.setdefault(key, None)
        # the bare table (for the CUDA version) is skipped only when nvidia-smi is already
        # crawling (a wedged driver) or time is short; a loaded machine is not a wedged one
        if gpus and smi_doc["ok"] and req.get("cuda_version", True) and \
                smi_doc["seconds"] < 5.0 and deadline.remaining() > 2.0 * smi_doc["seconds"] + 2.0:
            res = run_cmd([smi], min(req["smi_timeout_s"], 5.0), deadline, "nvidia-smi")
            smi_doc["seconds"] += res.seconds
            if smi_failure(res) is None:
                d, cuda = parse_versions(res.out)
                driver = driver or d
    attach_minors(gpus, smi, req, deadline, smi_doc, warnings, proc)
    by_uuid = dict((g["uuid"], g["index"]) for g in gpus)
    for a in apps:
        a["gpu_index"] = by_uuid.get(a["gpu_uuid"])

    wanted = set(holders) | set(a["pid"] for a in apps) | own | set(ctx["ancestors"])
    for job in (gpu_job, apps_job):  # our own nvidia-smi children are not worth listing
        if job is not None and job.pid is not None:
            wanted.discard(job.pid)
    processes = {}
    for pid in sorted(wanted):
        entry = process_entry(pid, ctx, proc)
        if entry is not None:
            processes[str(pid)] = entry
    vanished = sorted(p for p in holders if str(p) not in processes or seen_start[p] is None
                      or processes[str(p)]["starttime"] != seen_start[p])
    for pid in vanished:
        del holders[pid]
    unseen = sorted(set(a["pid"] for a in apps if str(a["pid"]) not in processes))
    if unseen:
        warnings.append("nvidia-smi lists PIDs not in this /proc (other PID namespace: "
                        "container or WSL2): %s" % ", ".join(str(p) for p in unseen))
    in_container, container = container_facts(proc)
    euid = os.geteuid()
    facts = {
        "hostname": socket.gethostname(),
        "kernel": os.uname()[2],
        "driver_version": driver,
        "cuda_version": cuda,
        "is_root": euid == 0,
        "uid": euid,
        "user": user_name(euid),
        "can_read_all_fds": can_read_all,
        "in_container": in_container,
        "container": container,
        "wsl2": is_wsl2(proc),
        "nvidia_smi": smi,
        "python": "%d.%d.%d" % tuple(sys.version_info[:3]),
        "agent_pid": ctx["self_pid"],
        "agent_starttime": ctx["starttime"],
        "hidepid": hidden,
    }
    smi_doc["seconds"] = round(smi_doc["seconds"], 3)
    return {
        "agent_version": AGENT_VERSION,
        "mode": "snapshot",
        "facts": facts,
        "nvidia_smi": smi_doc,
        "gpus": gpus,
        "compute_apps": apps,
        "holders": [{"pid": p, "devices": sorted(holders[p]), "mapped": mapped[p]}
                    for p in sorted(holders)],
        "holders_vanished": vanished,
        "fd_unreadable": denied_reasons(denied, proc),
        "processes": processes,
        "warnings": warnings,
        "seconds": round(time.monotonic() - t0, 3),
    }


def attach_minors(gpus, smi, req, deadline, smi_doc, warnings, proc=PROC):
    """minor (the N of /dev/nvidiaN) matched by PCI bus id: /proc/driver first, else -q."""
    for g in gpus:
        g["minor"] = None
    if not gpus:
        return
    minors = gpu_minors_from_proc(proc)
    missing = [g for g in gpus if minors.get(normalize_bus_id(g.get("pci_bus_id"))) is None]
    has_dev_files = False
    try:
        has_dev_files = any(GPU_DEVICE_RE.match("/dev/" + n) for n in os.listdir(DEV))
    except OSError:
        pass
    if missing and smi is not None and has_dev_files and deadline.remaining() > 1.0:
        res = run_cmd([smi, "-q"], req["smi_timeout_s"], deadline, "nvidia-smi")
        smi_doc["seconds"] += res.seconds
        if smi_failure(res) is None:
            minors.update(dict((k, v) for k, v in parse_q_minors(res.out).items()
                               if v is not None))
    for g in gpus:
        g["minor"] = minors.get(normalize_bus_id(g.get("pci_bus_id")))
    if has_dev_files and any(g["minor"] is None for g in gpus):
        warnings.append("minor numbers unknown: /dev/nvidiaN assumed to be GPU index N")


# ----------------------------------------------------------------------------- clean


def acquire_lock(path, wait_s, poll=0.1):
    """flock on path, polled for up to wait_s; returns the fd or None (busy).

    Opened read-only when it exists (flock needs no write access, and fs.protected_regular
    refuses O_CREAT on another user's file in /tmp), created exclusively otherwise.
    """
    fd = None
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileExistsError:
                continue
    if fd is None:
        raise OSError(errno.EIO, "cannot open lock file %s" % path)
    end = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except (OSError, IOError) as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
        if time.monotonic() + poll > end:
            os.close(fd)
            return None
        time.sleep(poll)


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
            "operator": self.operator, "host": socket.gethostname(), "pid": pid,
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


def wait_exit(targets, seconds, poll, deadline, proc=PROC):
    """Poll until every (pid, starttime) exited or seconds passed; returns those still there."""
    end = min(time.monotonic() + seconds, deadline.end)
    left = list(targets)
    while True:
        left = [t for t in left if not exited(t["pid"], t["starttime"], proc)]
        now = time.monotonic()
        if not left or now >= end:
            return left
        time.sleep(min(poll, end - now))


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


def wait_memory(req, scope, end, deadline):
    """The verdict waits for memory, not for processes: poll memory.used per scope GPU."""
    t0 = time.monotonic()
    out = {"ok": False, "seconds": 0.0, "polls": 0, "used_mib": {}, "error": None}
    if not scope:
        out["ok"] = True
        return out
    smi = find_nvidia_smi(req.get("nvidia_smi"))
    if smi is None:
        out["error"] = "nvidia-smi not found"
        return out
    thresholds = req.get("threshold_mib") or {}
    default = req.get("default_threshold_mib", 64)
    floors = req.get("wait_floor_mib") or {}
    poll = max(0.05, req["poll_s"])
    while True:
        used, error = query_used(smi, req, deadline)
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
        # Memory of processes the plan does not signal will not come back: once only that is
        # left, waiting longer cannot change the verdict.
        if floors and all(str(i) in floors and used[i] <= thresholds.get(str(i), default)
                          + floors[str(i)] for i in pending):
            out["error"] = "GPU %s still above threshold: held by processes not signalled" % (
                ", ".join(str(i) for i in pending))
            out["held_by_others"] = True
            break
        if time.monotonic() + poll > min(end, deadline.end):
            out["error"] = "GPU %s still above threshold" % ", ".join(str(i) for i in pending)
            break
        time.sleep(poll)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


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

    def strip(path):
        return path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path

    used, denied = scan_fds(lambda t: strip(t) if t.startswith(prefix) else None, (), proc)
    in_use = set()
    for paths in used.values():
        in_use.update(paths)
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
                return
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
                in_use.add(strip(line[i:].rstrip()))
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


def clean(req, deadline, res, proc=PROC):
    """Lock; stop units; TERM/KILL by wave with identity checks; wait for memory; report."""
    t0 = time.monotonic()
    res["started_at"] = round(time.time(), 3)  # signals' "t" count from here (audit times)
    for name in ("SIGHUP", "SIGPIPE"):  # a dropped SSH session must not cut the sequence
        try:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        except (ValueError, OSError, AttributeError):
            pass
    lock_path = req.get("lock_path") or DEFAULT_LOCK
    wait_s = min(float(req.get("lock_wait_s", req["timeout_s"])), max(0.0, deadline.remaining()))
    try:
        fd = acquire_lock(lock_path, wait_s)
    except (OSError, IOError) as exc:
        res["lock"] = "busy"  # not acquired: do nothing, say why
        res["error"] = "lock %s: %s" % (lock_path, exc)
        return res
    if fd is None:
        res["lock"] = "busy"
        return res
    res["lock"] = "acquired"
    try:
        _clean_locked(req, deadline, res, t0, proc)
    finally:
        os.close(fd)
    return res


def _clean_locked(req, deadline, res, t0, proc):
    ctx = self_context(proc)
    auditor = Auditor(req.get("operator"))
    reserve = min(req["smi_timeout_s"] + 1.0, max(1.0, req["deadline_s"] * 0.15))
    work_end = time.monotonic() + req["timeout_s"]
    stop_units(req.get("units") or [], req, deadline, reserve, res)

    targets = []
    for t in req.get("targets") or []:
        if not isinstance(t, dict):
            continue
        wave = t.get("wave", 1)
        targets.append({"pid": t.get("pid"), "starttime": t.get("starttime"),
                        "wave": wave if isinstance(wave, int) and not isinstance(wave, bool) else 1,
                        "outcomes": [], "cmdline": None})

    def signal_one(t, signame):
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

    grace = float(req["grace_s"])
    poll = max(0.01, float(req["poll_s"]))
    for wave in sorted(set(t["wave"] for t in targets)):
        group = [t for t in targets if t["wave"] == wave]
        termed = [t for t in group if signal_one(t, "TERM") == "sent"]
        left = wait_exit(termed, grace, poll, deadline, proc)
        killed = [t for t in left if signal_one(t, "KILL") == "sent"]
        wait_exit(killed, max(1.0, min(grace, 5.0)), poll, deadline, proc)
    if auditor.error:
        res["warnings"].append(auditor.error)

    scope = [i for i in (req.get("scope") or []) if isinstance(i, int)]
    res["memory_wait"] = wait_memory(req, scope, min(work_end, deadline.end - reserve), deadline)

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

    if req.get("shm"):
        clean_shm(req, res, proc)

    after = None
    if req.get("reset") and scope:
        pre = snapshot(req, deadline, proc)
        if not reset_gpus(req, scope, pre, deadline, res):
            after = pre
    res["after"] = after if after is not None else snapshot(req, deadline, proc)


# ----------------------------------------------------------------------------- entry point


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
    if req.get("mode", "snapshot") not in ("snapshot", "clean"):
        raise ValueError("unknown mode %r" % (req.get("mode"),))
    req.setdefault("mode", "snapshot")
    req["deadline_s"] = _number(req, "deadline_s", 55.0, 0.1)
    req["smi_timeout_s"] = _number(req, "smi_timeout_s", 10.0, 0.1)
    if req.get("nvidia_smi") is not None and not isinstance(req["nvidia_smi"], str):
        raise ValueError("nvidia_smi must be a path or null")
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


_EMITTED = []


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
        doc["traceback"] = traceback.format_exc()[-4000:]
    finally:
        try:
            signal.alarm(0)
        except (ValueError, OSError):
            pass
    if req["mode"] == "clean":
        doc["seconds"] = round(time.monotonic() - t0, 3)
    emit(doc)


if __name__ == "gpufleet_agent":
    main(REQUEST)  # noqa: F821 - injected by the bootstrap
elif __name__ == "__main__":
    main(sys.stdin.buffer.read())
