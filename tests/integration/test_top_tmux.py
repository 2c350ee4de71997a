"""`gpufleet top` in a REAL terminal: tmux (its own server, `tmux -L NAME`, killed by that
socket at the end) runs the real CLI against lab hosts; the tests send keys and read the
screen as a person would (`capture-pane -p`), and check the hosts' process lists by the
agents' PIDs.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pytest

from cli_helpers import (  # noqa: F401  (home: fixture)
    GPUFLEET,
    assert_one_line_error,
    home,
    read_jsonl,
    run_gpufleet,
)
from gpufleet.render.common import fmt_pair
from watch_helpers import agents_on, cli_env, ppid_of, start_sshd, stop_sshd_and_sessions

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="!!! tmux not installed")


class Tmux:
    """One tmux server of our own (socket name unique to the test), one session."""

    def __init__(self, home: Path, argv: list[str], width: int = 160, height: int = 50,
                 env: Optional[dict[str, str]] = None):
        self.name = "gftop-" + uuid.uuid4().hex[:10]
        self.env = dict(env or cli_env(home))
        self.env.pop("TMUX", None)
        script = (" ".join(shlex.quote(a) for a in argv)
                  + "; echo TOP-EXIT=$?; sleep 600")
        self.tmux("-f", "/dev/null", "new-session", "-d", "-s", "top", "-x", str(width),
                  "-y", str(height), "sh", "-c", script)

    def tmux(self, *args: str) -> str:
        res = subprocess.run(["tmux", "-L", self.name, *args], capture_output=True, text=True,
                             env=self.env, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def screen(self, escapes: bool = False) -> str:
        return self.tmux("capture-pane", "-p", *(["-e"] if escapes else []), "-t", "top")

    def wait(self, want: Union[str, Callable[[str], bool]], timeout: float = 30.0) -> str:
        """Poll the screen until it shows ``want`` (fails, printing the screen, if never)."""
        test = (lambda s: want in s) if isinstance(want, str) else want
        end = time.monotonic() + timeout
        text = ""
        while time.monotonic() < end:
            text = self.screen()
            if test(text):
                return text
            time.sleep(0.1)
        raise AssertionError("screen never showed %r; it shows:\n%s" % (want, text))

    def keys(self, *keys: str) -> None:
        for key in keys:
            self.tmux("send-keys", "-t", "top", key)
            time.sleep(0.15)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "top", "-l", text)
        time.sleep(0.15)

    def top_pid(self) -> int:
        """The gpufleet process: the child of the pane's shell."""
        shell = int(self.tmux("display-message", "-p", "-t", "top", "#{pane_pid}").strip())
        end = time.monotonic() + 10
        while time.monotonic() < end:
            kids = Path("/proc/%d/task/%d/children" % (shell, shell)).read_text().split()
            if kids:
                return int(kids[0])
            time.sleep(0.05)
        raise AssertionError("no gpufleet under the pane's shell")

    def kill_server(self) -> None:
        subprocess.run(["tmux", "-L", self.name, "kill-server"], capture_output=True,
                       env=self.env, timeout=30)


def row(screen: str, host: str) -> str:
    rows = [ln for ln in screen.splitlines() if ln[2:].split(" ", 1)[0] == host]
    assert len(rows) == 1, "no single row for %s in:\n%s" % (host, screen)
    return rows[0]


@pytest.fixture
def fleet(lab: Any, make_host: Any, home: Path) -> Any:
    a = make_host("top-a", gpus=2)
    a.keeper = a.spawn_holder(gpus=[1], mib=3000, title="keeper")
    a.victim = a.spawn_holder(gpus=[0], mib=5000, title="victim")
    b = make_host("top-b", gpus=1)
    inv = lab.inventory_yaml([a, b, lab.dead_host("top-dead")], connect_timeout=2,
                             **{"top-b": {"tags": ["inference"]}})
    return a, b, inv


@pytest.fixture
def top(fleet: Any, home: Path) -> Any:
    started: list[Tmux] = []

    def start(*args: str, width: int = 160, height: int = 50,
              env: Optional[dict[str, str]] = None) -> Tmux:
        argv = GPUFLEET + ["-i", str(fleet[2]), "top", "-n", "1", *args]
        t = Tmux(home, argv, width, height, env)
        started.append(t)
        return t

    yield start
    for t in started:
        t.kill_server()


def wait_no_agents(*hosts: Any, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(agents_on(h) for h in hosts):
            return
        time.sleep(0.1)
    raise AssertionError("agents left: %s" % {h.name: agents_on(h) for h in hosts})


def test_every_host_with_its_numbers_expand_filter_and_q_leaves_no_agent(fleet: Any, top: Any) -> None:
    a, b, _ = fleet
    t = top()
    screen = t.wait("hosts 3: 2 up, 1 down, 0 stale")
    used = sum(a.gpu_used())
    assert used == 8000
    ra = row(screen, "top-a")
    assert ra.split()[2:4] == ["2", "2/0"] and fmt_pair(used, 2 * 49140) in ra
    assert " 0%  " in ra and "UTIL" in screen.splitlines()[1]  # the hosts' utilisation
    assert row(screen, "top-b").split()[2:4] == ["1", "0/1"]
    assert "down" in row(screen, "top-dead") and "refused" in row(screen, "top-dead")
    assert "GPUs 2 busy, 1 free" in screen.splitlines()[0]
    assert len(agents_on(a)) == 1 and len(agents_on(b)) == 1  # one resident agent each

    t.keys("Enter")  # the cursor starts on the first row: top-a
    screen = t.wait("GPU 1")
    keeper = [ln for ln in screen.splitlines() if "pid %d" % a.keeper in ln]
    assert keeper and "keeper" in keeper[0] and "3000MiB" in keeper[0] and "nvidia-smi" in keeper[0]
    assert any("victim" in ln and "pid %d" % a.victim in ln for ln in screen.splitlines())

    t.keys("/")
    t.type("inference")  # a tag: only top-b
    t.keys("Enter")
    screen = t.wait(lambda s: "top-a" not in s.split("\n", 1)[1] and "top-b" in s)
    assert "filter 'inference'" in screen.splitlines()[0]
    t.keys("/")
    t.type("keeper")  # a holder's name: only top-a
    screen = t.wait(lambda s: "top-b" not in s.split("\n", 1)[1] and "top-a" in s.split("\n", 1)[1])
    t.keys("Escape")
    t.wait(lambda s: "top-b" in s.split("\n", 1)[1] and "top-a" in s.split("\n", 1)[1])

    t.keys("?")
    t.wait("sort: name, memory, unattributed")
    t.keys("x")
    t.keys("q")
    t.wait("TOP-EXIT=0")
    wait_no_agents(a, b)


def test_the_filter_finds_a_script_its_interpreter_runs(fleet: Any, top: Any, lab: Any) -> None:
    """`python3 train_dflash.py` has comm python3: `/train_dflash` must find its host, and the
    expanded host shows the script and its user on the holder's line."""
    a, b, _ = fleet
    job = b.spawn_holder(gpus=[0], mib=2000, user=lab.user, argv=[
        "python3", "/home/%s/train_dflash.py" % lab.user, "--epochs", "3"])
    t = top()
    t.wait(lambda s: "top-b" in s and fmt_pair(2000, 49140) in row(s, "top-b"))
    t.keys("/")
    t.type("train_dflash")
    t.keys("Enter")
    screen = t.wait(lambda s: "top-a" not in s.split("\n", 1)[1] and "top-b" in s)
    assert "filter 'train_dflash'" in screen.splitlines()[0]
    t.keys("Enter")  # the cursor is on top-b, the one host shown
    screen = t.wait("pid %d" % job)
    line = [ln for ln in screen.splitlines() if "pid %d" % job in ln][0]
    assert "train_dflash.py --epo" in line and lab.user in line, screen
    t.keys("q")
    t.wait("TOP-EXIT=0")
    wait_no_agents(a, b)


def test_clean_from_the_screen_frees_the_marked_gpu_and_nothing_else(fleet: Any, top: Any,
                                                                      home: Path) -> None:
    a, b, _ = fleet
    t = top("--all")  # a clean needs the hosts named
    t.wait("hosts 3: 2 up")
    t.keys("Enter")
    t.wait("GPU 0")
    t.keys("Down", "Space")  # the first row under the host: GPU 0
    t.wait(lambda s: any("[x] GPU 0" in ln for ln in s.splitlines()))
    t.keys("c")
    screen = t.wait("Signal the processes above?")
    assert "top-a: GPUs 0" in screen and str(a.victim) in screen and str(a.keeper) not in screen
    t.keys("n")  # no: nothing happens
    t.wait("nothing signalled")
    assert a.alive(a.victim) and a.alive(a.keeper)
    t.keys("x")
    t.keys("c")  # the mark stays until a clean ran
    t.wait("Signal the processes above?")
    t.keys("y")
    screen = t.wait(lambda s: "outcome" in s and "clean" in s.split("outcome", 1)[1], timeout=60)
    assert a.wait_gone(a.victim, 10)
    assert a.alive(a.keeper) and a.gpu_used() == [0, 3000]
    audit = read_jsonl(home / ".local" / "state" / "gpufleet" / "audit.jsonl")
    signals = [r for r in audit if r.get("event") != "verdict"]  # one verdict line per clean
    assert {(r["host"], r["pid"], r["signal"]) for r in signals} == {("top-a", a.victim, "TERM")}
    assert [r["verdict"] for r in audit if r.get("event") == "verdict"] == ["clean"]
    t.keys("x")  # the outcome page closes; the screen follows the host
    t.wait(lambda s: fmt_pair(3000, 2 * 49140) in row(s, "top-a"))
    t.keys("q")
    t.wait("TOP-EXIT=0")
    wait_no_agents(a, b)


def test_without_hosts_named_top_watches_and_refuses_marks_and_clean(fleet: Any, top: Any,
                                                                      home: Path) -> None:
    """No --host/-g/--tag/--all: the screen watches every host, but a mark or `c` only says
    how to select hosts, and nothing is planned or signalled."""
    a, b, _ = fleet
    how = "start top with --host NAME, -g GROUP, --tag TAG or --all"
    t = top()
    screen = t.wait("hosts 3: 2 up")
    assert "watch only" in screen.splitlines()[0] and "space mark" not in screen
    t.keys("Enter")
    t.wait("GPU 0")
    t.keys("Down", "Space")  # GPU 0 of top-a, the victim's
    screen = t.wait("clean changes hosts: " + how)
    assert "[x]" not in screen
    t.keys("c")
    screen = t.wait("clean changes hosts: " + how)
    assert "Signal the processes above?" not in screen and "planning" not in screen
    time.sleep(0.5)
    assert a.alive(a.victim) and a.alive(a.keeper)
    assert not (home / ".local" / "state" / "gpufleet" / "audit.jsonl").exists()
    t.keys("q")
    t.wait("TOP-EXIT=0")
    wait_no_agents(a, b)


def test_readonly_offers_no_action(fleet: Any, top: Any) -> None:
    a, b, _ = fleet
    t = top("--readonly")
    t.wait("read-only")
    t.keys("Enter")
    t.wait("GPU 0")
    t.keys("Down", "Space", "c")
    screen = t.wait("read-only: no")
    assert "[ ]" not in screen and "Signal" not in screen
    t.keys("q")
    t.wait("TOP-EXIT=0")


def test_sigterm_and_sigkill_of_top_leave_no_agent(fleet: Any, top: Any) -> None:
    a, b, _ = fleet
    for sig in (signal.SIGTERM, signal.SIGKILL):
        t = top()
        t.wait("hosts 3: 2 up")
        pids = agents_on(a) + agents_on(b)
        assert len(pids) == 2
        os.kill(t.top_pid(), sig)  # the gpufleet process this test started (under tmux)
        t.wait("TOP-EXIT=")
        wait_no_agents(a, b)
        t.kill_server()


def test_cut_connection_agent_ends_host_stale_then_back(fleet: Any, top: Any) -> None:
    a, b, _ = fleet
    t = top()
    t.wait("hosts 3: 2 up")
    [agent] = agents_on(a)
    session = ppid_of(a, agent)
    a.kill(session, signal.SIGSTOP)  # the host's end passes nothing: no EOF, no keep-alive
    try:
        screen = t.wait(lambda s: "stale" in row(s, "top-a"), timeout=10)
        assert "1 up, 1 down, 1 stale" in screen.splitlines()[0]
        end = time.monotonic() + 15
        while a.alive(agent) and time.monotonic() < end:
            time.sleep(0.1)
        assert not a.alive(agent), "the agent outlived its keep-alive deadline"
    finally:
        a.kill(session, signal.SIGCONT)
    t.wait(lambda s: "stale" not in row(s, "top-a") and "2 up" in s.splitlines()[0], timeout=45)
    assert len(agents_on(a)) == 1
    t.keys("q")
    t.wait("TOP-EXIT=0")
    wait_no_agents(a, b)


def test_sshd_killed_shows_stale_within_two_intervals_and_back(fleet: Any, top: Any) -> None:
    a, b, _ = fleet
    t = top()
    t.wait("hosts 3: 2 up")
    [agent] = agents_on(a)
    stop_sshd_and_sessions(a, agent)
    killed = time.monotonic()
    t.wait(lambda s: "stale" in row(s, "top-a"), timeout=10)
    assert time.monotonic() - killed < 2 * 1.0 + 1.0
    start_sshd(a)
    t.wait(lambda s: "stale" not in row(s, "top-a") and "2 up" in s.splitlines()[0], timeout=60)
    t.keys("q")
    t.wait("TOP-EXIT=0")


def test_resize_too_small_waits_then_draws_again(fleet: Any, top: Any) -> None:
    t = top()
    t.wait("hosts 3: 2 up")
    t.tmux("resize-window", "-t", "top", "-x", "50", "-y", "6")
    t.wait("terminal too small")
    t.keys("Enter")  # ignored while too small
    t.tmux("resize-window", "-t", "top", "-x", "120", "-y", "30")
    screen = t.wait("hosts 3:")
    assert all(len(line) <= 120 for line in screen.splitlines())
    assert "top-dead" in screen
    t.keys("q")
    t.wait("TOP-EXIT=0")


def test_colour_keeps_the_background_and_no_color_turns_it_off(fleet: Any, top: Any,
                                                               home: Path) -> None:
    t = top()
    t.wait("hosts 3: 2 up")
    coloured = t.screen(escapes=True)
    dead = [ln for ln in coloured.splitlines() if "top-dead" in ln][0]
    assert "\x1b[31m" in dead or ";31m" in dead or "[31;" in dead  # red: a down host
    assert not any("\x1b[4%dm" % c in coloured for c in range(8))  # never a background colour
    t.keys("q")
    t.kill_server()
    env = cli_env(home)
    env["NO_COLOR"] = "1"
    t = top(env=env)
    t.wait("hosts 3: 2 up")
    plain = t.screen(escapes=True)
    assert "31m" not in plain and "35m" not in plain and "down" in plain
    t.keys("q")


def test_without_a_terminal_bad_interval_or_empty_selection_is_one_line(fleet: Any,
                                                                        home: Path) -> None:
    a, b, inv = fleet
    before = (a.dir / "sshd.log").read_text().count("Accepted publickey")
    run = run_gpufleet(home, inv, "top", timeout=30)
    assert_one_line_error(run, "needs a terminal", "status --watch SECONDS --json")
    for args, fragment in ((["-n", "0"], "--interval must be a number"),
                           (["-n", "soon"], "--interval must be a number"),
                           (["--host", "nomatch"], "no host matches")):
        assert_one_line_error(run_gpufleet(home, inv, "top", *args, timeout=30), fragment)
    time.sleep(0.3)
    assert (a.dir / "sshd.log").read_text().count("Accepted publickey") == before
    assert agents_on(a) == []


def test_bad_interval_in_a_terminal_is_one_line_too(fleet: Any, top: Any) -> None:
    t = top("-n", "-2")
    screen = t.wait("TOP-EXIT=2")
    assert "gpufleet: error: --interval must be a number of seconds > 0, not '-2'" in screen
    assert json.dumps("Traceback") not in screen and "Traceback" not in screen
