"""An unprivileged user on a GPU host tries to steer a root gpufleet.

Each test plays the attacker as uid 65534 (``nobody``) on a lab host, or from this machine with
``setpriv --reuid=65534 --regid=65534 --clear-groups`` where the kernel object is shared (the
cgroup tree), and checks that root's gpufleet acts on evidence only: systemd's own answer for
units, the runtime's own cgroups for containers, the sshd binary for sshd.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cgroup_helpers import CgroupTree, cgroups, systemd_knows  # noqa: F401 (fixture)
from cli_helpers import run_gpufleet

pytestmark = pytest.mark.lab

NOBODY_UID = 65534
NOBODY = ["setpriv", "--reuid=%d" % NOBODY_UID, "--regid=%d" % NOBODY_UID, "--clear-groups"]
FAST = ("--grace", "1", "--timeout", "15")


def as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(NOBODY + list(argv), capture_output=True, text=True, timeout=30)


def user_manager(cgroups: CgroupTree, host: Any, pid: int) -> str:
    """The subtree systemd delegates to uid 65534 (its own ``user@65534.service``), with the
    user's process in it, as systemd --user would have started it."""
    manager = cgroups.make("user.slice/user-%d.slice/user@%d.service" % (NOBODY_UID, NOBODY_UID),
                           owner=NOBODY_UID)
    Path(manager, "cgroup.procs").write_text(str(host.outer_pid(pid)))
    return manager


def join_own_cgroup(manager: str, rel: str, outer_pid: int) -> str:
    """The attacker, as uid 65534, names a cgroup of its own and moves its process there."""
    script = ("import os, sys\n"
              "d = os.path.join(sys.argv[1], sys.argv[2])\n"
              "os.makedirs(d, exist_ok=True)\n"
              "open(os.path.join(d, 'cgroup.procs'), 'w').write(sys.argv[3])\n")
    res = as_nobody("/usr/bin/python3", "-c", script, manager, rel, str(outer_pid))
    assert res.returncode == 0, res.stderr
    return os.path.join(manager, rel)


def test_a_user_cgroup_named_like_a_system_unit_never_stops_that_unit(
        lab: Any, make_host: Any, tmp_path: Path, cgroups: CgroupTree, request: Any) -> None:
    host = make_host("cron-host", gpus=2, path_prefix="/root/bin")
    request.addfinalizer(host.stop)  # before the cgroups are removed
    real_cron = cgroups.make("system.slice/cron.service")
    holder = host.spawn_holder(gpus=[0], mib=3000, title="train", user="nobody", via="exec")
    manager = user_manager(cgroups, host, holder)
    systemd_knows(host, "cron", cgroups.control_group(real_cron), gpus=[], mib=0)
    systemd_knows(host, "user@%d" % NOBODY_UID, cgroups.control_group(manager), gpus=[], mib=0)
    join_own_cgroup(manager, "app.slice/cron.service", host.outer_pid(holder))
    assert host.path("/proc/%d/cgroup" % holder).read_text().rstrip().endswith(
        "/user@65534.service/app.slice/cron.service")
    inv = lab.inventory_yaml([host])

    status = run_gpufleet(tmp_path, inv, "status", "--json").host("cron-host")
    proc = status["gpus"][0]["processes"][0]
    assert proc["pid"] == holder
    assert proc["unit"] != "cron.service"
    assert (proc["user_unit"], proc["user_unit_uid"]) == ("cron.service", NOBODY_UID)

    run = run_gpufleet(tmp_path, inv, "clean", "--all", "--gpus", "0", "--stop-units", "--disable-units",
                       "--yes", "--json", *FAST)
    doc = run.host("cron-host")
    assert doc["units_stopped"] == []
    refused = {r["pid"]: r["reason"] for r in doc["refused"]}
    assert "uid 65534's own systemd" in refused[holder]
    assert "systemctl --user -M 65534@ stop cron.service" in refused[holder]
    calls = host.path("/root/units/calls.log").read_text().splitlines()
    assert not [c for c in calls if c.split()[-1:] == ["cron.service"] and
                ("stop" in c.split() or "disable" in c.split())], calls
    assert host.alive(holder)


def test_a_user_scope_named_like_a_container_is_no_container(
        lab: Any, make_host: Any, tmp_path: Path, cgroups: CgroupTree, request: Any) -> None:
    host = make_host("scope-host", gpus=2, path_prefix="/root/bin")
    request.addfinalizer(host.stop)
    holder = host.spawn_holder(gpus=[1], mib=2000, title="job", user="nobody", via="exec")
    manager = user_manager(cgroups, host, holder)
    systemd_knows(host, "user@%d" % NOBODY_UID, cgroups.control_group(manager), gpus=[], mib=0)
    fake = "docker-" + "ab12" * 16 + ".scope"
    join_own_cgroup(manager, "user.slice/" + fake, host.outer_pid(holder))
    inv = lab.inventory_yaml([host])

    status = run_gpufleet(tmp_path, inv, "status", "--json").host("scope-host")
    proc = status["gpus"][1]["processes"][0]
    assert proc["pid"] == holder and proc["container"] is None

    run = run_gpufleet(tmp_path, inv, "clean", "--all", "--gpus", "1", "--yes", "--json", *FAST)
    doc = run.host("scope-host")
    assert [t["pid"] for t in doc["targets"]] == [holder], json.dumps(doc)[:2000]
    assert doc["verdict"] == "clean" and run.rc == 0, str(run)
    assert not host.alive(holder)


def test_a_job_titled_like_sshd_is_no_sshd(lab: Any, make_host: Any, tmp_path: Path) -> None:
    """A per-session sshd runs as the user it serves ("sshd: alice@pts/3"), so the title and
    the owner prove nothing; the executable does. A user's GPU job with that title is a
    target, and the plan says what it claims to be."""
    host = make_host("sshd-claim", gpus=2)
    job = host.spawn_holder(gpus=[1], mib=9000, title="sshd: alice@pts/3", user="nobody",
                            via="exec")
    assert host.comm(job).startswith("sshd")
    inv = lab.inventory_yaml([host])

    plan = run_gpufleet(tmp_path, inv, "clean", "--all", "--gpus", "1", "--dry-run", *FAST)
    assert plan.rc == 0, str(plan)
    assert "claims to be sshd" in plan.stdout, plan.stdout
    assert "sshd (never signalled)" not in plan.stdout

    run = run_gpufleet(tmp_path, inv, "clean", "--all", "--gpus", "1", "--yes", "--json", *FAST)
    doc = run.host("sshd-claim")
    assert [t["pid"] for t in doc["targets"]] == [job], json.dumps(doc)[:2000]
    assert doc["verdict"] == "clean" and run.rc == 0, str(run)
    assert not host.alive(job) and host.gpu_used()[1] == 0
