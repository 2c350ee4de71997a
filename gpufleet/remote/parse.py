"""What nvidia-smi and /proc print, read into values: the agent's pure parsers (no I/O).

A piece of the remote agent (docs/DESIGN.md, "Running the agent"): standard library only,
Python 3.6+. Small pure functions, so the unit tests can feed them recorded nvidia-smi output
(tests/fixtures/recorded/).
"""
import re

AGENT_VERSION = 1
CMDLINE_MAX = 4096
PF_KTHREAD = 0x00200000


GPU_FIELDS = (
    "index", "uuid", "name", "pci.bus_id", "memory.used", "memory.total", "memory.free",
    "utilization.gpu", "driver_version",
)
#: Dropped one by one when a driver rejects them (query_gpus' INVALID_FIELD retry). The health
#: readings (`gpufleet health`) are --help-query-gpu's names; remapped rows are not among them (only
#: --query-remapped-rows has them): None on this path.
OPTIONAL_GPU_FIELDS = (
    "memory.reserved", "persistence_mode", "pcie.link.gen.current", "pcie.link.gen.max",
    "pcie.link.width.current", "pcie.link.width.max", "clocks_event_reasons.active",
    "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending",
)
REQUIRED_GPU_FIELDS = ("index", "uuid")
#: No process_name: nvidia-smi prints it (argv[0], anyone's to choose) into its CSV with
#: newlines verbatim and commas as '?' (recorded: probe/h200-names-probe4.log), so a title
#: could break rows; the agent reads names from /proc, as on the NVML path.
APP_FIELDS = ("pid", "used_memory", "gpu_uuid")
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
    "persistence_mode": "persistence_mode",
    "pcie.link.gen.current": "pcie_gen_current",
    "pcie.link.gen.max": "pcie_gen_max",
    "pcie.link.width.current": "pcie_width_current",
    "pcie.link.width.max": "pcie_width_max",
    "clocks_event_reasons.active": "clocks_event_reasons",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected_volatile",
    "ecc.errors.uncorrected.aggregate.total": "ecc_uncorrected_aggregate",
    "retired_pages.pending": "retired_pages_pending",
}
INT_FIELDS = frozenset(
    ["index", "memory.used", "memory.total", "memory.free", "memory.reserved", "utilization.gpu",
     "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current",
     "pcie.link.width.max", "ecc.errors.uncorrected.volatile.total",
     "ecc.errors.uncorrected.aggregate.total"]
)
#: Health keys the nvidia-smi path has no field for (None there).
SMI_MISSING_KEYS = ("clocks_event_names", "remapped_rows_correctable",
                    "remapped_rows_uncorrectable", "remapped_rows_pending",
                    "remapped_rows_failure")
#: nvidia-smi's words for a boolean field: persistence_mode (Enabled/Disabled, recorded in the
#: bare table as On), retired_pages.pending (Yes/No).
BOOL_WORDS = {"enabled": True, "disabled": False, "yes": True, "no": False, "on": True,
              "off": False}
#: nvml.h nvmlClocksEventReason* (= the older nvmlClocksThrottleReason*): bit -> name.
CLOCKS_EVENT_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"), (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"), (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

#: The patterns are compiled when the agent starts (one exec per host: a few each).
#: fullmatch, not ``^...$``: ``$`` also matches before a final newline, and a file named
#: "/dev/nvidia0\n" is not the device.
DEVICE_RE = re.compile(
    r"/dev/(?:nvidia[0-9]+|nvidiactl|nvidia-uvm|nvidia-uvm-tools|nvidia-caps/[^/]+|dxg)")
GPU_DEVICE_RE = re.compile(r"/dev/nvidia([0-9]+)")
#: A number as nvidia-smi prints it (already stripped): "81559", "81559 MiB", "35 %", "-1".
INT_RE = re.compile(r"(-?[0-9]+)(?:\s*(?:MiB|%))?")
#: A PID column: ASCII digits only (str.isdigit would take other scripts' digits too).
PID_RE = re.compile(r"[0-9]+")
BUS_RE = re.compile(r"\s*([0-9A-Fa-f]+):([0-9A-Fa-f]+):([0-9A-Fa-f]+)\.([0-9A-Fa-f]+)\s*")
INVALID_FIELD_RE = re.compile(r'Field "([^"]+)" is not a valid field to query')
Q_HEADER_RE = re.compile(r"^GPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)\s*$")
Q_KV_RE = re.compile(r"^\s*([^:]+?)\s*:\s*(.*?)\s*$")
CUDA_RE = re.compile(r"CUDA Version\s*:\s*([0-9][0-9.]*)")
DRIVER_RE = re.compile(r"Driver Version\s*:\s*([0-9][0-9.]*)")


def gpu_minor(path):
    """N of ``/dev/nvidiaN`` (ASCII digits), else None."""
    m = GPU_DEVICE_RE.fullmatch(path)
    return int(m.group(1)) if m else None


def is_device_path(path):
    """An NVIDIA device file: /dev/nvidiaN, nvidiactl, nvidia-uvm(-tools), nvidia-caps/NAME,
    dxg (WSL2)."""
    return DEVICE_RE.fullmatch(path) is not None


class ParseError(ValueError):
    """Output that is not what nvidia-smi (or /proc) is known to print."""


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
    m = INT_RE.fullmatch(v)
    if not m:
        raise ParseError("not a number: %r" % v[:40])
    return int(m.group(1))


def parse_bool(value):
    """Enabled/Disabled, Yes/No -> bool; not available -> None; anything else raises."""
    v = na(value)
    if v is None:
        return None
    if v.lower() not in BOOL_WORDS:
        raise ParseError("not a yes/no value: %r" % v[:40])
    return BOOL_WORDS[v.lower()]


def parse_mask(value):
    """clocks_event_reasons.active's 0x0000000000000000 -> int; not available -> None."""
    v = na(value)
    if v is None:
        return None
    try:
        return int(v, 16)
    except ValueError:
        raise ParseError("not a hex bitmask: %r" % v[:40]) from None


def clocks_event_names(mask):
    """The names of the bits set in a clocks event reasons mask ([] for 0, None for None);
    an unknown bit is named by its value, so nothing the driver says is lost."""
    if mask is None:
        return None
    names = [name for bit, name in CLOCKS_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _ in CLOCKS_EVENT_REASONS:
        known |= bit
    if mask & ~known:
        names.append("0x%x" % (mask & ~known))
    return names


FIELD_PARSERS = {"persistence_mode": parse_bool, "retired_pages.pending": parse_bool,
                 "clocks_event_reasons.active": parse_mask}


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
            if f in FIELD_PARSERS:
                row[key] = FIELD_PARSERS[f](v)
            else:
                row[key] = parse_int(v) if f in INT_FIELDS else na(v)
        if "clocks_event_reasons" in row:
            row["clocks_event_names"] = clocks_event_names(row["clocks_event_reasons"])
        if "index" in fields and row.get("index") is None:
            raise ParseError("GPU row without index: %r" % line[:80])
        if "uuid" in fields and not row.get("uuid"):
            raise ParseError("GPU row without uuid: %r" % line[:80])
        gpus.append(row)
    return gpus


def parse_apps_csv(text):
    """Rows of ``--query-compute-apps=pid,used_memory,gpu_uuid`` -> (apps, skipped, rejected).

    Strict: a row is exactly those three fields, a numeric PID, a number (or not available)
    and a GPU UUID; any other line is rejected (cut to 80 characters), never joined with its
    neighbours, and the rest still counts. Rows whose PID is not available (seen in some
    containers) are skipped and counted.
    """
    apps = []
    skipped = 0
    rejected = []
    for line in _data_lines(text):
        if line.strip().lower().startswith("no running"):
            continue
        row = _app_row(line)
        if row is None:
            rejected.append(line[:80])
        elif row["pid"] is None:
            skipped += 1
        else:
            apps.append(row)
    return apps, skipped, rejected


def _app_row(line):
    """One compute-apps row as a dict (pid None: not available), or None when malformed."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(APP_FIELDS):
        return None
    pid_s, used_s, uuid = parts
    if na(pid_s) is not None and not PID_RE.fullmatch(pid_s):
        return None
    try:
        used = parse_int(used_s)
    except ParseError:
        return None
    if na(uuid) is None:
        return None
    return {"pid": int(pid_s) if na(pid_s) is not None else None, "used_mib": used,
            "gpu_uuid": uuid}


def normalize_bus_id(value):
    """00000000:00:06.0 (nvidia-smi) and 0000:00:06.0 (/proc/driver) -> 0000:00:06.0."""
    if not value:
        return None
    m = BUS_RE.fullmatch(value)
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
        raise ParseError("bad stat: %s" % exc) from None


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


def _unit_name(comp):
    return comp.endswith(".service") or comp.endswith(".scope")


def _user_manager_uid(comp):
    """N of ``user@N.service`` (the per-user systemd, whose subtree that user may write), or
    None."""
    if comp.startswith("user@") and comp.endswith(".service") and comp[5:-8].isdigit():
        return int(comp[5:-8])
    return None


def cgroup_units(path):
    """What a cgroup path CLAIMS about systemd units, for systemd to confirm (confirm_units):
    ``([(unit, its cgroup path), ...] outermost first, (user unit, uid) or None)``.

    The kernel writes the path, but a user may create cgroups below the subtree delegated to
    it (``user@UID.service``, or a system unit with Delegate=), naming them anything: a name
    read from the path is only a claim. Claims stop at the first ``user@UID.service``: below
    it every name is that user's own (its user unit, the first non-slice component there)."""
    claims, user_unit = [], None
    if not path:
        return claims, user_unit
    comps = [c for c in path.split("/") if c]
    for i, comp in enumerate(comps):
        if _unit_name(comp):
            claims.append((comp, "/" + "/".join(comps[:i + 1])))
        uid = _user_manager_uid(comp)
        if uid is not None:
            below = [c for c in comps[i + 1:] if not c.endswith(".slice")]
            if below and _unit_name(below[0]):
                user_unit = (below[0], uid)
            break
    return claims, user_unit


def parse_systemctl_show(text):
    """``systemctl show -p Id -p ControlGroup -- UNIT...`` -> {unit: its ControlGroup, or ""
    for a unit systemd does not run}."""
    out = {}
    for block in text.split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                fields[key] = value
        if fields.get("Id"):
            out[fields["Id"]] = fields.get("ControlGroup", "")
    return out


#: (pattern, kind), tried in order on the part of a cgroup path a runtime made (runtime_part);
#: group 1 is the id (cut to 12 characters but for lxc's names).
CONTAINER_PATTERNS = (
    (re.compile(r"docker-([0-9a-f]{12,})\.scope"), "docker"),
    (re.compile(r"/docker/([0-9a-f]{12,})"), "docker"),
    (re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,})"), "podman"),
    (re.compile(r"cri-containerd-([0-9a-f]{12,})\.scope"), "containerd"),
    (re.compile(r"/containerd/([^/]+)"), "containerd"),
    (re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,})\.scope"), "crio"),
    (re.compile(r"/lxc\.payload[./]([^/]+)"), "lxc"),
    (re.compile(r"/lxc/([^/]+)"), "lxc"),
)
#: A pod's container id: 64 lower-case hex digits in a row.
HEX64_RE = re.compile(r"[0-9a-f]{64}")


#: Top-level cgroups of the runtimes' cgroupfs drivers (only root creates them).
_RUNTIME_ROOTS = ("docker", "lxc", "containerd")


def runtime_part(path):
    """The part of a cgroup path a container runtime made: the slices from the root and the
    first component after them (systemd's driver: ``/system.slice/docker-ID.scope``,
    ``/kubepods.slice/.../cri-containerd-ID.scope``), or a runtime's own top-level directory
    and the one after it (cgroupfs: ``/docker/ID``, ``/lxc/web``, ``/lxc.payload.web``).
    Anything deeper, and anything under ``user@UID.service``, a user may have named."""
    comps = [c for c in path.split("/") if c]
    if not comps:
        return ""
    head = comps[0]
    if head in _RUNTIME_ROOTS or head.startswith("lxc.payload"):
        return "/" + "/".join(comps[:2])
    i = 0
    while i < len(comps) and comps[i].endswith(".slice"):
        i += 1
    return "/" + "/".join(comps[:i + 1])


def container_of(path):
    """A short container name from a cgroup path ("docker:0123456789ab", "k8s:...", "lxc:web"),
    read only from the part a runtime made (runtime_part): a user's own scope named
    ``docker-<hex>.scope`` is no container."""
    if not path:
        return None
    comps = [c for c in path.split("/") if c]
    if comps and comps[0] in ("kubepods", "kubepods.slice"):
        m = HEX64_RE.search(comps[-1]) or HEX64_RE.search(path)
        return "k8s:" + m.group(0)[:12] if m else "kubepods"
    path = runtime_part(path)
    for regex, kind in CONTAINER_PATTERNS:
        m = regex.search(path)
        if m:
            ident = m.group(1)
            return kind + ":" + (ident if kind == "lxc" else ident[:12])
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


def first_line(*texts):
    for text in texts:
        for line in (text or "").splitlines():
            if line.strip():
                return line.strip()[:300]
    return None


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
        if is_device_path(path):
            found.add(path)
    return sorted(found)
