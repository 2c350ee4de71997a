#!/usr/bin/env python3
"""A fake ``nvidia-smi`` for the test lab, faithful to the output recorded on real H200 hosts.

Why a fake: gpufleet must be tested end to end (SSH, agent, parsing, clean) on machines without
GPUs. Every format below is copied from tests/fixtures/recorded/logs/*.log (driver 580.159.04); what
the recordings do not show is marked "unrecorded" and kept close to what the driver prints.

State lives in ``$FAKEGPU_ROOT`` (default /run/fakegpu, per lab host):

* ``config.json``: the GPUs and the failure modes (see ``DEFAULTS``);
* ``procs/<pid>.json``: one record per holder (written by fakecuda.py):
  ``{"pid", "starttime", "alloc": {"<index>": MiB}}`` (an MPS client: also ``"mps_server":
  PID``, see ``mps_server_only``). A holder counts while /proc/<pid> exists
  with the same starttime and is not a zombie (recorded: a zombie holds no GPU memory) -- a
  zombie *leader* whose other threads still run counts (recorded on the H200: NVML listed it
  with its 5638 MiB, tests/fixtures/real-h200/clean-cases/probe-1.log part D); once dead, its
  memory stays ``release_delay_s`` more, then the record is deleted;
* ``procs/<pid>.dead``: the time a holder was first seen dead (text, seconds since the epoch),
  written once (linked into place, first writer wins) by this fake or by the lab's fake
  ``libnvidia-ml.so.1`` (tests/lab/fakenvml/fakenvml.c), so the two never disagree about when
  its memory is released;
* ``resets.jsonl``: one line per successful ``--gpu-reset``.

Stdlib only and few imports: it is run very often.
"""
import json
import os
import sys
import time

ROOT = os.environ.get("FAKEGPU_ROOT") or "/run/fakegpu"

DEFAULTS = {
    "gpus": 1,
    "name": "NVIDIA RTX 6000 Ada Generation",  # a string, or one per GPU (list)
    "total_mib": 49140,  # an int, or one per GPU (list)
    "reserved_mib": 616,  # recorded on H200: total = used + free + reserved
    "driver": "580.159.04",
    "cuda": "13.0",
    "seed": "fakegpu",  # UUIDs derive from it: stable per host
    "uuids": None,  # optional explicit list
    "bus_ids": None,  # optional explicit list; default 00000000:00:06.0, :07.0, ...
    "minors": None,  # optional /dev/nvidiaN minor per index (index != minor on real hosts)
    "ghost_mib": {},  # per index: memory used that no process owns
    "utilization": {},  # per index, percent
    "release_delay_s": 0.0,
    "hidden_pids": False,  # container PID namespace: compute-apps lists nothing
    "wsl2": False,  # per-process used memory is [N/A]
    "fail": False,
    "hang": False,
    "garbage": False,
    "touch_mib": 0,  # recorded 4 MiB on a GPU a CUDA process sees but allocates nothing on
    # CUDA MPS clients (records with "mps_server": PID) are listed as themselves, as recorded
    # on the H200 (type M+C); True: their memory is listed in their server's row instead, as
    # some drivers and containers do (the server's row is then the sum)
    "mps_server_only": False,
    # Measured on real H200s (tests/fixtures/real-h200, docs/real-gpu.md): memory.used is the
    # listed per-process memory + ~2 MiB + ~6 MiB per listed process (base 2, per process 6).
    "unlisted_mib_base": 0,
    "unlisted_mib_per_process": 0,
    "temp_c": 37,
    "power_w": 126,
    "power_cap_w": 700,
    # Health readings (`gpufleet health`), shared with the fake NVML (fakenvml.c); per GPU: {index: v}
    # or [index, ...]. Defaults: the H200's recorded answers (probe/h200-clients-probe3.log).
    "lost": [],  # GPUs fallen off the bus: NVML GPU_IS_LOST; nvidia-smi exits 15
    "persistence": True,  # or {index: bool}
    "ecc_volatile": {},  # uncorrected ECC errors since the driver loaded
    "ecc_aggregate": {},  # uncorrected ECC errors over the GPU's life
    "remapped_pending": [],
    "remapped_failure": [],
    "remapped_correctable": {},
    "remapped_uncorrectable": {},
    "retired_pending": None,  # None: NOT_SUPPORTED (the H200); else [index, ...] pending
    "clocks_event_reasons": {},  # bitmask (nvml.h nvmlClocksEventReason*)
    "pcie_gen": {},  # current generation (max: pcie_gen_max, 5)
    "pcie_width": {},  # current width (max: pcie_width_max, 16)
    "pcie_gen_max": 5,
    "pcie_width_max": 16,
    # --query-gpu names this driver rejects, as an older driver rejects newer fields: the
    # recorded "is not a valid field" answer, exit 2 (invalid_field.txt); the agent drops
    # them one by one. Every health field here = a GPU none of whose readings can be taken.
    "invalid_fields": [],
}

FAIL_TEXT = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
BAD_ARGS = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."

# --help-query-gpu (recorded names and aliases): canonical name first.
GPU_FIELDS = {
    "index": "index",
    "uuid": "uuid",
    "gpu_uuid": "uuid",
    "name": "name",
    "gpu_name": "name",
    "pci.bus_id": "pci.bus_id",
    "gpu_bus_id": "pci.bus_id",
    "memory.used": "memory.used",
    "memory.total": "memory.total",
    "memory.free": "memory.free",
    "memory.reserved": "memory.reserved",
    "utilization.gpu": "utilization.gpu",
    "driver_version": "driver_version",
    "count": "count",
    "timestamp": "timestamp",
    "persistence_mode": "persistence_mode",
    "compute_mode": "compute_mode",
    "temperature.gpu": "temperature.gpu",
    # --help-query-gpu names (NVIDIA's nvidia-smi manual page, "--query-gpu"); their values'
    # spelling (Enabled/Disabled, Yes/No, 0x%016x, [N/A]) is unrecorded here
    "pcie.link.gen.current": "pcie.link.gen.current",
    "pcie.link.gen.max": "pcie.link.gen.max",
    "pcie.link.width.current": "pcie.link.width.current",
    "pcie.link.width.max": "pcie.link.width.max",
    "clocks_event_reasons.active": "clocks_event_reasons.active",
    "clocks_throttle_reasons.active": "clocks_event_reasons.active",
    "ecc.errors.uncorrected.volatile.total": "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total": "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.pending": "retired_pages.pending",
}
GPU_UNITS = {
    "memory.used": "MiB",
    "memory.total": "MiB",
    "memory.free": "MiB",
    "memory.reserved": "MiB",
    "utilization.gpu": "%",
}
# --help-query-compute-apps (recorded list).
APP_FIELDS = {
    "pid": "pid",
    "process_name": "process_name",
    "name": "process_name",
    "used_gpu_memory": "used_gpu_memory",
    "used_memory": "used_gpu_memory",
    "gpu_uuid": "gpu_uuid",
    "gpu_bus_id": "gpu_bus_id",
    "gpu_name": "gpu_name",
    "timestamp": "timestamp",
}
APP_UNITS = {"used_gpu_memory": "MiB"}


class Exit(Exception):
    def __init__(self, code, text=""):
        Exception.__init__(self, code)
        self.code = code
        self.text = text


# --- state --------------------------------------------------------------------------------


def load_config():
    cfg = dict(DEFAULTS)
    try:
        with open(os.path.join(ROOT, "config.json")) as f:
            cfg.update(json.load(f))
    except FileNotFoundError:
        pass
    return cfg


def _per_gpu(value, i):
    if isinstance(value, list):
        return value[i] if i < len(value) else value[-1]
    return value


def _uuid(seed, i):
    import hashlib

    h = hashlib.md5(("%s/%d" % (seed, i)).encode()).hexdigest()
    return "GPU-%s-%s-%s-%s-%s" % (h[0:8], h[8:12], h[12:16], h[16:20], h[20:32])


def gpus_of(cfg):
    out = []
    ghost = cfg.get("ghost_mib") or {}
    util = cfg.get("utilization") or {}
    for i in range(int(cfg["gpus"])):
        out.append(
            {
                "index": i,
                "uuid": cfg["uuids"][i] if cfg.get("uuids") else _uuid(cfg["seed"], i),
                "name": _per_gpu(cfg["name"], i),
                "bus_id": cfg["bus_ids"][i]
                if cfg.get("bus_ids")
                else "00000000:00:%02X.0" % (6 + i),
                "minor": cfg["minors"][i] if cfg.get("minors") else i,
                "total": int(_per_gpu(cfg["total_mib"], i)),
                "reserved": int(_per_gpu(cfg["reserved_mib"], i)),
                "ghost": int(ghost.get(str(i), 0)),
                "util": int(util.get(str(i), 0)),
            }
        )
    return out


def proc_state(pid):
    """(state, starttime, threads) of a pid in this PID namespace, or None when it does not
    exist."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = data[data.rindex(")") + 2 :].split()
    return rest[0], int(rest[19]), int(rest[17])


def holds(st, starttime):
    """Whether the process (proc_state's answer) still holds its memory: the same process, and
    not a zombie -- unless other threads still run under its zombie leader."""
    return st is not None and st[1] == starttime and (st[0] not in ("Z", "X") or st[2] > 1)


def process_name(pid):
    """argv[0] of the cmdline, verbatim: what nvidia-smi shows.

    Recorded: "python3" for a holder started as `python3 /tmp/hold.py` (a prctl rename does not
    change it), "/opt/torch/.venv/bin/python3" for one started by that path
    (tests/fixtures/recorded/probe); a setproctitle rename (vLLM) rewrites the cmdline itself."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        argv0 = ""
    if not argv0:
        try:
            with open("/proc/%d/comm" % pid) as f:
                argv0 = f.read().strip()
        except OSError:
            argv0 = "[Not Found]"
    return argv0


def _write_json(path, doc):
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.rename(tmp, path)


def dead_since(dead_path, delay, now):
    """When the holder was first seen dead (procs/<pid>.dead), recording ``now`` the first time
    (only with a release delay). The file is linked into place complete, so the first fake to see
    the death wins and a reader never sees half a number (fakenvml.c does the same)."""
    try:
        with open(dead_path) as f:
            text = f.read()
        return float(text) if text.strip() else now  # being written by the first to see it
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return None
    if delay <= 0:
        return None
    tmp = "%s.%d.tmp" % (dead_path, os.getpid())
    try:
        with open(tmp, "w") as f:
            f.write("%.6f\n" % now)
        os.chmod(tmp, 0o666)
        try:
            os.link(tmp, dead_path)
        except FileExistsError:
            return dead_since(dead_path, 0, now)
        except OSError:  # no hard links on this filesystem: create it in place
            try:
                fd = os.open(dead_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                return dead_since(dead_path, 0, now)
            with os.fdopen(fd, "w") as f:
                f.write("%.6f\n" % now)
        finally:
            os.unlink(tmp)
    except OSError:
        pass
    return now


def holders(cfg):
    """Records that count now: [(record, live)]; dead records past the delay are deleted."""
    pdir = os.path.join(ROOT, "procs")
    try:
        names = sorted(os.listdir(pdir))
    except FileNotFoundError:
        return []
    delay = float(cfg.get("release_delay_s") or 0.0)
    now = time.time()
    out = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(pdir, name)
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        st = proc_state(int(rec["pid"]))
        live = holds(st, int(rec["starttime"]))
        if live:
            out.append((rec, True))
            continue
        dead_path = path[: -len(".json")] + ".dead"
        since = dead_since(dead_path, delay, now)
        if since is not None and now - since < delay:
            out.append((rec, False))
            continue
        for p in (path, dead_path):
            try:
                os.unlink(p)
            except OSError:
                pass
    return out


def listed_pid(cfg, rec):
    """The PID a holder's memory is listed under: its own, or its MPS server's
    (mps_server_only)."""
    if cfg.get("mps_server_only") and rec.get("mps_server"):
        return int(rec["mps_server"])
    return int(rec["pid"])


def merge_rows(apps):
    """One row per (GPU, PID), as the driver lists them (an MPS server's row holds its
    clients' memory when mps_server_only)."""
    out = {}
    for a in apps:
        key = (a["gpu"]["index"], a["pid"])
        if key in out:
            out[key]["mib"] += a["mib"]
        else:
            out[key] = dict(a)
    return list(out.values())


def snapshot(cfg):
    gpus = gpus_of(cfg)
    by_index = {g["index"]: g for g in gpus}
    for g in gpus:
        g["used"] = g["ghost"]
    apps = []
    holders_now = holders(cfg)
    for rec, live in holders_now:
        for idx, mib in sorted((rec.get("alloc") or {}).items(), key=lambda kv: int(kv[0])):
            g = by_index.get(int(idx))
            if g is None or not mib:
                continue
            g["used"] += int(mib)
            if live:
                apps.append({"pid": listed_pid(cfg, rec), "gpu": g, "mib": int(mib)})
    touch = int(cfg.get("touch_mib") or 0)
    if touch:
        # Recorded (h200-two-gpus.log, probe): while a CUDA process with every GPU visible held
        # memory on one GPU, the other showed 4 MiB used that no process was listed for.
        allocated = set()
        for rec, live in holders_now:
            if live:
                allocated |= {int(i) for i, m in (rec.get("alloc") or {}).items() if m}
        for rec, live in holders_now:
            if not live or not rec.get("alloc"):
                continue
            for idx in rec.get("visible") or ():
                g = by_index.get(int(idx))
                if g is not None and int(idx) not in allocated and not g.get("touched"):
                    g["touched"] = True
                    g["used"] += touch
    base = int(cfg.get("unlisted_mib_base") or 0)
    per_process = int(cfg.get("unlisted_mib_per_process") or 0)
    if base or per_process:
        # Measured (tests/fixtures/real-h200): with 1, 2, 3, 4 CUDA processes on an H200,
        # memory.used exceeded the sum of their listed memory by 8-9, 14, 20, 26 MiB; by 0 once
        # none was left. nvidia-smi attributes that memory to no process.
        counts = {}
        for a in apps:
            counts[a["gpu"]["index"]] = counts.get(a["gpu"]["index"], 0) + 1
        for idx, n in counts.items():
            by_index[idx]["used"] += base + per_process * n
    apps = merge_rows(apps)  # after the driver's share: how NVML lists is no memory
    for g in gpus:
        g["used"] = min(g["used"], g["total"] - g["reserved"])
        g["free"] = g["total"] - g["reserved"] - g["used"]
    apps.sort(key=lambda a: (a["gpu"]["index"], a["pid"]))
    if cfg.get("hidden_pids"):
        apps = []
    for a in apps:
        a["name"] = process_name(a["pid"])
    return gpus, apps


# --- arguments ----------------------------------------------------------------------------


def parse_args(argv):
    opts = {"format": None, "display": None, "id": None}
    flags = set()
    i = 0
    with_value = {
        "--query-gpu": "query_gpu",
        "--query-compute-apps": "query_apps",
        "--format": "format",
        "-i": "id",
        "--id": "id",
        "-d": "display",
        "--display": "display",
    }
    bare = {
        "-q": "query",
        "--query": "query",
        "-r": "reset",
        "--gpu-reset": "reset",
        "-L": "list",
        "--list-gpus": "list",
        "-h": "help",
        "--help": "help",
        "--version": "version",
    }
    while i < len(argv):
        arg = argv[i]
        key, eq, val = arg.partition("=")
        if key in with_value:
            if not eq:
                i += 1
                if i >= len(argv):
                    raise Exit(2, BAD_ARGS)
                val = argv[i]
            opts[with_value[key]] = val
        elif arg in bare:
            flags.add(bare[arg])
        else:
            raise Exit(2, BAD_ARGS)
        i += 1
    return opts, flags


def select(gpus, ident):
    if ident is None:
        return gpus
    out = []
    for part in ident.split(","):
        part = part.strip()
        found = None
        for g in gpus:
            if part == str(g["index"]) or part == g["uuid"] or part.upper() == g["bus_id"]:
                found = g
        if found is None:
            raise Exit(6, "No devices were found")
        if found not in out:
            out.append(found)
    return out


# --- output -------------------------------------------------------------------------------


def fmt_csv(fields, rows, fmt, units):
    parts = [p.strip() for p in fmt.split(",")]
    known = ("csv", "noheader", "nounits")
    if not parts or parts[0] != "csv" or any(p not in known for p in parts):
        raise Exit(2, BAD_ARGS)
    with_units = "nounits" not in parts
    lines = []
    if "noheader" not in parts:
        lines.append(
            ", ".join(
                "%s [%s]" % (f, units[f]) if with_units and f in units else f for f in fields
            )
        )
    for row in rows:
        cells = []
        for f, v in zip(fields, row):
            v = str(v)
            if with_units and f in units and not v.startswith("["):
                v = "%s %s" % (v, units[f])
            cells.append(v)
        lines.append(", ".join(cells))
    return "\n".join(lines) + ("\n" if lines else "")


def resolve(fields_text, table):
    out = []
    for name in fields_text.split(","):
        name = name.strip()
        if name not in table:
            # recorded (probe log): the message, then an empty line; exit 2
            raise Exit(2, 'Field "%s" is not a valid field to query.\n\n' % name)
        out.append(table[name])
    return out


def stamp():
    return time.strftime("%Y/%m/%d %H:%M:%S.000")


def per_gpu_value(value, i, default):
    """A health setting for GPU i: {index: v}, [index, ...] (True for those), or one value."""
    if isinstance(value, dict):
        return value.get(str(i), default)
    if isinstance(value, list):
        return i in value
    return default if value is None else value


def health_values(cfg, i):
    retired = cfg.get("retired_pending")
    return {
        "persistence_mode": "Enabled" if per_gpu_value(cfg.get("persistence"), i, True)
        else "Disabled",
        "pcie.link.gen.current": per_gpu_value(cfg.get("pcie_gen"), i, cfg["pcie_gen_max"]),
        "pcie.link.gen.max": cfg["pcie_gen_max"],
        "pcie.link.width.current": per_gpu_value(cfg.get("pcie_width"), i,
                                                 cfg["pcie_width_max"]),
        "pcie.link.width.max": cfg["pcie_width_max"],
        "clocks_event_reasons.active": "0x%016x" % int(
            per_gpu_value(cfg.get("clocks_event_reasons"), i, 0)),
        "ecc.errors.uncorrected.volatile.total": per_gpu_value(cfg.get("ecc_volatile"), i, 0),
        "ecc.errors.uncorrected.aggregate.total": per_gpu_value(cfg.get("ecc_aggregate"), i,
                                                                0),
        "retired_pages.pending": "[N/A]" if retired is None
        else ("Yes" if i in retired else "No"),
    }


def lost_check(cfg, gpus):
    """A GPU fallen off the bus: nvidia-smi stops with the driver's words and NVML's code 15
    ("Unable to determine the device handle for GPU 0000:02:00.0: GPU is lost.  Reboot the
    system to recover this GPU": github.com/JosephKJ/OWOD/issues/81,
    github.com/AlexeyAB/darknet/issues/86)."""
    lost = [g for g in gpus if g["index"] in (cfg.get("lost") or [])]
    if lost:
        raise Exit(15, "".join(
            "Unable to determine the device handle for GPU %s: GPU is lost.  Reboot the "
            "system to recover this GPU\n" % g["bus_id"][4:] for g in lost))


def query_gpu(cfg, gpus, fields_text, fmt):
    rejected = set(cfg.get("invalid_fields") or ())
    fields = resolve(fields_text, {k: v for k, v in GPU_FIELDS.items() if k not in rejected})
    rows = []
    for g in gpus:
        value = {
            "index": g["index"],
            "uuid": g["uuid"],
            "name": g["name"],
            "pci.bus_id": g["bus_id"],
            "memory.used": g["used"],
            "memory.total": g["total"],
            "memory.free": g["free"],
            "memory.reserved": g["reserved"],
            "utilization.gpu": g["util"],
            "driver_version": cfg["driver"],
            "count": int(cfg["gpus"]),
            "timestamp": stamp(),
            "compute_mode": "Default",
            "temperature.gpu": cfg["temp_c"],
        }
        value.update(health_values(cfg, g["index"]))
        rows.append([value[f] for f in fields])
    return fmt_csv(fields, rows, fmt, GPU_UNITS)


def query_apps(cfg, gpus, apps, fields_text, fmt):
    fields = resolve(fields_text, APP_FIELDS)
    wanted = {g["index"] for g in gpus}
    rows = []
    for a in apps:
        if a["gpu"]["index"] not in wanted:
            continue
        value = {
            "pid": a["pid"],
            "process_name": csv_name(a["name"]),
            "used_gpu_memory": "[N/A]" if cfg.get("wsl2") else a["mib"],
            "gpu_uuid": a["gpu"]["uuid"],
            "gpu_bus_id": a["gpu"]["bus_id"],
            "gpu_name": a["gpu"]["name"],
            "timestamp": stamp(),
        }
        rows.append([value[f] for f in fields])
    return fmt_csv(fields, rows, fmt, APP_UNITS)


def csv_name(name):
    """A process name in CSV output: commas printed as '?', newlines verbatim (recorded on the
    H200, driver 580.159.04: probe/h200-names-probe4.log). The table and -q print it as is."""
    return name.replace(",", "?")


def table_name(name):
    """The table's name column holds 32 characters: a longer name is '...' and its last 29
    (recorded: probe/h200-names-probe4.log)."""
    return name if len(name) <= TABLE_NAME_WIDTH else "..." + name[-(TABLE_NAME_WIDTH - 3):]


TABLE_NAME_WIDTH = 32


def _fit(text, width):
    return text if len(text) <= width else text[: width - 3] + "..."


def table(cfg, gpus, apps):
    sep = "+-----------------------------------------+------------------------+----------------------+"
    wide = "+" + "-" * 89 + "+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y") + "       ", wide]
    head = "| NVIDIA-SMI %-23sDriver Version: %-15sCUDA Version: %-9s|" % (
        cfg["driver"],
        cfg["driver"],
        cfg["cuda"],
    )
    out += [
        head,
        sep,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    for g in gpus:
        out.append(
            "|%4d  %-29s%4s  |%19s Off |%21s |"
            % (g["index"], _fit(g["name"], 29), "On", g["bus_id"], "0")
        )
        power = "%dW / %4dW" % (cfg["power_w"], cfg["power_cap_w"])
        out.append(
            "| N/A   %2dC    P0 %23s |%8dMiB / %6dMiB |%7d%%      Default |"
            % (cfg["temp_c"], power, g["used"], g["total"], g["util"])
        )
        out.append(
            "|                                         |                        |             Disabled |"
        )
        out.append(sep)
    out += [
        "",
        wide,
        "| Processes:" + " " * 78 + "|",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * 89 + "|",
    ]
    if not apps:
        out.append("|  No running processes found" + " " * 61 + "|")
    for a in apps:
        mem = "N/A" if cfg.get("wsl2") else "%dMiB" % a["mib"]
        name = table_name(a["name"])
        out.append(
            "|%5d   N/A  N/A%16d%7s   %s%s |"
            % (a["gpu"]["index"], a["pid"], "C", name.ljust(46 - len(mem)), mem)
        )
    out.append(wide)
    return "\n".join(out) + "\n"


def _kv(indent, label, value, width=55):
    return (" " * indent + label).ljust(width) + ": " + str(value)


def query(cfg, all_gpus, gpus, apps, display):
    sections = {s.strip().upper() for s in display.split(",")} if display else None
    if sections is not None and not sections <= {"PIDS", "MEMORY"}:
        raise Exit(2, BAD_ARGS)
    out = [
        "",
        "==============NVSMI LOG==============",
        "",
        _kv(0, "Timestamp", time.strftime("%a %b %d %H:%M:%S %Y")),
        _kv(0, "Driver Version", cfg["driver"]),
        _kv(0, "CUDA Version", cfg["cuda"]),
        "",
        _kv(0, "Attached GPUs", len(all_gpus)),
    ]
    for g in gpus:
        out.append("GPU " + g["bus_id"])
        if sections is None:
            out += [
                _kv(4, "Product Name", g["name"]),
                _kv(4, "Persistence Mode", "Enabled"),
                _kv(4, "Minor Number", g["minor"]),
                _kv(4, "GPU UUID", g["uuid"]),
                "    PCI",
                _kv(8, "Bus", "0x%s" % g["bus_id"][9:11]),
                _kv(8, "Device", "0x%s" % g["bus_id"][12:14]),
                _kv(8, "Domain", "0x%s" % g["bus_id"][4:8]),
                _kv(8, "Bus Id", g["bus_id"]),
            ]
        if sections is None or "MEMORY" in sections:
            out += [
                "    FB Memory Usage",
                _kv(8, "Total", "%d MiB" % g["total"]),
                _kv(8, "Reserved", "%d MiB" % g["reserved"]),
                _kv(8, "Used", "%d MiB" % g["used"]),
                _kv(8, "Free", "%d MiB" % g["free"]),
            ]
        if sections is None or "PIDS" in sections:
            mine = [a for a in apps if a["gpu"] is g]
            if not mine:
                out.append(_kv(4, "Processes", "None"))
            else:
                out.append("    Processes")
                for a in mine:
                    used = "Not available" if cfg.get("wsl2") else "%d MiB" % a["mib"]
                    out += [
                        _kv(8, "GPU instance ID", "N/A", 42),
                        _kv(8, "Compute instance ID", "N/A", 42),
                        _kv(8, "Process ID", a["pid"], 42),
                        _kv(12, "Type", "C", 42),
                        _kv(12, "Name", a["name"], 42),
                        _kv(12, "Used GPU Memory", used, 42),
                    ]
        out.append("")
    return "\n".join(out) + "\n"


def in_use(gpu, apps):
    """Processes keeping a GPU busy: memory on it, or its device file open (as the driver sees)."""
    if any(a["gpu"] is gpu for a in apps):
        return True
    dev = "/dev/nvidia%d" % gpu["minor"]
    me = os.getpid()
    my_mnt = os.readlink("/proc/self/ns/mnt")
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            # A path names the same device file only in the same mount namespace (this
            # matters when /proc shows other lab hosts' processes too).
            if os.readlink("/proc/%s/ns/mnt" % name) != my_mnt:
                continue
            fds = os.listdir("/proc/%s/fd" % name)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%s/fd/%s" % (name, fd)) == dev:
                    return True
            except OSError:
                pass
    return False


def reset(cfg, gpus, apps, ident):
    if ident is None:
        chosen = gpus
    else:
        chosen = select(gpus, ident)
    if os.geteuid() != 0:
        # unrecorded: the driver refuses non-root resets
        lines = ["The following GPUs could not be reset:"]
        lines += ["  GPU %s: Insufficient Permissions" % g["bus_id"] for g in chosen]
        raise Exit(4, "\n".join(lines) + "\n")
    busy = [g for g in chosen if in_use(g, apps)]
    if busy:
        n = len(busy)
        lines = ["The following GPUs could not be reset:"]
        lines += ["  GPU %s: In use by another client" % g["bus_id"] for g in busy]
        lines.append("")
        lines.append(
            "%d device%s currently being used by one or more other processes (e.g., Fabric "
            "Manager, CUDA application, graphics application such as an X server, or a "
            "monitoring application such as another instance of nvidia-smi). Please first kill "
            "all processes using %s and all compute applications running in the system."
            % (n, " is" if n == 1 else "s are", "this device" if n == 1 else "these devices")
        )
        raise Exit(255, "\n".join(lines) + "\n")
    # A reset frees memory no process owns (the ghost): record it in the config.
    path = os.path.join(ROOT, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raw = {}
    ghost = dict(raw.get("ghost_mib") or {})
    lines = []
    with open(os.path.join(ROOT, "resets.jsonl"), "a") as f:
        for g in chosen:
            ghost.pop(str(g["index"]), None)
            f.write(json.dumps({"index": g["index"], "t": time.time()}) + "\n")
            lines.append("GPU %s was successfully reset." % g["bus_id"])
    raw["ghost_mib"] = ghost
    _write_json(path, raw)
    lines.append("All done.")
    return "\n".join(lines) + "\n"


def garble(text):
    """Truncated, garbled output: what a dying driver or a broken pipe can leave."""
    cut = text[: max(1, len(text) * 3 // 5)]
    return cut + "\ufffd\x1b[0m#,,GPU-?? , [Unknown Error],\n"


def run(argv):
    cfg = load_config()
    if cfg.get("hang"):
        while True:
            time.sleep(3600)
    if cfg.get("fail"):
        raise Exit(9, FAIL_TEXT + "\n")
    opts, flags = parse_args(argv)
    if "help" in flags:
        return "NVIDIA System Management Interface -- v%s (fakegpu)\n" % cfg["driver"]
    if "version" in flags:
        return "NVIDIA-SMI version  : %s\nDRIVER version     : %s\nCUDA Version       : %s\n" % (
            cfg["driver"],
            cfg["driver"],
            cfg["cuda"],
        )
    all_gpus, apps = snapshot(cfg)
    lost_check(cfg, all_gpus)
    if "reset" in flags:
        return reset(cfg, all_gpus, apps, opts["id"])
    gpus = select(all_gpus, opts["id"])
    if opts.get("query_gpu") is not None or opts.get("query_apps") is not None:
        if opts["format"] is None:
            raise Exit(2, '"--format" must be specified when querying information.\n')
        if opts.get("query_gpu") is not None:
            text = query_gpu(cfg, gpus, opts["query_gpu"], opts["format"])
        else:
            text = query_apps(cfg, gpus, apps, opts["query_apps"], opts["format"])
    elif "query" in flags:
        text = query(cfg, all_gpus, gpus, apps, opts["display"])
    elif "list" in flags:
        text = "".join("GPU %d: %s (UUID: %s)\n" % (g["index"], g["name"], g["uuid"]) for g in gpus)
    elif opts["display"] is not None:
        raise Exit(2, BAD_ARGS)
    else:
        text = table(cfg, gpus, [a for a in apps if a["gpu"] in gpus])
    if cfg.get("garbage"):
        text = garble(text)
    return text


_HELD = []


def hold_devices():
    """What the real nvidia-smi does while it runs (recorded on the H200, driver 580.159.04:
    tests/fixtures/recorded/logs/h200-clients-and-timings.log): /dev/nvidiactl, /dev/nvidia-uvm and every
    /dev/nvidiaN open, only /dev/nvidiactl mapped, comm "nvidia-smi". So a concurrent run shows
    up in other agents' fd scans, as on real hosts. WSL2 (no /dev/nvidia*) is unrecorded: none."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return
    numbered = sorted(n for n in names if n.startswith("nvidia") and n[6:].isdigit())
    if not numbered:
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, b"nvidia-smi", 0, 0, 0)
    except (OSError, AttributeError):
        pass
    for name in ["nvidiactl", "nvidia-uvm"] + numbered:
        try:
            _HELD.append(open("/dev/" + name, "rb"))
        except OSError:
            pass
    try:
        import mmap

        ctl = next(f for f in _HELD if f.name == "/dev/nvidiactl")
        _HELD.append(mmap.mmap(ctl.fileno(), 1, prot=mmap.PROT_READ))
    except (StopIteration, OSError, ValueError):
        pass


def main():
    hold_devices()
    try:
        text = run(sys.argv[1:])
        code = 0
    except Exit as e:
        text, code = e.text, e.code
        if text and not text.endswith("\n"):
            text += "\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
