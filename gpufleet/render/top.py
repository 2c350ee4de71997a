"""`gpufleet top`'s screen as values (pure: no terminal): layout; the state's values are
render/topstate.py, keys, marks and the clean scope render/topkeys.py (both re-exported here).

``layout(views, info, state, width, height, now)`` is every line the screen shows, each with
a role (the terminal layer maps roles to attributes: colour, bold, reverse) and, for rows the
cursor can stand on, a key. ``on_key(state, key, screen)`` is the next state and an action
("quit", "clean") for a key name ("UP", "ENTER", "q", ...). gpufleet/cli/topscreen.py draws it
with curses; tests read it without a terminal. Text from hosts (process names, units) goes
through the one terminal-safe function, so a process title cannot repaint the screen.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from gpufleet.core import health, policy
from gpufleet.core.gpus import format_gpu_ranges
from gpufleet.core.live import DOWN, STALE, UP, LiveHost
from gpufleet.core.ledger import ledger
from gpufleet.core.model import Snapshot
from gpufleet.render.command import command_summary, process_cells
from gpufleet.render.common import fmt_pair, short_gpu_name, terminal_safe
from gpufleet.render.health import health_summary
from gpufleet.render.status import BUSY_TOLERANCE_MIB, gpu_is_busy
from gpufleet.render.topkeys import clean_scope, on_key  # noqa: F401 (re-exported)
from gpufleet.render.topstate import (HELP, MIN_HEIGHT, MIN_WIDTH, SORTS, HostInfo,  # noqa: F401
                                      Key, Line, Overlay, Screen, TopState)


def cell(text: object) -> str:
    return terminal_safe(str(text), one_line=True)


def fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "~"


# ----------------------------------------------------------------------- numbers per host


@dataclass(frozen=True)
class HostNumbers:
    gpus: int = 0
    busy: int = 0
    used_mib: int = 0
    total_mib: int = 0
    unattributed_mib: int = 0
    expected_mib: int = 0
    unexpected: bool = False
    warnings: int = 0
    util_pct: Optional[int] = None  # the mean of the GPUs that report it


def host_numbers(snap: Optional[Snapshot], expected_mib: int) -> HostNumbers:
    if snap is None:
        return HostNumbers()
    rows = ledger(snap, expected_mib)
    return HostNumbers(
        gpus=len(snap.gpus),
        busy=sum(1 for g in snap.gpus if gpu_is_busy(snap, g, expected_mib)),
        used_mib=sum(g.memory_used_mib or 0 for g in snap.gpus),
        total_mib=sum(g.memory_total_mib or 0 for g in snap.gpus),
        unattributed_mib=sum(r.unattributed_mib or 0 for r in rows),
        expected_mib=expected_mib * len(snap.gpus),
        unexpected=any((r.unexpected_mib or 0) > BUSY_TOLERANCE_MIB for r in rows),
        warnings=len(snap.warnings) + (0 if snap.nvidia_smi_ok else 1),
        util_pct=mean_util(snap))


def mean_util(snap: Snapshot) -> Optional[int]:
    """The host's utilisation: the mean of its GPUs' (None when none reports it)."""
    known = [g.utilization_pct for g in snap.gpus if g.utilization_pct is not None]
    return round(sum(known) / len(known)) if known else None


def _snap(view: LiveHost) -> Optional[Snapshot]:
    return view.result.snapshot if view.result is not None else None


def bar(used: int, total: int, width: int) -> str:
    if width <= 2:
        return ""
    inner = width - 2
    filled = 0 if not total else min(inner, round(inner * used / total))
    return "[" + "#" * filled + "." * (inner - filled) + "]"


def host_health(view: LiveHost, info: HostInfo) -> Optional[health.HostHealth]:
    snap = _snap(view)
    return None if snap is None else health.assess(view.host, snap, info.expected_gpus)


def summary(views: Sequence[LiveHost], info: Mapping[str, HostInfo], now: float) -> str:
    states = [v.state(now) for v in views]
    nums = [host_numbers(_snap(v), info.get(v.host, HostInfo()).expected_mib) for v in views]
    busy = sum(n.busy for n in nums)
    gpus = sum(n.gpus for n in nums)
    report = [h for h in (host_health(v, info.get(v.host, HostInfo())) for v in views)
              if h is not None]
    return (f"hosts {len(views)}: {states.count(UP)} up, {states.count(DOWN)} down, "
            f"{states.count(STALE)} stale | GPUs {busy} busy, {gpus - busy} free | "
            f"{health_summary(report)} | memory "
            f"{fmt_pair(sum(n.used_mib for n in nums), sum(n.total_mib for n in nums))}"
            f" | unattributed {sum(n.unattributed_mib for n in nums)}MiB")


# ----------------------------------------------------------------------- filter and sort


def matches(view: LiveHost, info: HostInfo, text: str) -> bool:
    """Host name, a tag, or a holder's name, what it runs (render.command) or its user
    contains ``text`` (case-insensitive)."""
    needle = text.lower().strip()
    if not needle:
        return True
    words = [view.host] + list(info.tags)
    snap = _snap(view)
    if snap is not None:
        for p in snap.processes.values():  # python3 says nothing: what it runs, and whose
            words += [p.name, command_summary(p.cmdline, p.comm, 200), p.user or ""]
        words += [a.process_name for a in snap.compute_apps]
    return any(needle in w.lower() for w in words)


def ordered(views: Sequence[LiveHost], info: Mapping[str, HostInfo], state: TopState
            ) -> list[LiveHost]:
    shown = [v for v in views if matches(v, info.get(v.host, HostInfo()), state.filter)]
    if state.sort == "name":
        return sorted(shown, key=lambda v: v.host)

    def weight(v: LiveHost) -> tuple[int, int, str]:
        n = host_numbers(_snap(v), info.get(v.host, HostInfo()).expected_mib)
        value = n.used_mib if state.sort == "memory" else n.unattributed_mib
        return (0 if _snap(v) is not None else 1, -value, v.host)

    return sorted(shown, key=weight)


# ----------------------------------------------------------------------- rows


def columns(width: int, name_w: int) -> tuple[int, int]:
    """(name width, bar width) for this terminal width."""
    name_w = max(4, min(name_w, 24, width // 4))
    fixed = 2 + name_w + 2 + 4 + 2 + 9 + 2 + 19 + 2 + 6 + 22 + 2 + 4 + 2 + 10
    return name_w, max(4, min(30, width - fixed))


def header_line(name_w: int, bar_w: int) -> str:
    return ("  " + "HOST".ljust(name_w) + "  GPUS  BUSY/FREE  " + "MEMORY".ljust(bar_w + 21)
            + "UTIL  " + "UNATTRIBUTED".ljust(24) + "WARN  AGE")


def age_text(view: LiveHost, now: float) -> str:
    state = view.state(now)
    age = view.age_s(now)
    if state == DOWN:
        return "down"
    if age is None:
        return "..."
    return f"{'stale ' if state == STALE else ''}{age:.0f}s"


def host_line(view: LiveHost, info: HostInfo, state: TopState, now: float, name_w: int,
              bar_w: int) -> Line:
    n = host_numbers(_snap(view), info.expected_mib)
    mark = "-" if ("host", view.host) in state.expanded else "+"
    name = fit(cell(view.host), name_w).ljust(name_w)
    hstate = view.state(now)
    role = {UP: "host", STALE: "stale", DOWN: "down"}.get(hstate, "host")
    if _snap(view) is None:
        why = view.failure.message if view.failure else "connecting..."
        text = f"{mark} {name}  " + ("down: " if hstate == DOWN else "") + cell(why)
        return Line(text, role, ("host", view.host))
    memory = f"{bar(n.used_mib, n.total_mib, bar_w)} " + fmt_pair(n.used_mib, n.total_mib).ljust(20)
    util = "n/a" if n.util_pct is None else f"{n.util_pct}%"
    unattr = (f"{n.unattributed_mib}MiB (exp {n.expected_mib}MiB)"
              + (" !" if n.unexpected else "")).ljust(24)
    text = (f"{mark} {name}  {n.gpus:>4}  {n.busy:>4}/{n.gpus - n.busy:<4}  {memory}{util:>4}  "
            f"{unattr}{(str(n.warnings) if n.warnings else '-'):>4}  {age_text(view, now)}")
    if hstate == STALE and view.failure is not None:
        text += "  " + cell(view.failure.message)
    if n.unexpected and role == "host":
        role = "warn"
    return Line(text, role, ("host", view.host))


def marked(state: TopState, key: Key) -> str:
    if key[0] == "gpu":
        return "[x]" if ("gpu", key[1], key[2]) in state.marks else "[ ]"
    pid = key[3] if key[0] == "app" else key[2]
    return "[x]" if ("pid", key[1], pid) in state.marks else "[ ]"


def _proc_cells(snap: Snapshot, pid: int, fallback: str) -> tuple[str, str, str]:
    """(what runs, user, unit and container) of a holder's line."""
    proc = snap.processes.get(pid)
    user, container, what = process_cells(snap, pid, fallback, 28)
    where = []
    if proc is not None and proc.unit:
        where.append("unit " + cell(proc.unit))
    if container:
        where.append("container " + container)
    return what, user, "  ".join(where)


def gpu_lines(view: LiveHost, snap: Snapshot, info: HostInfo, state: TopState,
              bar_w: int) -> list[Line]:
    out: list[Line] = []
    rows = {r.index: r for r in ledger(snap, info.expected_mib)}
    box = "" if state.watch_only else "{} "
    for gpu in snap.gpus:
        key: Key = ("gpu", view.host, gpu.index)
        row = rows[gpu.index]
        util = "n/a" if gpu.utilization_pct is None else f"{gpu.utilization_pct}%"
        unattr = "n/a" if row.unattributed_mib is None else f"{row.unattributed_mib}MiB"
        text = (f"    {box.format(marked(state, key))}GPU {gpu.index:<2} "
                f"{short_gpu_name(gpu.name):<16} "
                f"{bar(gpu.memory_used_mib or 0, gpu.memory_total_mib or 0, min(bar_w, 16))} "
                f"{fmt_pair(gpu.memory_used_mib, gpu.memory_total_mib)}  util {util}"
                f"  unattr. {unattr}")
        out.append(Line(text, "gpu", key))
        for app in snap.apps_on(gpu.index):
            akey: Key = ("app", view.host, gpu.index, app.pid)
            name, user, where = _proc_cells(snap, app.pid, app.process_name)
            used = "n/a" if app.used_mib is None else f"{app.used_mib}MiB"
            text = (f"        {box.format(marked(state, akey))}{fit(name, 28):<28} pid {app.pid:<8} "
                    f"{fit(user, 12):<12} {used:>9}  nvidia-smi  {where}")
            out.append(Line(text.rstrip(), "holder", akey))
    return out


def device_file_lines(view: LiveHost, snap: Snapshot, info: HostInfo, state: TopState
                      ) -> list[Line]:
    """Holders nvidia-smi does not list (markable when they may hold memory), the GPU
    clients on one quiet line, and the host's warnings."""
    out: list[Line] = []
    box = "" if state.watch_only else "{} "
    roles = policy.holder_roles(snap, info.expected_mib + BUSY_TOLERANCE_MIB)
    clients = []
    holders = [h for h in snap.unlisted_holders() if h.pid in roles]
    for holder in holders:
        name, user, where = _proc_cells(snap, holder.pid, "?")
        if roles[holder.pid].role == policy.ROLE_CLIENT:
            clients.append(f"{name} {holder.pid}")
            continue
        if not out:
            out.append(Line("    device files, not listed by nvidia-smi:", "dim"))
        gpus = snap.holder_gpu_indices(holder)
        evidence = "fd" + (" + mapped" if holder.mapped else "") + (
            f": GPUs {format_gpu_ranges(gpus)}" if gpus else "")
        key: Key = ("fd", view.host, holder.pid)
        text = (f"        {box.format(marked(state, key))}{fit(name, 28):<28} pid {holder.pid:<8} "
                f"{fit(user, 12):<12} {'-':>9}  {evidence}  {where}")
        out.append(Line(text.rstrip(), "holder", key))
    if clients:
        out.append(Line("    clients (no memory): " + ", ".join(clients), "dim"))
    for warning in snap.warnings:
        out.append(Line("    warning: " + cell(warning), "warn"))
    hh = health.assess(view.host, snap, info.expected_gpus)
    for f in hh.host_findings:
        if f.severity != health.OK:
            out.append(Line(f"    host: {f.severity} {f.code}: " + cell(f.message), "warn"))
    if not snap.nvidia_smi_ok:
        out.append(Line("    nvidia-smi: " + cell(snap.nvidia_smi_error or "failed"), "warn"))
    return out


def list_lines(views: Sequence[LiveHost], info: Mapping[str, HostInfo], state: TopState,
               now: float, name_w: int, bar_w: int) -> list[Line]:
    lines: list[Line] = []
    for view in ordered(views, info, state):
        hinfo = info.get(view.host, HostInfo())
        lines.append(host_line(view, hinfo, state, now, name_w, bar_w))
        snap = _snap(view)
        if ("host", view.host) in state.expanded and snap is not None:
            lines += gpu_lines(view, snap, hinfo, state, bar_w)
            lines += device_file_lines(view, snap, hinfo, state)
    return lines


# ----------------------------------------------------------------------- the screen


def footer(state: TopState) -> Line:
    if state.editing:
        return Line(f"filter: {cell(state.filter)}_   (Enter keeps, Esc clears)", "prompt")
    if state.message:
        return Line(cell(state.message), "message")
    keys = "Enter expand  s sort  / filter  ? help  q quit"
    if not state.watch_only:
        keys = "Enter expand  space mark  c clean  s sort  / filter  ? help  q quit"
    return Line(f"{keys}  | every {state.interval_s:g}s, sort {state.sort}", "dim")


def title(views: Sequence[LiveHost], info: Mapping[str, HostInfo], state: TopState,
          now: float) -> Line:
    extra = f" | filter {cell(state.filter)!r}" if state.filter else ""
    if state.readonly:
        extra += " | read-only"
    elif state.actions_refused:
        extra += " | watch only (no hosts named)"
    return Line(summary(views, info, now) + extra, "title")


def overlay_lines(overlay: Overlay, width: int, height: int) -> list[Line]:
    body = [Line(fit(overlay.title, width), "title")]
    room = height - 2
    texts = []
    for text in overlay.lines:  # wrapped, not cut: a refusal's reason is the point of a plan
        text = terminal_safe(text, one_line=True)
        indent = " " * min(len(text) - len(text.lstrip()) + 4, width // 2)
        texts += textwrap.wrap(text, width, subsequent_indent=indent, drop_whitespace=False,
                               replace_whitespace=False) or [""]
    if len(texts) > room:
        texts = texts[: room - 1] + [f"... {len(overlay.lines) - room + 1} more lines"]
    body += [Line(t, "text") for t in texts]
    body += [Line("", "text")] * (height - 1 - len(body))
    role = "prompt" if overlay.kind == "confirm" else "message"
    return body + [Line(fit(overlay.prompt, width), role)]


def layout(views: Sequence[LiveHost], info: Mapping[str, HostInfo], state: TopState,
           width: int, height: int, now: float) -> Screen:
    """Every line of the screen for a terminal of ``width`` x ``height``."""
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        text = (f"terminal too small ({width}x{height}): gpufleet top needs "
                f"{MIN_WIDTH}x{MIN_HEIGHT}; waiting for a resize (q quits)")
        return Screen((Line(fit(text, width), "warn"),), too_small=True)
    if state.overlay is not None:
        return Screen(tuple(overlay_lines(state.overlay, width, height)))
    name_w, bar_w = columns(width, max((len(v.host) for v in views), default=4))
    body = list_lines(views, info, state, now, name_w, bar_w)
    keys = tuple(line.key for line in body if line.key is not None)
    room = height - 3
    at = next((i for i, line in enumerate(body) if line.key == state.cursor), 0)
    top = min(max(0, state.top), max(0, len(body) - room))
    if at < top:
        top = at
    elif at >= top + room:
        top = at - room + 1
    shown = body[top: top + room]
    if not body:
        shown = [Line(f"no host matches the filter {cell(state.filter)!r} (/ to change it)"
                      if state.filter else "no hosts", "message")]
    cursor = state.cursor if state.cursor in keys else (keys[0] if keys else None)
    lines = [title(views, info, state, now), Line(header_line(name_w, bar_w), "header")]
    lines += [replace(line, role="cursor") if line.key is not None and line.key == cursor
              else line for line in shown]
    lines += [Line("", "text")] * (height - 1 - len(lines))
    lines.append(footer(state))
    names = tuple(v.host for v in ordered(views, info, state))
    return Screen(tuple(replace(ln, text=fit(ln.text, width)) for ln in lines), keys, top,
                  False, room, names)
