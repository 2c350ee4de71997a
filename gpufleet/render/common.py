"""What every renderer shares: the JSON text, MiB cells, "n/a", and THE terminal-safe
function (pure)."""
from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

NA = "n/a"

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str, one_line: bool = False) -> str:
    """Text for a terminal with control characters shown (``\\x1b``), never interpreted:
    process titles are chosen by whoever runs the process, and an ESC sequence in one could
    clear or repaint the operator's screen (click strips them only when stdout is not a
    terminal). Tabs and newlines stay, unless ``one_line``: then they are shown escaped too,
    so a hostile title cannot fake another holder line in a multi-line table cell. JSON
    output escapes everything itself."""
    pattern = _CONTROL if one_line else _CONTROL_BUT_LINES
    return pattern.sub(lambda m: "\\x%02x" % ord(m.group()), text)


def fmt_mib(value: Optional[int]) -> str:
    """``700MiB``; from 10 GiB on ``48.0GiB``; None is ``n/a``."""
    if value is None:
        return NA
    if value >= 10240:
        return f"{value / 1024:.1f}GiB"
    return f"{value}MiB"


def fmt_pair(used: Optional[int], total: Optional[int]) -> str:
    """``6.8 / 48.0GiB``, ``716 / 8192MiB``: used and total in ONE unit, chosen by the total
    (GiB from 10 GiB on), never ``7000MiB / 48.0GiB``; n/a where one is not available."""
    if used is None or total is None:
        return f"{fmt_mib(used)} / {fmt_mib(total)}"
    if total >= 10240:
        return f"{used / 1024:.1f} / {total / 1024:.1f}GiB"
    return f"{used} / {total}MiB"


def error_cell(error: Optional[str], label: str = "ERROR", width: Optional[int] = 100) -> str:
    """A failed host's cell in every table: ``LABEL: message`` on one line, cut to ``width``
    (None: whole; the whole text is printed under the table)."""
    text = terminal_safe(" ".join(str(error or "failed").split()), one_line=True)
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return f"{label}: {text}"


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, a cut marked ``...`` (as nvidia-smi marks a
    process name it cut: tests/fixtures/recorded/probe/h200-names-probe4.log)."""
    if len(text) <= width:
        return text
    return text[: max(0, width - 3)] + "..."


# nvidia-smi's table cuts a long name with "..." at a fixed width; a table of eight GPUs needs
# the model, not the edition or the vendor every GPU here has
_NAME_SUFFIXES = ((" Server Edition", ""), (" Workstation Edition", ""), (" Generation", ""),
                  (" Laptop GPU", " Laptop"))
_NAME_DROPS = ("NVIDIA ", "GeForce ", "Tesla ", "Quadro ")  # in this order, while too long
_ARCHITECTURES = (" Blackwell", " Hopper", " Ampere", " Turing", " Volta")
GPU_NAME_WIDTH = 16


def short_gpu_name(name: str, width: int = GPU_NAME_WIDTH) -> str:
    """``NVIDIA H200``; ``RTX 6000 Ada`` for "NVIDIA RTX 6000 Ada Generation"; ``RTX PRO 6000``
    for "NVIDIA RTX PRO 6000 Blackwell Server Edition": the edition dropped, then, while still
    too long, the vendor, the product line ("GeForce"), the architecture (the model names it),
    and last a cut marked ``...`` as nvidia-smi marks one. The whole name is in --json."""
    name = terminal_safe(name, one_line=True)
    for suffix, instead in _NAME_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)] + instead
    for word in _NAME_DROPS:
        if len(name) > width and name.startswith(word):
            name = name[len(word):]
    for arch in _ARCHITECTURES:
        if len(name) > width and arch in name:
            name = name.replace(arch, "", 1)
    return cut(name, width)


TABLE_WIDTH = 120  # what a table must fit on a terminal that narrow (tests hold status to it)


def column_room(rows: Sequence[Sequence[Any]], headers: Sequence[str], column: int,
                width: int, floor: int = 24) -> int:
    """How wide one column may be for a table of these rows to be at most ``width`` wide
    (tabulate's "simple": a column is its widest line or its header + 2, two spaces between
    columns); never below ``floor``. Only how a table is called changes, not tabulate."""
    def widest(i: int) -> int:
        lines = [line for r in rows for line in str(r[i]).split("\n")]
        return max([len(headers[i]) + 2] + [len(line) for line in lines])

    others = sum(widest(i) for i in range(len(headers)) if i != column)
    return max(floor, len(headers[column]) + 2, width - others - 2 * (len(headers) - 1))


def fit_column(rows: list[list[Any]], headers: Sequence[str], column: int,
               width: int = TABLE_WIDTH, floor: int = 24) -> int:
    """Cut each line of one column's cells (in place, ``...``) to column_room; returns it."""
    room = column_room(rows, headers, column, width, floor)
    for r in rows:
        r[column] = "\n".join(cut(line, room) for line in str(r[column]).split("\n"))
    return room


def to_json(doc: Any) -> str:
    """Every --json document: indented, keys in the order they were built."""
    return json.dumps(doc, indent=2, sort_keys=False)


__all__ = ["NA", "TABLE_WIDTH", "column_room", "cut", "error_cell", "fit_column", "fmt_mib",
           "fmt_pair", "short_gpu_name", "terminal_safe", "to_json"]
