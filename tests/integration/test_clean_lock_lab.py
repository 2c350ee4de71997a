"""The host's clean lock against users who must not be able to hold it, end to end.

An unprivileged user could once create and flock the lock in world-writable /tmp and make
every root clean answer "busy". Here a lab user (uid 65534, as the security review did) plays
that attacker; and a root process that really holds the lock must be named in the busy
message. Every process a test starts is recorded by PID and killed by that PID.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable

import pytest

from cli_helpers import (
    assert_no_traceback,
    home,  # noqa: F401  (fixture)
    run_gpufleet,
    wait_for,
)

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
LOCK_DIR = "/run/gpufleet"
LOCK = LOCK_DIR + "/clean.lock"
OLD_LOCK = "/tmp/gpufleet-clean.lock"

# Holds an exclusive flock on argv[1] until killed; argv[2] gets {"pid", "tried": {...}}: with
# argv[3], the outcome (ok or errno name) of each attempt to plant that lock directory first.
HOLDER = r"""
import errno, fcntl, json, os, sys, time
tried = {}
plant = sys.argv[3:]
for name, make in plant and (
        ("mkdir " + plant[0], lambda: os.mkdir(plant[0], 0o777)),
        ("create " + plant[0] + "/clean.lock",
         lambda: os.close(os.open(plant[0] + "/clean.lock", os.O_RDWR | os.O_CREAT, 0o666)))):
    try:
        make()
        tried[name] = "ok"
    except OSError as exc:
        tried[name] = errno.errorcode.get(exc.errno, str(exc.errno))
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
with open(sys.argv[2] + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "tried": tried}, f)
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
time.sleep(600)
"""

# What uid 65534 can do to the real lock once a clean made it: open, create beside, list.
PROBE = r"""
import errno, json, os
out = {}
for name, act in (("open", lambda: os.close(os.open("/run/gpufleet/clean.lock", os.O_RDONLY))),
                  ("create", lambda: os.close(os.open("/run/gpufleet/x", os.O_RDWR | os.O_CREAT, 0o666))),
                  ("list", lambda: os.listdir("/run/gpufleet"))):
    try:
        act()
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(out))
"""


def clean(home: Path, inv: Path, *args: str) -> Any:
    return run_gpufleet(home, inv, "clean", "--all", "--yes", "--json", "--grace", "0.5",
                        "--audit-log", str(home / "audit.jsonl"), *args, timeout=120)


@pytest.fixture
def started(make_host: Any) -> Any:
    """Start detached HOLDER processes in a host (``prefix``: setpriv to another user) and
    kill each by its recorded PID at the end."""
    pids: list[tuple[Any, int]] = []

    def start(host: Any, lock: str, prefix: tuple[str, ...] = (), report: str = "/tmp/holder.json",
              plant: tuple[str, ...] = ()) -> dict[str, Any]:
        detached = ["setsid", "-f", "python3", "-c", HOLDER, lock, report, *plant]
        host.exec(["sh", "-c", 'exec "$@" </dev/null >/dev/null 2>&1', "sh", *prefix, *detached],
                  check=True)
        wait_for(lambda: host.path(report).exists(), 30, "the lock holder to start")
        doc = json.loads(host.path(report).read_text())
        pids.append((host, int(doc["pid"])))
        return doc

    yield start
    for host, pid in pids:
        if host.running:
            host.kill(pid)
            host.wait_gone(pid)


def test_a_user_holding_the_old_tmp_lock_blocks_no_root_clean_and_cannot_hold_the_real_one(
        lab: Any, make_host: Any, home: Path, started: Callable[..., dict[str, Any]]) -> None:
    host = make_host("shared-tmp", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=1200, title="leftover")
    attacker = started(host, OLD_LOCK, tuple(NOBODY), plant=(LOCK_DIR,))
    assert attacker["tried"] == {"mkdir /run/gpufleet": "EACCES",
                                 "create /run/gpufleet/clean.lock": "ENOENT"}, attacker
    assert os.stat(host.path(OLD_LOCK)).st_uid == 65534

    run = clean(home, lab.inventory_yaml([host]), "--timeout", "5")
    assert_no_traceback(run)
    assert run.rc == 0, str(run)
    doc = run.host("shared-tmp")
    assert doc["verdict"] == "clean", str(run)
    assert [(s["pid"], s["outcome"]) for s in doc["signals"]] == [(job, "sent")]
    assert not host.alive(job) and host.gpu_used() == [0]
    assert host.alive(attacker["pid"])  # it held its flock the whole time, to no effect

    for path, mode in ((LOCK_DIR, stat.S_IFDIR | 0o700), (LOCK, stat.S_IFREG | 0o600)):
        st = os.lstat(host.path(path))
        assert (st.st_uid, st.st_mode) == (0, mode), (path, oct(st.st_mode))
    probe = host.exec([*NOBODY, "python3", "-c", PROBE], check=True)
    assert json.loads(probe.stdout) == {"open": "EACCES", "create": "EACCES", "list": "EACCES"}


def _dir_of_nobody(host: Any) -> None:
    """A lock directory someone handed to uid 65534, who planted the lock file in it."""
    host.exec(["install", "-d", "-m", "0755", "-o", "65534", "-g", "65534", LOCK_DIR], check=True)


def _file_of_nobody(host: Any) -> None:
    """root's directory (others may pass through, not write), but a lock file that uid 65534
    owns (left by a chown, a restore) and so can open and flock."""
    host.exec(["install", "-d", "-m", "0711", LOCK_DIR], check=True)
    host.exec(["install", "-m", "0644", "-o", "65534", "-g", "65534", "/dev/null", LOCK],
              check=True)


def _link_to_tmp(host: Any) -> None:
    """The lock file is a symbolic link into /tmp, where uid 65534 holds the target."""
    host.exec(["install", "-d", "-m", "0700", LOCK_DIR], check=True)
    host.exec(["ln", "-s", OLD_LOCK, LOCK], check=True)


@pytest.mark.parametrize("plant, holds, why", [
    (_dir_of_nobody, LOCK, "/run/gpufleet is owned by uid 65534"),
    (_file_of_nobody, LOCK, "/run/gpufleet/clean.lock is owned by uid 65534"),
    (_link_to_tmp, OLD_LOCK, "/run/gpufleet/clean.lock is a symbolic link"),
], ids=["dir-owned-by-user", "file-owned-by-user", "file-is-a-symlink"])
def test_a_lock_someone_else_could_hold_is_refused_and_nothing_is_signalled(
        lab: Any, make_host: Any, home: Path, started: Callable[..., dict[str, Any]],
        plant: Callable[[Any], None], holds: str, why: str) -> None:
    host = make_host("planted", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=900, title="job")
    plant(host)
    started(host, holds, tuple(NOBODY))

    run = clean(home, lab.inventory_yaml([host]), "--timeout", "5")
    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    doc = run.host("planted")
    assert doc["verdict"] == "error" and doc["ok"] is False, str(run)
    assert why in doc["error"] and "nothing was signalled" in doc["error"], doc["error"]
    assert "\n" not in doc["error"]
    assert doc["signals"] == []
    assert host.alive(job) and host.gpu_used() == [900]
    assert run.seconds < 30  # refused at once, not after waiting for the lock


def test_the_real_lock_held_by_a_root_process_is_busy_and_names_the_holder(
        lab: Any, make_host: Any, home: Path, started: Callable[..., dict[str, Any]]) -> None:
    host = make_host("locked-box", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=1000, title="job")
    host.exec(["install", "-d", "-m", "0700", LOCK_DIR], check=True)
    holder = started(host, LOCK)
    cmdline = " ".join(host.cmdline(holder["pid"]))
    assert cmdline.startswith("python3 -c ")
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--timeout", "1")
    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    doc = run.host("locked-box")
    assert doc["verdict"] == "busy" and doc["ok"] is False, str(run)
    error = doc["error"]
    assert "PID %d" % holder["pid"] in error and "user root" in error, error
    assert "python3 -c import errno, fcntl, json, os, sys, time" in error, error
    assert error.endswith("; nothing was signalled") and "\n" not in error, error
    assert doc["signals"] == []
    assert {k: doc["lock_holder"][k] for k in ("pid", "uid", "user", "open")} == {
        "pid": holder["pid"], "uid": 0, "user": "root", "open": True}
    assert host.alive(job) and host.gpu_used() == [1000]

    text = run_gpufleet(home, inv, "clean", "--all", "--yes", "--grace", "0.5", "--timeout", "1",
                        "--audit-log", str(home / "audit.jsonl"), timeout=120)
    assert text.rc == 1 and "PID %d" % holder["pid"] in text.output, str(text)

    assert host.kill(holder["pid"]) and host.wait_gone(holder["pid"])
    again = clean(home, inv, "--timeout", "15")
    assert again.rc == 0 and again.host("locked-box")["verdict"] == "clean", str(again)
    assert not host.alive(job)
