"""Colour for a terminal (pure): ERROR, CRITICAL and a failed verdict (dirty, retaken, ...) in
red, UNKNOWN and stale in magenta, on the terminal's own background (foregrounds only, as
`top` draws them: light and dark themes alike). Colour says nothing the words do not.

It is painted on text already made terminal-safe, by position: a table's column spans come
from its dashes line (tabulate's "simple" format), so only the cells of the named columns are
painted, and only when the cell's own words say so; a process title that contains "CRITICAL"
is in another column and stays plain. The CLI decides whether to paint (cli/tty.py: a
terminal, no NO_COLOR).
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Optional

RED = "\x1b[31m"
MAGENTA = "\x1b[35m"
RESET = "\x1b[0m"

Rule = Callable[[str], Optional[str]]  # a cell's text -> its colour, or None


def paint(text: str, colour: Optional[str]) -> str:
    return text if not colour or not text else colour + text + RESET


def severity_colour(cell: str) -> Optional[str]:
    """HEALTH cells: CRITICAL red, UNKNOWN magenta (WARN and OK stay plain)."""
    word = cell.split(" ", 1)[0]
    return RED if word == "CRITICAL" else MAGENTA if word == "UNKNOWN" else None


def error_colour(cell: str) -> Optional[str]:
    """A failed host's cell (``ERROR: ...``)."""
    return RED if cell.startswith("ERROR:") else None


FAILED_VERDICTS = frozenset(["dirty", "retaken", "error", "unreachable", "busy"])


def verdict_colour(cell: str) -> Optional[str]:
    """A clean's VERDICT: anything but clean or planned is red."""
    return RED if cell in FAILED_VERDICTS else None


def _spans(dashes: str) -> list[tuple[int, int]]:
    out, start = [], None
    for pos, ch in enumerate(dashes + " "):
        if ch == "-" and start is None:
            start = pos
        elif ch != "-" and start is not None:
            out.append((start, pos))
            start = None
    return out


def paint_table(text: str, rules: Mapping[str, Rule]) -> str:
    """Each table in ``text`` (a header line over a dashes line) with the cells of the
    columns named in ``rules`` painted. A table ends at a line with text across a gap between
    its columns (the summary, notes): those lines, and every other, stay as they are."""
    lines = text.split("\n")
    out: list[str] = []
    spans: dict[int, Rule] = {}
    bounds: list[tuple[int, int]] = []
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and "-" in nxt and set(nxt) <= {"-", " "}:
            bounds = _spans(nxt)
            names = [line[a:b].strip() for a, b in bounds]
            spans = {k: rules[n] for k, n in enumerate(names) if n in rules}
        elif spans and any(line[b:b + 2].strip() for _, b in bounds[:-1]):
            spans = {}  # past the table's last row
        elif spans and line.strip() and not set(line) <= {"-", " "}:
            line = _paint_line(line, bounds, spans)
        out.append(line)
    return "\n".join(out)


def _paint_line(line: str, bounds: list[tuple[int, int]], spans: Mapping[int, Rule]) -> str:
    """One table line with its ruled cells painted (from the right, so positions hold)."""
    for k in sorted(spans, reverse=True):
        a, b = bounds[k]
        end = len(line) if k == len(bounds) - 1 else b
        cell = line[a:end].rstrip()
        colour = spans[k](cell.strip()) if cell.strip() else None
        if colour and cell == cell.lstrip():
            line = line[:a] + paint(cell, colour) + line[a + len(cell):]
    return line


_COUNTS = re.compile(r"\b([1-9][0-9]*) (failed|CRITICAL|UNKNOWN)\b")


def paint_counts(line: str) -> str:
    """A summary line's non-zero failures: ``1 failed``, ``2 CRITICAL`` red, ``3 UNKNOWN``
    magenta (the line is gpufleet's own words)."""
    return _COUNTS.sub(lambda m: paint(m.group(0), MAGENTA if m.group(2) == "UNKNOWN" else RED),
                       line)


STATUS = {"HEALTH": severity_colour, "HOLDERS": error_colour}
HEALTH = {"HEALTH": severity_colour, "FINDINGS": error_colour}
CLEAN = {"VERDICT": verdict_colour}


def paint_report(text: str, rules: Mapping[str, Rule]) -> str:
    """A command's terminal-safe text with its tables' cells (``rules``) and its summary
    lines' failure counts painted."""
    text = paint_table(text, rules)
    return "\n".join(paint_counts(line) if line.startswith("hosts: ") else line
                     for line in text.split("\n"))


def paint_stale(line: str, host: str) -> str:
    """``HOST: stale, ...`` (status --watch's note) with the word painted."""
    prefix = f"{host}: stale"
    if not line.startswith(prefix):
        return line
    return f"{host}: " + paint("stale", MAGENTA) + line[len(prefix):]
