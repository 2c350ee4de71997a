"""ops.live on `connection: local` hosts (the agent as a child process, no SSH): snapshots
arrive, a host whose interpreter is missing is down with its reason and kind, and stop()
leaves no agent behind."""
from __future__ import annotations

import time
from pathlib import Path

from gpufleet.config.inventory import load_inventory
from gpufleet.core.live import DOWN, STALE, UP
from gpufleet.ops.live import LiveFleet


def hosts(tmp_path: Path, text: str):
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return load_inventory(path).hosts


def wait(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    try:
        state = Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_local_snapshots_then_stop_ends_the_agent(tmp_path: Path) -> None:
    inv = hosts(tmp_path, "hosts:\n  here:\n    connection: local\n")
    fleet = LiveFleet(list(inv), 0.2)
    fleet.start()
    try:
        assert wait(lambda: fleet.view()[0].result is not None)
        first = fleet.view()[0]
        assert first.state(time.monotonic()) == UP and first.failure is None
        pid = first.result.snapshot.facts.agent_pid
        assert alive(pid)
        gen = fleet.generation
        assert wait(lambda: fleet.generation > gen)  # the next snapshot, same agent
        assert fleet.view()[0].result.snapshot.facts.agent_pid == pid
        # no snapshot for longer than two intervals and a second: stale, by age alone
        later = fleet.view()[0]
        assert later.state(later.received_at + later.stale_after_s + 0.1) == STALE
    finally:
        fleet.stop()
    assert wait(lambda: not alive(pid), 10), "agent %d outlived stop()" % pid


def test_a_missing_interpreter_is_down_with_its_kind(tmp_path: Path) -> None:
    inv = hosts(tmp_path, "hosts:\n  here:\n    connection: local\n"
                          "    python: /nonexistent/python3\n")
    fleet = LiveFleet(list(inv), 0.2)
    fleet.start()
    try:
        assert wait(lambda: fleet.view()[0].failure is not None)
        view = fleet.view()[0]
        assert view.state(time.monotonic()) == DOWN and view.result is None
        assert view.failure.kind == "command" and "/nonexistent/python3" in view.failure.message
        assert wait(lambda: fleet.view()[0].reconnects >= 1)  # retried, with backoff
    finally:
        fleet.stop()
