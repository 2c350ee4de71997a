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


class Counting:
    """A session factory around the real one: counts hosts between a session's open and the
    first line of its stream (the connect slots), and the order of opens and first lines.
    ``gate``: an open waits until that many are in flight (or ``gate_s`` passed), so
    without a bound every host would be in flight at once, whatever the timing."""

    def __init__(self, gate: int = 0, gate_s: float = 0.5, fail: tuple = ()):
        import threading

        self.cond = threading.Condition()
        self.in_flight = 0
        self.most = 0
        self.events: list = []
        self.opens: dict = {}
        self.gate, self.gate_s, self.fail = gate, gate_s, fail

    def __call__(self, host):
        from gpufleet.transport import open_session

        with self.cond:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.events.append(("open", host.name))
            self.opens[host.name] = self.opens.get(host.name, 0) + 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.in_flight >= self.gate, timeout=self.gate_s)
        if host.name in self.fail:
            self._done(host.name, "failed")
            from gpufleet.errors import TransportError

            raise TransportError("refused by the test's factory", kind="refused")
        session = open_session(host)
        real = session.stream_agent

        def stream_agent(request, timeout=None):
            stream = real(request, timeout)
            readline, first = stream.readline, [True]

            def counted(timeout):
                line = readline(timeout)
                if line is not None and first[0]:
                    first[0] = False
                    self._done(host.name, "line")
                return line
            stream.readline = counted
            return stream
        session.stream_agent = stream_agent
        return session

    def _done(self, name, what):
        with self.cond:
            self.in_flight -= 1
            self.events.append((what, name))


def local_hosts(tmp_path: Path, n: int, extra: str = ""):
    text = "hosts:\n" + "".join(f"  h{i}:\n    connection: local\n" for i in range(n))
    return hosts(tmp_path, text + extra)


def test_forks_bounds_the_hosts_connecting_at_once(tmp_path: Path) -> None:
    inv = local_hosts(tmp_path, 5)
    factory = Counting(gate=3)  # without the bound a third open would come at once
    fleet = LiveFleet(list(inv), 0.5, forks=2, session_factory=factory)
    fleet.start()
    try:
        assert wait(fleet.answered, 60)
        assert all(v.result is not None for v in fleet.view())
    finally:
        fleet.stop()
    assert factory.most == 2, factory.events


def test_a_connect_slot_is_held_until_the_first_line(tmp_path: Path) -> None:
    inv = local_hosts(tmp_path, 3)
    factory = Counting()
    fleet = LiveFleet(list(inv), 0.5, forks=1, session_factory=factory)
    fleet.start()
    try:
        assert wait(fleet.answered, 60)
    finally:
        fleet.stop()
    firsts = factory.events[:6]
    for at in range(0, 6, 2):  # each open followed by its own first line, before the next open
        assert firsts[at][0] == "open" and firsts[at + 1] == ("line", firsts[at][1]), firsts
    assert {name for _, name in firsts} == {"h0", "h1", "h2"}


def test_a_failed_connect_gives_its_slot_back(tmp_path: Path) -> None:
    inv = local_hosts(tmp_path, 2)
    factory = Counting(fail=("h0",))
    fleet = LiveFleet(list(inv), 0.5, forks=1, session_factory=factory)
    fleet.start()
    try:  # h0 fails, is retried (its slot came back), and h1 still gets its snapshot
        assert wait(lambda: factory.opens.get("h0", 0) >= 2 and fleet.answered(), 60)
        h0, h1 = fleet.view()
        assert h0.failure is not None and h0.failure.kind == "refused" and h0.result is None
        assert h1.result is not None
    finally:
        fleet.stop()


def test_without_forks_every_host_connects_at_once(tmp_path: Path) -> None:
    inv = local_hosts(tmp_path, 3)
    factory = Counting(gate=3, gate_s=20)
    fleet = LiveFleet(list(inv), 0.5, session_factory=factory)
    fleet.start()
    try:
        assert wait(fleet.answered, 60)
    finally:
        fleet.stop()
    assert factory.most == 3


def test_the_first_document_waits_one_timeout_per_wave_of_forks(tmp_path: Path) -> None:
    from gpufleet.cli.watch import first_round_limit

    inv = local_hosts(tmp_path, 5, "defaults:\n  connect_timeout: 2\n  command_timeout: 3\n")
    assert first_round_limit(inv, 32) == 5.0  # one wave
    assert first_round_limit(inv, 2) == 15.0  # h0 h1 | h2 h3 | h4
    assert first_round_limit(inv, 5) == 5.0


def test_on_result_sees_each_snapshot_before_it_is_published(tmp_path: Path) -> None:
    """The CLI renders a host's part of the next document in the host's thread (on_result);
    it must have run by the time the snapshot is visible, and a failing hook drops nothing."""
    inv = hosts(tmp_path, "hosts:\n  here:\n    connection: local\n")
    seen: list = []
    published_first: list = []

    def hook(result) -> None:
        if fleet.view()[0].result is result:
            published_first.append(result)
        seen.append(result)
        raise RuntimeError("a broken hook")

    fleet = LiveFleet(list(inv), 0.2, on_result=hook)
    fleet.start()
    try:
        assert wait(lambda: len(seen) >= 2)
        assert wait(lambda: fleet.view()[0].result in seen)
        assert fleet.view()[0].state(time.monotonic()) == UP  # the hook's error changed nothing
        assert not published_first
    finally:
        fleet.stop()


class LineTimes(Counting):
    """Counting, and every line's (time, host, watch_seq)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.lines: list[tuple[float, str, int]] = []
        self.pids: list = []  # each line's agent pid

    def __call__(self, host):
        session = super().__call__(host)
        real = session.stream_agent

        def stream_agent(request, timeout=None):
            stream = real(request, timeout)
            readline = stream.readline

            def timed(timeout):
                line = readline(timeout)
                if line is not None:
                    import json

                    doc = json.loads(line)
                    seq = doc.get("watch_seq", -1)
                    with self.cond:
                        self.lines.append((time.monotonic(), host.name, seq))
                        self.pids.append((doc.get("facts") or {}).get("agent_pid"))
                return line
            stream.readline = timed
            return stream
        session.stream_agent = stream_agent
        return session


def first_round(tmp_path: Path, **fleet_kw) -> tuple[list, float]:
    """Three local hosts connecting one at a time (forks=1, each open 0.5 s late: the gate
    never opens), 0.1 s interval, until each has a second snapshot: (every line sorted, when
    the last host's first line came)."""
    inv = local_hosts(tmp_path, 3)
    factory = LineTimes(gate=2, gate_s=0.5)
    fleet = LiveFleet(list(inv), 0.1, forks=1, session_factory=factory, **fleet_kw)
    fleet.start()
    try:
        assert wait(lambda: len({h for _, h, s in factory.lines if s >= 1}) == 3, 30)
    finally:
        fleet.stop()
    lines = sorted(factory.lines)
    return lines, max(t for t, _, s in lines if s == 0)


def test_refreshes_wait_until_every_host_has_answered_once(tmp_path: Path) -> None:
    """hold_first_s: no host's second snapshot comes before the last host's first, and once
    all have answered the refreshes start at once (``go``), long before the 30 s hold."""
    lines, last_first = first_round(tmp_path, hold_first_s=30.0)
    first_second = min(t for t, _, s in lines if s == 1)
    assert first_second >= last_first, lines
    assert max(t for t, _, s in lines if s == 1) - last_first < 5.0, lines


def test_without_hold_the_first_hosts_refresh_while_others_connect(tmp_path: Path) -> None:
    """The same fleet without the hold: h0 refreshes before h2 has answered (what the hold
    prevents; so the test above can fail)."""
    lines, last_first = first_round(tmp_path)
    assert min(t for t, _, s in lines if s == 1) < last_first, lines


def test_a_host_that_reconnects_after_the_first_round_is_not_held(tmp_path: Path) -> None:
    """Its new agent gets ``go`` with its first line (the round is long over): it refreshes
    at the interval again instead of waiting out hold_first_s."""
    import os
    import signal

    inv = local_hosts(tmp_path, 1)
    factory = LineTimes()
    fleet = LiveFleet(list(inv), 0.1, session_factory=factory, hold_first_s=60.0)
    fleet.start()
    try:
        assert wait(lambda: any(s >= 2 for _, _, s in factory.lines), 30)
        first_pid = factory.pids[0]
        os.kill(first_pid, signal.SIGKILL)  # the agent this test's fleet started
        assert wait(lambda: any(p not in (None, first_pid) for p in factory.pids), 30)
        new_pid = next(p for p in factory.pids if p not in (None, first_pid))
        assert wait(lambda: sum(1 for p in factory.pids if p == new_pid) >= 3, 10), factory.lines
    finally:
        fleet.stop()
