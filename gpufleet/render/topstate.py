"""`gpufleet top`'s state as values (pure): what the screen needs from the inventory, the UI
state, the lines and the screen a layout makes (render/top.py lays them out, render/topkeys.py
turns keys into the next state)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

MIN_WIDTH, MIN_HEIGHT = 60, 8
SORTS = ("name", "memory", "unattributed")
Key = tuple  # ("host", h) | ("gpu", h, index) | ("app", h, index, pid) | ("fd", h, pid)

HELP = (
    "gpufleet top: every selected host, refreshed; one SSH session each.",
    "",
    "  Up/Down, j/k, PgUp/PgDn   move          Enter   expand / collapse a host",
    "  s                         sort: name, memory, unattributed",
    "  /                         filter by host, tag, holder, what it runs or its user",
    "  space                     mark a GPU or a holder (its GPUs)",
    "  c                         clean the marked GPUs: the plan of `gpufleet clean`, then y/n",
    "                            (s there: plan again with processes spanning other GPUs)",
    "  ?                         this help     q   quit",
    "",
    "A host is stale when its last snapshot is older than two intervals or its session",
    "dropped (it is reconnected with backoff); down when it never answered.",
    "--readonly: no marks, no clean. Without --host, -g, --tag or --all: watch only.",
)


@dataclass(frozen=True)
class HostInfo:
    """What the screen needs from the inventory: tags (for the filter), expected MiB."""

    tags: tuple[str, ...] = ()
    expected_mib: int = 0
    expected_gpus: Optional[int] = None  # the inventory's `gpus:` (a host finding when short)


@dataclass(frozen=True)
class Overlay:
    """A page over the list: the help, a clean's plan and its question, its outcome."""

    title: str
    lines: tuple[str, ...]
    prompt: str = "any key closes"
    kind: str = "info"  # info | confirm | busy


@dataclass(frozen=True)
class TopState:
    interval_s: float = 2.0
    readonly: bool = False
    sort: str = "name"
    filter: str = ""
    editing: bool = False
    expanded: frozenset = frozenset()
    marks: frozenset = frozenset()  # ("gpu", host, index) | ("pid", host, pid)
    cursor: Optional[Key] = None
    top: int = 0
    message: str = ""
    overlay: Optional[Overlay] = None
    # top started without --host/-g/--tag/--all: it watches every host, and a mark or `c`
    # shows this line (how to select hosts) instead: a clean needs the hosts named
    actions_refused: str = ""

    @property
    def watch_only(self) -> bool:
        return self.readonly or bool(self.actions_refused)


@dataclass(frozen=True)
class Line:
    text: str
    role: str = "text"
    key: Optional[Key] = None


@dataclass(frozen=True)
class Screen:
    lines: tuple[Line, ...]
    keys: tuple[Key, ...] = ()
    top: int = 0
    too_small: bool = False
    list_height: int = 0
    shown: tuple[str, ...] = field(default=())  # hosts after the filter, in order
