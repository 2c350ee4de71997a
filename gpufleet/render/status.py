"""Status as a table (pure: values in, text out); the JSON document is render/status_json.py,
whose names are re-exported here.
"""
from __future__ import annotations

import textwrap
from typing import Optional, Sequence

from gpufleet.core import health, mps, policy
from gpufleet.core.health import OK, RANK, UNKNOWN, GpuHealth, HostHealth
from gpufleet.core.ledger import GpuLedger, driver_allowance_mib, ledger
from gpufleet.core.model import GpuInfo, HostResult, Snapshot
from gpufleet.render.table import render_table
from gpufleet.render.common import (NA, column_room, cut, error_cell, fmt_mib,  # noqa: F401
                                    short_gpu_name, terminal_safe, to_json)
from gpufleet.render.command import process_cells
from gpufleet.render.health import health_summary
from gpufleet.render.status_json import (BUSY_TOLERANCE_MIB, HEALTH_READINGS, HostDocs,  # noqa: F401
                                         host_doc, host_json, status_document, status_json,
                                         watch_document)

HOLDER_WIDTH = 60  # what runs, at most (the table cuts it further to fit its width)
ERROR_WIDTH = 100  # of an error in the table (render.common.error_cell); all of it below
WRAP = "\t"  # where a holder's line may wrap: a tab, which no process text keeps (escaped)


def cell_text(text: str) -> str:
    """A process-supplied string as ONE table line (``terminal_safe(text, one_line=True)``)."""
    return terminal_safe(text, one_line=True)


def holder_line(snapshot: Snapshot, pid: int, fallback: str, amount: str) -> str:
    """``353 alice 29996MiB train_dflash.py --epochs 3``: the PID, the user, how much (or which
    device files), a foreign container, and what runs (render.command), last so that cutting
    the line to the table's width cuts only that."""
    user, container, what = process_cells(snapshot, pid, fallback, HOLDER_WIDTH)
    head = " ".join(w for w in (str(pid), user, amount, f"[{container}]" if container else "")
                    if w)
    return head + WRAP + what  # fit_holders: one line, or the head and an indented "what"


def holders_text(snapshot: Snapshot, gpu: GpuInfo,
                 refused: Optional[dict[int, policy.ListingCheck]] = None) -> str:
    """One line per process nvidia-smi attributes to this GPU (holder_line); a listed process
    that holds nothing of it is marked (policy.listing_check), and so is a CUDA MPS server's
    memory (expected while MPS runs)."""
    parts = []
    servers = mps.servers(snapshot)
    for app in snapshot.apps_on(gpu.index):
        mark = "" if app.pid in snapshot.processes else " (not in /proc)"
        if refused and app.pid in refused:
            mark = " (untrusted row)"
        mark += " (MPS server)" if app.pid in servers else ""
        used = NA if app.used_mib is None else f"{app.used_mib}MiB"  # MiB, as every column
        parts.append(holder_line(snapshot, app.pid, app.process_name, used + mark))
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
        parts.append(holder_line(snapshot, holder.pid, "?", f"(fd: {where})"))
    return "\n".join(parts)


def gpu_is_busy(snapshot: Snapshot, gpu: GpuInfo, expected_mib: int) -> bool:
    """Someone's processes are listed on it, or more memory is used than the host is expected
    to keep (CUDA MPS servers' memory counts as expected: a model can start beside it)."""
    servers = mps.servers(snapshot)
    apps = snapshot.apps_on(gpu.index)
    if any(a.pid not in servers for a in apps):
        return True
    used = gpu.memory_used_mib
    expected_mib += mps.expected_server_mib(snapshot).get(gpu.index, 0) + \
        driver_allowance_mib(len(apps))
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


# HOLDERS last: its lines are the long ones, wrapped and cut to a terminal's width
COLUMNS = {"host": "HOST", "gpu": "GPU", "name": "NAME", "memory": "MEMORY (MiB)",
           "util": "UTIL", "temp": "TEMP (C)", "power": "POWER (W)",
           "unattr": "UNATTR (MiB)", "health": "HEALTH", "holders": "HOLDERS"}
WIDE = ("temp", "power")  # `status --wide`: NVML's readings (n/a from nvidia-smi)
STATUS_HEADERS = [h for k, h in COLUMNS.items() if k not in WIDE]


def status_headers(wide: bool = False) -> list[str]:
    return [h for k, h in COLUMNS.items() if wide or k not in WIDE]


def _row(cells: dict[str, str], wide: bool) -> list[str]:
    """One table row from its cells by column key (absent: empty)."""
    return [cells.get(k, "") for k in COLUMNS if wide or k not in WIDE]


def _mib(value: Optional[int]) -> str:
    return NA if value is None else str(value)


def gpu_cells(snap: Snapshot, gpu: GpuInfo, row: GpuLedger, exp: int) -> dict[str, str]:
    """A GPU's numbers in the units of the headers: MiB, %, degrees C, W."""
    unattr = _mib(row.unattributed_mib)
    if row.unexpected_mib and row.unexpected_mib > BUSY_TOLERANCE_MIB:
        unattr += " !"
    elif row.unattributed_mib and exp:
        unattr += " (exp)"
    return {"gpu": str(gpu.index), "name": short_gpu_name(gpu.name),
            "memory": f"{_mib(gpu.memory_used_mib)} / {_mib(gpu.memory_total_mib)}",
            "util": NA if gpu.utilization_pct is None else f"{gpu.utilization_pct}%",
            "temp": _mib(gpu.temperature_c),
            "power": NA if gpu.power_w is None else f"{gpu.power_w:.0f}", "unattr": unattr}


def host_rows(res: HostResult, expected: dict[str, int],
              expected_gpus: Optional[dict[str, Optional[int]]], wide: bool) -> list[list[str]]:
    """A host's rows: one per GPU, the `fd` and `clients` rows, a `host` row per finding of
    its own; one row with the reason when it could not be read."""
    snap = res.snapshot
    dash = {k: "-" for k in COLUMNS}
    if not res.ok or snap is None:
        return [_row(dict(dash, host=res.host, holders=error_cell(res.error)), wide)]
    hh = health.assess(res.host, snap, (expected_gpus or {}).get(res.host))
    if not snap.nvidia_smi_ok or not snap.gpus:
        why = error_cell(snap.nvidia_smi_error) if not snap.nvidia_smi_ok else "-"
        name = "no GPUs" if snap.nvidia_smi_ok else "-"
        return [_row(dict(dash, host=res.host, name=name, holders=why,
                          health=host_health_cell(hh)), wide)]
    exp = expected.get(res.host, 0)
    refused = policy.refused_listings(snap)
    view = policy.without_refused_listings(snap, drop_holders=False)
    led = {row.index: row for row in ledger(view, exp)}
    rows = [_row(dict(gpu_cells(snap, gpu, led[gpu.index], exp), host=res.host,
                      holders=holders_text(snap, gpu, refused),
                      health=health_cell(hh.gpu(gpu.index))), wide) for gpu in snap.gpus]
    unlisted = unlisted_holders_text(view, exp)
    if unlisted:  # device files open, no listing: possible holders, once per host
        rows.append(_row({"host": res.host, "gpu": "fd", "name": "not listed",
                          "holders": unlisted}, wide))
    clients = unlisted_holders_text(view, exp, policy.ROLE_CLIENT)
    if clients:  # monitors and exporters: device files open, no evidence of memory
        rows.append(_row({"host": res.host, "gpu": "clients", "name": "no memory",
                          "holders": clients}, wide))
    return rows + [_row({"host": hh.host, "gpu": "host", "holders": cell_text(f.message),
                         "health": f"{f.severity} {f.code}"}, wide)
                   for f in hh.host_findings if f.severity != OK]


def status_rows(results: Sequence[HostResult], expected: dict[str, int],
                expected_gpus: Optional[dict[str, Optional[int]]] = None,
                wide: bool = False) -> list[list[str]]:
    return [row for res in results for row in host_rows(res, expected, expected_gpus, wide)]


def summary_line(results: Sequence[HostResult], expected: dict[str, int],
                 expected_gpus: Optional[dict[str, Optional[int]]] = None) -> str:
    """Hosts, busy and free GPUs, and the health of what answered (host findings too)."""
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
    report = [health.assess_result(r, (expected_gpus or {}).get(r.host)) for r in results]
    return f"hosts: {ok} ok, {failed} failed; GPUs: {busy} busy, {free} free; " + \
        health_summary(report)


def failing_hosts(results: Sequence[HostResult],
                  expected_gpus: Optional[dict[str, Optional[int]]] = None) -> list[str]:
    """Hosts `status` must not pass (exit 1): not reached, GPUs not read, or a CRITICAL
    finding of the host itself (driver not loaded, GPUs missing: it could not be read whole)."""
    out = []
    for r in results:
        if not r.ok or r.snapshot is None or not r.snapshot.nvidia_smi_ok or \
                health.critical_host_findings(health.assess_result(r, (expected_gpus or {}).get(r.host))):
            out.append(r.host)
    return out


HOLDERS_FLOOR = 20  # below this a holder's PID, user and MiB no longer fit one line
HOLDERS_SHORT = 32  # below this a holder's line wraps: HEALTH gives what it can first


def fitted_room(rows: list[list[str]], headers: list[str], width: int) -> int:
    """HOLDERS' room in ``width``; when it is short, HEALTH's findings go below their severity
    (``CRITICAL`` over ``remap_failure``) to leave more."""
    room = column_room(rows, headers, len(headers) - 1, width, 0)
    if room < HOLDERS_SHORT:
        at = headers.index(COLUMNS["health"])
        for row in rows:
            row[at] = row[at].replace(" ", "\n", 1)
    return column_room(rows, headers, len(headers) - 1, width, HOLDERS_FLOOR)


def fit_holders(cell: str, room: Optional[int]) -> str:
    """A HOLDERS cell in ``room`` columns (None: as long as it is): a holder's line that does
    not fit goes on as an indented line with what runs, cut if it still does not fit; an error
    is cut (it is printed whole below), a host finding's message wrapped."""
    out = []
    for line in cell.split("\n"):
        head, _, what = line.partition(WRAP)
        whole = f"{head} {what}" if what else head
        if room is None or len(whole) <= room:
            out.append(whole)
        elif what:
            out += [cut(head, room), "  " + cut(what, room - 2)]
        elif head.startswith("ERROR: "):  # printed whole under the table
            out.append(cut(head, room))
        else:  # a host finding's message: all of it matters
            out += textwrap.wrap(head, room, subsequent_indent="  ") or [""]
    return "\n".join(out)


def status_table(results: Sequence[HostResult], expected: dict[str, int],
                 expected_gpus: Optional[dict[str, Optional[int]]] = None,
                 wide: bool = False, width: Optional[int] = None) -> str:
    """The table (``width``: a terminal's, its lines at most that wide: HOLDERS, last, wraps
    and is cut to what the other columns leave; None: nothing cut, as `ps` writes to a pipe),
    the summary, then what did not fit: whole errors. The hosts' warnings are not here
    (core.hostwarnings: the CLI prints them on stderr, away from the rows scripts cut)."""
    headers = status_headers(wide)
    rows = status_rows(results, expected, expected_gpus, wide)
    room = fitted_room(rows, headers, width) if width else None
    for row in rows:
        row[-1] = fit_holders(row[-1], room)
    table = render_table(rows, headers)
    shown = ERROR_WIDTH if room is None else min(ERROR_WIDTH, room - len("ERROR: "))
    notes = [f"{name}: {error}" for name, error in _long_errors(results, shown)]
    return table + "\n" + summary_line(results, expected, expected_gpus) + \
        "".join("\n" + n for n in notes)



def _long_errors(results: Sequence[HostResult], width: int) -> list[tuple[str, str]]:
    """Errors cut short in the table are printed whole below it: they say what to do."""
    out = []
    for res in results:
        error = res.error if not res.ok or res.snapshot is None else (
            None if res.snapshot.nvidia_smi_ok else res.snapshot.nvidia_smi_error)
        text = " ".join(str(error or "").split())
        if len(text) > width:
            out.append((res.host, text))
    return out


