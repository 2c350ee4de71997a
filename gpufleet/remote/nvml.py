"""The GPUs as NVML reports them: libnvidia-ml.so.1 through ctypes, every failure a value.

A piece of the remote agent. Why: one NVML init and a dozen calls cost about 12 ms on an H200,
where the nvidia-smi runs they replace cost 33 + 25 + 110 + 127 ms (measured on the H200: docs/real-gpu.md, "NVML, isolated start").
The rows it returns have the keys of the nvidia-smi path (parse.GPU_KEYS), in the same units
(MiB, rounded up like nvidia-smi), so nothing downstream can tell the sources apart except by
``facts.gpu_source``.

Signatures, constants and struct layouts are NVIDIA's nvml.h (github.com/NVIDIA/go-nvml,
pkg/nvml/nvml.h, NVML_API_VERSION 13): nvmlMemory_v2_st, nvmlProcessInfo_v2_st (=
nvmlProcessInfo_t, what the _v2 and _v3 process entry points fill), nvmlProcessInfo_v1_st,
nvmlPciInfo_st. Return codes from enum nvmlReturn_enum. A call the library does not export
(an old driver) reads as NVML_ERROR_FUNCTION_NOT_FOUND, exactly as NVML itself reports it.

A wedged driver can block an NVML call inside the kernel, where no Python signal handler runs:
every call batch runs in a daemon thread joined with a bound (``bounded``); one that does not
come back marks the library wedged and the document says so.
"""
import ctypes
import os
import time

from .jobs import read_bytes_bounded, run_bounded  # joined
from .parse import clocks_event_names  # joined

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_VALUE_NOT_AVAILABLE_ULL = (1 << 64) - 1
NVML_TEMPERATURE_GPU = 0
#: nvml.h nvmlMemoryErrorType_t / nvmlEccCounterType_t
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
MIB = 1024 * 1024

LIBRARY = "libnvidia-ml.so.1"
#: Where drivers put the library when the loader's search does not find it: Debian/Ubuntu,
#: RHEL, NVIDIA's container toolkit, WSL2.
LIBRARY_FALLBACKS = (
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/lib/wsl/lib/libnvidia-ml.so.1",
)
#: Bounds of one batch of calls (init + a full read, or one memory poll).
CALL_TIMEOUT_S = 10.0
BUFFER = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE, NVML_DEVICE_NAME_V2_BUFFER_SIZE (both 96)


class Memory(ctypes.Structure):  # nvml.h: struct nvmlMemory_st
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class MemoryV2(ctypes.Structure):  # nvml.h: struct nvmlMemory_v2_st
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


#: nvml.h: #define NVML_STRUCT_VERSION(data, ver) (sizeof(nvml##data##_v##ver##_t) | (ver << 24U))
MEMORY_V2 = ctypes.sizeof(MemoryV2) | (2 << 24)


class ProcessInfoV1(ctypes.Structure):  # nvml.h: struct nvmlProcessInfo_v1_st
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class ProcessInfo(ctypes.Structure):  # nvml.h: struct nvmlProcessInfo_v2_st (nvmlProcessInfo_t)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class PciInfo(ctypes.Structure):  # nvml.h: struct nvmlPciInfo_st (the _v3 entry point's)
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint),
                ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


#: (entry point, struct) from the newest to the oldest; the first one exported is used.
PROCESS_CALLS = {
    "compute": (("nvmlDeviceGetComputeRunningProcesses_v3", ProcessInfo),
                ("nvmlDeviceGetComputeRunningProcesses_v2", ProcessInfo),
                ("nvmlDeviceGetComputeRunningProcesses", ProcessInfoV1)),
    "graphics": (("nvmlDeviceGetGraphicsRunningProcesses_v3", ProcessInfo),
                 ("nvmlDeviceGetGraphicsRunningProcesses_v2", ProcessInfo),
                 ("nvmlDeviceGetGraphicsRunningProcesses", ProcessInfoV1)),
}


def load_library(requested=None):
    """(ctypes library, path or name, None) or (None, None, why): the loader's search first
    (LD_LIBRARY_PATH, ld.so.cache), then the known places."""
    names = [requested] if requested else [LIBRARY] + list(LIBRARY_FALLBACKS)
    last = None
    for name in names:
        if name != LIBRARY and not os.path.exists(name):
            continue
        try:
            return ctypes.CDLL(name), name, None
        except OSError as exc:
            last = "%s: %s" % (name, exc)
    if requested:
        return None, None, last or "%s not found" % requested
    return None, None, last or "%s not found" % LIBRARY


def bounded(fn, timeout):
    """(result, why, timed_out) of fn() run in a thread of its own: why is None when it
    returned; timed_out when it did not return in time (the caller marks the library wedged)."""

    def call():
        try:
            return fn(), None, False
        except Exception as exc:  # a bug in a read must come back as a value
            return None, "%s: %s" % (type(exc).__name__, exc), False

    finished, value = run_bounded(call, timeout)
    if not finished:
        return None, "NVML did not answer within %gs (driver wedged?)" % round(timeout, 1), True
    return value


class Nvml(object):
    """One initialised library: handles and minor numbers are learned once and kept, so a
    resident agent (watch mode) or the clean's memory wait pays only for the readings."""

    def __init__(self, lib, path):
        self.lib = lib
        self.path = path
        self.handles = {}
        self.minors = {}
        self.wedged = None
        self.init_rc = None
        self._names = {}
        err = lib.nvmlErrorString if hasattr(lib, "nvmlErrorString") else None
        if err is not None:
            err.restype = ctypes.c_char_p
        self._error_string = err

    def call(self, name, *args):
        """NVML's return code; a function the library does not export is FUNCTION_NOT_FOUND."""
        fn = self._names.get(name)
        if fn is None:
            fn = getattr(self.lib, name, None)
            if fn is None:
                return NVML_ERROR_FUNCTION_NOT_FOUND
            self._names[name] = fn
        return fn(*args)

    def error(self, rc):
        """'GPU is lost (15)': NVML's own words and the code, which JSON readers key on."""
        text = None
        if self._error_string is not None:
            try:
                text = self._error_string(rc)
            except Exception:
                text = None
        text = text.decode("utf-8", "replace") if text else "NVML error"
        return "%s (%d)" % (text, rc)

    def init(self):
        """None, or why nvmlInit failed (init_v2, else the old nvmlInit)."""
        rc = self.call("nvmlInit_v2")
        if rc == NVML_ERROR_FUNCTION_NOT_FOUND:
            rc = self.call("nvmlInit")
        self.init_rc = rc
        return None if rc == NVML_SUCCESS else "nvmlInit: " + self.error(rc)

    def handle(self, index):
        """(handle, rc): the device handle, learned once per index."""
        if index in self.handles:
            return self.handles[index], NVML_SUCCESS
        h = ctypes.c_void_p()
        rc = self.call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(h))
        if rc == NVML_SUCCESS:
            self.handles[index] = h
        return h, rc


_STATE = {}  # type: dict  # the one library per agent process: "nvml" -> Nvml, or "error" -> why


def open_nvml(requested=None, timeout=CALL_TIMEOUT_S):
    """(Nvml, None) or (None, why): loaded and initialised once per agent process."""
    if "nvml" in _STATE:
        nv = _STATE["nvml"]
        return (None, nv.wedged) if nv.wedged else (nv, None)
    if "error" in _STATE:
        return None, _STATE["error"]
    lib, path, why = load_library(requested)
    if lib is None:
        _STATE["error"] = why
        return None, why
    nv = Nvml(lib, path)
    why, late, _ = bounded(nv.init, min(timeout, CALL_TIMEOUT_S))
    why = why or late
    if why:
        _STATE["error"] = why
        _STATE["error_code"] = nv.init_rc if nv.init_rc else None
        return None, why
    _STATE["nvml"] = nv
    return nv, None


def nvml_decided():
    """Whether this agent process opened NVML already (or found it unusable)."""
    return "nvml" in _STATE or "error" in _STATE


def nvml_error_code():
    """NVML's return code when it could not be opened (9: driver not loaded), else None."""
    return _STATE.get("error_code")


def text_of(nv, name, handle=None, size=BUFFER):
    """(text, rc) of a string getter (with a device handle, or a system one without)."""
    buf = ctypes.create_string_buffer(size)
    if handle is None:
        rc = nv.call(name, buf, ctypes.c_uint(size))
    else:
        rc = nv.call(name, handle, buf, ctypes.c_uint(size))
    return (buf.value.decode("utf-8", "replace") if rc == NVML_SUCCESS else None), rc


def uint_of(nv, name, handle, *extra):
    """(unsigned int, rc) of a device getter with one out parameter (extra args first)."""
    out = ctypes.c_uint()
    rc = nv.call(name, handle, *(list(extra) + [ctypes.byref(out)]))
    return (out.value if rc == NVML_SUCCESS else None), rc


def mib(value):
    """bytes -> MiB as nvidia-smi prints them: rounded UP. Recorded on the H200 at one moment
    (tests/fixtures/recorded/probe/h200-clients-probe3.log): v2 reserved 644939776 B (615.06 MiB)
    and free 150109880320 B (143155.94 MiB) were printed 616 and 143156 MiB; tests/gpu/gpu_nvml.py
    holds the two to equality. NVML's 'not available' -> None."""
    if value is None or value == NVML_VALUE_NOT_AVAILABLE_ULL:
        return None
    return int(-(-value // MIB))


def cuda_version(nv):
    """'13.0' from nvmlSystemGetCudaDriverVersion_v2's 13000 (nvidia-smi's CUDA Version)."""
    out = ctypes.c_int()
    rc = nv.call("nvmlSystemGetCudaDriverVersion_v2", ctypes.byref(out))
    if rc == NVML_ERROR_FUNCTION_NOT_FOUND:
        rc = nv.call("nvmlSystemGetCudaDriverVersion", ctypes.byref(out))
    if rc != NVML_SUCCESS or out.value <= 0:
        return None
    return "%d.%d" % (out.value // 1000, (out.value % 1000) // 10)


def memory_of(nv, handle):
    """(used, total, free, reserved) in MiB, rc: the v2 struct (reserved apart, as nvidia-smi
    shows it), else v1 (an older driver: there `used` is what that driver's nvidia-smi shows)."""
    m2 = MemoryV2()
    m2.version = MEMORY_V2
    rc = nv.call("nvmlDeviceGetMemoryInfo_v2", handle, ctypes.byref(m2))
    if rc == NVML_SUCCESS:
        return (mib(m2.used), mib(m2.total), mib(m2.free), mib(m2.reserved)), rc
    if rc not in (NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
                  NVML_ERROR_NOT_SUPPORTED):
        return (None, None, None, None), rc
    m1 = Memory()
    rc = nv.call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(m1))
    if rc != NVML_SUCCESS:
        return (None, None, None, None), rc
    return (mib(m1.used), mib(m1.total), mib(m1.free), None), rc


def processes_of(nv, handle, kind):
    """([(pid, used MiB or None)], rc) from the newest process entry point exported; the list
    may grow between the sizing call and the read: retried with room to spare."""
    for name, struct in PROCESS_CALLS[kind]:
        count = ctypes.c_uint(0)
        infos = None
        rc = nv.call(name, handle, ctypes.byref(count), None)
        if rc == NVML_ERROR_FUNCTION_NOT_FOUND:
            continue
        for _ in range(4):
            if rc == NVML_SUCCESS and (infos is not None or count.value == 0):
                break
            if rc == NVML_SUCCESS:  # a count with no buffer: size it as if told to
                rc = NVML_ERROR_INSUFFICIENT_SIZE
            if rc != NVML_ERROR_INSUFFICIENT_SIZE:
                return [], rc
            size = count.value + 8
            infos = (struct * size)()
            count = ctypes.c_uint(size)
            rc = nv.call(name, handle, ctypes.byref(count), infos)
        if rc != NVML_SUCCESS or infos is None:
            return [], rc
        return [(int(infos[i].pid), mib(infos[i].usedGpuMemory))
                for i in range(count.value)], rc
    return [], NVML_ERROR_FUNCTION_NOT_FOUND


def process_name(pid, proc="/proc"):
    """argv[0] of the cmdline, verbatim, as nvidia-smi prints process_name ("" when this /proc
    does not have the pid: another PID namespace)."""
    data, _ = read_bytes_bounded("%s/%d/cmdline" % (proc, pid), 0.2, 4096)
    if data:
        return data.split(b"\0", 1)[0].decode("utf-8", "replace")
    data, _ = read_bytes_bounded("%s/%d/comm" % (proc, pid), 0.2, 256)
    return data.decode("utf-8", "replace").strip() if data else ""


def device_row(nv, index, handle, errors):
    """One GPU's row with parse.GPU_KEYS' keys (+ minor and the NVML-only readings); a reading
    the GPU does not support is None, any other failure is None plus an entry in errors."""
    row = {"index": index, "nvml_error_codes": {}}

    def keep(key, value, rc):
        row[key] = value
        if rc not in (NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
            errors[key] = nv.error(rc)
            row["nvml_error_codes"][key] = rc
        return rc

    keep("uuid", *text_of(nv, "nvmlDeviceGetUUID", handle))
    keep("name", *text_of(nv, "nvmlDeviceGetName", handle))
    pci = PciInfo()
    rc = nv.call("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci))
    keep("pci_bus_id", pci.busId.decode("ascii", "replace") if rc == NVML_SUCCESS else None, rc)
    if index not in nv.minors:  # fixed for the GPU's life: learned once per agent process
        minor, rc = uint_of(nv, "nvmlDeviceGetMinorNumber", handle)
        if rc in (NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED):
            nv.minors[index] = minor
        keep("minor", minor, rc)
    row["minor"] = nv.minors.get(index)
    (used, total, free, reserved), rc = memory_of(nv, handle)
    keep("memory_used_mib", used, rc)
    row.update(memory_total_mib=total, memory_free_mib=free, memory_reserved_mib=reserved)
    util = (ctypes.c_uint * 2)()  # nvmlUtilization_t: gpu, memory
    rc = nv.call("nvmlDeviceGetUtilizationRates", handle, ctypes.byref(util))
    keep("utilization_pct", util[0] if rc == NVML_SUCCESS else None, rc)
    mode = ctypes.c_int()
    rc = nv.call("nvmlDeviceGetPersistenceMode", handle, ctypes.byref(mode))
    keep("persistence_mode", bool(mode.value) if rc == NVML_SUCCESS else None, rc)
    keep("temperature_c", *uint_of(nv, "nvmlDeviceGetTemperature", handle,
                                   ctypes.c_int(NVML_TEMPERATURE_GPU)))
    power, rc = uint_of(nv, "nvmlDeviceGetPowerUsage", handle)
    keep("power_w", None if power is None else round(power / 1000.0, 2), rc)
    health_readings(nv, handle, row, keep)
    return row


def health_readings(nv, handle, row, keep):
    """The readings of the health gate (`gpufleet health`), each None where the GPU has none: ECC
    uncorrected counts, remapped rows, retired pages pending, clocks event reasons, PCIe link.
    Entry points and out parameters as recorded on the H200 (probe/h200-clients-probe3.log)."""
    for key, counter in (("ecc_uncorrected_volatile", NVML_VOLATILE_ECC),
                         ("ecc_uncorrected_aggregate", NVML_AGGREGATE_ECC)):
        out = ctypes.c_ulonglong()
        rc = nv.call("nvmlDeviceGetTotalEccErrors", handle,
                     ctypes.c_int(NVML_MEMORY_ERROR_TYPE_UNCORRECTED), ctypes.c_int(counter),
                     ctypes.byref(out))
        keep(key, int(out.value) if rc == NVML_SUCCESS else None, rc)
    rows = [ctypes.c_uint() for _ in range(4)]  # corrRows, uncRows, isPending, failureOccurred
    rc = nv.call("nvmlDeviceGetRemappedRows", handle, *[ctypes.byref(r) for r in rows])
    ok = rc == NVML_SUCCESS
    keep("remapped_rows_correctable", rows[0].value if ok else None, rc)
    row["remapped_rows_uncorrectable"] = rows[1].value if ok else None
    row["remapped_rows_pending"] = bool(rows[2].value) if ok else None
    row["remapped_rows_failure"] = bool(rows[3].value) if ok else None
    pending = ctypes.c_int()
    rc = nv.call("nvmlDeviceGetRetiredPagesPendingStatus", handle, ctypes.byref(pending))
    keep("retired_pages_pending", bool(pending.value) if rc == NVML_SUCCESS else None, rc)
    reasons = ctypes.c_ulonglong()
    rc = nv.call("nvmlDeviceGetCurrentClocksEventReasons", handle, ctypes.byref(reasons))
    if rc == NVML_ERROR_FUNCTION_NOT_FOUND:  # drivers before 535: the older name, same bits
        rc = nv.call("nvmlDeviceGetCurrentClocksThrottleReasons", handle, ctypes.byref(reasons))
    mask = int(reasons.value) if rc == NVML_SUCCESS else None
    keep("clocks_event_reasons", mask, rc)
    row["clocks_event_names"] = clocks_event_names(mask)
    for key, name in (("pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
                      ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                      ("pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth"),
                      ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
        keep(key, *uint_of(nv, name, handle))


def read_devices(nv, proc="/proc"):
    """Everything one snapshot needs, in one pass over the initialised library: a dict with
    gpus, compute_apps, graphics_apps (nvidia-smi --query-compute-apps lists only compute),
    driver, cuda, gpu_errors ([{index, error, code}]: a GPU NVML cannot read, e.g. lost)."""
    out = {"gpus": [], "compute_apps": [], "graphics_apps": [], "gpu_errors": [],
           "driver": text_of(nv, "nvmlSystemGetDriverVersion", None, 80)[0],
           "cuda": cuda_version(nv)}
    count = ctypes.c_uint()
    rc = nv.call("nvmlDeviceGetCount_v2", ctypes.byref(count))
    if rc != NVML_SUCCESS:
        out["error"] = "nvmlDeviceGetCount: " + nv.error(rc)
        return out
    names = {}
    for index in range(count.value):
        handle, rc = nv.handle(index)
        errors = {}
        row = device_row(nv, index, handle, errors) if rc == NVML_SUCCESS else None
        lost = rc if rc != NVML_SUCCESS else _lost_code(errors, nv)
        if lost is not None:
            out["gpu_errors"].append({"index": index, "error": nv.error(lost), "code": lost})
            nv.handles.pop(index, None)
            nv.minors.pop(index, None)
            continue
        row["nvml_errors"] = errors
        out["gpus"].append(row)
        for kind in ("compute", "graphics"):
            procs, prc = processes_of(nv, handle, kind)
            if prc not in (NVML_SUCCESS, NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                errors[kind + "_processes"] = nv.error(prc)
            for pid, used in procs:
                if pid not in names:
                    names[pid] = process_name(pid, proc)
                out[kind + "_apps"].append({"pid": pid, "process_name": names[pid],
                                            "used_mib": used, "gpu_uuid": row["uuid"]})
    return out


def _lost_code(errors, nv):
    """NVML_ERROR_GPU_IS_LOST when any reading of the GPU said so (its numbers mean nothing)."""
    lost = nv.error(NVML_ERROR_GPU_IS_LOST)
    return NVML_ERROR_GPU_IS_LOST if lost in errors.values() else None


def memory_used(nv, indices):
    """({index: memory.used MiB}, None) for the clean's memory wait (a GPU NVML cannot read is
    absent), or (None, why) when the first call fails."""
    used = {}
    for index in indices:
        handle, rc = nv.handle(index)
        if rc != NVML_SUCCESS:
            if rc == NVML_ERROR_GPU_IS_LOST:
                return None, "GPU %d: %s" % (index, nv.error(rc))
            continue
        (value, _, _, _), rc = memory_of(nv, handle)
        if rc != NVML_SUCCESS:
            return None, "GPU %d: nvmlDeviceGetMemoryInfo: %s" % (index, nv.error(rc))
        used[index] = value
    return used, None


def read_bounded(nv, timeout, fn, *args):
    """fn(nv, *args) under the call bound; a call that does not return wedges the library."""
    t0 = time.monotonic()
    result, why, timed_out = bounded(lambda: fn(nv, *args), min(timeout, CALL_TIMEOUT_S))
    if timed_out:
        nv.wedged = why
    return result, why, time.monotonic() - t0
