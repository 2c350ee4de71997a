"""What a runbook step looks at in a snapshot: per-GPU metrics, holders, `assert` conditions, reports.

Internal to gpufleet.runbook.run (import from there). Pure: these take values and return values
(a Snapshot in, findings out) so the unit tests need no host.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from gpufleet.core import policy
from gpufleet.core.ledger import ledger
from gpufleet.core.model import Snapshot
from gpufleet.errors import StepFailed
from gpufleet.core.gpus import format_gpu_ranges as format_gpu_list


# --------------------------------------------------------------------------- conditions (pure)


def _free_mib(gpu: Any) -> Optional[int]:
    if gpu.memory_free_mib is not None:
        return gpu.memory_free_mib
    if gpu.memory_total_mib is not None and gpu.memory_used_mib is not None:
        return max(0, gpu.memory_total_mib - gpu.memory_used_mib - (gpu.memory_reserved_mib or 0))
    return None


def _usable_mib(gpu: Any) -> Optional[int]:
    """Total minus the driver's reservation: what can ever be free (H200: 143771 - 616)."""
    if gpu.memory_total_mib is None:
        return None
    return gpu.memory_total_mib - (gpu.memory_reserved_mib or 0)


def gpu_metrics(snapshot: Snapshot, expected_unattributed_mib: int = 0) -> dict[int, dict[str, Any]]:
    """Per GPU index: the metrics an `assert` may bound (None = not available).

    ``free_fraction`` is free / (total - reserved): reserved memory is never free, so an idle
    GPU is 1.0 whatever its reservation."""
    rows = {row.index: row for row in ledger(snapshot, expected_unattributed_mib)}
    out = {}
    for gpu in snapshot.gpus:
        free = _free_mib(gpu)
        total = _usable_mib(gpu)
        row = rows[gpu.index]
        out[gpu.index] = {
            "free_mib": free,
            "used_mib": gpu.memory_used_mib,
            "free_fraction": (free / total) if free is not None and total else None,
            "unattributed_mib": row.unattributed_mib,
            "unexpected_unattributed_mib": row.unexpected_mib,
            "reserved_mib": gpu.memory_reserved_mib,
        }
    return out


def _chosen(snapshot: Snapshot, gpus: Optional[Sequence[int]]) -> tuple[list[int], list[int]]:
    have = [g.index for g in snapshot.gpus]
    if gpus is None:
        return have, []
    return [i for i in gpus if i in have], [i for i in gpus if i not in have]


def holders_on(snapshot: Snapshot, gpus: Iterable[int],
               threshold_mib: int = policy.DEFAULT_TOLERANCE_MIB) -> dict[int, set[int]]:
    """PIDs holding each GPU's memory: nvidia-smi's listing, plus device-file holders that
    nvidia-smi lists nowhere and that policy.holder_role calls holders (another PID namespace,
    hidden PIDs, with memory to explain). GPU clients (monitors, exporters, nvidia-smi runs)
    hold no memory and are not counted. A listed process is NOT counted on a GPU it only has a
    file open on: CUDA opens every /dev/nvidiaN."""
    wanted = set(gpus)
    out: dict[int, set[int]] = {i: set() for i in wanted}
    for i in wanted:
        out[i].update(a.pid for a in snapshot.apps_on(i))
    roles = policy.holder_roles(snapshot, threshold_mib)
    for holder in snapshot.unlisted_holders():
        role = roles.get(holder.pid)
        if role is not None and role.role == policy.ROLE_CLIENT:
            continue
        for i in snapshot.holder_gpu_indices(holder):
            if i in wanted:
                out[i].add(holder.pid)
    return out


def memory_holders(snapshot: Snapshot, gpus: Iterable[int]) -> set[tuple[int, Optional[int]]]:
    """(pid, starttime) of every process nvidia-smi attributes memory to on these GPUs."""
    out = set()
    for i in gpus:
        for app in snapshot.apps_on(i):
            proc = snapshot.processes.get(app.pid)
            out.add((app.pid, proc.starttime if proc is not None else None))
    return out


def _alive(snapshot: Snapshot, pid: int, starttime: Optional[int]) -> bool:
    proc = snapshot.processes.get(pid)
    return proc is not None and starttime is not None and proc.starttime == starttime


def _fmt(metric: str, value: float) -> str:
    return f"{value:.3f}" if metric == "free_fraction" else f"{value:g} MiB"


def check_conditions(that: Mapping[str, Any], snapshot: Snapshot, baseline: Optional[Snapshot],
                     expected_unattributed_mib: int = 0) -> list[tuple[bool, str]]:
    """One (held, what was found) per condition. Missing evidence never holds."""
    if not snapshot.nvidia_smi_ok:
        return [(False, f"{snapshot.gpu_reader} failed: {snapshot.nvidia_smi_error or '?'}")]
    return list(_conditions(that, snapshot, baseline, expected_unattributed_mib))


def _conditions(that: Mapping[str, Any], snapshot: Snapshot, baseline: Optional[Snapshot],
                expected_unattributed_mib: int) -> Iterable[tuple[bool, str]]:
    if that["bounds"]:
        indices, missing = _chosen(snapshot, that["gpus"])
        if missing:
            yield False, f"no GPU {format_gpu_list(missing)} on this host"
        metrics = gpu_metrics(snapshot, expected_unattributed_mib)
        for metric, (lo, hi) in that["bounds"].items():
            bad = []
            for i in indices:
                value = metrics[i][metric]
                if value is None:
                    bad.append(f"GPU {i} n/a")
                elif (lo is not None and value < lo) or (hi is not None and value > hi):
                    bad.append(f"GPU {i} {_fmt(metric, value)}")
            want = " and ".join(([f">= {_fmt(metric, lo)}"] if lo is not None else [])
                                + ([f"<= {_fmt(metric, hi)}"] if hi is not None else []))
            if bad:
                yield False, f"{metric} {want}: FAILED on {', '.join(bad)}"
            else:
                yield True, f"{metric} {want}: ok on GPU {format_gpu_list(indices) or '-'}"
    for key, gpus in that["sets"].items():
        indices, missing = _chosen(snapshot, gpus)
        if missing:
            yield False, f"{key}: no GPU {format_gpu_list(missing)} on this host"
        if key == "no_holders_on":
            found = holders_on(snapshot, indices,
                               expected_unattributed_mib + policy.DEFAULT_TOLERANCE_MIB)
            bad = [f"GPU {i}: {', '.join(_pid_name(snapshot, p) for p in sorted(pids))}"
                   for i, pids in sorted(found.items()) if pids]
            if bad:
                yield False, f"no holders on {format_gpu_list(gpus)}: FAILED, {'; '.join(bad)}"
            else:
                yield True, f"no holders on {format_gpu_list(gpus)}: ok"
        else:  # holders_alive_on
            if baseline is None:
                yield False, f"holders alive on {format_gpu_list(gpus)}: no snapshot from the start"
                continue
            before = memory_holders(baseline, gpus)
            if not before:  # nothing held them, so nothing can have been lost
                yield True, (f"holders alive on {format_gpu_list(gpus)}: ok (nothing held these "
                             "GPUs at the start)")
                continue
            gone = [(p, s) for p, s in sorted(before, key=lambda x: x[0]) if not _alive(snapshot, p, s)]
            names = ", ".join(_pid_name(baseline, p) for p, _ in sorted(before))
            if gone:
                yield False, (f"holders alive on {format_gpu_list(gpus)}: FAILED, gone or replaced: "
                              f"{', '.join(_pid_name(baseline, p) for p, _ in gone)}")
            else:
                yield True, f"holders alive on {format_gpu_list(gpus)}: ok ({names})"


def _pid_name(snapshot: Snapshot, pid: int) -> str:
    proc = snapshot.processes.get(pid)
    if proc is not None:
        return f"{proc.name} {pid}"
    app = next((a for a in snapshot.compute_apps if a.pid == pid), None)
    return f"{app.process_name if app else '?'} {pid}"


def report_lines(snapshot: Snapshot, gpus: Optional[Sequence[int]], expected_unattributed_mib: int,
                 wsl2: bool) -> list[str]:
    """Per GPU: used, free, total, reserved, unattributed (vs what the inventory expects)."""
    if not snapshot.nvidia_smi_ok:
        raise StepFailed(f"{snapshot.gpu_reader} failed: {snapshot.nvidia_smi_error or '?'}")
    indices, missing = _chosen(snapshot, gpus)
    if missing:
        raise StepFailed(f"no GPU {format_gpu_list(missing)} on this host")
    if not indices:
        raise StepFailed("no GPUs on this host")
    metrics = gpu_metrics(snapshot, expected_unattributed_mib)
    by_index = {g.index: g for g in snapshot.gpus}

    def mib(v: Optional[int]) -> str:
        return "n/a" if v is None else f"{v} MiB"

    lines = []
    for i in indices:
        g, m = by_index[i], metrics[i]
        unattr = m["unattributed_mib"]
        note = ""
        if unattr is not None:
            if m["unexpected_unattributed_mib"]:
                note = (f" (expected {expected_unattributed_mib}; if this is normal here, set "
                        f"unattributed_mib: {unattr} for this host)")
            elif expected_unattributed_mib:
                note = f" (expected {expected_unattributed_mib})"
        what = "reservation (unattributed)" if wsl2 else "unattributed"
        lines.append(f"GPU {i}: used {mib(g.memory_used_mib)} of {mib(g.memory_total_mib)}, "
                     f"free {mib(m['free_mib'])}, reserved {mib(g.memory_reserved_mib)}, "
                     f"{what} {mib(unattr)}{note}")
    return lines


def health_outcome(snapshot: Snapshot, host: str, gpus: Optional[Sequence[int]],
                   expected_gpus: Optional[int], fail_on: str,
                   warn_on: str = "warn") -> tuple[bool, str]:
    """(failed, detail) of a `health` step (pure): the findings on the chosen GPUs (None:
    all) and the host's own, judged against fail_on / warn_on ("critical", "warn", "never")."""
    from gpufleet.core import health

    hh = health.assess(host, snapshot, expected_gpus)
    rows = [g for g in hh.gpus if gpus is None or g.index is None or g.index in gpus]
    # "warn" takes UNKNOWN in (a GPU none of whose readings could be taken), as --strict does
    limit = {"critical": health.RANK[health.CRITICAL], "warn": health.RANK[health.UNKNOWN],
             "never": 99}
    bad: list[str] = []
    warned: list[str] = []
    for where, f in [(f"GPU {g.index}" if g.index is not None else f"PCI {g.pci}", f)
                     for g in rows for f in g.findings] + [("host", f) for f in hh.host_findings]:
        text = f"{where}: {f.severity} {f.code} ({health.ACTION_TEXT[f.action]})"
        if health.RANK[f.severity] >= limit[fail_on]:
            bad.append(text)
        elif health.RANK[f.severity] >= limit[warn_on]:
            warned.append(text)
    checked = f"{len(rows)} GPU(s)"
    if bad:
        return True, "; ".join(bad + warned)
    if warned:
        return False, f"{checked}; warning: " + "; ".join(warned)
    return False, f"{checked} OK"
