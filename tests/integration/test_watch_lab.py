"""`gpufleet status --watch SECONDS --json` against lab hosts: NDJSON per interval from ONE
resident agent per host, and no agent left on any host whatever happens to the controller
(SIGTERM, SIGKILL, its connection cut), a host whose sshd dies shown stale and back.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import assert_one_line_error, home, run_gpufleet  # noqa: F401  (fixture)
from watch_helpers import (
    Watch,
    agents_on,
    host_of,
    ppid_of,
    start_sshd,
    stop_sshd_and_sessions,
    wait_gone,
)

STATUS_HOST_KEYS = {"host", "ok", "error", "seconds", "facts", "gpus", "holders", "warnings"}


@pytest.fixture
def watched(lab: Any, make_host: Any, home: Path) -> Any:
    host = make_host("watch-a", gpus=2)
    host.holder = host.spawn_holder(gpus=[1], mib=3000, title="trainer")
    other = make_host("watch-b", gpus=1)
    inv = lab.inventory_yaml([host, other, lab.dead_host("watch-dead")], connect_timeout=2)
    watch = Watch(home, inv, 1.0)
    yield host, other, watch
    watch.stop()


def test_ndjson_one_document_per_interval_from_one_resident_agent(watched: Any) -> None:
    host, other, watch = watched
    docs = [watch.doc() for _ in range(3)]
    assert [d["seq"] for d in docs] == [0, 1, 2]
    pids = set()
    for doc in docs:
        a = host_of(doc, "watch-a")
        assert STATUS_HOST_KEYS <= set(a) and (a["state"], a["stale"], a["ok"]) == ("up", False, True)
        assert [g["memory_used_mib"] for g in a["gpus"]] == host.gpu_used() == [0, 3000]
        assert [p["pid"] for p in a["gpus"][1]["processes"]] == [host.holder]
        assert a["age_s"] is not None and a["age_s"] < 3.0
        pids.add(a["facts"]["agent_pid"])
        dead = host_of(doc, "watch-dead")
        assert (dead["ok"], dead["state"], dead["error_kind"]) == (False, "down", "refused")
        assert host_of(doc, "watch-b")["state"] == "up"
    assert len(pids) == 1, "one resident agent, not one exec per document: %s" % pids
    assert agents_on(host) == sorted(pids)
    # the numbers follow the host: the holder goes, the next documents say so
    host.kill(host.holder)
    watch.until(lambda d: [g["memory_used_mib"] for g in host_of(d, "watch-a")["gpus"]] == [0, 0],
                timeout=10, what="GPU 1 freed")


def test_sigterm_ends_the_watch_and_every_agent(watched: Any) -> None:
    host, other, watch = watched
    doc = watch.doc()
    pids = [(host, host_of(doc, "watch-a")["facts"]["agent_pid"]),
            (other, host_of(doc, "watch-b")["facts"]["agent_pid"])]
    watch.signal(signal.SIGTERM)
    assert watch.proc.wait(timeout=15) == 0
    for h, pid in pids:
        assert wait_gone(h, pid, 10), "agent %d left on %s" % (pid, h.name)
        assert agents_on(h) == []


def test_sigkill_of_the_controller_leaves_no_agent(watched: Any) -> None:
    """Killed without a chance to close anything: the TCP connection closes, sshd closes the
    agent's stdin, the agent ends on EOF."""
    host, other, watch = watched
    doc = watch.doc()
    pids = [(host, host_of(doc, "watch-a")["facts"]["agent_pid"]),
            (other, host_of(doc, "watch-b")["facts"]["agent_pid"])]
    watch.signal(signal.SIGKILL)
    watch.proc.wait(timeout=10)
    for h, pid in pids:  # each agent on its own EOF: wait for both, not one then look
        assert wait_gone(h, pid, 10), "agent left on %s after SIGKILL of the controller" % h.name
    assert agents_on(host) == [] and agents_on(other) == []


def test_connection_cut_the_agent_ends_itself_and_the_host_comes_back(watched: Any) -> None:
    """The host's end of the connection stops passing anything (its sshd session process is
    stopped: no EOF, no keep-alive, as when the network goes). The agent ends by its
    keep-alive deadline (5 s at a 1 s interval); the host shows stale within two intervals;
    once the session process runs again the controller reconnects: a new agent."""
    host, other, watch = watched
    pid = host_of(watch.doc(), "watch-a")["facts"]["agent_pid"]
    session = ppid_of(host, pid)
    assert host.comm(session).startswith("sshd")
    host.kill(session, signal.SIGSTOP)
    try:
        cut = time.monotonic()
        stale = watch.until(lambda d: host_of(d, "watch-a")["state"] == "stale", timeout=10,
                            what="watch-a stale")
        a = host_of(stale, "watch-a")
        assert a["stale"] and not a["ok"] and a["gpus"], a  # the last numbers, marked stale
        assert time.monotonic() - cut < 2 * 1.0 + 3.0  # two intervals (+1 s slack +1 s a line)
        assert wait_gone(host, pid, 15), "agent still running with its connection cut"
        assert host_of(watch.doc(), "watch-b")["state"] == "up"  # the others are unaffected
    finally:
        host.kill(session, signal.SIGCONT)
    back = watch.until(lambda d: host_of(d, "watch-a")["state"] == "up", timeout=40,
                       what="watch-a back up")
    assert host_of(back, "watch-a")["facts"]["agent_pid"] != pid
    assert len(agents_on(host)) == 1


def test_a_host_whose_sshd_dies_is_stale_and_back_when_it_returns(watched: Any) -> None:
    host, other, watch = watched
    pid = host_of(watch.doc(), "watch-a")["facts"]["agent_pid"]
    stop_sshd_and_sessions(host, pid)
    killed = time.monotonic()
    doc = watch.until(lambda d: host_of(d, "watch-a")["state"] == "stale", timeout=10,
                      what="watch-a stale")
    assert time.monotonic() - killed < 2 * 1.0 + 1.0
    assert host_of(doc, "watch-a")["error_kind"] in ("closed", "command", "refused"), doc
    assert wait_gone(host, pid, 10)  # stdin closed with its session
    doc = watch.until(lambda d: host_of(d, "watch-a")["error_kind"] == "refused", timeout=15,
                      what="reconnect refused while sshd is down")
    assert host_of(doc, "watch-a")["age_s"] > 0
    start_sshd(host)
    back = watch.until(lambda d: host_of(d, "watch-a")["state"] == "up", timeout=60,
                       what="watch-a back")
    assert host_of(back, "watch-a")["facts"]["agent_pid"] != pid


def test_a_local_host_agent_ends_with_the_controller(tmp_path: Path, home: Path) -> None:
    """`connection: local`: the agent is a child process; SIGKILL of the CLI closes its pipe."""
    import os

    inv = tmp_path / "fleet.yaml"
    inv.write_text("hosts:\n  here:\n    connection: local\n")
    watch = Watch(home, inv, 0.5)
    try:
        pid = host_of(watch.doc(), "here")["facts"]["agent_pid"]
        os.kill(pid, 0)  # running
        watch.signal(signal.SIGKILL)
        watch.proc.wait(timeout=10)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                state = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0]
            except OSError:
                break
            if state == "Z":
                break
            time.sleep(0.05)
        else:
            raise AssertionError("local agent %d still running" % pid)
    finally:
        watch.stop()


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf"])
def test_bad_interval_is_one_line_and_connects_nowhere(lab_host: Any, lab: Any, home: Path,
                                                       value: str) -> None:
    inv = lab.inventory_yaml([lab_host])
    before = (lab_host.dir / "sshd.log").read_text().count("Accepted publickey")
    run = run_gpufleet(home, inv, "status", "--watch", value, "--json", timeout=30)
    assert_one_line_error(run, "--watch must be a number of seconds > 0")
    time.sleep(0.3)
    assert (lab_host.dir / "sshd.log").read_text().count("Accepted publickey") == before


def test_text_watch_prints_the_table_each_interval_and_ends_when_stdout_closes(
        lab: Any, make_host: Any, home: Path) -> None:
    import subprocess

    from watch_helpers import cli_env
    from cli_helpers import GPUFLEET

    host = make_host("watch-text", gpus=1)
    inv = lab.inventory_yaml([host])
    proc = subprocess.Popen(GPUFLEET + ["-i", str(inv), "status", "--watch", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(home),
                            cwd=str(home))
    try:
        assert proc.stdout is not None
        seen = []
        while len([ln for ln in seen if "(every 0.5s; Ctrl-C ends)" in ln]) < 2:
            seen.append(proc.stdout.readline().decode())
        assert any(ln.split()[:2] == ["watch-text", "0"] for ln in seen), seen
        [agent] = agents_on(host)
        proc.stdout.close()  # `| head`: the next print fails, the watch ends, streams close
        assert proc.wait(timeout=15) == 1
        assert wait_gone(host, agent, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
