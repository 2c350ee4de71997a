"""The clean's exit wait (agent piece gpufleet/remote/pidfd.py: wait_exit): pidfds where the
kernel has them, polling otherwise, identity (pid, starttime) first, bounds kept.

Real child processes of this test, ended by their own PIDs. Latencies (signal -> the wait
returns) are printed (`pytest -s` / `-rP`), never asserted: the assertions are behaviour (who
is reported as exited, which way was used, that the bounds hold).
"""
from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpufleet.remote import agent

# A process whose main thread leaves (pthread_exit: the leader becomes a zombie) while a worker
# thread runs on: like a CUDA process tearing its context down after SIGTERM. The worker ends
# the process when the file named by argv[1] appears.
ZOMBIE_LEADER = r"""
import ctypes, os, sys, threading, time
def worker():
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    os._exit(0)
threading.Thread(target=worker).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def starttime(pid: int) -> int:
    return int(Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[19])


def state(pid: int) -> str:
    return Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture
def spawn() -> Iterator[Any]:
    """Start `sleep`-like children; each is killed by its own PID and reaped at teardown."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(argv or ["sleep", "300"], stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL)
        started.append(p)
        if argv:  # a python child says when it is set up
            assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout:
            p.stdout.close()


@pytest.fixture
def fresh_pidfd_state(monkeypatch: Any) -> Any:
    """The agent's per-host pidfd memory ("off", the ctypes syscall) restored after the test."""
    for key in ("off", "syscall"):
        monkeypatch.setitem(agent.PIDFD_STATE, key, None)
    return agent.PIDFD_STATE


def target(p: subprocess.Popen) -> dict:
    return {"pid": p.pid, "starttime": starttime(p.pid)}


def kill_later(p: subprocess.Popen, after_s: float, sig: int = signal.SIGKILL) -> list[float]:
    """Signal p (by its PID) after after_s in a thread; the list gets the monotonic time sent."""
    sent: list[float] = []

    def go() -> None:
        time.sleep(after_s)
        sent.append(time.monotonic())
        os.kill(p.pid, sig)

    threading.Thread(target=go, daemon=True).start()
    return sent


def wait(targets: list, seconds: float, poll: float = 5.0, deadline_s: float = 60.0,
         **kw: Any) -> tuple[list, dict, float]:
    stats: dict = {}
    left = agent.wait_exit(targets, seconds, poll, agent.Deadline(deadline_s), stats=stats, **kw)
    return left, stats, time.monotonic()


def test_an_exit_is_seen_through_the_pidfd(spawn: Any, fresh_pidfd_state: Any) -> None:
    """poll is 5 s: only an event ends this wait soon after the kill; pidfd watched it."""
    p = spawn()
    sent = kill_later(p, 0.3)
    left, stats, done = wait([target(p)], seconds=30)
    assert left == [] and stats == {"pidfd": 1, "polled": 0}
    assert state(p.pid) == "Z"  # exited, not yet reaped by us: a zombie counts as exited
    print("pidfd wait: exit seen %.1f ms after SIGKILL" % ((done - sent[0]) * 1000))


def test_several_targets_each_seen(spawn: Any, fresh_pidfd_state: Any) -> None:
    procs = [spawn() for _ in range(3)]
    sents = [kill_later(p, 0.1 * (i + 1)) for i, p in enumerate(procs)]
    left, stats, done = wait([target(p) for p in procs], seconds=30)
    assert left == [] and stats["pidfd"] == 3 and stats["polled"] == 0
    print("pidfd wait, 3 targets: last exit seen %.1f ms after its SIGKILL"
          % ((done - max(s[0] for s in sents)) * 1000))


def test_the_polling_fallback_forced(spawn: Any, fresh_pidfd_state: Any) -> None:
    """allow_pidfd=False (the request's "pidfd": false): the old polling, same answer."""
    p = spawn()
    sent = kill_later(p, 0.3)
    left, stats, done = wait([target(p)], seconds=30, poll=0.1, allow_pidfd=False)
    assert left == [] and stats == {"pidfd": 0, "polled": 1,
                                    "reason": "pidfd disabled by the request"}
    print("polling wait (poll 0.1 s): exit seen %.1f ms after SIGKILL" % ((done - sent[0]) * 1000))


def test_the_ctypes_syscall_where_os_has_no_pidfd_open(spawn: Any, fresh_pidfd_state: Any,
                                                       monkeypatch: Any) -> None:
    """Python < 3.9 (no os.pidfd_open): syscall(434) through ctypes gives a working pidfd."""
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    p = spawn()
    fd = agent.pidfd_open(p.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(50) == []  # alive: not readable
        os.kill(p.pid, signal.SIGKILL)
        assert [fd_ for fd_, _ in poller.poll(10000)] == [fd]
    finally:
        os.close(fd)
    q = spawn()
    sent = kill_later(q, 0.3)
    left, stats, done = wait([target(q)], seconds=30)
    assert left == [] and stats == {"pidfd": 1, "polled": 0}
    print("ctypes pidfd wait: exit seen %.1f ms after SIGKILL" % ((done - sent[0]) * 1000))


def test_a_kernel_without_pidfd_open_falls_back_to_polling(spawn: Any, fresh_pidfd_state: Any,
                                                           monkeypatch: Any) -> None:
    """A real ENOSYS from the kernel (a syscall number it does not have, as a kernel older
    than 5.3 answers 434): this wait and every later one poll, and say why."""
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    monkeypatch.setitem(agent.PIDFD_OPEN_NR, os.uname()[4], 100000)
    with pytest.raises(OSError) as raised:
        agent.pidfd_open(os.getpid())
    assert raised.value.errno == errno.ENOSYS
    p = spawn()
    kill_later(p, 0.3)
    left, stats, _ = wait([target(p)], seconds=30, poll=0.05)
    assert left == [] and stats["pidfd"] == 0 and stats["polled"] == 1
    assert "pidfd_open" in stats["reason"] and fresh_pidfd_state["off"]
    q = spawn()
    kill_later(q, 0.1)
    left, stats, _ = wait([target(q)], seconds=30, poll=0.05)
    assert left == [] and stats["polled"] == 1  # remembered: not tried again


def test_identity_first_a_reused_or_gone_pid_is_exited_at_once(spawn: Any,
                                                               fresh_pidfd_state: Any) -> None:
    """A live pid whose start time is not the target's is another process: the target has
    exited, and no pidfd is opened for the stranger; a pid already gone likewise."""
    alive = spawn()
    stranger = {"pid": alive.pid, "starttime": starttime(alive.pid) - 1}
    gone = spawn()
    gone_t = target(gone)
    gone.kill()
    gone.wait()  # reaped: the pid is free
    left, stats, _ = wait([stranger, gone_t], seconds=30)
    assert left == [] and stats == {"pidfd": 0, "polled": 0}
    assert alive.poll() is None  # the stranger was only looked at
    assert agent.exit_watch(stranger) == ("gone", None)


def test_a_zombie_leader_with_live_threads_has_not_exited(spawn: Any, fresh_pidfd_state: Any,
                                                          tmp_path: Path) -> None:
    """The leader is a zombie but a thread still runs (it may hold GPU memory): the pidfd is
    not readable and has_exited agrees, so the wait goes on until the last thread ends."""
    flag = tmp_path / "end"
    p = spawn([sys.executable, "-c", ZOMBIE_LEADER, str(flag)])
    for _ in range(200):
        if state(p.pid) == "Z":
            break
        time.sleep(0.01)
    assert state(p.pid) == "Z"
    t = target(p)
    left, stats, _ = wait([t], seconds=0.3)
    assert left == [t] and stats["pidfd"] == 1  # still there after its 0.3 s
    threading.Timer(0.2, flag.touch).start()
    left, stats, _ = wait([t], seconds=30)
    assert left == []


def test_the_deadline_bounds_the_wait(spawn: Any, fresh_pidfd_state: Any) -> None:
    """A target that never exits: the wait ends at the agent's deadline, not at `seconds`."""
    p = spawn()
    t = target(p)
    started = time.monotonic()
    left, stats, done = wait([t], seconds=300, deadline_s=0.3)
    assert left == [t] and stats["pidfd"] == 1
    assert done - started < 30  # 0.3 s, on a busy machine; 300 would be the bug
    left, _, _ = wait([t], seconds=0.2, deadline_s=300)
    assert left == [t]
    assert p.poll() is None
