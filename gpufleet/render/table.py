"""Every table gpufleet prints, in tabulate's "simple" format, byte for byte, without tabulate.

Importing tabulate (and the wcwidth it loads when installed) cost ~30 ms at every start of a
command that draws a table. This is tabulate's algorithm (0.9, 0.10) for the one way gpufleet
calls it: a list of rows, a list of headers, format "simple", default alignment (numbers
right, on the decimal point; text left; cells stripped), numbers parsed and reformatted
(``"1e3"`` is ``1000``) unless ``numparse=False``, None as an empty cell, multi-line cells,
ANSI escape sequences not counted in widths, and wide characters counted by
``wcwidth.wcswidth`` where wcwidth is installed (as tabulate does; wcwidth is imported only
for a cell with a character outside printable ASCII and ``NARROW``). tests/unit/
test_render_table.py renders the same rows through both.
"""
from __future__ import annotations

import math
import re
from itertools import zip_longest
from typing import Any, Callable, Optional, Sequence

_NONE, _BOOL, _INT, _FLOAT, _STR = range(5)  # tabulate's order, least generic first
NARROW = frozenset("…—–−·°µ×")  # one column wide everywhere (wcwidth agrees): no wcwidth import
_MULTILINE = re.compile(r"\r|\n|\r\n")
_LINES = re.compile("[\r\n]")
_patterns: dict[str, re.Pattern] = {}


def _pattern(name: str) -> re.Pattern:
    """tabulate's regexes, compiled on first use (a table without them never pays)."""
    if name not in _patterns:
        esc, csi, osc, st = r"\x1b", r"\x1b\[", r"\x1b\]", r"\x1b\\"
        _patterns["ansi"] = re.compile(
            rf"({csi}[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]"
            rf"|{osc}8;(\w+=\w+:?)*;([^{esc}]+){st}([^{esc}]+){osc}8;;{st})")
        _patterns["thousands"] = re.compile(r"^(([+-]?[0-9]{1,3})(?:,([0-9]{3}))*)?(?(1)\.[0-9]*|\.[0-9]+)?$")
        _patterns["colored_int"] = re.compile(r"(\\[xX]+[0-9a-fA-F]+\[\d+[mM]+)([0-9.]+)(\\.*)$")
    return _patterns[name]


def _strip_ansi(s: str) -> str:
    return _pattern("ansi").sub(r"\4", s) if "\x1b" in s else s


def _convertible(conv: Callable[[Any], Any], value: Any) -> bool:
    try:
        conv(value)
        return True
    except (ValueError, TypeError):
        return False


def _thousands(s: str) -> bool:
    return _pattern("thousands").match(s) is not None


def _isint(value: Any) -> bool:
    return type(value) is int or (isinstance(value, str) and _convertible(int, value))


def _isnumber(value: Any) -> bool:
    if type(value) in (float, int):
        return True
    if not _convertible(float, value):
        return False
    if not isinstance(value, str):
        return True
    number = float(value)
    return not (math.isinf(number) or math.isnan(number)) or value.lower() in ("inf", "-inf", "nan")


def _type(value: Any, numparse: bool) -> int:
    """A cell's least generic type (tabulate's ``_type``; an empty string counts as missing)."""
    if isinstance(value, str):
        value = _strip_ansi(value)
    if value is None or (isinstance(value, str) and not value):
        return _NONE
    if hasattr(value, "isoformat"):
        return _STR
    if type(value) is bool or (isinstance(value, str) and value in ("True", "False")):
        return _BOOL
    if numparse and (_isint(value) or (isinstance(value, str) and _thousands(value) and "." not in value)):
        return _INT
    if numparse and (_isnumber(value) or (isinstance(value, str) and _thousands(value))):
        return _FLOAT
    return _STR


def _format(value: Any, coltype: int, has_invisible: bool) -> str:
    """A cell's text for its column's type (tabulate's ``_format``, default formats)."""
    if value is None or (isinstance(value, str) and not value):
        return ""
    if coltype == _INT:
        if isinstance(value, str):
            escaped = value.encode("unicode_escape").decode("utf-8")
            colored = _pattern("colored_int").search(escaped) if "\x1b" in value else None
            if colored and colored.group(2).isdigit():
                value = (colored.group(1) + format(int(colored.group(2)), "") + colored.group(3)
                         ).encode("utf-8").decode("unicode_escape")
        return format(value, "")
    if coltype == _FLOAT:
        if has_invisible and isinstance(value, str):
            raw = _strip_ansi(value)
            try:
                return value.replace(raw, format(float(raw), "g"))
            except (ValueError, TypeError):
                return f"{value}"
        if isinstance(value, str) and "," in value:
            value = value.replace(",", "")
        try:
            return format(float(value), "g")
        except (ValueError, TypeError):
            return f"{value}"
    return f"{value}"


def _afterpoint(s: str) -> int:
    """Characters after the decimal point (or the exponent's e); -1 for none."""
    if not (_isnumber(s) or _thousands(s)) or _isint(s):
        return -1
    pos = s.rfind(".")
    pos = s.lower().rfind("e") if pos < 0 else pos
    return len(s) - pos - 1 if pos >= 0 else -1


class _Widths:
    """How wide text is on screen, as tabulate measures it for this table."""

    def __init__(self, texts: Sequence[str]) -> None:
        text = "\t".join(texts)
        self.invisible = "\x1b" in text and _pattern("ansi").search(text) is not None
        self.multiline = _MULTILINE.search(text) is not None
        chars = "".join(texts).replace("\n", "")
        plain = chars.isascii() and chars.isprintable()
        self.wcswidth: Optional[Callable[[str], int]] = None
        if not plain and not all(c in NARROW or " " <= c <= "~" for c in chars):
            try:
                import wcwidth  # tabulate's optional wide-character support, same condition

                self.wcswidth = wcwidth.wcswidth
            except ImportError:
                pass
        self.corrected = self.invisible or self.wcswidth is not None  # tabulate's other branch

    def line(self, s: str) -> int:
        if self.invisible:
            return (self.wcswidth or len)(_strip_ansi(s))
        return self.wcswidth(s) if self.wcswidth is not None else len(s)

    def cell(self, s: str) -> int:
        return max(map(self.line, _LINES.split(s))) if self.multiline else self.line(s)


def _align_column(strings: list[str], align: str, minwidth: int, w: _Widths) -> list[str]:
    """tabulate's ``_align_column``: strip (not for numbers), decimal points lined up, padded."""
    if align == "decimal":
        decimals = [_afterpoint(_strip_ansi(s) if w.invisible else s) for s in strings]
        most = max(decimals)
        strings = [s + (most - d) * " " for s, d in zip(strings, decimals)]
        pad: Callable[[int, str], str] = lambda width, s: s.rjust(width)  # noqa: E731
    else:
        strings = [s.strip() for s in strings]
        pad = lambda width, s: s.ljust(width)  # noqa: E731
    if w.multiline:
        line_widths = [[w.line(x) for x in _LINES.split(s)] for s in strings]
        widest = max(max(x for ws in line_widths for x in ws), minwidth)
        if not w.corrected:
            return ["\n".join(pad(widest, x) for x in s.splitlines()) for s in strings]
        lens = [[len(x) for x in _LINES.split(s)] for s in strings]
        targets = [[widest - (a - b) for a, b in zip(ws, ls)] for ws, ls in zip(line_widths, lens)]
        return ["\n".join(pad(t, x) for x, t in zip((s.splitlines() or s), ts))
                for s, ts in zip(strings, targets)]
    widths = [w.line(s) for s in strings]
    widest = max(max(widths), minwidth)
    if not w.corrected:
        return [pad(widest, s) for s in strings]
    return [pad(widest - (a - len(s)), s) for s, a in zip(strings, widths)]


def _align_header(header: str, align: str, width: int, w: _Widths) -> str:
    if w.multiline:
        return "\n".join(_align_header(h, align, width, _single(w)) for h in _MULTILINE.split(header))
    width += len(header) - w.line(header)
    return header.ljust(width) if align == "left" else header.rjust(width)


def _single(w: _Widths) -> _Widths:
    one = _Widths.__new__(_Widths)
    one.__dict__.update(w.__dict__, multiline=False)
    return one


def _lines(cells: Sequence[str], widths: Sequence[int], multiline: bool) -> list[str]:
    """One row's lines: "  " between cells, trailing blanks cut; a multi-line row as many lines
    as its tallest cell, the others filled with blanks (an all-empty one has none)."""
    if not multiline:
        return ["  ".join(cells).rstrip()]
    parts = [c.splitlines() for c in cells]
    height = max(map(len, parts)) if parts else 0
    parts = [p + [" " * width] * (height - len(p)) for p, width in zip(parts, widths)]
    return ["  ".join(p[i] for p in parts).rstrip() for i in range(height)]


def render_table(rows: Sequence[Sequence[Any]], headers: Sequence[Any], numparse: bool = True) -> str:
    """``tabulate(rows, headers=headers, disable_numparse=not numparse)``, format "simple"."""
    rows = [list(r) for r in rows]
    headers = [str(h) for h in headers]
    if headers and rows:
        headers = [""] * max(0, len(rows[0]) - len(headers)) + headers
    w = _Widths(headers + [str(v) for r in rows for v in r])
    cols = [list(c) for c in zip_longest(*rows)]
    types = [max([_BOOL] + [_type(v, numparse) for v in c]) for c in cols]
    aligns = ["decimal" if t in (_INT, _FLOAT) else "left" for t in types]
    minwidths = [w.cell(h) + 2 for h in headers] if headers else [0] * len(cols)
    cols = [_align_column([_format(v, t, w.invisible) for v in c], a, m, w)
            for c, t, a, m in zip(cols, types, aligns, minwidths)]
    if headers:
        header_aligns = aligns or ["left"] * len(headers)
        minwidths = [max(m, max(w.cell(x) for x in c))
                     for m, c in zip(minwidths, cols or [[""]] * len(headers))]
        headers = [_align_header(h, a, m, w) for h, a, m in zip(headers, header_aligns, minwidths)]
    else:
        minwidths = [max(w.cell(x) for x in c) for c in cols]
    if not headers and not rows:
        return ""
    rule = "  ".join("-" * width for width in minwidths).rstrip()
    lines = _lines(headers, minwidths, w.multiline) + [rule] if headers else [rule]
    for row in zip(*cols):
        lines.extend(_lines(row, minwidths, w.multiline))
    return "\n".join(lines + ([] if headers else [rule]))


__all__ = ["NARROW", "render_table"]
