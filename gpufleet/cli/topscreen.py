"""The terminal side of `gpufleet top`: curses (standard library), keys, the clean job.

What is drawn is ``render.top.layout`` (pure); this module only reads keys, keeps the state,
and paints lines. No flicker: the window is erased and repainted in memory, and curses sends
the terminal only the cells that changed (``noutrefresh`` + ``doupdate``), at most once per
change of data, key, resize or second (the ages). Colours keep the terminal's own background
(``use_default_colors``: light and dark themes alike), and nothing is told by colour alone
(stale, down, marks and warnings are words and signs); ``NO_COLOR`` turns colour off.

A clean from the screen is ``ops.clean.run_clean`` for the marked GPUs of one host, exactly
as `gpufleet clean --host H --gpus G` runs it: a fresh snapshot, the same planner, policy and
identity checks, the plan shown, and only ``y`` executes it (same memory wait, verdict and
audit log). It runs on a thread so the screen keeps drawing.
"""
from __future__ import annotations

import curses
import locale
import os
import threading
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.core.gpus import format_gpu_indices
from gpufleet.core.plan.types import FAMILY, SPANNING
from gpufleet.errors import EXIT_OK, GpufleetError
from gpufleet.errors import lines as error_lines
from gpufleet.render.top import HostInfo, Overlay, Screen, TopState, clean_scope, layout, on_key

KEYS = {curses.KEY_UP: "UP", curses.KEY_DOWN: "DOWN", curses.KEY_PPAGE: "PGUP",
        curses.KEY_NPAGE: "PGDN", curses.KEY_HOME: "HOME", curses.KEY_END: "END",
        curses.KEY_ENTER: "ENTER", curses.KEY_BACKSPACE: "BACKSPACE", curses.KEY_LEFT: "LEFT",
        curses.KEY_RIGHT: "RIGHT", "\n": "ENTER", "\r": "ENTER", "\x1b": "ESC",
        "\x7f": "BACKSPACE", "\b": "BACKSPACE"}


class CleanJob:
    """One clean from the screen: plan, wait for the operator's answer, act, outcome."""

    def __init__(self, host: Host, gpus: Sequence[int], audit_log: Optional[str]):
        self.host, self.gpus, self.audit_log = host, list(gpus), audit_log
        self.phase = "planning"  # planning | confirm | cleaning | done
        self.lines: list[str] = []
        self.has_targets = False
        self.acted = False  # something was sent to the host (then the marks are spent)
        self.spanning = False  # planned with include_spanning (the `s` key, as --include-spanning)
        self.can_span = False  # the plan refused processes that span GPUs outside the marks
        self._replan = False
        self._answer: Optional[bool] = None
        self._answered = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="gpufleet-top-clean").start()

    @property
    def what(self) -> str:
        return f"{self.host.name} GPUs {format_gpu_indices(self.gpus)}"

    def reply(self, yes: bool) -> None:
        self._answer = yes
        self._answered.set()

    def include_spanning(self) -> None:
        """`s` on the plan: nothing is signalled; the plan is made again with the processes
        (and vLLM families) that also use GPUs outside the marks, as `clean
        --include-spanning` makes it, and shown for y/n."""
        self._replan = True
        self.reply(False)

    def _confirm(self, results: list[Any]) -> bool:
        from gpufleet.render.clean import plan_text

        lines: list[str] = []
        for r in results:
            if r.plan is not None:
                lines += plan_text(r.plan).splitlines()
            elif r.error:
                lines.append(f"{r.host}: {r.error}")
        self.has_targets = any(r.plan is not None and r.plan.targets for r in results)
        self.can_span = not self.spanning and any(
            f.kind in (SPANNING, FAMILY) for r in results if r.plan is not None for f in r.plan.refused)
        self.lines, self.phase = lines, "confirm"
        self._answered.wait()
        go = bool(self._answer) and self.has_targets
        if go:
            self.phase, self.acted = "cleaning", True
        return go

    def _run(self) -> None:
        from gpufleet.ops.clean import CleanOptions, run_clean
        from gpufleet.render.clean import outcome_table

        try:
            while True:
                opts = CleanOptions(gpus=",".join(str(g) for g in self.gpus),
                                    audit_log=self.audit_log, include_spanning=self.spanning)
                run = run_clean([self.host], opts, forks=1, confirm=self._confirm)
                if not (run.declined and self._replan):
                    break
                self.spanning, self._replan, self._answer = True, False, None
                self._answered.clear()
                self.phase = "planning"
            lines = ["nothing signalled"] if run.declined else outcome_table(run.results).splitlines()
        except GpufleetError as exc:
            lines = list(error_lines(exc))
        except Exception as exc:  # the screen must survive a bug: say it, on the page
            lines = [f"gpufleet: internal error: {type(exc).__name__}: {exc}"]
        self.lines, self.phase = lines, "done"

    def overlay(self) -> Overlay:
        if self.phase == "planning":
            spanning = " with the processes spanning other GPUs" if self.spanning else ""
            return Overlay(f"clean {self.what}: planning{spanning} from a fresh snapshot ...", (),
                           "planning ...", "busy")
        if self.phase == "confirm":
            prompt = ("Signal the processes above? y = yes, n = no" if self.has_targets
                      else "nothing to signal: any key closes")
            if self.can_span:
                prompt += (", s = plan again with the processes that also use GPUs outside "
                           "the marks (clean --include-spanning)")
            return Overlay(f"clean {self.what}: the plan", tuple(self.lines), prompt, "confirm")
        if self.phase == "cleaning":
            return Overlay(f"clean {self.what}: signalling, then waiting for the memory ...",
                           tuple(self.lines), "cleaning ... (the outcome follows)", "busy")
        title = f"clean {self.what}{' (include spanning)' if self.spanning else ''}: outcome"
        return Overlay(title, tuple(self.lines), "any key closes")


class Top:
    """The loop: draw on change, read a key, act."""

    def __init__(self, scr: Any, fleet: Any, hosts: Sequence[Host], interval: float,
                 readonly: bool, audit_log: Optional[str], actions_refused: str = ""):
        self.scr, self.fleet = scr, fleet
        self.hosts = {h.name: h for h in hosts}
        self.info = {h.name: HostInfo(tuple(h.tags or ()), int(h.unattributed_mib or 0), h.gpus)
                     for h in hosts}
        self.audit_log = audit_log
        self.state = TopState(interval_s=interval, readonly=readonly,
                              actions_refused=actions_refused)
        self.screen = Screen(())
        self.job: Optional[CleanJob] = None
        self.attrs = attributes()

    def draw(self) -> None:
        if self.job is not None:
            self.state = replace(self.state, overlay=self.job.overlay())
        height, width = self.scr.getmaxyx()
        screen = layout(self.fleet.view(), self.info, self.state, width, height,
                        time.monotonic())
        if screen.keys and self.state.cursor not in screen.keys:
            self.state = replace(self.state, cursor=screen.keys[0])
        self.state = replace(self.state, top=screen.top)
        self.screen = screen
        self.scr.erase()
        encoding = locale.getpreferredencoding(False) or "utf-8"
        for y, line in enumerate(screen.lines[:height]):
            text = line.text.encode(encoding, "replace").decode(encoding, "replace")
            try:
                self.scr.addnstr(y, 0, text, max(0, width - 1), self.attrs.get(line.role, 0))
            except curses.error:
                pass  # the last cell of a shrinking window
        self.scr.noutrefresh()
        curses.doupdate()

    def answer(self, key: str) -> None:
        """A key while a page is over the list."""
        job = self.job
        if job is None:
            self.state = replace(self.state, overlay=None)
        elif job.phase == "confirm":
            if job.can_span and key in ("s", "S"):
                job.include_spanning()
            elif job.has_targets and key in ("y", "Y"):
                job.reply(True)
            elif not job.has_targets or key in ("n", "N", "ESC", "q"):
                job.reply(False)
        elif job.phase == "done":
            self.job = None
            marks = frozenset() if job.acted else self.state.marks  # declined: marks kept
            self.state = replace(self.state, overlay=None, marks=marks)

    def start_clean(self) -> None:
        host, gpus, why = clean_scope(self.state, self.fleet.view())
        if host is None:
            self.state = replace(self.state, message=why)
            return
        self.job = CleanJob(self.hosts[host], gpus, self.audit_log)

    def key(self, key: str) -> bool:
        """Handle one key; False to quit."""
        self.state, action = on_key(self.state, key, self.screen)
        if action == "quit":
            if self.job is not None and self.job.phase == "cleaning":
                self.state = replace(self.state, message="a clean is running: wait for its outcome")
                return True
            return False
        if action == "clean":
            self.start_clean()
        elif action is not None and action.startswith("answer:"):
            if self.screen.too_small and key in ("q", "Q"):
                return False
            self.answer(action[len("answer:"):])
        return True

    def loop(self) -> None:
        generation, drawn_at, dirty = -1, 0.0, True
        job_phase = None
        while True:
            gen = self.fleet.generation
            phase = self.job.phase if self.job is not None else None
            if dirty or gen != generation or phase != job_phase or time.monotonic() - drawn_at >= 1:
                generation, job_phase, drawn_at, dirty = gen, phase, time.monotonic(), False
                self.draw()
            key = read_key(self.scr)
            if key is None:
                continue
            dirty = True
            if key == "RESIZE":
                continue
            if self.screen.too_small and key not in ("q", "Q"):
                continue
            if not self.key(key):
                return


def read_key(scr: Any) -> Optional[str]:
    try:
        ch = scr.get_wch()
    except curses.error:
        return None  # the timeout: nothing pressed
    if ch == curses.KEY_RESIZE:
        return "RESIZE"
    name = KEYS.get(ch)
    if name is not None:
        return name
    return ch if isinstance(ch, str) else None


def attributes() -> dict[str, int]:
    """Role -> curses attribute; colours only with a colour terminal and no NO_COLOR."""
    attrs = {"title": curses.A_BOLD, "header": curses.A_BOLD | curses.A_UNDERLINE,
             "cursor": curses.A_REVERSE, "down": curses.A_BOLD, "stale": curses.A_DIM,
             "warn": curses.A_BOLD, "dim": curses.A_DIM, "prompt": curses.A_BOLD,
             "message": curses.A_BOLD}
    if os.environ.get("NO_COLOR") or not curses.has_colors():
        return attrs
    try:
        curses.use_default_colors()  # the terminal's own background: light or dark
        curses.init_pair(1, curses.COLOR_RED, -1)
        curses.init_pair(2, curses.COLOR_MAGENTA, -1)
    except curses.error:
        return attrs
    attrs.update(down=curses.color_pair(1) | curses.A_BOLD, warn=curses.color_pair(1),
                 stale=curses.color_pair(2))
    return attrs


def run_top(fleet: Any, hosts: Sequence[Host], interval: float, readonly: bool,
            audit_log: Optional[str], actions_refused: str = "") -> int:
    """The screen of a started ``fleet`` (cli/top.py starts it, then imports this module)
    until q; SIGTERM / Ctrl-C raise KeyboardInterrupt to the caller, which stops the fleet.
    ``actions_refused``: no hosts were named, so marks and `c` show this line instead."""
    locale.setlocale(locale.LC_ALL, "")
    os.environ.setdefault("ESCDELAY", "25")

    def main(scr: Any) -> None:
        try:
            curses.curs_set(0)
        except curses.error:
            pass
        scr.timeout(200)
        Top(scr, fleet, hosts, interval, readonly, audit_log, actions_refused).loop()

    curses.wrapper(main)
    return EXIT_OK
