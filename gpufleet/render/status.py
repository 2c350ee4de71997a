"""Status as a table or as the documented JSON document (pure: values in, text out).

The JSON keys are a contract (README "status --json"); more keys may be added, none renamed.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Sequence


from gpufleet.core import health, policy
from gpufleet.core.health import OK, RANK, UNKNOWN, GpuHealth, HostHealth
from gpufleet.core.live import STALE, LiveHost
from gpufleet.core.model import HEALTH_BOOL_KEYS, HEALTH_INT_KEYS
from gpufleet.core.model import FD_DENIED_WARNING, GpuInfo, GpuLedger, HostResult, Snapshot, ledger
from gpufleet.core.results import Failure
from gpufleet.errors import COMMAND, TIMEOUT
from gpufleet.render.table import render_table
from gpufleet.render.common import NA, error_cell, fmt_mib, terminal_safe, to_json  # noqa: F401 (re-exported)

BUSY_TOLERANCE_MIB = policy.DEFAULT_TOLERANCE_MIB
HEALTH_READINGS = HEALTH_INT_KEYS + HEALTH_BOOL_KEYS  # per GPU in status JSON (issue 16)  # clean's --tolerance-mib default


def cell_text(text: str) -> str:
    """A process-supplied string as ONE table line (``terminal_safe(text, one_line=True)``)."""
    return terminal_safe(text, one_line=True)


def _process_name(snapshot: Snapshot, pid: int, fallback: str) -> str:
    proc = snapshot.processes.get(pid)
    return cell_text(proc.name if proc is not None else (fallback or "?"))


def holders_text(snapshot: Snapshot, gpu: GpuInfo,
                 refused: Optional[dict[int, policy.ListingCheck]] = None) -> str:
    """`VLLM::Worker 1234 700MiB`, one per line: what nvidia-smi attributes to this GPU; a
    listed process that holds nothing of it is marked (policy.listing_check)."""
    parts = []
    for app in snapshot.apps_on(gpu.index):
        name = _process_name(snapshot, app.pid, app.process_name)
        mark = "" if app.pid in snapshot.processes else " (not in /proc)"
        if refused and app.pid in refused:
            mark = " (untrusted row)"
        parts.append(f"{name} {app.pid} {fmt_mib(app.used_mib)}{mark}")
    return "\n".join(parts) if parts else "-"


def unlisted_holders_text(snapshot: Snapshot, expected_mib: int = 0,
                          role: str = policy.ROLE_HOLDER) -> str:
    """Device-file holders nvidia-smi does not list, once per host: a CUDA process opens
    every /dev/nvidiaN, so repeating them on each GPU row would claim memory they may not hold.
    ``role``: the possible memory holders (the `fd` row) or the GPU clients (`clients` row,
    monitors and exporters with no evidence of memory; gpufleet.core.policy.holder_role)."""
    from gpufleet.core.gpus import format_gpu_ranges as format_gpu_list

    parts = []
    roles = policy.holder_roles(snapshot, expected_mib + BUSY_TOLERANCE_MIB)
    for holder in snapshot.unlisted_holders():
        if roles[holder.pid].role != role:
            continue
        gpus = snapshot.holder_gpu_indices(holder)
        where = f"GPUs {format_gpu_list(gpus)}" if gpus else ", ".join(
            d.rsplit("/", 1)[-1] for d in holder.devices)
        parts.append(f"{_process_name(snapshot, holder.pid, '?')} {holder.pid} (fd: {where})")
    return "\n".join(parts)


def gpu_is_busy(snapshot: Snapshot, gpu: GpuInfo, expected_mib: int) -> bool:
    if snapshot.apps_on(gpu.index):
        return True
    used = gpu.memory_used_mib
    return used is not None and used > expected_mib + BUSY_TOLERANCE_MIB


def health_cell(gpu: Optional[GpuHealth]) -> str:
    """The HEALTH column: the worst finding's severity and code (``CRITICAL xid_79``);
    UNKNOWN when no reading could be taken; ``OK (partial)`` when some could not (`health`
    names them): a GPU nothing was learnt about must not read as OK."""
    if gpu is None:
        return NA
    top = gpu.worst_finding
    if top is None:
        return OK + (" (partial)" if gpu.unknown else "")
    return UNKNOWN if top.severity == UNKNOWN else f"{top.severity} {top.code}"


def host_health_cell(h: HostHealth) -> str:
    """A host row without GPU rows (readings failed): its worst finding, if any."""
    bad = [f for g in h.gpus for f in g.findings] + list(h.host_findings)
    bad = [f for f in bad if f.severity != OK]
    if not bad:
        return "-"
    top = max(bad, key=lambda f: RANK[f.severity])
    return f"{top.severity} {top.code}"


def status_rows(results: Sequence[HostResult], expected: dict[str, int],
                expected_gpus: Optional[dict[str, Optional[int]]] = None) -> list[list[str]]:
    rows: list[list[str]] = []
    for res in results:
        snap = res.snapshot
        if not res.ok or snap is None:
            rows.append([res.host, "-", "-", "-", "-", "-", error_cell(res.error), "-"])
            continue
        hh = health.assess(res.host, snap, (expected_gpus or {}).get(res.host))
        if not snap.nvidia_smi_ok:
            rows.append([res.host, "-", "-", "-", "-", "-", error_cell(snap.nvidia_smi_error),
                         host_health_cell(hh)])
            continue
        if not snap.gpus:
            rows.append([res.host, "-", "no GPUs", "-", "-", "-", "-", host_health_cell(hh)])
            continue
        exp = expected.get(res.host, 0)
        refused = policy.refused_listings(snap)
        view = policy.without_refused_listings(snap, drop_holders=False)
        led = {row.index: row for row in ledger(view, exp)}
        for gpu in snap.gpus:
            row = led[gpu.index]
            unattr = fmt_mib(row.unattributed_mib)
            if row.unexpected_mib and row.unexpected_mib > BUSY_TOLERANCE_MIB:
                unattr += " !"
            elif row.unattributed_mib and exp:
                unattr += " (expected)"
            util = NA if gpu.utilization_pct is None else f"{gpu.utilization_pct}%"
            rows.append(
                [
                    res.host,
                    str(gpu.index),
                    gpu.name,
                    f"{fmt_mib(gpu.memory_used_mib)} / {fmt_mib(gpu.memory_total_mib)}",
                    util,
                    unattr,
                    holders_text(snap, gpu, refused),
                    health_cell(hh.gpu(gpu.index)),
                ]
            )
        unlisted = unlisted_holders_text(view, exp)
        if unlisted:
            rows.append([res.host, "fd", "open device files, not listed by nvidia-smi", "", "", "", unlisted, ""])
        clients = unlisted_holders_text(view, exp, policy.ROLE_CLIENT)
        if clients:
            rows.append([res.host, "clients", "GPU clients (monitors, exporters): no memory", "",
                         "", "", clients, ""])
    return rows


STATUS_HEADERS = ["HOST", "GPU", "NAME", "MEMORY", "UTIL", "UNATTRIBUTED", "HOLDERS", "HEALTH"]


def summary_line(results: Sequence[HostResult], expected: dict[str, int]) -> str:
    ok = sum(1 for r in results if r.ok and r.snapshot is not None and r.snapshot.nvidia_smi_ok)
    failed = len(results) - ok
    busy = free = 0
    for res in results:
        if res.ok and res.snapshot is not None:
            for gpu in res.snapshot.gpus:
                if gpu_is_busy(res.snapshot, gpu, expected.get(res.host, 0)):
                    busy += 1
                else:
                    free += 1
    return f"hosts: {ok} ok, {failed} failed; GPUs: {busy} busy, {free} free"


def status_table(results: Sequence[HostResult], expected: dict[str, int],
                 expected_gpus: Optional[dict[str, Optional[int]]] = None) -> str:
    table = render_table(status_rows(results, expected, expected_gpus), STATUS_HEADERS)
    notes = [f"{name}: {error}" for name, error in _long_errors(results)]
    notes += [f"{r.host}: warning: {w}" for r in results if r.snapshot is not None
              for w in screen_warnings(r.snapshot, expected.get(r.host, 0))
              + listing_warnings(r.snapshot)]
    return table + "\n" + summary_line(results, expected) + "".join("\n" + n for n in notes)


def screen_warnings(snapshot: Snapshot, expected_mib: int = 0) -> list[str]:
    """The warnings worth a line on screen (JSON keeps them all): "cannot read the open files
    of ..." only when the unreadable processes could hide memory that nothing explains."""
    quiet = not policy.unreadable_could_matter(snapshot, expected_mib + BUSY_TOLERANCE_MIB)
    return [w for w in snapshot.warnings if not (quiet and w.startswith(FD_DENIED_WARNING))]


def listing_warnings(snapshot: Snapshot) -> list[str]:
    """One line per listed process that holds nothing of its GPU (policy.listing_check)."""
    return [f"PID {c.pid} is an untrusted row: {c.reason}; its memory counts as unattributed"
            for c in policy.refused_listings(snapshot).values()]


def _long_errors(results: Sequence[HostResult], width: int = 100) -> list[tuple[str, str]]:
    """Errors cut short in the table are printed whole below it: they say what to do."""
    out = []
    for res in results:
        error = res.error if not res.ok or res.snapshot is None else (
            None if res.snapshot.nvidia_smi_ok else res.snapshot.nvidia_smi_error)
        text = " ".join(str(error or "").split())
        if len(text) > width:
            out.append((res.host, text))
    return out


def _process_doc(snapshot: Snapshot, pid: int, fallback: str, used_mib: Optional[int],
                 check: Optional[policy.ListingCheck] = None) -> dict:
    proc = snapshot.processes.get(pid)
    return {
        "pid": pid,
        "name": proc.name if proc else fallback,
        "cmdline": proc.cmdline if proc else None,
        "user": proc.user if proc else None,
        "state": proc.state if proc else None,
        "used_mib": used_mib,
        "unit": proc.unit if proc else None,
        "user_unit": proc.user_unit if proc else None,
        "user_unit_uid": proc.user_unit_uid if proc else None,
        "container": proc.container if proc else None,
        "starttime": proc.starttime if proc else None,
        "visible": proc is not None,
        # policy.listing_check: verified | unverified | refused (null: not in this /proc)
        "listing": check.trust if check else None,
        "listing_reason": check.reason if check else None,
    }


def host_doc(res: HostResult, expected_mib: int,
             expected_gpus: Optional[int] = None) -> dict[str, Any]:
    snap = res.snapshot
    doc: dict[str, Any] = {
        "host": res.host,
        "ok": bool(res.ok and snap is not None and snap.nvidia_smi_ok),
        "error": res.error if not res.ok else (None if snap is None or snap.nvidia_smi_ok else snap.nvidia_smi_error),
        **(res.error_kind_field() if not res.ok else
           {} if snap is None or snap.nvidia_smi_ok else {"error_kind": COMMAND}),
        "seconds": round(res.seconds, 3),
        "facts": snap.facts.as_dict() if snap else {},
        "gpus": [],
        "holders": [],
        "warnings": list(snap.warnings) if snap else [],
    }
    if snap is None:
        return doc
    view = policy.without_refused_listings(snap, drop_holders=False)
    led = {row.index: row for row in ledger(view, expected_mib)}
    hh = health.assess(res.host, snap, expected_gpus)
    checks = policy.listing_checks(snap)
    for gpu in snap.gpus:
        doc["gpus"].append(_gpu_doc(snap, gpu, led[gpu.index], checks))
        doc["gpus"][-1]["health"] = _health_doc(hh.gpu(gpu.index))
    doc["health"] = {"severity": hh.severity,
                     "findings": [f.as_dict() for f in hh.host_findings]}
    doc["holders"].extend(_holder_docs(snap, expected_mib))
    doc["holders_vanished"] = list(snap.holders_vanished)
    doc["fd_unreadable"] = [{"pid": u.pid, "comm": u.comm, "reason": u.reason}
                            for u in snap.fd_unreadable]
    doc["gpu_errors"] = [{"index": e.index, "error": e.error, "code": e.code}
                         for e in snap.gpu_errors]
    return doc


def _gpu_doc(snap: Snapshot, gpu: GpuInfo, row: GpuLedger,
             checks: dict[int, policy.ListingCheck]) -> dict[str, Any]:
    """One GPU's entry: nvidia-smi's numbers, the ledger's attribution (refused listings not
    counted: policy.listing_check), its processes."""
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "pci_bus_id": gpu.pci_bus_id,
        "memory_used_mib": gpu.memory_used_mib,
        "memory_total_mib": gpu.memory_total_mib,
        "memory_free_mib": gpu.memory_free_mib,
        "memory_reserved_mib": gpu.memory_reserved_mib,
        "attributed_mib": row.attributed_mib,
        "unattributed_mib": row.unattributed_mib,
        "expected_unattributed_mib": row.expected_unattributed_mib,
        "unexpected_unattributed_mib": row.unexpected_mib,
        "driver_allowance_mib": row.driver_allowance_mib,
        "utilization_pct": gpu.utilization_pct,
        "persistence_mode": gpu.persistence_mode,
        "temperature_c": gpu.temperature_c,
        "power_w": gpu.power_w,
        **{key: getattr(gpu, key) for key in HEALTH_READINGS},
        "clocks_event_names": None if gpu.clocks_event_names is None
        else list(gpu.clocks_event_names),
        "processes": [
            _process_doc(snap, a.pid, a.process_name, a.used_mib, checks.get(a.pid))
            for a in snap.apps_on(gpu.index)
        ],
    }


def _health_doc(g: Optional[GpuHealth]) -> Optional[dict[str, Any]]:
    """A GPU's ``health``: severity, worst code, action, every finding."""
    if g is None:
        return None
    top = g.worst_finding
    return {"severity": g.severity, "code": top.code if top else None, "action": g.action,
            "findings": [f.as_dict() for f in g.findings]}


def _holder_docs(snap: Snapshot, expected_mib: int) -> list[dict[str, Any]]:
    """One entry per process holding a GPU device, with its role (why it holds it). A listed
    process that holds nothing of its GPU (policy.listing_check) is judged as unlisted."""
    out: list[dict[str, Any]] = []
    listed = snap.listed_pids()
    refused = policy.refused_listings(snap)
    view = policy.without_refused_listings(snap, drop_holders=False)
    roles = policy.holder_roles(view, expected_mib + BUSY_TOLERANCE_MIB)
    for holder in snap.holders:
        proc = snap.processes.get(holder.pid)
        role = roles.get(holder.pid)
        trusted = holder.pid in listed and holder.pid not in refused
        reason = role.reason if role else None
        if holder.pid in refused:
            reason = f"{refused[holder.pid].reason} (an untrusted row); {reason or '?'}"
        out.append(
            {
                "pid": holder.pid,
                "name": proc.name if proc else None,
                "devices": list(holder.devices),
                "gpus": list(snap.holder_gpu_indices(holder)),
                "listed_by_nvidia_smi": holder.pid in listed,
                "relation": proc.relation if proc else None,
                "mapped": None if holder.mapped is None else list(holder.mapped),
                "role": policy.ROLE_HOLDER if trusted else (role.role if role else None),
                "role_reason": "listed by nvidia-smi" if trusted else reason,
            }
        )
    return out


def status_document(results: Iterable[HostResult], expected: dict[str, int],
                    expected_gpus: Optional[dict[str, Optional[int]]] = None) -> dict[str, Any]:
    return {"hosts": [host_doc(r, expected.get(r.host, 0), (expected_gpus or {}).get(r.host))
                      for r in results]}



def host_json(res: HostResult, expected_mib: int, expected_gpus: Optional[int] = None) -> str:
    """One host's entry of ``status --json``, encoded as it stands in the document (indent 2,
    two levels deep). Made in the host's worker as its result arrives, so a large fleet's
    pure-Python indenting overlaps the hosts still answering instead of following the last."""
    text = json.dumps(host_doc(res, expected_mib, expected_gpus), indent=2)
    return "    " + text.replace("\n", "\n    ")


def status_json(entries: Sequence[str], seconds: float) -> str:
    """``to_json({"hosts": [...], "seconds": seconds})`` from the hosts' host_json entries:
    the same text, character for character (tests/unit/test_render_status_json.py)."""
    hosts = "[\n" + ",\n".join(entries) + "\n  ]" if entries else "[]"
    return '{\n  "hosts": ' + hosts + ',\n  "seconds": ' + json.dumps(seconds) + "\n}"


class HostDocs:
    """host_doc of each host's latest result, made once per result: a watch writes a
    document every interval, and a host's part changes only when a new snapshot arrives
    (ops.live.LiveFleet's on_result makes it in the host's thread as it does)."""

    def __init__(self, expected: dict[str, int]) -> None:
        self.expected = expected
        self._docs: dict[str, tuple[HostResult, dict[str, Any]]] = {}

    def doc(self, res: HostResult) -> dict[str, Any]:
        """A fresh top-level copy (the watch adds its keys to it)."""
        hit = self._docs.get(res.host)
        if hit is None or hit[0] is not res:
            hit = (res, host_doc(res, self.expected.get(res.host, 0)))
            self._docs[res.host] = hit
        return dict(hit[1])


def watch_document(views: Sequence[LiveHost], expected: dict[str, int], now: float,
                   seq: int, docs: Optional[HostDocs] = None) -> dict[str, Any]:
    """One `status --watch --json` line: the status document of every host's latest
    snapshot (a host that dropped keeps its last one), plus per host ``state`` (up, stale,
    down, connecting), ``age_s`` (seconds since that snapshot, null before the first) and
    ``stale``; ``seq`` counts the documents. A stale host is ``ok: false`` with the numbers
    it last sent; its ``error`` says why it is away. ``docs``: host parts already made."""
    hosts = []
    for view in views:
        res = view.as_result()
        doc = docs.doc(res) if docs is not None and view.result is not None else \
            host_doc(res, expected.get(view.host, 0))
        age = view.age_s(now)
        state = view.state(now)
        doc.update(state=state, stale=state == STALE,
                   age_s=None if age is None else round(age, 3))
        if state == STALE:  # the numbers are the last ones it sent; why it is away:
            failure = view.failure or Failure(TIMEOUT, f"no snapshot for {age or 0:.0f}s")
            doc.update(ok=False, error=failure.message, error_kind=failure.kind)
        hosts.append(doc)
    return {"seq": seq, "hosts": hosts}
