"""The status JSON document (`status --json`, `status --watch --json`), pure: values in, text out.

The keys are a contract (README "status --json"); more keys may be added, none renamed. Kept
apart from the table (render/status.py, which re-exports these names) so neither grows past
what one reads at once.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Optional, Sequence

from gpufleet.core import health, policy
from gpufleet.core.health import GpuHealth
from gpufleet.core.live import STALE, LiveHost
from gpufleet.core.ledger import GpuLedger, ledger
from gpufleet.core.model import HEALTH_BOOL_KEYS, HEALTH_INT_KEYS, GpuInfo, HostResult, Snapshot
from gpufleet.core.results import Failure
from gpufleet.errors import COMMAND, TIMEOUT

BUSY_TOLERANCE_MIB = policy.DEFAULT_TOLERANCE_MIB  # clean's --tolerance-mib default
HEALTH_READINGS = HEALTH_INT_KEYS + HEALTH_BOOL_KEYS  # per GPU in status JSON


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
        "mps_server_mib": row.mps_server_mib,
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
            "unknown": list(g.unknown), "findings": [f.as_dict() for f in g.findings]}


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
