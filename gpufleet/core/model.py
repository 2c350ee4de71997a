"""Immutable model of what one host knows about its GPUs, parsed from the agent's JSON.

The remote agent (gpufleet/remote/agent.py) prints one JSON document per exec; this module
turns it into frozen values the pure core works with. "Not available" is ``None`` here and
"n/a" on screen, never an error: WSL2 and containers report far less than bare metal.

The agent's snapshot document (version 1), the contract between agent and controller, is
docs/protocol.md "The snapshot reply" (tests/unit/test_protocol_doc.py holds it to what the
agent writes). Notes on some of its fields:

``relation`` is "self", "ancestor", "session" (same session id as the agent) or null.
``fds_readable`` (added later; older agents omit it): false when the agent was refused the
process's open files, so whether it holds a GPU cannot be checked (policy.listing_check).
``compute_apps[].process_name`` is argv[0] read from /proc by the agent, never nvidia-smi's
CSV (a title with a newline or a comma would break its rows).

``threads`` (added later) is the kernel's thread count (the leader included). A zombie leader
(state Z) with more than one thread is a process whose main thread is gone while others run
on (recorded on the H200: pthread_exit, or a killed process whose threads are stuck in the
driver); it holds what they hold. For such a leader only, ``live_threads`` is how many still
run and ``stuck_threads`` those in uninterruptible sleep (D) with their wchan; for any other
process they are absent (null, []).

``exe`` is the kernel's /proc/PID/exe link and ``exe_root`` whether the file it runs belongs
to root and no one else may write it (null: not readable); a protected name counts only with
that evidence (core/policy.py).

``unit`` is the systemd unit systemd itself says owns the process (its ControlGroup is that
part of the cgroup path), never a name read from the path alone; ``user_unit`` and
``user_unit_uid`` name a unit of a user's own systemd (under ``user@UID.service``).

``mapped`` (added later; older agents omit it) is which NVIDIA device files the holder has
*mapped* (/proc/PID/maps), the evidence that tells a CUDA context (maps /dev/nvidiaN and
/dev/nvidia-uvm) from an NVML client (monitors, exporters: open files, no mappings; a running
nvidia-smi maps only /dev/nvidiactl). ``null`` = not available (maps unreadable, too big, too
slow, or an older agent): then only the memory evidence decides (gpufleet.core.policy.holder_role).
``holders_vanished``: device-file holders that exited before their details were read (a
concurrent nvidia-smi run); they are not holders. ``fd_unreadable``: processes whose open files
could not be read, with the reason ("permission denied as root", ...).
``facts.hidepid``: /proc is mounted hidepid and the agent is not root.
``mps`` (added later; absent: none asked): ``[{"pid", "pipe_dir", "pipe_dir_trusted",
"servers": [{"pid", "clients": [pid]}] | null, "error"}]``, one per CUDA MPS control daemon
(its executable root's nvidia-cuda-mps-control), its lists as it answers them (remote/mps.py).

NVML (added later): ``facts.gpu_source`` is "nvml" or "nvidia-smi" (what read the GPUs) and
``facts.gpu_source_reason`` why it is not the default (NVML unavailable, forced by the
inventory); the ``nvidia_smi`` object is then the GPU readings' status whatever their source.
``facts.agent_cache`` (hit | miss | off | unusable; added later) and ``agent_cache_reason``:
what the host's loader did with its cache of the compiled agent (remote/loader.py);
``facts.agent_sent`` (added later): false when the controller left the agent's source out of
the request because it had seen this host cache it (the run came from that cache).
``nvml``: {"library", "error", "seconds"}; ``graphics_apps`` (NVML: graphics processes, not
counted as attributed, like nvidia-smi's --query-compute-apps); ``gpu_errors``: [{"index",
"error", "code"}] GPUs NVML counts but cannot read (lost: code 15); the document then has
``nvidia_smi.ok`` false. ``temperature_c``, ``power_w`` are None from the nvidia-smi path.

Health (the readings `gpufleet health` judges, docs/health.md): per GPU the ECC, remapped rows, retired pages, clocks event
and PCIe readings (``HEALTH_INT_KEYS``, ``HEALTH_BOOL_KEYS``, ``clocks_event_names``,
``nvml_error_codes``), ``gpu_errors[].pci_bus_id``, ``nvml.code``, ``nvidia_smi.exit_code`` and
``kernel_log`` (Xid events, ``KernelLog``); absent keys (older agents) read as None.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpufleet.core.results import HostOutcome
from gpufleet.errors import SnapshotError

AGENT_VERSION = 1
COMM_MAX = 15  # TASK_COMM_LEN - 1: the kernel truncates comm to this many bytes

_NVIDIA_DEV = re.compile(r"^/dev/nvidia(\d+)$")
# The warning the agent gives about unreadable open files (gpufleet/remote/agent.py
# denied_warning); status prints it only when it could matter (gpufleet.core.policy).
FD_DENIED_WARNING = "cannot read the open files of "


@dataclass(frozen=True)
class StuckThread:
    """A thread in uninterruptible sleep (D) under a zombie leader, and where (wchan)."""

    tid: int
    wchan: Optional[str] = None


@dataclass(frozen=True)
class ProcessInfo:
    """One process; (pid, starttime) is its identity because PIDs are reused."""

    pid: int
    ppid: Optional[int]
    starttime: Optional[int]
    state: Optional[str]
    uid: Optional[int]
    user: Optional[str]
    comm: str
    cmdline: str
    cgroup: Optional[str] = None
    exe: Optional[str] = None
    exe_root: Optional[bool] = None
    unit: Optional[str] = None
    user_unit: Optional[str] = None
    user_unit_uid: Optional[int] = None
    container: Optional[str] = None
    container_restart: Optional[str] = None  # the runtime's restart policy (docker, podman)
    container_name: Optional[str] = None  # the runtime's name for it (docker, podman)
    session: Optional[int] = None
    pgid: Optional[int] = None
    kernel_thread: bool = False
    wchan: Optional[str] = None
    relation: Optional[str] = None
    fds_readable: Optional[bool] = None  # False: its open files were refused (None: not said)
    threads: Optional[int] = None  # the kernel's count, leader included (None: older agent)
    live_threads: Optional[int] = None  # under a zombie leader only: threads still running
    stuck_threads: tuple[StuckThread, ...] = ()  # under a zombie leader: those in D state

    @property
    def identity(self) -> tuple[int, Optional[int]]:
        return (self.pid, self.starttime)

    @property
    def name(self) -> str:
        """What an operator recognises: the comm, which vLLM renames (VLLM::Worker).

        The kernel cuts comm at 15 bytes ("VLLM::EngineCor"); when the rewritten cmdline
        starts with it (setproctitle), its first word is the full name (VLLM::EngineCore_DP0).
        """
        first = self.cmdline.split(" ", 1)[0] if self.cmdline else ""
        if self.comm and len(self.comm) >= COMM_MAX and first.startswith(self.comm):
            return first
        return self.comm or first or "?"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    pci_bus_id: Optional[str] = None
    minor: Optional[int] = None
    memory_used_mib: Optional[int] = None
    memory_total_mib: Optional[int] = None
    memory_free_mib: Optional[int] = None
    memory_reserved_mib: Optional[int] = None
    utilization_pct: Optional[int] = None
    # NVML only (None from the nvidia-smi path, or where the GPU does not report them)
    persistence_mode: Optional[bool] = None
    temperature_c: Optional[int] = None
    power_w: Optional[float] = None
    # health readings (`gpufleet health`): None = not available (the GPU or the reader has none)
    ecc_uncorrected_volatile: Optional[int] = None
    ecc_uncorrected_aggregate: Optional[int] = None
    remapped_rows_correctable: Optional[int] = None
    remapped_rows_uncorrectable: Optional[int] = None
    remapped_rows_pending: Optional[bool] = None
    remapped_rows_failure: Optional[bool] = None
    retired_pages_pending: Optional[bool] = None
    clocks_event_reasons: Optional[int] = None
    clocks_event_names: Optional[tuple[str, ...]] = None
    pcie_gen_current: Optional[int] = None
    pcie_gen_max: Optional[int] = None
    pcie_width_current: Optional[int] = None
    pcie_width_max: Optional[int] = None
    nvml_error_codes: tuple[tuple[str, int], ...] = ()  # (reading, NVML code) that failed


#: GpuInfo's health readings, as the document names them (parse_snapshot reads these).
HEALTH_INT_KEYS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate",
                   "remapped_rows_correctable", "remapped_rows_uncorrectable",
                   "clocks_event_reasons", "pcie_gen_current", "pcie_gen_max",
                   "pcie_width_current", "pcie_width_max")
HEALTH_BOOL_KEYS = ("remapped_rows_pending", "remapped_rows_failure", "retired_pages_pending")


@dataclass(frozen=True)
class XidEvent:
    """Xid events of one code on one PCI device since boot (the kernel log), folded."""

    pci: str  # 0000:18:00 (domain:bus:device, as the Xid line names it)
    code: int
    count: int
    first_s: Optional[float] = None  # seconds since boot
    last_s: Optional[float] = None
    last_epoch: Optional[float] = None
    message: str = ""


@dataclass(frozen=True)
class KernelLog:
    """What the agent read of the kernel log: where from, or why not (a value, not an error)."""

    source: Optional[str] = None  # /dev/kmsg | journalctl | dmesg | None (none readable)
    error: Optional[str] = None
    truncated: bool = False
    xid: tuple[XidEvent, ...] = ()


@dataclass(frozen=True)
class GpuError:
    """A GPU NVML counted but could not read (e.g. lost: NVML_ERROR_GPU_IS_LOST, code 15)."""

    index: int
    error: str
    code: Optional[int] = None
    pci_bus_id: Optional[str] = None  # from the driver's /proc listing (NVML has none then)


@dataclass(frozen=True)
class ComputeApp:
    """One row of nvidia-smi --query-compute-apps, joined to a GPU by UUID."""

    pid: int
    process_name: str
    used_mib: Optional[int]
    gpu_uuid: str


@dataclass(frozen=True)
class Holder:
    """A process with an open NVIDIA device file (what `fuser -v /dev/nvidia*` shows)."""

    pid: int
    devices: tuple[str, ...]
    mapped: Optional[tuple[str, ...]] = None  # None: maps not available (old agent, unreadable)


@dataclass(frozen=True)
class MpsServer:
    """An MPS server and its clients, as its control daemon lists them (a claim)."""

    pid: int
    clients: tuple[int, ...] = ()


@dataclass(frozen=True)
class MpsDaemon:
    """What the agent learnt from one CUDA MPS control daemon (remote/mps.py): its pipe
    directory (CUDA_MPS_PIPE_DIRECTORY in its environment, else the default), whether that
    directory is one only the daemon's user can write, and its lists (None: not asked, or no
    answer: ``error`` says why)."""

    pid: int
    pipe_dir: Optional[str] = None
    pipe_dir_trusted: bool = False
    servers: Optional[tuple[MpsServer, ...]] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class FdUnreadable:
    """A process whose open files the agent could not read, and why (for the operator)."""

    pid: int
    comm: Optional[str]
    reason: str


@dataclass(frozen=True)
class HostFacts:
    hostname: Optional[str] = None
    kernel: Optional[str] = None
    driver_version: Optional[str] = None
    cuda_version: Optional[str] = None
    is_root: bool = False
    uid: Optional[int] = None
    user: Optional[str] = None
    can_read_all_fds: bool = True
    in_container: bool = False
    container: Optional[str] = None
    wsl2: bool = False
    nvidia_smi: Optional[str] = None
    python: Optional[str] = None
    agent_pid: Optional[int] = None
    agent_starttime: Optional[int] = None
    hidepid: bool = False
    gpu_source: Optional[str] = None  # "nvml" | "nvidia-smi" (None: an agent before NVML)
    gpu_source_reason: Optional[str] = None  # why not the default choice
    agent_cache: Optional[str] = None  # "hit" | "miss" | "off" | "unusable" (None: not said)
    agent_cache_reason: Optional[str] = None  # why not a hit ("absent", "dir-owner", ...)
    agent_sent: Optional[bool] = None  # False: run from the host's cache, the source left out

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Snapshot:
    """Everything one agent exec saw on one host."""

    facts: HostFacts
    gpus: tuple[GpuInfo, ...]
    compute_apps: tuple[ComputeApp, ...]
    holders: tuple[Holder, ...]
    processes: Mapping[int, ProcessInfo]
    nvidia_smi_ok: bool = True
    nvidia_smi_error: Optional[str] = None
    warnings: tuple[str, ...] = ()
    holders_vanished: tuple[int, ...] = ()
    fd_unreadable: tuple[FdUnreadable, ...] = ()
    gpu_errors: tuple[GpuError, ...] = ()
    kernel_log: Optional[KernelLog] = None  # None: an agent older than the health readings, or not read
    nvidia_smi_exit_code: Optional[int] = None  # 9 driver not loaded, 14 InfoROM, 15 lost
    nvml_error_code: Optional[int] = None  # NVML's code when it could not be opened
    mps: tuple[MpsDaemon, ...] = ()  # CUDA MPS control daemons the agent asked (remote/mps.py)

    @property
    def gpu_reader(self) -> str:
        """What read the GPUs, for messages: "NVML" or "nvidia-smi"."""
        return "NVML" if self.facts.gpu_source == "nvml" else "nvidia-smi"

    def gpu_by_uuid(self, uuid: str) -> Optional[GpuInfo]:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None

    def gpu_indices_of_app(self, pid: int) -> tuple[int, ...]:
        """GPUs nvidia-smi attributes memory of ``pid`` to (by UUID, never by position)."""
        found = set()
        for app in self.compute_apps:
            if app.pid == pid:
                gpu = self.gpu_by_uuid(app.gpu_uuid)
                if gpu is not None:
                    found.add(gpu.index)
        return tuple(sorted(found))

    def apps_on(self, index: int) -> tuple[ComputeApp, ...]:
        gpu = next((g for g in self.gpus if g.index == index), None)
        if gpu is None:
            return ()
        return tuple(a for a in self.compute_apps if a.gpu_uuid == gpu.uuid)

    def listed_pids(self) -> frozenset[int]:
        return frozenset(a.pid for a in self.compute_apps)

    def unlisted_holders(self) -> tuple[Holder, ...]:
        """Device-file holders nvidia-smi lists nowhere (another PID namespace, WSL2), minus
        the agent and its ancestors, which hold nothing of their own."""
        listed = self.listed_pids()
        out = []
        for holder in self.holders:
            proc = self.processes.get(holder.pid)
            if holder.pid in listed or (proc is not None and proc.relation in ("self", "ancestor")):
                continue
            out.append(holder)
        return tuple(out)

    def minor_to_index(self) -> dict[int, int]:
        """/dev/nvidiaN minor -> nvidia-smi index; the two can differ, so never assume."""
        out = {}
        for gpu in self.gpus:
            out[gpu.minor if gpu.minor is not None else gpu.index] = gpu.index
        return out

    def holder_gpu_indices(self, holder: Holder) -> tuple[int, ...]:
        """GPU indices whose /dev/nvidiaN the holder has open (evidence of use, not of memory)."""
        return self.device_gpu_indices(holder.devices)

    def device_gpu_indices(self, devices: tuple[str, ...]) -> tuple[int, ...]:
        """nvidia-smi indices of the /dev/nvidiaN among ``devices``."""
        mapping = self.minor_to_index()
        found = set()
        for dev in devices:
            m = _NVIDIA_DEV.match(dev)
            if m and int(m.group(1)) in mapping:
                found.add(mapping[int(m.group(1))])
        return tuple(sorted(found))


def _opt_int(value: Any) -> Optional[int]:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _opt_bool(value: Any) -> Optional[bool]:
    return value if isinstance(value, bool) else None


def _opt_float(value: Any) -> Optional[float]:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _gpu(g: Mapping[str, Any]) -> GpuInfo:
    return GpuInfo(
        index=int(g["index"]),
        uuid=str(g["uuid"]),
        name=str(g.get("name") or "?"),
        pci_bus_id=g.get("pci_bus_id"),
        minor=_opt_int(g.get("minor")),
        memory_used_mib=_opt_int(g.get("memory_used_mib")),
        memory_total_mib=_opt_int(g.get("memory_total_mib")),
        memory_free_mib=_opt_int(g.get("memory_free_mib")),
        memory_reserved_mib=_opt_int(g.get("memory_reserved_mib")),
        utilization_pct=_opt_int(g.get("utilization_pct")),
        persistence_mode=_opt_bool(g.get("persistence_mode")),
        temperature_c=_opt_int(g.get("temperature_c")),
        power_w=_opt_float(g.get("power_w")),
        **_health_fields(g),
    )


def _health_fields(g: Mapping[str, Any]) -> dict[str, Any]:
    """The health readings of one GPU row (absent keys: an older agent, None)."""
    out: dict[str, Any] = {k: _opt_int(g.get(k)) for k in HEALTH_INT_KEYS}
    out.update({k: _opt_bool(g.get(k)) for k in HEALTH_BOOL_KEYS})
    names = g.get("clocks_event_names")
    out["clocks_event_names"] = None if names is None else tuple(str(n) for n in names)
    codes = g.get("nvml_error_codes") or {}
    out["nvml_error_codes"] = tuple(sorted((str(k), int(v)) for k, v in codes.items()
                                           if _opt_int(v) is not None))
    return out


def _kernel_log(raw: Any) -> Optional[KernelLog]:
    if not isinstance(raw, Mapping):
        return None
    events = tuple(
        XidEvent(pci=str(x["pci"]), code=int(x["code"]), count=int(x.get("count") or 1),
                 first_s=_opt_float(x.get("first_s")), last_s=_opt_float(x.get("last_s")),
                 last_epoch=_opt_float(x.get("last_epoch")), message=str(x.get("message") or ""))
        for x in raw.get("xid") or ())
    return KernelLog(source=raw.get("source"), error=raw.get("error"),
                     truncated=bool(raw.get("truncated")), xid=events)


def _process(raw: Mapping[str, Any]) -> ProcessInfo:
    return ProcessInfo(
        pid=int(raw["pid"]),
        ppid=_opt_int(raw.get("ppid")),
        starttime=_opt_int(raw.get("starttime")),
        state=raw.get("state"),
        uid=_opt_int(raw.get("uid")),
        user=raw.get("user"),
        comm=str(raw.get("comm") or ""),
        cmdline=str(raw.get("cmdline") or ""),
        cgroup=raw.get("cgroup"),
        exe=raw.get("exe") if isinstance(raw.get("exe"), str) else None,
        exe_root=raw.get("exe_root") if isinstance(raw.get("exe_root"), bool) else None,
        unit=raw.get("unit"),
        user_unit=raw.get("user_unit"),
        user_unit_uid=_opt_int(raw.get("user_unit_uid")),
        container=raw.get("container"),
        container_restart=raw.get("container_restart") if isinstance(
            raw.get("container_restart"), str) else None,
        container_name=raw.get("container_name") if isinstance(
            raw.get("container_name"), str) else None,
        session=_opt_int(raw.get("session")),
        pgid=_opt_int(raw.get("pgid")),
        kernel_thread=bool(raw.get("kernel_thread", False)),
        wchan=raw.get("wchan"),
        relation=raw.get("relation"),
        fds_readable=_opt_bool(raw.get("fds_readable")),
        threads=_opt_int(raw.get("threads")),
        live_threads=_opt_int(raw.get("live_threads")),
        stuck_threads=tuple(StuckThread(int(t["tid"]), t.get("wchan"))
                            for t in raw.get("stuck_threads") or ()),
    )


def _mps_daemon(raw: Mapping[str, Any]) -> MpsDaemon:
    servers = raw.get("servers")
    return MpsDaemon(
        pid=int(raw["pid"]),
        pipe_dir=raw.get("pipe_dir") if isinstance(raw.get("pipe_dir"), str) else None,
        pipe_dir_trusted=raw.get("pipe_dir_trusted") is True,
        servers=None if servers is None else tuple(
            MpsServer(pid=int(s["pid"]), clients=tuple(int(c) for c in s.get("clients") or ()))
            for s in servers),
        error=raw.get("error") if isinstance(raw.get("error"), str) else None,
    )


def parse_snapshot(doc: Mapping[str, Any]) -> Snapshot:
    """Turn the agent's JSON into a Snapshot; a malformed document raises SnapshotError."""
    if not isinstance(doc, Mapping):
        raise SnapshotError("agent output is not a JSON object")
    version = doc.get("agent_version")
    if version != AGENT_VERSION:
        raise SnapshotError(f"agent version {version!r}, controller expects {AGENT_VERSION}")
    try:
        facts_raw = doc.get("facts") or {}
        known = HostFacts.__dataclass_fields__
        facts = HostFacts(**{k: v for k, v in facts_raw.items() if k in known})
        gpus = tuple(_gpu(g) for g in doc.get("gpus") or ())
        apps = tuple(
            ComputeApp(
                pid=int(a["pid"]),
                process_name=str(a.get("process_name") or ""),
                used_mib=_opt_int(a.get("used_mib")),
                gpu_uuid=str(a.get("gpu_uuid") or ""),
            )
            for a in doc.get("compute_apps") or ()
        )
        holders = tuple(
            Holder(pid=int(h["pid"]), devices=tuple(sorted(h.get("devices") or ())),
                   mapped=None if h.get("mapped") is None else tuple(sorted(h["mapped"])))
            for h in doc.get("holders") or ()
        )
        unreadable = tuple(
            FdUnreadable(pid=int(u["pid"]), comm=u.get("comm"), reason=str(u.get("reason") or "?"))
            for u in doc.get("fd_unreadable") or ()
        )
        processes = {int(k): _process(v) for k, v in (doc.get("processes") or {}).items()}
        smi = doc.get("nvidia_smi") or {}
        return Snapshot(
            facts=facts,
            gpus=tuple(sorted(gpus, key=lambda g: g.index)),
            compute_apps=apps,
            holders=holders,
            processes=processes,
            nvidia_smi_ok=bool(smi.get("ok", True)),
            nvidia_smi_error=smi.get("error"),
            warnings=tuple(str(w) for w in doc.get("warnings") or ()),
            holders_vanished=tuple(int(p) for p in doc.get("holders_vanished") or ()),
            fd_unreadable=unreadable,
            gpu_errors=tuple(GpuError(index=int(e["index"]), error=str(e.get("error") or "?"),
                                      code=_opt_int(e.get("code")),
                                      pci_bus_id=e.get("pci_bus_id"))
                             for e in doc.get("gpu_errors") or ()),
            kernel_log=_kernel_log(doc.get("kernel_log")),
            nvidia_smi_exit_code=_opt_int(smi.get("exit_code")),
            nvml_error_code=_opt_int((doc.get("nvml") or {}).get("code")),
            mps=tuple(_mps_daemon(d) for d in doc.get("mps") or ()),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotError(f"malformed agent document: {exc}") from None


@dataclass(frozen=True)
class HostResult(HostOutcome):
    """One host's snapshot, or why there is none: a failure is a value, never an exception."""

    host: str
    ok: bool
    error: Optional[str] = None
    snapshot: Optional[Snapshot] = None
    seconds: float = 0.0
    error_kind: Optional[str] = None
