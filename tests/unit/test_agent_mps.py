"""The agent asks a CUDA MPS control daemon for its lists (gpufleet/remote/mps.py).

The daemon is asked through its own binary with its own pipe directory, and only when that
directory is one no other user could have made or changed: these tests make directories
another user owns (chown to 65534), writable by others, links, and a fake /proc whose daemon
runs a root-owned stand-in of nvidia-cuda-mps-control answering as the real one did on the
H200 (probe-1.log part C: get_server_list '908\\n', get_client_list 908 '891\\n').
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpufleet.remote import mps
from gpufleet.remote.jobs import Deadline

EUID = os.geteuid()
OTHER = 65534
needs_root = pytest.mark.skipif(EUID != 0, reason="chown to another uid needs root")

# A stand-in for the control client: a command on stdin, the recorded answers on stdout; it
# leaves the pipe directory it was given in a file there.
CONTROL = """#!/bin/sh
read cmd
echo "$CUDA_MPS_PIPE_DIRECTORY" > "$CUDA_MPS_PIPE_DIRECTORY/asked"
case "$cmd" in
  get_server_list) echo 908 ;;
  "get_client_list 908") echo 891; echo 892 ;;
  *) echo "bad $cmd" >&2; exit 3 ;;
esac
"""


def fake_proc(tmp: Path, pipe_dir: str, env: bytes, control: str = CONTROL) -> Path:
    """/proc with one daemon, PID 888: its exe (a root-owned 0755 file named
    nvidia-cuda-mps-control), environ, stat (start time 4242) and root (a directory tree)."""
    proc = tmp / "proc"
    d = proc / "888"
    (d / "root").mkdir(parents=True)
    bindir = tmp / "bin"
    bindir.mkdir(mode=0o755)
    exe = bindir / "nvidia-cuda-mps-control"
    exe.write_text(control)
    exe.chmod(0o755)
    (d / "exe").symlink_to(exe)
    (d / "environ").write_bytes(env)
    (d / "stat").write_text("888 (nvidia-cuda-mps) S 1 888 888 0 -1 4194560 0 0 0 0 0 0 0 0 "
                            "20 0 1 0 4242 0 0\n")
    os.chmod(tmp, 0o755)
    (d / "root" / pipe_dir.lstrip("/")).mkdir(parents=True, mode=0o755)
    return proc


def test_the_pipe_directory_comes_from_the_daemons_environment(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "/run/mps", b"PATH=/bin\0CUDA_MPS_PIPE_DIRECTORY=/run/mps\0")
    assert mps.mps_pipe_dir(888, str(proc)) == "/run/mps"
    (proc / "888" / "environ").write_bytes(b"PATH=/bin\0HOME=/root\0")
    assert mps.mps_pipe_dir(888, str(proc)) == "/tmp/nvidia-mps"  # NVIDIA's default
    assert mps.mps_pipe_dir(999, str(proc)) is None  # not readable: not guessed


@needs_root
def test_a_pipe_directory_someone_else_could_make_or_change_is_not_trusted(tmp_path: Path
                                                                            ) -> None:
    root = tmp_path / "r"
    (root / "tmp").mkdir(parents=True)
    os.chmod(root / "tmp", 0o1777)
    mine = root / "tmp" / "nvidia-mps"
    mine.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    os.chmod(root, 0o755)
    assert mps.mps_dir_problem(str(root), "/tmp/nvidia-mps", 0) is None
    assert "not the daemon's uid 1000" in mps.mps_dir_problem(str(root), "/tmp/nvidia-mps", 1000)
    os.chown(mine, OTHER, OTHER)  # a user made it before the daemon started
    assert "owned by uid 65534" in mps.mps_dir_problem(str(root), "/tmp/nvidia-mps", 0)
    os.chown(mine, 0, 0)
    os.chmod(mine, 0o777)
    assert "may write it" in mps.mps_dir_problem(str(root), "/tmp/nvidia-mps", 0)
    os.chmod(mine, 0o755)
    (root / "tmp" / "link").symlink_to(mine)
    assert "not a directory" in mps.mps_dir_problem(str(root), "/tmp/link", 0)
    assert "plain absolute" in mps.mps_dir_problem(str(root), "tmp/nvidia-mps", 0)
    assert "plain absolute" in mps.mps_dir_problem(str(root), "/tmp/x/../nvidia-mps", 0)
    os.chmod(root / "tmp", 0o777)  # not sticky: anyone may rename it away and put another
    assert "/tmp may be changed" in mps.mps_dir_problem(str(root), "/tmp/nvidia-mps", 0)


@needs_root
def test_the_daemon_is_asked_through_its_own_binary_and_its_pipe_directory(tmp_path: Path
                                                                            ) -> None:
    proc = fake_proc(tmp_path, "/run/mps", b"CUDA_MPS_PIPE_DIRECTORY=/run/mps\0")
    entry = {"pid": 888, "uid": 0, "starttime": 4242}
    got = mps.mps_ask_daemon(888, entry, Deadline(20), str(proc))
    assert got == {"pid": 888, "pipe_dir": "/run/mps", "pipe_dir_trusted": True,
                   "servers": [{"pid": 908, "clients": [891, 892]}], "error": None}
    seen = proc / "888" / "root" / "run" / "mps"
    assert (seen / "asked").read_text().strip() == str(seen)  # the daemon's own view of it
    # another process by now (a reused PID): not asked
    got = mps.mps_ask_daemon(888, dict(entry, starttime=1), Deadline(20), str(proc))
    assert got["servers"] is None and got["error"] == "the daemon exited"


@needs_root
def test_an_executable_others_may_write_is_never_run(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "/run/mps", b"CUDA_MPS_PIPE_DIRECTORY=/run/mps\0")
    exe = tmp_path / "bin" / "nvidia-cuda-mps-control"
    exe.chmod(0o777)
    got = mps.mps_ask_daemon(888, {"pid": 888, "uid": 0, "starttime": 4242}, Deadline(20),
                             str(proc))
    assert got["servers"] is None and got["error"] == "its executable is not root's"
    assert not (proc / "888" / "root" / "run" / "mps" / "asked").exists()


@needs_root
def test_a_daemon_that_does_not_answer_is_bounded(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, "/run/mps", b"CUDA_MPS_PIPE_DIRECTORY=/run/mps\0",
                     control="#!/bin/sh\nexec sleep 60\n")
    started = time.monotonic()
    got = mps.mps_ask_daemon(888, {"pid": 888, "uid": 0, "starttime": 4242}, Deadline(20),
                             str(proc))
    assert time.monotonic() - started < mps.MPS_ASK_TIMEOUT_S + 1.5
    assert got["servers"] is None and "no answer within" in got["error"]


def test_answers_are_pids_one_a_line_or_an_error() -> None:
    assert mps.mps_pids("908\n", "get_server_list") == ([908], None)
    assert mps.mps_pids("", "get_server_list") == ([], None)
    pids, why = mps.mps_pids("891\nCannot find MPS control daemon\n", "get_client_list 908")
    assert pids is None and "unexpected answer" in why


def test_only_root_binaries_named_like_the_daemon_are_daemons() -> None:
    procs = {
        "888": {"pid": 888, "exe": "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
                "exe_root": True},
        "908": {"pid": 908, "exe": "/usr/local/nvidia/bin/nvidia-cuda-mps-server",
                "exe_root": True},
        "77": {"pid": 77, "exe": "/data/a/nvidia-cuda-mps-control", "exe_root": False},
        "78": {"pid": 78, "exe": "/usr/bin/python3.11", "exe_root": True},
        "79": {"pid": 79, "exe": None, "exe_root": None},
    }
    assert mps.mps_daemons(procs) == [888]
