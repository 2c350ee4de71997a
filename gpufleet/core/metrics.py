"""The fleet as Prometheus metric families (pure: HostResult values in, families out).

`gpufleet export` and `gpufleet serve` render these (gpufleet.render.prometheus); nothing here
knows about HTTP, files or prometheus_client, so every number is unit-tested without a server.
Names follow Prometheus's conventions (``gpufleet_`` prefix, base units in the name: ``_bytes``,
``_seconds``, ``_ratio``, ``_total``) and the GPU labels are dcgm-exporter's (``Hostname``,
``gpu`` = index, ``UUID`` with its ``GPU-`` prefix, ``pci_bus_id``; the model as ``model_name``
or, with --model-label, dcgm-exporter's camelCase ``modelName``) plus
``host``, the inventory name, so the series join the dashboards operators already have.
docs/prometheus.md lists every family; FAMILIES below is that list, one definition.

A host that failed is ``gpufleet_up 0`` with ``reason`` = its failure kind (gpufleet.errors),
and has no other series; "not available" (WSL2's per-process memory, say) is no sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Protocol, Sequence

from gpufleet.core import policy
from gpufleet.core.ledger import ledger
from gpufleet.core.model import GpuInfo, HostResult, Snapshot
from gpufleet.errors import COMMAND, INTERNAL

MIB = 1 << 20
GAUGE, COUNTER = "gauge", "counter"

# dcgm-exporter's label for the GPU's name is camelCase (modelName); promtool's lint warns
# about any camelCase label, so the default is model_name: a lint-clean exposition.
MODEL_LABELS = ("model_name", "modelName")  # the default first: promtool lints camelCase
PROCESS_LABELS = ("pid", "name", "user")
DEFAULT_MAX_PROCESSES = 20  # per host: the bound on per-process series (docs/prometheus.md)
NAME_MAX = 64  # a process name label is cut to this many characters

HOST_LABELS = ("host", "Hostname")


def gpu_labels(model_label: str = "model_name") -> tuple[str, ...]:
    return ("host", "Hostname", "gpu", "UUID", model_label, "pci_bus_id")


# name -> (type, help, label names after the GPU/host ones); "G" = GPU labels, "H" = host
FAMILIES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "gpufleet_up": (GAUGE, "1 when the host's snapshot was gathered and nvidia-smi answered; "
                    "0 with reason = the failure kind", "H", ("reason",)),
    "gpufleet_agent_seconds": (GAUGE, "Seconds the agent's exec took (controller's clock)", "H", ()),
    "gpufleet_snapshot_timestamp_seconds": (GAUGE, "When this host's snapshot was taken "
                                            "(Unix time)", "H", ()),
    "gpufleet_gpus": (GAUGE, "GPUs nvidia-smi reports on the host", "H", ()),
    "gpufleet_unmanaged_holders": (GAUGE, "GPU memory holders in no systemd service and no "
                                   "container", "H", ()),
    "gpufleet_gpu_memory_used_bytes": (GAUGE, "GPU memory used (nvidia-smi memory.used)", "G", ()),
    "gpufleet_gpu_memory_total_bytes": (GAUGE, "GPU memory total (memory.total)", "G", ()),
    "gpufleet_gpu_memory_reserved_bytes": (GAUGE, "GPU memory the driver reserves "
                                           "(memory.reserved)", "G", ()),
    "gpufleet_gpu_utilization_ratio": (GAUGE, "GPU utilisation (utilization.gpu / 100)", "G", ()),
    "gpufleet_gpu_unattributed_memory_bytes": (GAUGE, "Memory used that no listed process "
                                               "accounts for", "G", ()),
    "gpufleet_gpu_expected_unattributed_memory_bytes": (GAUGE, "Unattributed memory the inventory "
                                                        "expects (unattributed_mib)", "G", ()),
    "gpufleet_gpu_unexpected_unattributed_memory_bytes": (
        GAUGE, "Unattributed memory beyond the expected amount and the driver's per-process "
        "share", "G", ()),
    "gpufleet_gpu_holders": (GAUGE, "Memory holders of the GPU: listed by nvidia-smi, or "
                             "device_file (an open /dev/nvidiaN, not listed)", "G", ("source",)),
    "gpufleet_process_memory_used_bytes": (GAUGE, "GPU memory of one process (opt-in, at most "
                                           "--max-processes series per host)", "G", ()),
    "gpufleet_process_series_dropped": (GAUGE, "Per-process series left out by the "
                                        "--max-processes bound", "H", ()),
    "gpufleet_last_clean_timestamp_seconds": (GAUGE, "When the last clean of the host ended "
                                              "(audit log; Unix time)", "h", ()),
    "gpufleet_last_clean_verdict": (GAUGE, "1 for the verdict of the host's last clean (audit "
                                    "log)", "h", ("verdict",)),
    "gpufleet_cleans_total": (COUNTER, "Cleans of the host in the audit log, by verdict", "h",
                              ("verdict",)),
    "gpufleet_health_finding": (GAUGE, "1 per finding of `gpufleet health`, by GPU (gpu empty: the host's): ECC, "
                                "remapped rows, Xid, lost GPUs, GPU count, throttling, PCIe, persistence", "h",
                                ("gpu", "code", "severity")),
    # `serve` only: its own refreshes
    "gpufleet_refresh_seconds": (GAUGE, "Seconds the last fleet refresh took", "", ()),
    "gpufleet_refresh_timestamp_seconds": (GAUGE, "When the last fleet refresh ended (Unix "
                                           "time)", "", ()),
    "gpufleet_refreshes_total": (COUNTER, "Fleet refreshes since serve started, by result",
                                 "", ("result",)),
}


@dataclass(frozen=True)
class Family:
    """One metric family: its samples are (label values in ``labels`` order, value)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]


@dataclass(frozen=True)
class LastClean:
    """What the audit log says of a host's cleans: the last verdict, when, and counts."""

    verdict: str
    time: float
    counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportOptions:
    """What the operator chose: the model label's name and the opt-in per-process series."""

    model_label: str = "model_name"
    per_process: bool = False
    process_labels: tuple[str, ...] = PROCESS_LABELS
    max_processes: int = DEFAULT_MAX_PROCESSES


class HealthFinding(Protocol):
    """The shape a health finding needs to become a metric (core/health.MetricFinding); read
    only, so frozen dataclasses fit."""

    @property
    def host(self) -> str: ...
    @property
    def gpu(self) -> Optional[int]: ...
    @property
    def code(self) -> str: ...
    @property
    def severity(self) -> str: ...


class _Families:
    """Samples gathered by family name, emitted in FAMILIES order."""

    def __init__(self, opts: ExportOptions):
        self.opts = opts
        self.samples: dict[str, list[tuple[tuple[str, ...], float]]] = {n: [] for n in FAMILIES}

    def labels_of(self, name: str) -> tuple[str, ...]:
        _, _, base, extra = FAMILIES[name]
        head = {"G": gpu_labels(self.opts.model_label), "H": HOST_LABELS, "h": ("host",),
                "": ()}[base]
        if name == "gpufleet_process_memory_used_bytes":
            extra = tuple(lb for lb in PROCESS_LABELS if lb in self.opts.process_labels)
        return head + extra

    def add(self, name: str, labels: tuple[str, ...], value: Optional[float]) -> None:
        if value is not None:
            self.samples[name].append((labels, float(value)))

    def families(self) -> list[Family]:
        """The families that have samples (an empty one says nothing), in FAMILIES order."""
        return [Family(name, kind, text, self.labels_of(name), tuple(self.samples[name]))
                for name, (kind, text, _, _) in FAMILIES.items() if self.samples[name]]


def _bytes(mib: Optional[int]) -> Optional[int]:
    return None if mib is None else int(mib) * MIB


def uuid_label(uuid: str) -> str:
    """dcgm-exporter's UUID: with its ``GPU-`` (or ``MIG-``) prefix, as nvidia-smi prints it."""
    return uuid if uuid.startswith(("GPU-", "MIG-")) or not uuid else "GPU-" + uuid


def _gpu_key(res: HostResult, snap: Snapshot, gpu: GpuInfo) -> tuple[str, ...]:
    return (res.host, snap.facts.hostname or "", str(gpu.index), uuid_label(gpu.uuid), gpu.name,
            gpu.pci_bus_id or "")


def up_reason(res: HostResult) -> Optional[str]:
    """None when the host is up, else its failure kind (nvidia-smi failing is COMMAND, as in
    clean: connected, the command failed)."""
    if not res.ok or res.snapshot is None:
        return res.error_kind or INTERNAL
    return None if res.snapshot.nvidia_smi_ok else COMMAND


def _holder_pids(snap: Snapshot, threshold_mib: int) -> tuple[dict[int, set[int]], set[int]]:
    """Per GPU the device-file holders (role holder, not listed), and every holder pid."""
    roles = policy.holder_roles(snap, threshold_mib)
    per_gpu: dict[int, set[int]] = {g.index: set() for g in snap.gpus}
    every = set(snap.listed_pids())
    for holder in snap.unlisted_holders():
        if roles[holder.pid].role != policy.ROLE_HOLDER:
            continue
        every.add(holder.pid)
        for index in snap.holder_gpu_indices(holder):
            per_gpu.setdefault(index, set()).add(holder.pid)
    return per_gpu, every


def _unmanaged(snap: Snapshot, pids: Iterable[int]) -> int:
    count = 0
    for pid in pids:
        proc = snap.processes.get(pid)
        if proc is not None and policy.service_unit(proc) is None and not proc.container:
            count += 1
    return count


def _host(fam: _Families, res: HostResult, expected_mib: int, taken_at: Optional[float],
          known_hostname: str = "") -> None:
    snap = res.snapshot
    hostname = (snap.facts.hostname or "") if snap is not None else known_hostname
    key = (res.host, hostname)
    reason = up_reason(res)
    fam.add("gpufleet_up", key + (reason or "",), 0 if reason else 1)
    fam.add("gpufleet_agent_seconds", key, round(res.seconds, 6))
    fam.add("gpufleet_snapshot_timestamp_seconds", key, taken_at)
    if reason is not None or snap is None:
        return
    fam.add("gpufleet_gpus", key, len(snap.gpus))
    per_gpu, every = _holder_pids(snap, expected_mib + policy.DEFAULT_TOLERANCE_MIB)
    fam.add("gpufleet_unmanaged_holders", key, _unmanaged(snap, every))
    rows = {row.index: row for row in ledger(snap, expected_mib)}
    for gpu in snap.gpus:
        g, row = _gpu_key(res, snap, gpu), rows[gpu.index]
        fam.add("gpufleet_gpu_memory_used_bytes", g, _bytes(gpu.memory_used_mib))
        fam.add("gpufleet_gpu_memory_total_bytes", g, _bytes(gpu.memory_total_mib))
        fam.add("gpufleet_gpu_memory_reserved_bytes", g, _bytes(gpu.memory_reserved_mib))
        util = gpu.utilization_pct
        fam.add("gpufleet_gpu_utilization_ratio", g, None if util is None else util / 100.0)
        fam.add("gpufleet_gpu_unattributed_memory_bytes", g, _bytes(row.unattributed_mib))
        fam.add("gpufleet_gpu_expected_unattributed_memory_bytes", g, _bytes(expected_mib))
        fam.add("gpufleet_gpu_unexpected_unattributed_memory_bytes", g, _bytes(row.unexpected_mib))
        listed = {a.pid for a in snap.apps_on(gpu.index)}
        fam.add("gpufleet_gpu_holders", g + ("listed",), len(listed))
        fam.add("gpufleet_gpu_holders", g + ("device_file",), len(per_gpu.get(gpu.index, ())))
    if fam.opts.per_process:
        _processes(fam, res, snap)


def _processes(fam: _Families, res: HostResult, snap: Snapshot) -> None:
    """Per-process memory, summed over the chosen labels, the largest first, at most
    ``max_processes`` series per host; how many were left out is a series of its own."""
    chosen = fam.opts.process_labels
    sums: dict[tuple[str, ...], int] = {}
    for gpu in snap.gpus:
        for app in snap.apps_on(gpu.index):
            if app.used_mib is None:  # not available (WSL2): no sample
                continue
            proc = snap.processes.get(app.pid)
            values = {"pid": str(app.pid),
                      "name": (proc.name if proc is not None else app.process_name)[:NAME_MAX],
                      "user": (proc.user or "") if proc is not None else ""}
            key = _gpu_key(res, snap, gpu) + tuple(values[lb] for lb in PROCESS_LABELS
                                                   if lb in chosen)
            sums[key] = sums.get(key, 0) + app.used_mib
    ranked = sorted(sums.items(), key=lambda kv: (-kv[1], kv[0]))
    limit = max(0, fam.opts.max_processes)
    for key, mib in ranked[:limit]:
        fam.add("gpufleet_process_memory_used_bytes", key, mib * MIB)
    fam.add("gpufleet_process_series_dropped", (res.host, snap.facts.hostname or ""),
            max(0, len(ranked) - limit))


def _cleans(fam: _Families, host: str, last: LastClean) -> None:
    fam.add("gpufleet_last_clean_timestamp_seconds", (host,), last.time)
    fam.add("gpufleet_last_clean_verdict", (host, last.verdict), 1)
    for verdict, count in sorted(last.counts.items()):
        fam.add("gpufleet_cleans_total", (host, verdict), count)


def health_samples(fam: _Families, findings: Iterable[HealthFinding]) -> None:
    """Where health findings (`gpufleet health`) become metrics: one sample per finding, value 1.
    Several findings of one code on one GPU are one series."""
    seen = set()
    for f in findings:
        key = (f.host, "" if f.gpu is None else str(f.gpu), f.code, f.severity)
        if key not in seen:
            seen.add(key)
            fam.add("gpufleet_health_finding", key, 1)


@dataclass(frozen=True)
class RefreshStats:
    """`serve`'s own refreshes: the last one's duration and end, and counts by result."""

    seconds: float
    ended_at: float
    ok: int
    failed: int


def fleet_families(results: Sequence[HostResult], expected: Mapping[str, int],
                   last_cleans: Optional[Mapping[str, LastClean]] = None,
                   opts: Optional[ExportOptions] = None,
                   taken_at: Optional[Mapping[str, float]] = None,
                   findings: Iterable[HealthFinding] = (),
                   refresh: Optional[RefreshStats] = None,
                   hostnames: Optional[Mapping[str, str]] = None) -> list[Family]:
    """Every family for these hosts. ``expected``: each host's ``unattributed_mib``;
    ``last_cleans``: the audit log's last clean per host (only hosts in ``results``);
    ``taken_at``: when each host's snapshot was taken (Unix time); ``findings``: health
    findings (core/health, as `gpufleet health` judges); ``refresh``: serve's own refresh numbers; ``hostnames``: the
    ``Hostname`` of hosts that failed this time (serve's last known, so a host's series keep
    their labels while it is down)."""
    fam = _Families(opts or ExportOptions())
    times, known = taken_at or {}, hostnames or {}
    for res in results:
        _host(fam, res, int(expected.get(res.host, 0)), times.get(res.host),
              known.get(res.host, ""))
    names = {r.host for r in results}
    cleans = last_cleans or {}
    for host in sorted(cleans):
        if host in names:
            _cleans(fam, host, cleans[host])
    health_samples(fam, findings)
    if refresh is not None:
        fam.add("gpufleet_refresh_seconds", (), round(refresh.seconds, 6))
        fam.add("gpufleet_refresh_timestamp_seconds", (), refresh.ended_at)
        fam.add("gpufleet_refreshes_total", ("ok",), refresh.ok)
        fam.add("gpufleet_refreshes_total", ("failed",), refresh.failed)
    return fam.families()
