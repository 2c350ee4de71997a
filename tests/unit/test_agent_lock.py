"""The clean's host lock, on the host's side (gpufleet/remote/lock.py).

The lock must be a file only the agent's own user could have created or opened: these tests
make directories and files another user owns (chown to 65534), writable by others, links and
FIFOs, and check each is refused; and parse /proc/locks as the kernel writes it (checked on
this machine: ``1: FLOCK  ADVISORY  WRITE 8605 fe:00:2146450 0 EOF``, a waiter with ``->``).
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from gpufleet.remote import lock

from test_agent_run import (  # noqa: E402  (tests/unit is on sys.path under pytest)
    Stub,
    agent_env,
    children,  # noqa: F401  (fixture)
    clean_request,
    gpu_app,
    run_agent,
    starttime,
)

EUID = os.geteuid()
OTHER = 65534
needs_root = pytest.mark.skipif(EUID != 0, reason="chown to another uid needs root")


# ------------------------------------------------------------------- /proc/locks


def test_a_flock_holder_line_is_parsed_with_hex_device_numbers() -> None:
    assert lock.parse_lock_line("1: FLOCK  ADVISORY  WRITE 8605 fe:00:2146450 0 EOF\n") == {
        "type": "FLOCK", "access": "WRITE", "pid": 8605, "major": 0xfe, "minor": 0,
        "inode": 2146450, "waiting": False}
    parsed = lock.parse_lock_line("12: FLOCK  ADVISORY  READ 77 103:1a:99 0 EOF")
    assert (parsed["major"], parsed["minor"], parsed["inode"]) == (0x103, 0x1a, 99)


def test_a_waiter_line_is_marked_waiting_and_odd_lines_are_none() -> None:
    waiter = lock.parse_lock_line("1: -> FLOCK  ADVISORY  WRITE 8609 fe:00:2146450 0 EOF")
    assert waiter is not None and waiter["waiting"] and waiter["pid"] == 8609
    posix = lock.parse_lock_line("3: POSIX  ADVISORY  WRITE 900 00:19:12 0 EOF")
    assert posix is not None and posix["type"] == "POSIX"
    for odd in ("", "garbage", "1: FLOCK ADVISORY WRITE 5 <none>:0 0 EOF",
                "1: FLOCK  ADVISORY  WRITE x fe:00:1 0 EOF", "FLOCK ADVISORY WRITE 5 fe:00:1 0"):
        assert lock.parse_lock_line(odd) is None, odd


def _fake_proc(tmp_path: Path, locks: str, pid: int, target: str) -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid) / "fd").mkdir(parents=True)
    (proc / "locks").write_text(locks)
    (proc / str(pid) / "status").write_text("Name:\tholder\nUid:\t0\t0\t0\t0\n")
    (proc / str(pid) / "cmdline").write_bytes(b"flock\x00/run/gpufleet/clean.lock\x00sleep\x00600\x00")
    os.symlink(target, proc / str(pid) / "fd" / "3")
    return proc


def test_the_holder_is_the_flock_line_of_that_file_not_a_waiter_or_another_file(
        tmp_path: Path) -> None:
    dev = os.makedev(0xfe, 0x01)
    locks = ("1: FLOCK  ADVISORY  WRITE 55 fe:01:4242 0 EOF\n"  # another file
             "2: POSIX  ADVISORY  WRITE 66 fe:01:777 0 EOF\n"  # fcntl locks never block flock
             "3: -> FLOCK  ADVISORY  WRITE 88 fe:01:777 0 EOF\n"  # waiting, not holding
             "3: FLOCK  ADVISORY  WRITE 31 fe:01:777 0 EOF\n")
    proc = _fake_proc(tmp_path, locks, 31, "/run/gpufleet/clean.lock")
    assert lock.lock_holder("/run/gpufleet/clean.lock", dev, 777, str(proc)) == {
        "pid": 31, "uid": 0, "user": "root",
        "cmdline": "flock /run/gpufleet/clean.lock sleep 600", "open": True}
    assert lock.lock_holder("/run/gpufleet/clean.lock", dev, 778, str(proc)) is None


def test_a_holder_pid_that_no_longer_has_the_file_open_is_said_so(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, "1: FLOCK  ADVISORY  WRITE 31 fe:01:777 0 EOF\n", 31, "/dev/null")
    holder = lock.lock_holder("/run/gpufleet/clean.lock", os.makedev(0xfe, 1), 777, str(proc))
    assert holder is not None and holder["open"] is False


def test_a_holder_in_another_pid_namespace_shows_as_pid_0(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, "1: FLOCK  ADVISORY  WRITE 0 fe:01:777 0 EOF\n", 31, "/x")
    assert lock.lock_holder("/x", os.makedev(0xfe, 1), 777, str(proc))["pid"] == 0


def test_a_real_holder_is_found_in_this_machines_proc_locks(tmp_path: Path, children: Any) -> None:
    path = str(tmp_path / "clean.lock")
    fd = lock.open_lock(path, EUID)
    os.close(fd)
    script = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
              "fcntl.flock(fd, fcntl.LOCK_EX); print('ready', flush=True); time.sleep(60)")
    holder = children([sys.executable, "-c", script, path, "lock-test-marker"])
    st = os.stat(path)
    found = lock.lock_holder(path, st.st_dev, st.st_ino)
    assert found is not None and found["pid"] == holder.pid and found["uid"] == EUID
    assert found["cmdline"].endswith(path + " lock-test-marker") and found["open"] is True


# ------------------------------------------------------------------- ownership checks


def test_ownership_problem_names_links_types_owners_and_modes(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    f = d / "f"
    f.write_text("")
    os.chmod(f, 0o600)
    link = tmp_path / "link"
    link.symlink_to(d)
    assert lock.ownership_problem(os.lstat(d), EUID, True) is None
    assert lock.ownership_problem(os.lstat(f), EUID, False) is None
    assert lock.ownership_problem(os.lstat(link), EUID, True) == "is a symbolic link"
    assert lock.ownership_problem(os.lstat(f), EUID, True) == "is not a directory"
    assert lock.ownership_problem(os.lstat(d), EUID, False) == "is not a regular file"
    assert lock.ownership_problem(os.lstat(d), EUID + 1, True) == \
        "is owned by uid %d, not by the agent's uid %d" % (EUID, EUID + 1)
    for mode in (0o770, 0o702, 0o1777):
        os.chmod(d, mode)
        assert lock.ownership_problem(os.lstat(d), EUID, True) == \
            "is writable by group or others (mode %04o)" % mode


def test_open_lock_makes_a_private_directory_and_file(tmp_path: Path) -> None:
    path = tmp_path / "gpufleet" / "clean.lock"
    os.close(lock.open_lock(str(path), EUID))
    assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == EUID
    os.close(lock.open_lock(str(path), EUID))  # and takes them again


def _refusal(path: Path, euid: int = EUID) -> tuple[str, str]:
    with pytest.raises(lock.LockRefused) as info:
        lock.open_lock(str(path), euid)
    return info.value.kind, info.value.reason


def test_a_directory_others_may_write_or_own_or_a_link_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # /tmp
    assert _refusal(shared / "clean.lock") == (
        "unsafe_dir", "%s is writable by group or others (mode 1777)" % shared)
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert _refusal(tmp_path / "link" / "clean.lock") == (
        "unsafe_dir", "%s is a symbolic link" % (tmp_path / "link"))
    assert not (tmp_path / "real" / "clean.lock").exists()
    assert _refusal(tmp_path / "real" / "clean.lock", EUID + 1)[1].startswith(
        "%s is owned by uid %d" % (tmp_path / "real", EUID))


@needs_root
def test_a_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER, OTHER)
    assert _refusal(theirs / "clean.lock") == (
        "unsafe_dir", "%s is owned by uid %d, not by the agent's uid 0" % (theirs, OTHER))


@needs_root
def test_a_lock_file_another_user_owns_or_may_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "gpufleet"
    d.mkdir(mode=0o711)
    path = d / "clean.lock"
    path.write_text("")
    os.chown(path, OTHER, OTHER)
    assert _refusal(path) == ("unsafe_file", "%s is owned by uid %d, not by the agent's uid 0"
                              % (path, OTHER))
    os.chown(path, 0, 0)
    os.chmod(path, 0o666)
    assert _refusal(path) == ("unsafe_file", "%s is writable by group or others (mode 0666)"
                              % path)


def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    d = tmp_path / "gpufleet"
    d.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text("")
    (d / "clean.lock").symlink_to(target)
    assert _refusal(d / "clean.lock") == ("unsafe_file", "%s is a symbolic link" % (d / "clean.lock"))
    (d / "dangling.lock").symlink_to(tmp_path / "nothing-here")
    assert _refusal(d / "dangling.lock")[0] == "unsafe_file"
    assert not (tmp_path / "nothing-here").exists()  # O_CREAT did not follow the link
    os.mkfifo(d / "fifo.lock", 0o600)
    assert _refusal(d / "fifo.lock") == ("unsafe_file", "%s is not a regular file" % (d / "fifo.lock"))


def test_a_relative_or_missing_lock_path_is_refused(tmp_path: Path) -> None:
    assert _refusal(Path("clean.lock"))[0] == "unsafe_path"
    assert _refusal(tmp_path / "no" / "such" / "clean.lock")[0] == "os_error"


# ------------------------------------------------------------------- where the lock lives


def _owned_dir(path: Path, uid: int, mode: int = 0o700) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    os.chown(path, uid, uid)
    return path


def test_root_locks_in_run_gpufleet_whatever_the_environment() -> None:
    assert lock.default_lock_path(0, {"XDG_RUNTIME_DIR": "/tmp"}) == "/run/gpufleet/clean.lock"


@needs_root
def test_a_user_locks_in_their_own_runtime_directory_else_nowhere(tmp_path: Path) -> None:
    uid = 4242424
    mine = _owned_dir(tmp_path / "xdg", uid)
    assert lock.default_lock_path(uid, {"XDG_RUNTIME_DIR": str(mine)}) == \
        str(mine) + "/gpufleet/clean.lock"
    open_to_all = _owned_dir(tmp_path / "open", uid, 0o777)
    for env, told in (({}, "XDG_RUNTIME_DIR is not set"),
                      ({"XDG_RUNTIME_DIR": "run/me"}, "'run/me' is not an absolute path"),
                      ({"XDG_RUNTIME_DIR": str(open_to_all)}, "is writable by group or others"),
                      ({"XDG_RUNTIME_DIR": str(tmp_path)}, "is owned by uid 0"),
                      ({"XDG_RUNTIME_DIR": "/tmp"}, "/tmp is owned by uid 0")):
        with pytest.raises(lock.LockRefused) as info:
            lock.default_lock_path(uid, env)
        assert info.value.kind == "no_runtime_dir" and told in info.value.reason, env
        assert "/run/user/%d cannot be used" % uid in info.value.reason


# ------------------------------------------------------------------- the agent's clean


def test_a_clean_with_a_lock_in_a_world_writable_directory_signals_nothing(
        tmp_path: Path, children: Any) -> None:
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}],
        lock_path=str(shared / "clean.lock")), env=agent_env(tmp_path))
    assert doc["lock"] == "refused" and doc["signals"] == [] and doc["after"] is None
    assert doc["lock_path"] == str(shared / "clean.lock")
    assert doc["lock_refused"] == {"kind": "unsafe_dir", "path": str(shared),
                                   "reason": "%s is writable by group or others (mode 1777)"
                                   % shared}
    assert doc["error"].endswith("; nothing was signalled")
    assert h.poll() is None


def test_a_busy_clean_names_the_holder(tmp_path: Path, children: Any) -> None:
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    path = str(tmp_path / "clean.lock")
    fd, _ = lock.acquire_lock(path, 0.0)
    try:
        doc = run_agent(clean_request(tmp_path, stub, [
            {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}], lock_wait_s=0.2),
            env=agent_env(tmp_path))
    finally:
        os.close(fd)
    assert doc["lock"] == "busy" and doc["signals"] == [] and doc["lock_path"] == path
    assert doc["lock_holder"]["pid"] == os.getpid() and doc["lock_holder"]["open"] is True
    assert h.poll() is None


@needs_root
def test_a_user_agent_without_a_runtime_directory_refuses_rather_than_use_tmp(
        tmp_path: Path, children: Any) -> None:
    if os.path.exists("/run/user/%d" % OTHER) or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs /usr/bin/python3 and no /run/user/%d on this machine" % OTHER)
    h = children.holder()
    req = clean_request(tmp_path, Stub(tmp_path / "stub", apps=[gpu_app(h)]), [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}], lock_path=None,
        nvidia_smi="/nonexistent/nvidia-smi", scope=[])
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    as_nobody = dict(python="/usr/bin/python3", user=OTHER, group=OTHER, extra_groups=[], cwd="/")
    doc = run_agent(req, env=env, **as_nobody)
    assert doc["lock"] == "refused" and doc["lock_refused"]["kind"] == "no_runtime_dir", doc
    assert doc["signals"] == [] and h.poll() is None
    xdg = tempfile.mkdtemp(prefix="gpufleet-test-xdg-")  # reachable by uid 65534, unlike tmp_path
    try:
        os.chown(xdg, OTHER, OTHER)
        doc = run_agent(dict(req, targets=[]), env=dict(env, XDG_RUNTIME_DIR=xdg), **as_nobody)
        assert doc["lock"] == "acquired", doc.get("error")
        assert doc["lock_path"] == xdg + "/gpufleet/clean.lock"
        assert os.lstat(doc["lock_path"]).st_uid == OTHER
    finally:
        shutil.rmtree(xdg)
