"""`gpufleet slurm epilog|prolog` on a lab host, run the way slurmd runs them (as root, inside
the node, with only Slurm's variables in the environment: no PATH, no HOME) but without a
scheduler, for what needs no Slurm daemons: another user's holder on the job's GPUs, the
syslog line, the dcgm-exporter job map, the budget, bad input. test_slurm_lab.py has the real
cluster."""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any, Iterator

import pytest

from cli_helpers import REPO_ROOT

pytestmark = pytest.mark.lab


def run_node(host: Any, command: str, env: dict, *args: str, timeout: float = 60) -> Any:
    """The command as slurmd would start it: an environment of Slurm's variables only."""
    argv = ["env", "-i", "PYTHONPATH=%s" % REPO_ROOT] + ["%s=%s" % kv for kv in env.items()]
    argv += [sys.executable, "-m", "gpufleet", "slurm", command] + list(args)
    started = time.monotonic()
    res = host.exec(argv, timeout=timeout)
    res.seconds = time.monotonic() - started
    return res


def job_env(job_id: int, uid: int, gpus: str) -> dict:
    return dict(SLURM_JOB_ID=str(job_id), SLURM_JOB_UID=str(uid), SLURM_JOB_GPUS=gpus,
                SLURMD_NODENAME="n", SLURM_SCRIPT_CONTEXT="epilog_slurmd")


def uid_of(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid


@pytest.fixture
def node(make_host: Any) -> Any:
    return make_host(gpus=4)


@pytest.fixture
def syslog_socket(node: Any) -> Iterator[socket.socket]:
    """The node's /dev/log (its /dev is private): a datagram socket the test reads."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(node.path("/dev/log"))
    sock.bind(path)
    os.chmod(path, 0o666)
    sock.settimeout(5)
    try:
        yield sock
    finally:
        sock.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def test_another_users_holder_on_the_job_gpu_is_refused_and_reported(node: Any, lab: Any) -> None:
    user = lab.user
    mine = node.spawn_holder(gpus=[0], mib=716, title="VLLM::Worker", user=user, via="exec")
    theirs = node.spawn_holder(gpus=[1], mib=500, title="someone", user="root", via="exec")
    res = run_node(node, "epilog", job_env(42, uid_of(user), "0,1"), "--budget", "8",
                   "--grace", "1", "--no-syslog", "--audit-log", "/tmp/audit.jsonl")
    audit = node.path("/tmp/audit.jsonl")  # the node's private /tmp
    assert res.returncode == 1, res
    assert not node.alive(mine) and node.alive(theirs)
    line = res.stderr.strip().splitlines()[-1]
    assert line == ("gpufleet: GPU 1: 500 MiB held by pid %d someone (uid 0): owned by root "
                    "(uid 0), not the job's user (uid %d)" % (theirs, uid_of(user))), res.stderr
    every = [json.loads(x) for x in audit.read_text().splitlines()]
    records = [r for r in every if r.get("event") != "verdict"]  # the signals' lines
    assert {r["pid"] for r in records} == {mine}
    assert all(r["job_id"] == "42" and r["job_user"] == user and r["job_uid"] == uid_of(user)
               and r["operator"].startswith("slurm-epilog job 42 user %s" % user) for r in every)
    assert [r["verdict"] for r in every if r.get("event") == "verdict"] == ["dirty"]
    assert node.gpu_used()[0] == 0 and node.gpu_used()[1] == 500
    node.kill(theirs)


def test_epilog_line_goes_to_syslog_and_nothing_to_clean_is_quick(node: Any,
                                                                   syslog_socket: Any) -> None:
    res = run_node(node, "epilog", job_env(7, 0, "2,3"))
    assert res.returncode == 0, res
    got = syslog_socket.recv(4096).decode()
    assert got.startswith("<30>") and "gpufleet[" in got  # daemon.info
    assert "gpufleet: job 7: GPU 2,3 free (nothing left to signal)" in got
    held = node.spawn_holder(gpus=[2], mib=300, title="stuck", ignore_term=True, via="exec")
    node.set_config(release_delay_s=600.0)
    try:
        res = run_node(node, "epilog", job_env(8, 0, "2,3"), "--budget", "10", "--grace", "1")
    finally:
        node.set_config(release_delay_s=0.0)
    assert res.returncode == 1, res
    assert res.seconds < 10 + 2.5, res.seconds  # inside the budget (+ interpreter start-ups)
    got = syslog_socket.recv(4096).decode()
    assert got.startswith("<27>")  # daemon.err
    assert "gpufleet: GPU 2: 300 MiB used, no process holds it (expected at most 64 MiB) " \
           "after KILL" in got, got
    assert not node.alive(held)


def test_prolog_writes_and_epilog_removes_the_dcgm_job_map(node: Any) -> None:
    d = "/run/dcgm-job-map"
    assert run_node(node, "prolog", job_env(11, 0, "0,1"), "--dcgm-job-map", d,
                    "--no-syslog").returncode == 0
    assert run_node(node, "prolog", job_env(12, 0, "1"), "--dcgm-job-map", d,
                    "--no-syslog").returncode == 0
    assert node.path(d + "/0").read_text() == "11\n"
    assert node.path(d + "/1").read_text() == "11\n12\n"
    assert run_node(node, "epilog", job_env(11, 0, "0,1"), "--dcgm-job-map", d,
                    "--no-syslog").returncode == 0
    assert not node.path(d + "/0").exists()
    assert node.path(d + "/1").read_text() == "12\n"


def test_prolog_refuses_held_gpus_and_passes_free_ones(node: Any) -> None:
    holder = node.spawn_holder(gpus=[3], mib=1024, title="leftover", via="exec")
    res = run_node(node, "prolog", job_env(5, 0, "3"), "--no-syslog")
    assert res.returncode == 1
    assert res.stderr.strip() == ("gpufleet: GPU 3: 1024 MiB held by pid %d leftover (uid 0) "
                                  "before job 5" % holder), res.stderr
    assert node.alive(holder)  # the prolog signals nothing
    assert run_node(node, "prolog", job_env(5, 0, "0-2"), "--no-syslog").returncode == 0
    node.kill(holder)


def test_prolog_refuses_a_job_on_a_critical_gpu(make_host: Any) -> None:
    """The health gate (`gpufleet health`'s CRITICAL): uncorrected ECC errors on GPU 1 refuse a job there, not on GPU 0."""
    sick = make_host(gpus=2, ecc_volatile={"1": 2}, ecc_aggregate={"1": 2})
    res = run_node(sick, "prolog", job_env(6, 0, "1"), "--no-syslog")
    assert res.returncode == 1, res
    line = res.stderr.strip()
    assert line.startswith("gpufleet: ") and "health:" in line and "before job 6" in line, line
    assert "ecc" in line.lower(), line
    assert run_node(sick, "prolog", job_env(6, 0, "0"), "--no-syslog").returncode == 0


@pytest.mark.parametrize("env,words", [
    ({}, "not running under Slurm: SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": "9", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "0,9"}, "GPU 9 does not exist"),
    ({"SLURM_JOB_ID": "9", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "zero"}, "'zero' is not a GPU"),
    ({"SLURM_JOB_ID": "9", "SLURM_JOB_UID": "31337", "SLURM_JOB_GPUS": "0"}, "no passwd entry"),
])
def test_bad_input_signals_nothing(node: Any, env: dict, words: str) -> None:
    holder = node.spawn_holder(gpus=[0], mib=700, title="leftover", via="exec")
    res = run_node(node, "epilog", env, "--no-syslog", "--audit-log", "/tmp/audit.jsonl")
    audit = node.path("/tmp/audit.jsonl")
    assert res.returncode == 2, res
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: ") and words in lines[0], res
    assert "Traceback" not in res.stderr
    if env:
        assert "configuration is at fault" in lines[0]
    assert node.alive(holder) and not audit.exists()
    node.kill(holder)
