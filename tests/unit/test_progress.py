"""gpufleet.cli.progress: the progress line's text (width, safe names) and its terminal behaviour.

The line as a person sees it, in a real terminal against lab hosts, is tested in
tests/integration/test_progress_tty.py; here the pieces, with a fake terminal stream.
"""
from __future__ import annotations

import io
import threading
import time

from hypothesis import given, settings, strategies as st

from gpufleet.ops import fanout
from gpufleet.cli.progress import CLEAR_LINE, HostProgress, progress_line, safe_name, text_width


class Tty(io.StringIO):
    """A stream that says it is a terminal, and records what was written."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:  # no real terminal behind it: the width falls back
        raise io.UnsupportedOperation("fileno")


class Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_everything_fits() -> None:
    line = progress_line("status", 3, 5, ["node-a", "node-b"], 12.7, 80)
    assert line == "status: 3/5 hosts done, 12s; running: node-a, node-b"


def test_names_that_do_not_fit_are_counted() -> None:
    names = ["train-node-%02d" % i for i in range(20)]
    line = progress_line("clean", 0, 20, names, 3, 60)
    assert line == "clean: 0/20 hosts done, 3s; running: train-node-00 +19 more"
    assert text_width(line) <= 59
    wider = progress_line("clean", 0, 20, names, 3, 90)
    assert wider.startswith("clean: 0/20 hosts done, 3s; running: train-node-00, train-node-01, ")
    assert wider.endswith(" more") and text_width(wider) <= 89


def test_one_long_name_is_cut_with_an_ellipsis() -> None:
    line = progress_line("status", 1, 3, ["x" * 200, "b"], 0, 50)
    assert line.startswith("status: 1/3 hosts done, 0s; running: xxx")
    assert line.endswith("… +1 more") and text_width(line) <= 49
    # too narrow for a name: how many run; narrower still: the head, cut
    assert progress_line("status", 1, 3, ["abcdef", "g"], 0, 42) == (
        "status: 1/3 hosts done, 0s; 2 running")
    assert progress_line("status", 1, 3, ["abc"], 0, 10) == "status: …"


def test_control_characters_are_escaped() -> None:
    evil = "node\x1b[2J\r\nfake: 9/9 hosts done\x07\u202e"
    line = progress_line("status", 0, 1, [evil], 0, 200)
    assert "\x1b" not in line and "\r" not in line and "\n" not in line and "\x07" not in line
    assert "node\\x1b[2J\\x0d\\x0afake: 9/9 hosts done\\x07\\u202e" in line
    assert safe_name("plain-host.example") == "plain-host.example"


def test_wide_characters_count_double() -> None:
    names = ["ノード%d" % i for i in range(10)]  # 2 columns per katakana
    line = progress_line("status", 0, 10, names, 0, 60)  # 38 + 7 + 9 + 8 columns > 59
    assert line == "status: 0/10 hosts done, 0s; running: ノード0 +9 more"
    line = progress_line("status", 0, 10, names, 0, 66)
    assert line == "status: 0/10 hosts done, 0s; running: ノード0, ノード1 +8 more"
    assert text_width(line) == len(line) + 6 <= 65


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=40), max_size=30), st.integers(1, 300),
       st.integers(0, 100), st.text(max_size=20))
def test_the_line_always_fits_and_is_inert(names, width, done, label) -> None:
    line = progress_line(label, done, len(names) + done, names, 5.5, width)
    assert text_width(line) <= max(1, width - 1)
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in line)


def test_not_a_terminal_writes_nothing() -> None:
    pipe = Pipe()
    with HostProgress(["a", "b"], "status", stream=pipe, interval_s=0.05, delay_s=0) as p:
        assert not p.enabled
        p.started("a")
        time.sleep(0.2)
        p.finished("a")
    assert pipe.getvalue() == ""


def test_on_a_terminal_it_redraws_in_place_and_clears() -> None:
    tty = Tty()
    hosts = ["fast", "slow"]
    with HostProgress(hosts, "clean", stream=tty, interval_s=0.05, width=100, delay_s=0) as p:
        out = fanout.run_hosts(hosts, lambda h: time.sleep(0.6 if h == "slow" else 0.05) or h,
                               forks=2, **p.callbacks())
        assert out == hosts
        time.sleep(0.15)
        shown = tty.getvalue()
    text = tty.getvalue()
    assert CLEAR_LINE + "clean: 1/2 hosts done, 0s; running: slow" in shown
    assert CLEAR_LINE + "clean: 2/2 hosts done, 0s" in shown  # after the last one, until closed
    assert text.endswith(CLEAR_LINE)  # erased before the caller prints its table
    assert "\n" not in text  # never scrolls


def test_redraws_are_rate_limited() -> None:
    tty = Tty()
    names = ["h%d" % i for i in range(500)]
    with HostProgress(names, "status", stream=tty, interval_s=0.25, width=100, delay_s=0) as p:
        end = time.monotonic() + 1.0
        i = 0
        while time.monotonic() < end:  # the state changes all the time
            p.started(names[i % 500])
            p.finished(names[i % 500])
            i += 1
            time.sleep(0.001)
    assert i > 100
    assert 1 <= tty.getvalue().count(CLEAR_LINE) <= 1.0 / 0.25 + 2


def test_print_above_keeps_messages_out_of_the_line() -> None:
    tty = Tty()
    with HostProgress(["a"], "clean", stream=tty, interval_s=0.05, width=80, delay_s=0) as p:
        p.started("a")
        time.sleep(0.15)
        p.print_above("gpufleet: interrupted: waiting for 1 host(s)")
        time.sleep(0.15)
    text = tty.getvalue()
    before, after = text.split("gpufleet: interrupted: waiting for 1 host(s)\n")
    assert before.endswith("running: a" + CLEAR_LINE)  # the line was erased first
    assert CLEAR_LINE + "clean: 0/1 hosts done, 0s; running: a" in after  # and redrawn below
    assert text.endswith(CLEAR_LINE)


def test_no_hosts_no_thread() -> None:
    tty = Tty()
    with HostProgress([], "status", stream=tty, interval_s=0.05, delay_s=0) as p:
        assert not p.enabled
    assert tty.getvalue() == ""


def test_quick_work_shows_nothing() -> None:
    """Done before the delay: no line ever drawn (a one-host status would only flicker)."""
    tty = Tty()
    with HostProgress(["a"], "status", stream=tty, interval_s=0.05, delay_s=0.5) as p:
        p.started("a")
        time.sleep(0.2)
        p.finished("a")
    assert tty.getvalue() == ""
