"""What stdout allows a table: the width it must fit and whether it may be coloured.

On a terminal a table fits the terminal's width (`status`'s HOLDERS wrap and are cut) and
says ERROR, CRITICAL, UNKNOWN, dirty and stale in colour; written to a pipe or a file it is
whole and plain, as `ps` writes (scripts read --json; `COLUMNS` asks for a width anyway).
NO_COLOR (any value, no-color.org) and TERM=dumb turn colour off.
"""
from __future__ import annotations

import os
import sys
from typing import IO, Any, Optional


def _is_tty(stream: Optional[IO[Any]]) -> bool:
    stream = stream if stream is not None else sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def table_width(stream: Optional[IO[Any]] = None) -> Optional[int]:
    """``COLUMNS`` when set to a number, else the terminal's width when ``stream`` (stdout)
    is one, else None: nothing is cut."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if not _is_tty(stream):
        return None
    try:
        return os.get_terminal_size((stream if stream is not None else sys.stdout).fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def colour(stream: Optional[IO[Any]] = None) -> bool:
    """Colour only on a terminal, never with NO_COLOR set or TERM=dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return _is_tty(stream)


def styled(text: str, rules: str, stream: Optional[IO[Any]] = None) -> str:
    """``text`` made terminal-safe (the one function), then painted by ``rules`` (a name in
    render/style.py: STATUS, HEALTH, CLEAN) when ``stream`` (stdout) takes colour."""
    from gpufleet.render.common import terminal_safe

    text = terminal_safe(text)
    if not colour(stream):
        return text
    from gpufleet.render import style

    return style.paint_report(text, getattr(style, rules))
