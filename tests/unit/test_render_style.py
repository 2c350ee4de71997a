"""Colour on a terminal (render/style.py, cli/tty.py): only the cells of the named columns whose
own words say so, on text already terminal-safe; none with NO_COLOR, TERM=dumb or a pipe."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from gpufleet.cli import tty
from gpufleet.core.model import HostResult, parse_snapshot
from gpufleet.render import style
from gpufleet.render.clean import outcome_table
from gpufleet.render.common import terminal_safe
from gpufleet.render.status import status_table

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "status"
RED, MAGENTA, RESET = "\x1b[31m", "\x1b[35m", "\x1b[0m"


def basic(**processes: dict) -> HostResult:
    doc = json.loads((FIX / "basic.json").read_text())
    for pid, fields in processes.items():
        doc["processes"][pid].update(fields)
    return HostResult(host="box", ok=True, snapshot=parse_snapshot(doc))


def test_critical_unknown_and_errors_are_painted_and_nothing_else() -> None:
    """A process whose command line says CRITICAL and ERROR: stays plain (HOLDERS paints only
    a failed host's ERROR: cell); the host's CRITICAL finding, an UNKNOWN GPU, a dead host's
    error and the summary's failures are painted."""
    liar = basic(**{"426": {"cmdline": "ERROR: CRITICAL", "comm": "ERROR:"}})
    blind = HostResult(host="blind", ok=True, snapshot=parse_snapshot(
        json.loads((FIX / "na_fields.json").read_text())))  # no readings: UNKNOWN
    dead = HostResult(host="dead", ok=False, error="connection refused")
    plain = terminal_safe(status_table([liar, blind, dead], {}, {"box": 2}))
    text = style.paint_report(plain, style.STATUS)
    assert f"{RED}CRITICAL gpu_count{RESET}" in text
    assert f"{MAGENTA}UNKNOWN{RESET}" in text
    assert f"{RED}ERROR: connection refused{RESET}" in text
    assert f"{RED}1 failed{RESET}" in text and f"{RED}1 CRITICAL{RESET}" in text
    assert f"{MAGENTA}1 UNKNOWN{RESET}" in text
    liar_line = [ln for ln in text.splitlines() if "426 root" in ln][0]
    assert "\x1b" not in liar_line and "ERROR: CRITICAL" in liar_line
    assert style.paint_report(plain, style.STATUS).replace(RED, "").replace(
        MAGENTA, "").replace(RESET, "") == plain  # colour adds, never changes, the words


def test_a_failed_verdict_is_painted() -> None:
    from types import SimpleNamespace

    def result(host: str, verdict: str) -> SimpleNamespace:
        return SimpleNamespace(host=host, plan=None, verdict_detail={}, verdict=verdict,
                               agent_doc=None, seconds=1.0, error=None, reason="")

    text = style.paint_report(terminal_safe(outcome_table(
        [result("a", "clean"), result("b", "dirty"), result("c", "retaken")])), style.CLEAN)
    assert f"{RED}dirty{RESET}" in text and f"{RED}retaken{RESET}" in text
    assert "clean" in text and f"{RED}clean" not in text


def test_a_stale_note_is_painted() -> None:
    line = "node-a: stale, last snapshot 12s ago: connection lost"
    assert style.paint_stale(line, "node-a") == f"node-a: {MAGENTA}stale{RESET}, last " \
        "snapshot 12s ago: connection lost"
    assert style.paint_stale("node-a: up", "node-a") == "node-a: up"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("env,stream,coloured", [
    ({}, Tty(), True),
    ({"NO_COLOR": "1"}, Tty(), False),
    ({"TERM": "dumb"}, Tty(), False),
    ({}, io.StringIO(), False),  # a pipe or a file
])
def test_colour_only_on_a_terminal_without_no_color(monkeypatch: pytest.MonkeyPatch, env: dict,
                                                     stream: io.StringIO, coloured: bool) -> None:
    for name in ("NO_COLOR", "TERM"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert tty.colour(stream) is coloured
    text = tty.styled("HOST  HEALTH\n----  ----------\nh     CRITICAL x\n", "STATUS", stream)
    assert ("\x1b[31m" in text) is coloured


def test_the_width_is_columns_then_the_terminals_then_none(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.setenv("COLUMNS", "132")
    assert tty.table_width(io.StringIO()) == 132
    monkeypatch.delenv("COLUMNS")
    assert tty.table_width(io.StringIO()) is None  # a pipe: whole lines
    master, slave = os.openpty()
    try:
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        with os.fdopen(os.dup(slave), "w") as term:
            assert tty.table_width(term) == 120
    finally:
        os.close(master)
        os.close(slave)
