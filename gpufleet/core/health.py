"""The health gate (is every GPU sound?): a snapshot's readings -> findings, each with the action it calls for.

Pure: values in, values out. A finding has a code (what JSON readers key on), a severity (OK,
WARN, CRITICAL), a message and an action. Xid events follow the recovery buckets of NVIDIA's Xid
catalog ("Resolution Bucket (Immediate Action)", docs.nvidia.com/deploy/xid-errors/
analyzing-xid-catalog.html; transcribed per code as NVIDIA ships it in
github.com/NVIDIA/NVSentinel, distros/kubernetes/nvsentinel/charts/gpu-health-monitor/
xiderrorsmapping.csv): RESTART_APP, RESET_GPU, RESTART_BM (drain and reboot the node),
CONTACT_SUPPORT / UNEXPECTED_ERR_REPORT_ISSUE, CHECK_MECHANICALS, IGNORE. The memory readings
follow NVIDIA's A100/H100 memory error management guide (docs.nvidia.com/deploy/
a100-gpu-mem-error-mgmt): a pending row remap takes effect at the next GPU reset; a remapping
failure means the GPU is out of spare rows (RMA).

A reset is the action only where gpufleet's reset rules allow one (root, the host itself, not
WSL2: the same conditions as ``gpufleet clean --reset``); elsewhere the node is drained and
rebooted instead. Xid events are since boot: the kernel log holds nothing older.

A reading that could not be taken is unknown, never OK (core/readings.py): a GPU that gave
none is UNKNOWN (``no_readings``), one that gave some names the others (``readings_missing``,
an OK finding, as ``xid_unavailable`` is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from gpufleet.core import readings
from gpufleet.core.xidcatalog import (CHECK_MECHANICALS_XIDS, IGNORE_XIDS, RESET_GPU_XIDS,
                                     RESTART_APP_XIDS, RESTART_BM_XIDS, XID_NAMES)
from gpufleet.core.model import GpuInfo, HostResult, KernelLog, Snapshot, XidEvent

OK = "OK"
UNKNOWN = "UNKNOWN"  # nothing could be read: not OK, and no known fault either
WARN = "WARN"
CRITICAL = "CRITICAL"
SEVERITIES = (OK, UNKNOWN, WARN, CRITICAL)
RANK = {OK: 0, UNKNOWN: 1, WARN: 2, CRITICAL: 3}  # order only; exporters read VALUE
VALUE = {OK: 0, WARN: 1, CRITICAL: 2, UNKNOWN: -1}  # finding_values (docs/health.md)

# Actions, mildest first (a GPU's action is that of its worst finding, then the most drastic).
NONE = "none"
CONFIGURE = "configure"
INSPECT = "inspect"
RESTART_APP = "restart_app"
RESET_GPU = "reset_gpu"
DRAIN_REBOOT = "drain_reboot"
CONTACT_SUPPORT = "contact_support"
ACTIONS = (NONE, CONFIGURE, INSPECT, RESTART_APP, RESET_GPU, DRAIN_REBOOT, CONTACT_SUPPORT)
ACTION_TEXT = {
    NONE: "-",
    CONFIGURE: "enable persistence mode (nvidia-smi -pm 1 or nvidia-persistenced)",
    INSPECT: "check cooling, power and the PCIe slot",
    RESTART_APP: "restart the application",
    RESET_GPU: "reset the GPU (gpufleet clean --reset, once nothing holds it)",
    DRAIN_REBOOT: "drain and reboot the node",
    CONTACT_SUPPORT: "contact support / RMA",
}

NVML_DRIVER_NOT_LOADED = 9
NVML_CORRUPTED_INFOROM = 14
NVML_GPU_IS_LOST = 15
THROTTLE_HW = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
THROTTLE_THERMAL = ("sw_thermal_slowdown",)


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing) about a GPU or a host."""

    code: str
    severity: str
    message: str
    action: str = NONE
    xid: Optional[int] = None
    detail: str = ""  # the evidence verbatim (an Xid's last kernel log message): untrusted text

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "severity": self.severity, "message": self.message,
                "action": self.action, "action_text": ACTION_TEXT[self.action], "xid": self.xid,
                "detail": self.detail}


@dataclass(frozen=True)
class GpuHealth:
    """One GPU's findings; ``index`` None for a PCI device the Xid log names but no GPU
    reading matches (its bus id is ``pci``)."""

    index: Optional[int]
    pci: Optional[str]
    uuid: Optional[str]
    name: Optional[str]
    findings: tuple[Finding, ...] = ()
    unknown: tuple[str, ...] = ()  # reading groups not taken (core/readings.py)

    @property
    def severity(self) -> str:
        return worst(f.severity for f in self.findings)

    @property
    def worst_finding(self) -> Optional[Finding]:
        bad = [f for f in self.findings if f.severity != OK]
        if not bad:
            return None
        return max(bad, key=lambda f: (RANK[f.severity], ACTIONS.index(f.action)))

    @property
    def action(self) -> str:
        top = self.worst_finding
        return top.action if top is not None else NONE


@dataclass(frozen=True)
class HostHealth:
    """A host's verdict: GPU rows plus host-level findings (driver, GPU count, kernel log)."""

    host: str
    ok: bool  # the host answered and the readings could be judged
    error: Optional[str] = None
    gpus: tuple[GpuHealth, ...] = ()
    host_findings: tuple[Finding, ...] = ()
    reset_blocker: Optional[str] = None  # why gpufleet may not reset a GPU here (None: it may)

    @property
    def severity(self) -> str:
        sev = [g.severity for g in self.gpus] + [f.severity for f in self.host_findings]
        return worst(sev)

    def gpu(self, index: int) -> Optional[GpuHealth]:
        return next((g for g in self.gpus if g.index == index), None)


def worst(severities: Iterable[str]) -> str:
    out = OK
    for sev in severities:
        if RANK[sev] > RANK[out]:
            out = sev
    return out


def short_pci(bus_id: Optional[str]) -> Optional[str]:
    """00000000:18:00.0 (nvidia-smi, NVML) or 0000:18:00.0 -> 0000:18:00 (the Xid line's)."""
    if not bus_id:
        return None
    parts = bus_id.strip().split(":")
    if len(parts) != 3:
        return None
    try:
        domain = int(parts[0], 16)
        bus = int(parts[1], 16)
        dev = int(parts[2].split(".")[0], 16)
    except ValueError:
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}"


def reset_possible(snapshot: Snapshot) -> tuple[bool, str]:
    """(whether gpufleet may reset a GPU here, why not): clean --reset's conditions."""
    facts = snapshot.facts
    if facts.wsl2:
        return False, "WSL2 has no GPU reset"
    if facts.in_container:
        return False, f"the agent runs in container {facts.container or '?'}"
    if not facts.is_root:
        return False, "not root"
    return True, ""


def _reset_or_reboot(snapshot: Snapshot, finding: Finding) -> Finding:
    """A finding whose action is a reset, made a drain-and-reboot where no reset is allowed."""
    if finding.action != RESET_GPU:
        return finding
    allowed, why = reset_possible(snapshot)
    if allowed:
        return finding
    return Finding(finding.code, finding.severity,
                   f"{finding.message} (a GPU reset is not possible here: {why})",
                   DRAIN_REBOOT, finding.xid, finding.detail)


def xid_finding(event: XidEvent) -> Finding:
    """An Xid code's severity and action from NVIDIA's catalog bucket."""
    code = event.code
    what = XID_NAMES.get(code, "see NVIDIA's Xid catalog")
    text = f"Xid {code} ({what}) x{event.count} since boot"
    if code in RESTART_BM_XIDS:
        sev, action = CRITICAL, DRAIN_REBOOT
    elif code in RESET_GPU_XIDS:
        sev, action = CRITICAL, RESET_GPU
    elif code in RESTART_APP_XIDS:
        sev, action = WARN, RESTART_APP
    elif code in IGNORE_XIDS:
        sev, action = OK, NONE
    elif code in CHECK_MECHANICALS_XIDS:
        sev, action = WARN, INSPECT
    else:
        sev, action = WARN, CONTACT_SUPPORT
    return Finding(f"xid_{code}", sev, text, action, code, event.message)


def memory_findings(gpu: GpuInfo) -> list[Finding]:
    """ECC, remapped rows, retired pages (None readings make no finding)."""
    out = []
    if gpu.remapped_rows_failure:
        out.append(Finding("remap_failure", CRITICAL, "row remapping failed (no spare rows)",
                           CONTACT_SUPPORT))
    if gpu.ecc_uncorrected_volatile:
        out.append(Finding("ecc_uncorrected", CRITICAL,
                           f"{gpu.ecc_uncorrected_volatile} uncorrected ECC error(s) since "
                           "the driver loaded", RESET_GPU))
    elif gpu.ecc_uncorrected_aggregate:
        out.append(Finding("ecc_uncorrected_history", WARN,
                           f"{gpu.ecc_uncorrected_aggregate} uncorrected ECC error(s) in the "
                           "GPU's life (none since the driver loaded)", NONE))
    if gpu.remapped_rows_pending:
        out.append(Finding("remap_pending", CRITICAL,
                           "a row remap is pending: it takes effect at the next GPU reset",
                           RESET_GPU))
    if gpu.retired_pages_pending:
        out.append(Finding("retired_pages_pending", CRITICAL,
                           "a page retirement is pending: it takes effect at the next GPU "
                           "reset", RESET_GPU))
    return out


def link_findings(gpu: GpuInfo) -> list[Finding]:
    """Clocks event reasons, PCIe link below the GPU's maximum, persistence mode."""
    out = []
    names = gpu.clocks_event_names or ()
    hw = [n for n in names if n in THROTTLE_HW]
    if hw:
        out.append(Finding("hw_slowdown", WARN, "clocks held down: " + ", ".join(hw), INSPECT))
    thermal = [n for n in names if n in THROTTLE_THERMAL]
    if thermal:
        out.append(Finding("thermal_slowdown", WARN, "clocks held down: thermal slowdown",
                           INSPECT))
    cw, mw = gpu.pcie_width_current, gpu.pcie_width_max
    if cw is not None and mw is not None and cw < mw:
        out.append(Finding("pcie_width", WARN, f"PCIe link x{cw} of x{mw}", INSPECT))
    cg, mg = gpu.pcie_gen_current, gpu.pcie_gen_max
    if cg is not None and mg is not None and cg < mg:
        if "gpu_idle" in names:  # an idle GPU lowers its link generation to save power
            out.append(Finding("pcie_gen_idle", OK, f"PCIe gen {cg} of {mg} (idle)", NONE))
        else:
            out.append(Finding("pcie_gen", WARN, f"PCIe gen {cg} of {mg}", INSPECT))
    if gpu.persistence_mode is False:
        out.append(Finding("persistence_off", WARN, "persistence mode is off", CONFIGURE))
    return out


def readings_finding(missing: tuple[str, ...]) -> Optional[Finding]:
    """What was not read: every group (UNKNOWN: no finding would mean nothing), or some."""
    if not missing:
        return None
    if len(missing) == len(readings.READINGS):
        return Finding("no_readings", UNKNOWN,
                       f"nothing could be read ({readings.describe(missing)})", NONE)
    return Finding("readings_missing", OK, f"not read: {readings.describe(missing)}", NONE)


def gpu_findings(snapshot: Snapshot, gpu: GpuInfo, xids: Sequence[XidEvent]) -> GpuHealth:
    found: list[Finding] = memory_findings(gpu) + link_findings(gpu)
    if any(code == NVML_CORRUPTED_INFOROM for _, code in gpu.nvml_error_codes):
        found.append(Finding("inforom_corrupted", WARN, "InfoROM corrupted", CONTACT_SUPPORT))
    found += [xid_finding(x) for x in xids]
    missing = readings.unknown(gpu)
    unread = readings_finding(missing)
    if unread is not None:
        found.append(unread)
    return GpuHealth(gpu.index, short_pci(gpu.pci_bus_id), gpu.uuid, gpu.name,
                     tuple(_reset_or_reboot(snapshot, f) for f in found), missing)


def host_level(snapshot: Snapshot, expected_gpus: Optional[int], seen: int) -> list[Finding]:
    """Driver, InfoROM, lost GPU by exit code, GPU count, the kernel log's availability."""
    out = []
    smi_code, nvml_code = snapshot.nvidia_smi_exit_code, snapshot.nvml_error_code
    if NVML_DRIVER_NOT_LOADED in (smi_code, nvml_code) and not snapshot.gpus:
        out.append(Finding("driver_not_loaded", CRITICAL, "the NVIDIA driver is not loaded "
                           "(or not answering)", DRAIN_REBOOT))
    if smi_code == NVML_CORRUPTED_INFOROM:
        out.append(Finding("inforom_corrupted", WARN, "nvidia-smi: InfoROM corrupted (exit 14)",
                           CONTACT_SUPPORT))
    if smi_code == NVML_GPU_IS_LOST and not snapshot.gpu_errors:
        out.append(Finding("gpu_lost", CRITICAL, "nvidia-smi: a GPU is lost (exit 15)",
                           DRAIN_REBOOT))
    if expected_gpus is not None and seen != expected_gpus:
        sev, action = (CRITICAL, DRAIN_REBOOT) if seen < expected_gpus else (WARN, NONE)
        out.append(Finding("gpu_count", sev, f"{seen} GPU(s) found, the inventory expects "
                           f"{expected_gpus}", action))
    out += kernel_log_findings(snapshot.kernel_log)
    return out


def kernel_log_findings(log: Optional[KernelLog]) -> list[Finding]:
    """"Not available" is a value: an OK finding that says why Xid events are unknown."""
    if log is None:
        return []
    if log.source is None:
        return [Finding("xid_unavailable", OK, f"kernel log not readable: {log.error}", NONE)]
    if log.truncated:
        return [Finding("xid_truncated", OK, f"kernel log read in part ({log.source})", NONE)]
    return []


def assess(host: str, snapshot: Snapshot, expected_gpus: Optional[int] = None) -> HostHealth:
    """Every GPU's findings (lost ones included), Xid events matched by PCI bus id, and the
    host's own findings."""
    xids = snapshot.kernel_log.xid if snapshot.kernel_log else ()
    by_pci: dict[str, list[XidEvent]] = {}
    for x in xids:
        by_pci.setdefault(x.pci, []).append(x)
    rows = []
    for gpu in snapshot.gpus:
        rows.append(gpu_findings(snapshot, gpu, by_pci.pop(short_pci(gpu.pci_bus_id) or "", [])))
    for err in snapshot.gpu_errors:
        pci = short_pci(err.pci_bus_id)
        lost = err.code == NVML_GPU_IS_LOST
        found = [Finding("gpu_lost" if lost else "gpu_unreadable", CRITICAL if lost else WARN,
                         err.error, DRAIN_REBOOT if lost else CONTACT_SUPPORT)]
        found += [xid_finding(x) for x in by_pci.pop(pci or "", [])]
        rows.append(GpuHealth(err.index, pci, None, None,
                              tuple(_reset_or_reboot(snapshot, f) for f in found)))
    for pci, events in by_pci.items():  # the log names a device no reading matches
        rows.append(GpuHealth(None, pci, None, None,
                              tuple(_reset_or_reboot(snapshot, xid_finding(x)) for x in events)))
    rows.sort(key=lambda g: (g.index is None, g.index if g.index is not None else 0, g.pci or ""))
    seen = len(snapshot.gpus) + len(snapshot.gpu_errors)
    allowed, why = reset_possible(snapshot)
    return HostHealth(host, True, None, tuple(rows),
                      tuple(host_level(snapshot, expected_gpus, seen)),
                      None if allowed else why)


def assess_result(result: HostResult, expected_gpus: Optional[int] = None) -> HostHealth:
    """A host's health, or why it has none (unreachable: ok False, the error)."""
    if not result.ok or result.snapshot is None:
        return HostHealth(result.host, False, result.error)
    return assess(result.host, result.snapshot, expected_gpus)


def critical_host_findings(health: HostHealth) -> list[Finding]:
    """The host's own CRITICAL findings (driver not loaded, GPUs missing, ...): what makes a
    host that answered one `status` must not pass (exit 1), as it could not be read whole."""
    return [f for f in health.host_findings if f.severity == CRITICAL]


def tally(report: Sequence[HostHealth]) -> tuple[dict[str, int], dict[str, int]]:
    """(GPUs per severity, host findings per severity) over the hosts that answered: what
    every summary line counts. OK host findings (notes such as xid_unavailable) are left out."""
    gpus = {sev: 0 for sev in SEVERITIES}
    hosts = {sev: 0 for sev in SEVERITIES}
    for h in report:
        for g in h.gpus:
            gpus[g.severity] += 1
        for f in h.host_findings:
            if f.severity != OK:
                hosts[f.severity] += 1
    return gpus, hosts


def job_refusal(health: HostHealth, gpus: Optional[Sequence[int]] = None) -> Optional[str]:
    """For a Slurm prolog: why a job must not start on these GPUs (None: it may). A CRITICAL
    finding on one of them, or on the host, refuses it; so does a host that gave no readings."""
    if not health.ok:
        return f"{health.host}: no health readings: {health.error}"
    for f in health.host_findings:
        if f.severity == CRITICAL:
            return f"{health.host}: {f.code}: {f.message}"
    for g in health.gpus:
        if g.severity != CRITICAL or (gpus is not None and g.index is not None
                                      and g.index not in gpus):
            continue
        top = g.worst_finding
        where = f"GPU {g.index}" if g.index is not None else f"PCI {g.pci}"
        return f"{health.host} {where}: {top.code if top else '?'}: {top.message if top else ''}"
    return None


def finding_values(health: HostHealth) -> list[dict[str, Any]]:
    """For an exporter: one value per finding and per GPU, labels and a number (VALUE: OK 0,
    WARN 1, CRITICAL 2, UNKNOWN -1), so a metric such as gpufleet_gpu_health{host,gpu,pci,code}
    needs no parsing."""
    out: list[dict[str, Any]] = []
    for g in health.gpus:
        gpu = "" if g.index is None else str(g.index)
        out.append({"host": health.host, "gpu": gpu, "pci": g.pci or "", "code": "",
                    "severity": g.severity, "value": VALUE[g.severity], "action": g.action})
        for f in g.findings:
            out.append({"host": health.host, "gpu": gpu, "pci": g.pci or "", "code": f.code,
                        "severity": f.severity, "value": VALUE[f.severity], "action": f.action})
    for f in health.host_findings:
        out.append({"host": health.host, "gpu": "", "pci": "", "code": f.code,
                    "severity": f.severity, "value": VALUE[f.severity], "action": f.action})
    return out


@dataclass(frozen=True)
class MetricFinding:
    """One finding as the exporter labels it (core/metrics.HealthFinding)."""

    host: str
    gpu: Optional[int]
    code: str
    severity: str


def metric_findings(health: HostHealth) -> list[MetricFinding]:
    """Every finding of a host, GPU ones with their index (None: a host finding, or a PCI
    device no GPU reading matches), for `gpufleet export` / `serve`."""
    out = [MetricFinding(health.host, g.index, f.code, f.severity)
           for g in health.gpus for f in g.findings]
    out += [MetricFinding(health.host, None, f.code, f.severity) for f in health.host_findings]
    return out
