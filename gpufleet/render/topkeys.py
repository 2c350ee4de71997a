"""`gpufleet top`'s keys as values (pure): ``on_key(state, key, screen)`` is the next state
and an action ("quit", "clean") for a key name ("UP", "ENTER", "q", ...); ``clean_scope`` is
the host and GPUs the marks ask to clean."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from gpufleet.core.live import LiveHost
from gpufleet.core.model import Snapshot
from gpufleet.render.topstate import HELP, SORTS, Key, Overlay, Screen, TopState


def _snap(view: LiveHost) -> Optional[Snapshot]:
    return view.result.snapshot if view.result is not None else None


MOVES = {"UP": -1, "k": -1, "DOWN": 1, "j": 1, "PGUP": -10, "PGDN": 10}


def move(state: TopState, screen: Screen, step: int) -> TopState:
    keys = screen.keys
    if not keys:
        return state
    at = keys.index(state.cursor) if state.cursor in keys else 0
    if step in (-10, 10):
        step = (screen.list_height or 10) * (1 if step > 0 else -1)
    return replace(state, cursor=keys[max(0, min(len(keys) - 1, at + step))])


def toggle_expand(state: TopState, screen: Screen) -> TopState:
    cursor = state.cursor if state.cursor in screen.keys else (
        screen.keys[0] if screen.keys else None)
    if cursor is None:
        return state
    host_key = ("host", cursor[1])
    expanded = set(state.expanded)
    if host_key in expanded:
        expanded.discard(host_key)
    else:
        expanded.add(host_key)
    return replace(state, expanded=frozenset(expanded), cursor=host_key)


def mark_key(key: Key) -> Optional[tuple]:
    if key[0] == "gpu":
        return ("gpu", key[1], key[2])
    if key[0] == "app":
        return ("pid", key[1], key[3])
    if key[0] == "fd":
        return ("pid", key[1], key[2])
    return None


def toggle_mark(state: TopState, screen: Screen) -> TopState:
    if state.readonly:
        return replace(state, message="read-only: no marks (started with --readonly)")
    if state.actions_refused:
        return replace(state, message=state.actions_refused)
    cursor = state.cursor if state.cursor in screen.keys else None
    mark = mark_key(cursor) if cursor is not None else None
    if mark is None:
        return replace(state, message="expand a host (Enter), then mark its GPUs or holders")
    marks = set(state.marks)
    marks.symmetric_difference_update({mark})
    return replace(state, marks=frozenset(marks), message="")


def edit_filter(state: TopState, key: str) -> TopState:
    if key == "ENTER":
        return replace(state, editing=False)
    if key == "ESC":
        return replace(state, editing=False, filter="")
    if key == "BACKSPACE":
        return replace(state, filter=state.filter[:-1])
    if len(key) == 1 and key.isprintable():
        return replace(state, filter=state.filter + key)
    return state


def on_key(state: TopState, key: str, screen: Screen) -> tuple[TopState, Optional[str]]:
    """The next state for a key, and an action for the caller: "quit" or "clean"."""
    if state.editing:
        return edit_filter(state, key), None
    if state.overlay is not None:
        return state, ("answer:" + key)  # the caller owns overlays (help, plan, outcome)
    state = replace(state, message="")
    if key in ("q", "Q"):
        return state, "quit"
    if key in MOVES:
        return move(state, screen, MOVES[key]), None
    if key in ("HOME", "g"):
        return replace(state, cursor=screen.keys[0] if screen.keys else None), None
    if key in ("END", "G"):
        return replace(state, cursor=screen.keys[-1] if screen.keys else None), None
    if key in ("ENTER", "RIGHT", "LEFT"):
        return toggle_expand(state, screen), None
    if key == " ":
        return toggle_mark(state, screen), None
    if key == "s":
        return replace(state, sort=SORTS[(SORTS.index(state.sort) + 1) % len(SORTS)]), None
    if key == "/":  # a new filter (Esc clears it, Enter keeps it)
        return replace(state, editing=True, filter=""), None
    if key == "?":
        return replace(state, overlay=Overlay("help", HELP)), None
    if key == "c":
        if state.readonly:
            return replace(state, message="read-only: no actions (started with --readonly)"), None
        if state.actions_refused:
            return replace(state, message=state.actions_refused), None
        return state, "clean"
    return state, None


def clean_scope(state: TopState, views: Sequence[LiveHost]) -> tuple[Optional[str], list[int], str]:
    """(host, GPUs, "") the marks ask to clean, or (None, [], why not). A marked holder
    brings its GPUs (the planner works on GPUs, as `gpufleet clean --gpus` does)."""
    hosts = sorted({m[1] for m in state.marks})
    if not hosts:
        return None, [], "nothing marked: mark GPUs or holders with space (expand a host first)"
    if len(hosts) > 1:
        return None, [], f"marks on {len(hosts)} hosts: clean one host at a time"
    host = hosts[0]
    view = next((v for v in views if v.host == host), None)
    snap = _snap(view) if view is not None else None
    if snap is None:
        return None, [], f"{host}: no snapshot to plan from"
    gpus: set[int] = set()
    for mark in state.marks:
        if mark[0] == "gpu":
            gpus.add(int(mark[2]))
            continue
        listed = snap.gpu_indices_of_app(int(mark[2]))
        gpus.update(listed)  # a CUDA process opens every /dev/nvidiaN: nvidia-smi's GPUs first
        holder = next((h for h in snap.holders if h.pid == mark[2]), None)
        if holder is not None and not listed:
            gpus.update(snap.holder_gpu_indices(holder))
    if not gpus:
        return None, [], f"{host}: the marked processes are on no GPU any more"
    return host, sorted(gpus), ""
