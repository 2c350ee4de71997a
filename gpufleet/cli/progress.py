"""One line of progress on stderr while a command works on many hosts.

A clean can take grace + memory wait (a minute or more) and a status over a large fleet waits
for its slowest host; without this nothing shows until every host is done. The line says how
many hosts are done, which are still running (by name, cut to the terminal's width) and the
seconds elapsed; it appears once the work has taken ``delay_s`` (0.5 s), is redrawn in place
(``\\r`` + clear line) at most ``1 / interval_s`` times a second and is erased before the
caller prints its table.

Only on a terminal: when stderr is not a tty nothing at all is written (scripts, CI, pipes),
and stdout / ``--json`` are never touched. It plugs into ``fanout.run_hosts`` through its
``on_start`` / ``on_result`` callbacks (:meth:`HostProgress.callbacks`).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import unicodedata
from typing import Any, Callable, Iterable, Optional, Sequence, TextIO, TypedDict

CLEAR_LINE = "\r\x1b[K"
INTERVAL_S = 0.25  # at most 4 redraws a second
DELAY_S = 0.5  # nothing for work that ends sooner (a quick status would only flicker)
DEFAULT_WIDTH = 80
VERBOSE = False  # -v: its log lines are the progress; a line redrawn among them would garble both


def safe_name(text: str) -> str:
    """A name as terminal-inert text: control characters (ESC, CR, newline...) and other
    unprintable characters are shown escaped, never sent to the terminal."""
    out = []
    for ch in str(text):
        if ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x100:
            out.append("\\x%02x" % ord(ch))
        else:
            out.append("\\u%04x" % ord(ch) if ord(ch) < 0x10000 else "\\U%08x" % ord(ch))
    return "".join(out)


def _char_width(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def text_width(text: str) -> int:
    """Columns the (already safe) text takes on a terminal."""
    return sum(_char_width(ch) for ch in text)


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` columns, ending in an ellipsis when cut."""
    if width <= 0:
        return ""
    if text_width(text) <= width:
        return text
    out, used = [], 0
    for ch in text:
        w = _char_width(ch)
        if used + w > width - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + "…"


def progress_line(label: str, done: int, total: int, running: Sequence[str], elapsed_s: float,
                  width: int) -> str:
    """``clean: 3/10 hosts done, 12s; running: node-a, node-b +5 more``, in < ``width``
    columns (the last column is left free: writing into it makes some terminals wrap).

    Names are made safe here; as many as fit are shown whole, the rest are counted."""
    room = max(1, int(width) - 1)
    head = f"{safe_name(label)}: {done}/{total} hosts done, {int(elapsed_s)}s"
    if not running:
        return cut(head, room)
    names = [safe_name(n) for n in running]
    prefix = head + "; running: "
    shown: list[str] = []
    for i, name in enumerate(names):
        rest = len(names) - i - 1
        more = f" +{rest} more" if rest else ""
        candidate = prefix + ", ".join(shown + [name]) + more
        if text_width(candidate) > room:
            break
        shown.append(name)
    if len(shown) == len(names):
        return prefix + ", ".join(shown)
    rest = len(names) - len(shown)
    if shown:
        return prefix + ", ".join(shown) + f" +{rest} more"
    # not even one whole name fits: the first one, cut, and the count of the others
    more = f" +{rest - 1} more" if rest > 1 else ""
    avail = room - text_width(prefix) - text_width(more)
    if avail >= 4:
        return prefix + cut(names[0], avail) + more
    short = f"{head}; {len(names)} running"
    return short if text_width(short) <= room else cut(head, room)


class Callbacks(TypedDict):
    """fanout.run_hosts's progress keywords."""

    on_start: Callable[[Any], None]
    on_result: Callable[[Any, Any], None]


def _name_of(item: Any) -> str:
    """fanout's work items: inventory Hosts (``.name``) or per-host results (``.host``)."""
    for attr in ("name", "host"):
        value = getattr(item, attr, None)
        if isinstance(value, str):
            return value
    return str(item)


class HostProgress:
    """The progress line of one fan-out; a no-op unless ``stream`` is a terminal.

    ``with HostProgress(hosts, "status") as progress:`` then pass
    ``**progress.callbacks()`` to ``run_hosts``; leaving the block erases the line.
    """

    def __init__(self, items: Iterable[Any], label: str, stream: Optional[TextIO] = None,
                 interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 width: Optional[int] = None, delay_s: float = DELAY_S) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.names = [_name_of(i) for i in items]
        self.interval_s = max(0.05, float(interval_s))
        self.delay_s = max(0.0, float(delay_s))
        self._clock = clock
        self._width = width
        self._started_at = clock()
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}  # name -> position, kept in host order
        self._order = {n: i for i, n in reversed(list(enumerate(self.names)))}
        self._done = 0
        self._shown = ""  # what the terminal shows now ("" = nothing)
        self._closed = False
        self._wake = threading.Event()
        self.enabled = _is_tty(self.stream) and bool(self.names) and not VERBOSE
        self._thread: Optional[threading.Thread] = None
        if self.enabled:
            self._thread = threading.Thread(target=self._tick, name="gpufleet-progress", daemon=True)
            self._thread.start()

    # ---- fanout callbacks (any thread)

    def callbacks(self) -> Callbacks:
        return {"on_start": self.started, "on_result": self.finished}

    def started(self, item: Any) -> None:
        name = _name_of(item)
        with self._lock:
            self._running[name] = self._order.get(name, len(self._order))

    def finished(self, item: Any, _value: Any = None) -> None:
        name = _name_of(item)
        with self._lock:
            self._running.pop(name, None)
            self._done += 1

    # ---- output

    def line(self) -> str:
        with self._lock:
            running = [n for n, _ in sorted(self._running.items(), key=lambda kv: kv[1])]
            done = self._done
        return progress_line(self.label, done, len(self.names), running,
                             self._clock() - self._started_at, self._columns())

    def print_above(self, text: str) -> None:
        """Write a line of ``text`` to the stream (as ``click.echo(err=True)`` would) without
        mixing it into the progress line: erase, write, and the next tick redraws."""
        with self._lock:
            if self._shown:
                self._write(CLEAR_LINE)
                self._shown = ""
            self._write(text + "\n")

    def close(self) -> None:
        """Erase the line and stop redrawing; idempotent."""
        with self._lock:
            self._closed = True
            self._wake.set()
            if self._shown:
                self._write(CLEAR_LINE)
                self._shown = ""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def __enter__(self) -> "HostProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals

    def _columns(self) -> int:
        if self._width is not None:
            return self._width
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or DEFAULT_WIDTH
        except (AttributeError, ValueError, OSError):
            return DEFAULT_WIDTH

    def _tick(self) -> None:
        if self.delay_s and self._wake.wait(self.delay_s):
            return
        while not self._wake.wait(self.interval_s):
            text = self.line()
            with self._lock:
                if self._closed:
                    return
                if text != self._shown:
                    self._write(CLEAR_LINE + text)
                    self._shown = text

    def _write(self, text: str) -> None:
        """(lock held) Best effort: a closed or broken stderr never fails the command."""
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def echo_err(progress: Optional[HostProgress]) -> Callable[[str], None]:
    """A writer of stderr lines that keeps clear of ``progress`` (plain stderr without it)."""
    if progress is not None and progress.enabled:
        return progress.print_above

    def write(text: str) -> None:
        import click

        click.echo(text, err=True)

    return write
