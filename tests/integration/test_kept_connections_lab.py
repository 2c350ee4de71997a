"""SSH connections kept between commands (``ssh_persist``, on by default: 60 s), against real
sshd lab hosts. The inventories here leave ``ssh_persist`` unset: what they show is the default.

A host's first ``ssh`` becomes an OpenSSH master (ControlMaster=auto, ControlPersist) whose
socket is in gpufleet's private directory; the next command's runs and streams go through it
(each an ``ssh`` client of the master, after ``ssh -O check`` says it answers: a hung master is
passed by within the connect timeout), with no new connection: counted where it happens, in
each host's sshd log at VERBOSE ("Accepted publickey" per connection, "Starting session:
command" per exec). Every master a test started is ended through its control socket
(`gpufleet disconnect`, or tests/conftest.py's ``kept_ssh`` after the test); a master stopped
with SIGSTOP is one whose PID its master reported.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import GPUFLEET, REPO_ROOT, home, run_gpufleet  # noqa: F401  (home: fixture)
from test_clean_conversation_lab import VERBOSE, host_agents, log_mark, sessions_since
from watch_helpers import Watch

FAST = ("--grace", "1", "--timeout", "15")


@pytest.fixture
def kept_dir(kept_ssh: Path, monkeypatch: Any, home: Path) -> Path:
    """Where the test's masters are: the socket directory in tests/conftest.py's ``kept_ssh``
    runtime directory (which ends them after the test); HOME for in-process calls."""
    from gpufleet.transport import kept

    monkeypatch.setenv("HOME", str(home))
    kept._warned.clear()
    return kept_ssh / "gpufleet-ssh"


@pytest.fixture
def host(make_host: Any) -> Any:
    h = make_host(gpus=2, sshd_extra=VERBOSE + "\nAcceptEnv GFTEST_*")
    h.holder = h.spawn_holder(gpus=[0], mib=900, title="VLLM::Worker")
    return h


def master_pid(host: Any) -> Any:
    from gpufleet.config.inventory import load_inventory
    from gpufleet.transport import keptlist, sshcontrol

    path = keptlist.socket_of(load_inventory(host.inventory).get(host.name))
    return path, (sshcontrol.check(path, 5).pid if path else None)


def status(home: Path, inv: Path, host: Any) -> dict:
    run = run_gpufleet(home, inv, "status", "--json")
    assert run.rc == 0, str(run)
    return run.host(host.name)


def test_the_next_command_joins_the_kept_connection(kept_dir: Path, host: Any, lab: Any,
                                                    home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    mark = log_mark(host)
    first = status(home, inv, host)
    assert sessions_since(host, mark) == (1, 1)
    path, pid = master_pid(host)
    assert pid is not None and os.path.dirname(path) == str(kept_dir)
    st = os.lstat(kept_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    for _ in range(2):
        mark = log_mark(host)
        again = status(home, inv, host)
        assert sessions_since(host, mark) == (0, 1)  # an exec, no connection
        assert [p["pid"] for p in again["gpus"][0]["processes"]] == [host.holder]
        assert again["gpus"][0]["processes"] == first["gpus"][0]["processes"]
    assert master_pid(host)[1] == pid


def test_verbose_says_how_each_run_reached_the_host(kept_dir: Path, host: Any, lab: Any,
                                                   home: Path) -> None:
    """-v: the first command's run is the ``ssh`` that becomes the kept master; the next
    command's joins it (the master's PID named); stdout is the same document as without -v."""
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    first = run_gpufleet(home, inv, "-v", "status", "--json")
    assert first.rc == 0, str(first)
    path, pid = master_pid(host)
    assert pid is not None
    assert (f"gpufleet: {host.name}: run with an ssh process that becomes the kept master "
            f"{path}: exit 0 after ") in first.stderr, first.stderr
    again = run_gpufleet(home, inv, "-v", "status", "--json")
    assert again.rc == 0, str(again)
    assert (f"gpufleet: {host.name}: run through the kept master {path} (its ssh joins master "
            f"pid {pid}, no handshake): exit 0 after ") in again.stderr, again.stderr
    for run in (first, again):
        assert [p["pid"] for p in run.host(host.name)["gpus"][0]["processes"]] == [host.holder]


def test_clean_plans_and_acts_over_the_kept_connection(kept_dir: Path, host: Any, lab: Any,
                                                       home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    status(home, inv, host)
    mark = log_mark(host)
    run = run_gpufleet(home, inv, "clean", "--all", "--gpus", "0", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    row = run.host(host.name)
    assert row["verdict"] == "clean", row
    assert [(s["pid"], s["outcome"]) for s in row["signals"]] == [(host.holder, "sent")]
    assert not host.alive(host.holder)
    assert sessions_since(host, mark) == (0, 1)  # one exec: the plan and the act
    assert host_agents(host) == []


def test_a_watch_streams_over_the_kept_connection(kept_dir: Path, host: Any, lab: Any,
                                                  home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    status(home, inv, host)
    mark = log_mark(host)
    watch = Watch(home, inv, 0.5)
    try:
        docs = [watch.doc(), watch.doc()]
        for doc in docs:
            (row,) = [h for h in doc["hosts"] if h["host"] == host.name]
            assert [p["pid"] for p in row["gpus"][0]["processes"]] == [host.holder]
        assert sessions_since(host, mark) == (0, 1)
        assert len(host_agents(host)) == 1
    finally:
        watch.signal(signal.SIGTERM)
        watch.proc.wait(timeout=20)
        watch.stop()
    end = time.monotonic() + 10
    while host_agents(host) and time.monotonic() < end:
        time.sleep(0.1)
    assert host_agents(host) == []  # the agent ended with its stream


def test_disconnect_lists_and_closes_them(kept_dir: Path, host: Any, lab: Any,
                                          home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    status(home, inv, host)
    path, pid = master_pid(host)
    listed = run_gpufleet(home, inv, "disconnect", "--list", "--all")
    assert listed.rc == 0, str(listed)
    assert listed.stdout.splitlines() == [f"{host.name}: kept (master pid {pid})",
                                          "1 kept connection"]
    assert master_pid(host)[1] == pid  # --list closes nothing
    # no selection, no inventory: every socket of the user, named by the host it reaches
    # (its label), never by its hashed socket name alone
    named = f"{host.name} (root@127.0.0.1:{host.port})"
    listed = run_gpufleet(home, None, "disconnect", "--list")
    assert listed.stdout.splitlines() == [f"{named}: kept (master pid {pid})",
                                          "1 kept connection"], str(listed)
    closed = run_gpufleet(home, None, "disconnect")
    assert closed.rc == 0, str(closed)
    assert closed.stdout.splitlines() == [f"{named}: closed (master pid {pid})",
                                          "1 kept connection closed"]
    end = time.monotonic() + 10
    while os.path.exists("/proc/%d" % pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not os.path.exists("/proc/%d" % pid) and not os.path.exists(path)
    assert run_gpufleet(home, None, "disconnect").stdout.strip() == "no kept connections"
    mark = log_mark(host)
    status(home, inv, host)  # connects again, and keeps that one
    assert sessions_since(host, mark) == (1, 1)
    assert master_pid(host)[1] not in (None, pid)


def test_a_stale_socket_is_replaced(kept_dir: Path, host: Any, lab: Any, home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    path, pid = master_pid(host)
    assert pid is None
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file nobody listens on: a master that died without cleaning up
    stale.close()
    mark = log_mark(host)
    status(home, inv, host)
    assert sessions_since(host, mark) == (1, 1)
    assert master_pid(host)[1] is not None


def test_a_master_that_does_not_answer_is_bypassed(kept_dir: Path, host: Any, lab: Any,
                                                   home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml", connect_timeout=2)
    status(home, inv, host)
    path, pid = master_pid(host)
    os.kill(pid, signal.SIGSTOP)  # the master this test's CLI started (its own PID report)
    try:
        mark = log_mark(host)
        started = time.monotonic()
        run = run_gpufleet(home, inv, "-v", "status", "--json")
        took = time.monotonic() - started
        assert run.rc == 0, str(run)
        row = run.host(host.name)
        assert (f"{host.name}: run with an ssh process of its own (the kept master {path} does "
                "not answer)") in run.stderr, run.stderr
        assert [p["pid"] for p in row["gpus"][0]["processes"]] == [host.holder]
        assert sessions_since(host, mark) == (1, 1)  # a connection of its own
        assert took < 15, took  # the kept one's 2 s, not the command timeout
    finally:
        os.kill(pid, signal.SIGCONT)
    assert master_pid(host)[1] == pid


def test_a_lost_connection_is_the_host_down_not_a_hang(kept_dir: Path, host: Any, lab: Any,
                                                       home: Path) -> None:
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    status(home, inv, host)
    path, pid = master_pid(host)
    host.stop()  # sshd and every session with it: the master's connection ends
    end = time.monotonic() + 10
    while os.path.exists("/proc/%d" % pid) and time.monotonic() < end:
        time.sleep(0.05)
    run = run_gpufleet(home, inv, "status", "--json")
    assert run.rc != 0
    row = run.host(host.name)
    assert row["error_kind"] == "refused", row


def test_runs_through_the_master_give_what_ssh_gives(kept_dir: Path, host: Any, lab: Any,
                                                     home: Path) -> None:
    """Exit status, stdout, stderr, stdin of any size, SendEnv, and the timeout: the first run
    (ssh, which becomes the master) and the second (an ssh client of that master) alike."""
    from gpufleet.config.inventory import load_inventory
    from gpufleet.transport import TransportError, open_session
    from gpufleet.transport.openssh import OpensshSession

    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    (home / ".ssh" / "config").write_text("SendEnv GFTEST_*\n")
    os.environ["GFTEST_WORD"] = "it's a $word"
    try:
        inv = lab.inventory_yaml([host], path=home / "fleet.yaml")
        h = load_inventory(inv).get(host.name)
        shell = ["sh", "-c", 'printf "%s|" "$GFTEST_WORD"; wc -c; echo oops >&2; exit 3']
        big = os.urandom(3 << 20)
        results = []
        for connections in (1, 0):
            mark = log_mark(host)
            session = open_session(h)
            assert isinstance(session, OpensshSession) and session.target is not None
            assert session.target.kept is not None
            got = session.run_argv(shell, stdin=big, timeout=30)
            results.append((got.exit_code, got.stdout.strip(), got.stderr.strip()))
            assert sessions_since(host, mark) == (connections, 1)
        assert results[0] == results[1] == (3, b"it's a $word|%d" % len(big), b"oops"), results
        session = open_session(h)
        started = time.monotonic()
        with pytest.raises(TransportError, match="sleep timed out after 1.5s"):
            session.run_argv(["sleep", "30"], timeout=1.5)
        assert time.monotonic() - started < 6
    finally:
        del os.environ["GFTEST_WORD"]


def test_a_directory_others_can_enter_turns_it_off(kept_dir: Path, host: Any, lab: Any,
                                                   home: Path) -> None:
    kept_dir.mkdir(mode=0o700)
    os.chmod(kept_dir, 0o755)
    inv = lab.inventory_yaml([host], path=home / "fleet.yaml")
    for _ in range(2):
        mark = log_mark(host)
        run = run_gpufleet(home, inv, "status", "--json")
        assert run.rc == 0, str(run)
        assert sessions_since(host, mark) == (1, 1)
        assert run.stderr.count("ssh_persist is off for this run") == 1, run.stderr
        assert f"{kept_dir} is mode 0755, not 0700" in run.stderr
    assert os.listdir(kept_dir) == []


def test_ssh_persist_0_keeps_nothing(kept_dir: Path, host: Any, lab: Any, home: Path) -> None:
    inv = lab.inventory_yaml([host], path=home / "fleet.yaml", ssh_persist=0)
    for _ in range(2):
        mark = log_mark(host)
        status(home, inv, host)
        assert sessions_since(host, mark) == (1, 1)
    assert not kept_dir.exists()


def test_a_runbook_runs_every_step_over_one_kept_connection(kept_dir: Path, host: Any, lab: Any,
                                                            home: Path) -> None:
    """A runbook's session runs several commands: with ssh_persist it opens no master of its
    own (transport/sshmaster.py's, which ends with the command) but keeps the one it made."""
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    book = home / "two.yaml"
    book.write_text("steps:\n  - {name: one, kind: shell, argv: [\"true\"]}\n"
                    "  - {name: two, kind: assert, that: {free_fraction_min: 0.1}}\n")
    for connections in (1, 0):
        mark = log_mark(host)
        run = run_gpufleet(home, inv, "run", str(book), "--all", "--json", "--yes")
        assert run.rc == 0, str(run)
        outcomes = [s["outcome"] for s in run.json()["hosts"][0]["steps"]]
        assert outcomes == ["ok", "ok"], run.stdout
        got = sessions_since(host, mark)
        assert got[0] == connections and got[1] >= 2, got
    assert master_pid(host)[1] is not None


def test_disconnect_says_what_it_could_not_close(kept_dir: Path, host: Any, lab: Any,
                                                 home: Path) -> None:
    """A stale socket is removed; a master that does not answer (stopped by this test, by the
    PID it reported) is left in place, and said to be."""
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    status(home, inv, host)
    path, pid = master_pid(host)
    os.kill(pid, signal.SIGSTOP)
    try:
        run = run_gpufleet(home, inv, "disconnect", "--all")
        assert run.rc == 0, str(run)
        assert run.stdout.splitlines() == [f"{host.name}: no master answers: left in place",
                                           "0 kept connections closed"]
        assert os.path.exists(path)
    finally:
        os.kill(pid, signal.SIGCONT)
    os.kill(pid, 0)  # still there: nothing signalled it
    assert master_pid(host)[1] == pid
    closed = run_gpufleet(home, inv, "disconnect", "--all")
    assert closed.stdout.splitlines()[0] == f"{host.name}: closed (master pid {pid})"
    stale = socket.socket(socket.AF_UNIX)
    end = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)
    stale.bind(path)
    stale.close()
    again = run_gpufleet(home, inv, "disconnect", "--all")
    assert again.stdout.splitlines() == [f"{host.name}: no master answers: socket removed",
                                         "0 kept connections closed"]
    assert not os.path.exists(path)


def master_checks(path: str) -> bool:
    """OpenSSH's own word that a master answers at ``path`` (``ssh -O check``)."""
    return subprocess.run(["ssh", "-o", f"ControlPath={path}", "-O", "check", "kept"],
                          capture_output=True, timeout=15).returncode == 0


def cli_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUFLEET_INVENTORY", "SSH_AUTH_SOCK")}
    return dict(env, HOME=str(home), PYTHONPATH=str(REPO_ROOT))


def master_stdio(pid: int) -> list[str]:
    """Where the master's stdin, stdout and stderr go, and whether it holds any pipe."""
    fds = {int(n): os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")}
    return [fds.get(0, ""), fds.get(1, ""), fds.get(2, "")] + sorted(
        f for n, f in fds.items() if n > 2 and f.startswith("pipe:"))


def close_and_check_gone(home: Path, path: str, pid: int) -> None:
    assert run_gpufleet(home, None, "disconnect").rc == 0
    end = time.monotonic() + 10
    while os.path.exists("/proc/%d" % pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not os.path.exists("/proc/%d" % pid) and not master_checks(path)


@pytest.mark.parametrize("verbose", [False, True], ids=["plain", "-v"])
def test_a_kept_master_never_holds_the_clis_output(kept_dir: Path, host: Any, lab: Any,
                                                   home: Path, verbose: bool) -> None:
    """A program capturing gpufleet's stdout and stderr through pipes sees both end when the
    CLI ends, not when the master it left (kept 60 s) does: the master's stdin, stdout and
    stderr are /dev/null (OpenSSH's control_persist_detach; gpufleet's -v is its own log and
    passes no -v to ssh, which would keep stderr) and it holds no pipe of ours."""
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    assert master_pid(host)[1] is None
    argv = GPUFLEET + ["-i", str(inv)] + (["-v"] if verbose else []) + ["status"]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env(home), cwd=str(home))
    out, err = proc.communicate(timeout=120)  # returns at EOF on both pipes, and the exit
    took = time.monotonic() - started
    assert proc.returncode == 0, err
    assert host.name in out.decode() and (b"kept master" in err) == verbose, err
    assert took < 20, f"the pipes ended {took:.1f}s after the start (the master keeps 60 s)"
    path, pid = master_pid(host)
    assert pid is not None and master_checks(path)  # the master outlived the CLI
    assert master_stdio(pid) == ["/dev/null"] * 3
    close_and_check_gone(home, path, pid)


def test_a_pipe_to_a_reader_that_stops_early_ends_with_the_cli(kept_dir: Path, host: Any,
                                                               lab: Any, home: Path) -> None:
    """`gpufleet status | head -1`, run by a shell whose output is captured: the pipeline
    ends with the CLI (head took its line and left; the CLI's own writes end), the master
    stays, answering ``ssh -O check``."""
    inv = host.inventory = lab.inventory_yaml([host], path=home / "fleet.yaml")
    line = shlex.join(GPUFLEET + ["-i", str(inv), "status"]) + " | head -1"
    started = time.monotonic()
    res = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=120,
                         env=cli_env(home), cwd=str(home))
    took = time.monotonic() - started
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 1, res
    assert took < 20, f"the pipeline ended {took:.1f}s after the start (the master keeps 60 s)"
    path, pid = master_pid(host)
    assert pid is not None and master_checks(path)
    close_and_check_gone(home, path, pid)


def test_a_new_host_keeps_its_connection_by_default(kept_dir: Path, host: Any, lab: Any,
                                                    home: Path) -> None:
    """No ``ssh_persist`` anywhere, no XDG_RUNTIME_DIR: kept, quietly, in the cache
    directory (the fallback says nothing)."""
    inv = lab.inventory_yaml([host], path=home / "fleet.yaml")
    env = {k: v for k, v in cli_env(home).items() if k not in ("XDG_RUNTIME_DIR", "XDG_CACHE_HOME")}
    cache = kept_dir.parent / "cache"
    env["XDG_CACHE_HOME"] = str(cache)  # a short one: a socket path has 108 bytes
    try:
        for connections in (1, 0):
            mark = log_mark(host)
            res = subprocess.run(GPUFLEET + ["-i", str(inv), "status"], capture_output=True,
                                 text=True, timeout=120, env=env, cwd=str(home))
            assert res.returncode == 0 and res.stderr == "", res
            assert sessions_since(host, mark) == (connections, 1)
        (sock,) = [p for p in (cache / "gpufleet" / "ssh").iterdir() if p.is_socket()]
        assert master_checks(str(sock))
        closed = subprocess.run(GPUFLEET + ["disconnect"], capture_output=True, text=True,
                                timeout=60, env=env, cwd=str(home))
        assert closed.stdout.splitlines()[-1] == "1 kept connection closed", closed
    finally:  # tests/conftest.py's kept_ssh looks in the runtime directory only
        from gpufleet.transport import keptlist

        for sock in (cache / "gpufleet" / "ssh").glob("*"):
            if sock.is_socket():
                keptlist.close_kept(str(sock))
