"""The progress line as a person sees it: the real CLI in a real terminal (tmux) against lab
hosts where one host is slow.

While the slow host works, the terminal shows `clean: 1/2 hosts done, Ns; running: SLOW`; when
the command ends the line is gone and only the table is on the screen. With stderr a pipe,
nothing at all is written to stderr. tmux runs on a private socket (-L) that the test ends
itself (kill-server on that socket only).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import GPUFLEET, REPO_ROOT, assert_no_traceback, home, run_gpufleet  # noqa: F401

MIB = 2000
DONE = "__GPUFLEET_DONE__"


class Terminal:
    """A 160x50 tmux pane running one shell command line."""

    def __init__(self, command: str) -> None:
        self.socket = "gpufleet-test-%s" % uuid.uuid4().hex[:10]
        self._tmux("new-session", "-d", "-x", "160", "-y", "50", "-s", "t",
                   "%s; echo %s rc=$?; sleep 600" % (command, DONE))

    def _tmux(self, *args: str) -> str:
        res = subprocess.run(["tmux", "-L", self.socket, "-f", os.devnull, *args],
                             capture_output=True, text=True, timeout=10)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def wait_for(self, pattern: str, timeout: float) -> tuple[re.Match, str]:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            found = re.search(pattern, text)
            if found:
                return found, text
            time.sleep(0.05)
        raise AssertionError("never on screen: %r; last screen:\n%s" % (pattern, text))

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def terminal():
    if shutil.which("tmux") is None:
        pytest.skip("!!! tmux not installed")
    made: list[Terminal] = []

    def start(command: str) -> Terminal:
        made.append(Terminal(command))
        return made[-1]

    yield start
    for t in made:
        t.close()


def cli_line(home: Path, inventory: Path, *args: str) -> str:
    """The CLI as shell text for the pane (this checkout first on the path, HOME private)."""
    env = {"HOME": str(home), "PYTHONPATH": str(REPO_ROOT)}
    argv = ["env", "-u", "GPUFLEET_INVENTORY", "-u", "SSH_AUTH_SOCK"]
    argv += ["%s=%s" % kv for kv in env.items()] + GPUFLEET + ["-i", str(inventory), *args]
    return "cd %s && %s" % (shlex.quote(str(home)), " ".join(shlex.quote(a) for a in argv))


def slow_and_fast(lab: Any, make_host: Any, tag: str, delay: float) -> tuple[Any, Any, Path]:
    fast = make_host("%s-fast" % tag, gpus=1)
    slow = make_host("%s-slow" % tag, gpus=1, release_delay_s=delay)  # memory stays after exit
    for h in (fast, slow):
        h.spawn_holder(gpus=[0], mib=MIB, title="job")
    return fast, slow, lab.inventory_yaml([fast, slow])


def test_clean_shows_progress_while_waiting_and_clears_it(lab: Any, make_host: Any, home: Path,
                                                          terminal: Any) -> None:
    fast, slow, inv = slow_and_fast(lab, make_host, "pgc", delay=4.0)
    term = terminal(cli_line(home, inv, "clean", "--all", "--yes", "--grace", "1", "--timeout", "20"))

    found, during = term.wait_for(r"clean: 1/2 hosts done, (\d+)s; running: %s" % slow.name, 15)
    assert fast.name not in during.split("clean: 1/2")[1]
    first = int(found.group(1))
    # refreshed in place: the seconds count up on the same line
    found, during = term.wait_for(r"clean: 1/2 hosts done, (?!%ds)(\d+)s; running" % first, 5)
    assert int(found.group(1)) > first
    assert len(re.findall("hosts done", during)) == 1, during

    _, final = term.wait_for(DONE + r" rc=\d+", 30)
    assert DONE + " rc=0" in final, final
    assert "hosts done" not in final and "running:" not in final, final
    rows = [line for line in final.splitlines() if line.startswith(("pgc-fast", "pgc-slow"))]
    assert len(rows) == 2 and all(" clean " in r for r in rows), final


def test_status_shows_the_slow_host_by_name(lab: Any, make_host: Any, home: Path,
                                            terminal: Any) -> None:
    fast = make_host("pgs-fast", gpus=1)
    slow = make_host("pgs-slow", gpus=1, driver="hang")  # nvidia-smi never answers
    inv = lab.inventory_yaml([fast, slow], command_timeout=8)  # the agent gives up after 4 s
    term = terminal(cli_line(home, inv, "status"))

    term.wait_for(r"status: 1/2 hosts done, \d+s; running: pgs-slow", 10)
    _, final = term.wait_for(DONE + r" rc=\d+", 30)
    assert "hosts done" not in final and "running:" not in final, final
    assert "hosts: " in final and "pgs-fast" in final, final


def test_not_a_terminal_nothing_on_stderr(lab: Any, make_host: Any, home: Path) -> None:
    """stderr a pipe: the same slow clean writes nothing at all to it; stdout unchanged."""
    fast, slow, inv = slow_and_fast(lab, make_host, "pgp", delay=2.0)

    run = run_gpufleet(home, inv, "clean", "--all", "--yes", "--grace", "1", "--timeout", "20")
    assert_no_traceback(run)
    assert run.rc == 0, str(run)
    assert run.seconds > 2.0, str(run)  # the slow host really was slow
    assert run.stderr == "", str(run)
    assert "\r" not in run.stdout and "\x1b" not in run.stdout, str(run)

    for h in (fast, slow):
        h.spawn_holder(gpus=[0], mib=MIB, title="job")
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 0 and run.stderr == "", str(run)
