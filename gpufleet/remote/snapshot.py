"""The snapshot mode: one document with what this host knows about its GPUs.

A piece of the remote agent: the snapshot document (docs/protocol.md); every failure is a value
in it.
"""
import os
import sys
import time

from .jobs import Background, Job, find_nvidia_smi, run_cmd, smi_failure  # joined
from .kmsg import kernel_log  # joined
from .mps import mps_report  # joined
from .owners import confirm_units, container_restarts  # joined
from .nvml import (  # joined
    nvml_decided,
    nvml_error_code,
    open_nvml,
    process_name,
    read_bounded,
    read_devices,
)
from .parse import (  # joined
    AGENT_VERSION,
    APP_FIELDS,
    GPU_FIELDS,
    GPU_KEYS,
    INVALID_FIELD_RE,
    OPTIONAL_GPU_FIELDS,
    REQUIRED_GPU_FIELDS,
    SMI_MISSING_KEYS,
    ParseError,
    check_complete,
    gpu_minor,
    normalize_bus_id,
    parse_apps_csv,
    parse_gpu_csv,
    parse_q_minors,
    parse_versions,
)
from .procfs import (  # joined
    DEV,
    PROC,
    ancestors_of,
    container_facts,
    denied_reasons,
    denied_warning,
    device_target,
    gpu_minors_from_proc,
    hidepid_active,
    is_wsl2,
    mapped_devices,
    process_entry,
    read_stat,
    scan_fds,
    self_context,
    user_name,  # joined
)


#: What the loader (remote/loader.py) did with the compiled agent: {"state": hit | miss | off
#: | unusable, "reason": ...}; main() fills it from the loader's AGENT_CACHE global (empty:
#: the agent was not started by the loader, e.g. ``python3 -m gpufleet.remote.agent``).
AGENT_CACHE_FACTS = {}  # type: dict


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
    """The snapshot document (docs/protocol.md); every failure is a value in it."""
    t0 = time.monotonic()
    ctx = self_context(proc)
    warnings = ctx["warnings"]
    smi = find_nvidia_smi(req.get("nvidia_smi"))
    smi_doc = {"ok": False, "error": None, "exit_code": None, "seconds": 0.0}
    source, nv, reason, jobs, scanned = _source_and_scan(req, deadline, ctx, smi, proc)
    nvml_doc = {"library": nv.path if nv else None, "error": None if nv else reason,
                "code": None if nv else nvml_error_code(), "seconds": 0.0}
    gpus, apps, driver, cuda = [], [], None, None
    if source != "nvml" and smi is None:
        smi_doc["error"] = "nvidia-smi not found" + (
            ": %s" % req["nvidia_smi"] if req.get("nvidia_smi") else "")
    own = set([ctx["self_pid"]]) | _job_pids(jobs)
    # none of ours in it: the scan skipped nvidia-smi started before it; later ones it never saw
    holders, denied, seen_start, mapped = scanned
    hidden, can_read_all = _fd_visibility(denied, warnings, proc)
    extra = {"kernel_log": kernel_log(deadline, proc=proc) if req.get("kernel_log", True)
             else None}
    if source == "nvml":  # after the scan: many short calls, one thread
        gpus, apps, driver, cuda, more = _query_nvml(nv, reason, smi_doc, nvml_doc,
                                                     nvml_timeout(req, deadline), proc)
        extra.update(more)
        lost_bus_ids(extra.get("gpu_errors") or [], len(gpus), proc)
    elif smi is not None:
        gpus, apps, driver, cuda = _query_smi(smi, req, deadline, jobs, smi_doc, warnings,
                                              proc)
    attach_minors(gpus, None if source == "nvml" else smi, req, deadline, smi_doc, warnings,
                  proc)
    by_uuid = dict((g["uuid"], g["index"]) for g in gpus)
    for a in apps:
        a["gpu_index"] = by_uuid.get(a["gpu_uuid"])
    processes, vanished = _settle_holders(holders, seen_start, apps, own, ctx, jobs,
                                          warnings, proc)
    extra["mps"] = _what_runs_them(processes, denied, req, deadline, warnings, proc)
    facts = _snapshot_facts(ctx, smi, driver, cuda, can_read_all, hidden, proc)
    facts.update(gpu_source=source, gpu_source_reason=reason)
    smi_doc["seconds"] = round(smi_doc["seconds"], 3)
    nvml_doc["seconds"] = round(nvml_doc["seconds"], 3)
    doc = {
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
        "nvml": nvml_doc,
        "seconds": round(time.monotonic() - t0, 3),
    }
    doc.update(extra)
    return doc


def _what_runs_them(processes, denied, req, deadline, warnings, proc):
    """What the processes' own details cannot say: their units as systemd confirms them, their
    containers' restart policies as the runtime says, whose open files were refused, and the CUDA MPS daemon's servers and clients (returned)."""
    confirm_units(processes, req, deadline, warnings)
    container_restarts(processes, req, deadline, warnings)
    for pid in set(denied) & set(int(p) for p in processes):
        processes[str(pid)]["fds_readable"] = False
    return mps_report(processes, deadline, proc) if req.get("mps", True) else []


#: The request's gpu_source (the inventory's): auto = NVML when it loads and initialises, else
#: nvidia-smi; nvml = NVML or an error (no fallback); nvidia-smi = never NVML.
GPU_SOURCES = ("auto", "nvml", "nvidia-smi")


def _source_and_scan(req, deadline, ctx, smi, proc):
    """(source, Nvml or None, reason, nvidia-smi jobs, the /proc scan): the scan runs while
    the GPU reader waits on the driver."""
    jobs = (None, None)
    early = _nvml_wanted(req) and not nvml_decided()
    if early:  # NVML's load and init wait on the driver (~13 ms on an H200): /proc meanwhile
        opening = Background(lambda: gpu_source(req, deadline))
        scanned = _scan_holders(set([ctx["self_pid"]]), proc)
        source, nv, reason = opening.result()
    else:  # nvidia-smi forced, or NVML opened (or refused) by an earlier snapshot
        source, nv, reason = gpu_source(req, deadline)
    if source != "nvml" and smi is not None:  # its two queries run while /proc is scanned
        jobs = _start_smi_jobs(smi, req, deadline)
    if not early:
        scanned = _scan_holders(set([ctx["self_pid"]]) | _job_pids(jobs), proc)
    return source, nv, reason, jobs, scanned


def _nvml_wanted(req):
    """Whether gpu_source tries NVML (else nvidia-smi is forced by the request)."""
    wanted = req.get("gpu_source") or "auto"
    return not (wanted == "nvidia-smi" or (wanted == "auto" and req.get("nvidia_smi")))


def gpu_source(req, deadline):
    """(source, Nvml or None, reason): which reader this snapshot uses and, when it is not the
    default choice, why (facts.gpu_source_reason)."""
    wanted = req.get("gpu_source") or "auto"
    if not _nvml_wanted(req):
        if wanted == "nvidia-smi":
            return "nvidia-smi", None, "gpu_source is nvidia-smi"
        return "nvidia-smi", None, "nvidia_smi is set (it forces the nvidia-smi path)"
    nv, why = open_nvml(req.get("nvml_library"), nvml_timeout(req, deadline))
    if nv is not None:
        return "nvml", nv, None
    if wanted == "nvml":
        return "nvml", None, "gpu_source is nvml and NVML is unavailable: %s" % why
    return "nvidia-smi", None, "NVML unavailable: %s" % why


def nvml_timeout(req, deadline):
    """How long one batch of NVML calls may take: a GPU query's bound, inside the deadline."""
    return max(0.1, min(req["smi_timeout_s"], deadline.remaining()))


def _query_nvml(nv, reason, smi_doc, nvml_doc, timeout, proc):
    """(gpus, apps, driver, cuda, extra doc keys) from NVML; failures go into smi_doc (the GPU
    readings' status, whatever their source) and nvml_doc."""
    if nv is None:  # gpu_source nvml forced, and NVML is not there
        smi_doc["error"] = reason
        return [], [], None, None, {}
    got, why, secs = read_bounded(nv, timeout, read_devices, proc)
    smi_doc["seconds"] += secs
    nvml_doc["seconds"] += secs
    if got is None:
        smi_doc["error"] = nvml_doc["error"] = why
        return [], [], None, None, {}
    extra = {"graphics_apps": got["graphics_apps"], "gpu_errors": got["gpu_errors"]}
    error = got.get("error")
    if error is None and got["gpu_errors"]:
        first = got["gpu_errors"][0]
        error = "GPU %d: %s" % (first["index"], first["error"])
    if error is not None:
        smi_doc["error"] = nvml_doc["error"] = error
    else:
        smi_doc["ok"] = True
    return got["gpus"], got["compute_apps"], got["driver"], got["cuda"], extra


def lost_bus_ids(gpu_errors, readable, proc=PROC):
    """pci_bus_id of each GPU NVML cannot read (lost: no handle, no PCI info), from the
    driver's /proc/driver/nvidia/gpus: NVML numbers GPUs in PCI bus order, so index i is the
    i-th bus there, when that directory has exactly one entry per GPU (else None)."""
    buses = sorted(gpu_minors_from_proc(proc))
    for e in gpu_errors:
        ok = len(buses) == readable + len(gpu_errors) and 0 <= e["index"] < len(buses)
        e["pci_bus_id"] = buses[e["index"]] if ok else None


def _start_smi_jobs(smi, req, deadline):
    """(gpu_job, apps_job): both queries run while /proc is scanned: one moment, and half the
    wall time."""
    gpu_job = Job(gpu_query_argv(smi, list(GPU_FIELDS) + list(OPTIONAL_GPU_FIELDS)),
                  req["smi_timeout_s"], deadline, "nvidia-smi")
    apps_job = Job([smi, "--query-compute-apps=" + ",".join(APP_FIELDS),
                    "--format=csv,noheader,nounits"], req["smi_timeout_s"], deadline,
                   "nvidia-smi")
    return gpu_job, apps_job


def _job_pids(jobs):
    """The PIDs of our own nvidia-smi children (jobs not started are None)."""
    return set(job.pid for job in jobs if job is not None and job.pid is not None)


def _scan_holders(own, proc):
    """(holders, denied, seen_start, mapped): the device fds, then at once the maps and the
    identity they belong to: a holder that is gone (or whose PID was reused) by the time its
    details are read was no holder (nvidia-smi runs meanwhile)."""
    holders, denied = scan_fds(device_target, own, proc)
    seen_start = {}
    mapped = {}
    for pid in holders:
        st = read_stat(pid, proc)
        seen_start[pid] = st["starttime"] if st else None
        mapped[pid] = mapped_devices(pid, proc)
    return holders, denied, seen_start, mapped


def _fd_visibility(denied, warnings, proc):
    """(hidden, can_read_all): whether /proc hides other users, and whether every fd was read."""
    hidden = hidepid_active(proc) and os.geteuid() != 0
    can_read_all = not denied and not hidden
    if hidden:
        warnings.append("/proc is mounted hidepid: other users' processes, and any GPU "
                        "holders among them, are hidden")
    elif denied:
        warnings.append(denied_warning(denied, proc))
    return hidden, can_read_all


def _query_smi(smi, req, deadline, jobs, smi_doc, warnings, proc=PROC):
    """(gpus, apps, driver, cuda) from the started queries (and the bare table, when time
    allows); failures go into smi_doc."""
    gpu_job, apps_job = jobs
    apps = []
    cuda = None
    gpus, error, code, secs = query_gpus(smi, req, deadline, gpu_job)
    smi_doc["seconds"] += secs
    ares = apps_job.finish()
    smi_doc["seconds"] += ares.seconds
    if error is not None:
        smi_doc.update(error=error, exit_code=code)
    else:
        smi_doc["ok"] = True
        apps = _compute_apps(ares, smi_doc, warnings, proc)
    driver = _pop_driver_versions(gpus)
    # the bare table (for the CUDA version) is skipped only when nvidia-smi is already
    # crawling (a wedged driver) or time is short; a loaded machine is not a wedged one
    if gpus and smi_doc["ok"] and req.get("cuda_version", True) and \
            smi_doc["seconds"] < 5.0 and deadline.remaining() > 2.0 * smi_doc["seconds"] + 2.0:
        res = run_cmd([smi], min(req["smi_timeout_s"], 5.0), deadline, "nvidia-smi")
        smi_doc["seconds"] += res.seconds
        if smi_failure(res) is None:
            d, cuda = parse_versions(res.out)
            driver = driver or d
    return gpus, apps, driver, cuda


def _compute_apps(ares, smi_doc, warnings, proc=PROC):
    """The rows of --query-compute-apps ([] when it failed: then smi_doc says why), each named
    from /proc (argv[0], as the NVML path names them): nvidia-smi is never asked for names."""
    apps = []
    fail = smi_failure(ares)
    if fail is not None:
        smi_doc.update(ok=False, error="compute apps: %s" % fail[0], exit_code=fail[1])
        return apps
    try:
        check_complete(ares.out, "--query-compute-apps")
    except ParseError as exc:
        smi_doc.update(ok=False, error=str(exc))
        return apps
    apps, skipped, rejected = parse_apps_csv(ares.out)
    if skipped:
        warnings.append("%d compute app row(s) without a PID skipped" % skipped)
    if rejected:
        warnings.append("%d nvidia-smi --query-compute-apps row(s) rejected (not %s): %s"
                        % (len(rejected), ", ".join(APP_FIELDS),
                           ", ".join(repr(r) for r in rejected[:3])))
    names = {}
    for a in apps:
        if a["pid"] not in names:
            names[a["pid"]] = process_name(a["pid"], proc)
        a["process_name"] = names[a["pid"]]
    return apps


def _pop_driver_versions(gpus):
    """The driver version (from the first GPU that has one), taken out of every GPU row; the
    rows get every other GPU key, None where not queried."""
    driver = None
    for g in gpus:
        driver = driver or g.pop("driver_version", None)
        g.pop("driver_version", None)
        for key in list(GPU_KEYS.values()) + list(SMI_MISSING_KEYS):
            if key != "driver_version":
                g.setdefault(key, None)
    return driver


#: How many generations above a holder the snapshot describes (a holder's family and the
#: supervisor, shell loop or runtime shim above it).
OWNER_DEPTH = 8


def _settle_holders(holders, seen_start, apps, own, ctx, jobs, warnings, proc):
    """(processes, vanished): the details of every process worth listing; holders that are
    gone or reused since the scan are dropped from holders (vanished)."""
    wanted = set(holders) | set(a["pid"] for a in apps) | own | set(ctx["ancestors"])
    # and who started them, up to init: a holder's owner is read from its parents (policy)
    for pid in set(holders) | set(a["pid"] for a in apps):
        wanted.update(ancestors_of(pid, proc)[:OWNER_DEPTH])
    # our own nvidia-smi children are not worth listing
    wanted -= _job_pids(jobs)
    processes = {}
    for pid in sorted(wanted):
        entry = process_entry(pid, ctx, proc)
        if entry is not None:
            entry["fds_readable"] = True  # its fds were listed (False below where refused)
            processes[str(pid)] = entry
    vanished = sorted(p for p in holders if str(p) not in processes or seen_start[p] is None
                      or processes[str(p)]["starttime"] != seen_start[p])
    for pid in vanished:
        del holders[pid]
    unseen = sorted(set(a["pid"] for a in apps if str(a["pid"]) not in processes))
    if unseen:
        warnings.append("nvidia-smi lists PIDs not in this /proc (other PID namespace: "
                        "container or WSL2): %s" % ", ".join(str(p) for p in unseen))
    return processes, vanished


def _snapshot_facts(ctx, smi, driver, cuda, can_read_all, hidden, proc):
    """The document's facts about this host and this agent."""
    in_container, container = container_facts(proc)
    euid = os.geteuid()
    return {
        "hostname": os.uname()[1],  # gethostname(2) on Linux; no socket import (~4 ms)
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
        "agent_cache": AGENT_CACHE_FACTS.get("state"),
        "agent_cache_reason": AGENT_CACHE_FACTS.get("reason"),
        "agent_sent": AGENT_CACHE_FACTS.get("sent"),
    }


def attach_minors(gpus, smi, req, deadline, smi_doc, warnings, proc=PROC):
    """minor (the N of /dev/nvidiaN): NVML's when it gave one, else matched by PCI bus id in
    /proc/driver, else from ``-q`` (smi None: never run nvidia-smi)."""
    known = dict((normalize_bus_id(g.get("pci_bus_id")), g["minor"]) for g in gpus
                 if g.get("minor") is not None)
    for g in gpus:
        g["minor"] = None
    if not gpus:
        return
    minors = gpu_minors_from_proc(proc)
    minors.update(known)
    missing = [g for g in gpus if minors.get(normalize_bus_id(g.get("pci_bus_id"))) is None]
    has_dev_files = False
    try:
        has_dev_files = any(gpu_minor("/dev/" + n) is not None for n in os.listdir(DEV))
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
