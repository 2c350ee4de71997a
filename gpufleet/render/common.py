"""What every renderer shares: the JSON text, MiB cells, "n/a", and THE terminal-safe
function (pure)."""
from __future__ import annotations

import json
import re
from typing import Any, Optional

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


def error_cell(error: Optional[str], label: str = "ERROR", width: Optional[int] = 100) -> str:
    """A failed host's cell in every table: ``LABEL: message`` on one line, cut to ``width``
    (None: whole; the whole text is printed under the table)."""
    text = " ".join(str(error or "failed").split())
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return f"{label}: {text}"


def to_json(doc: Any) -> str:
    """Every --json document: indented, keys in the order they were built."""
    return json.dumps(doc, indent=2, sort_keys=False)


__all__ = ["NA", "error_cell", "fmt_mib", "terminal_safe", "to_json"]
