"""Remote-side faults: no or old python3, a missing, failing, hanging, garbled or lying
nvidia-smi, thousands of processes, holders that vanish or whose PID is reused between plan
and signal, a user without root, sudo that wants a password.

Every case asserts the row, the verdict, the exit code and exactly which processes of the
host are alive afterwards (faultkit.assert_gone_exactly). Broken nvidia-smi variants that the
lab's fake driver does not have are small wrappers around it, placed in the host and named by
the inventory's ``nvidia_smi`` key.
"""
from __future__ import annotations

import shlex
import signal
from pathlib import Path
from typing import Any

import pytest

from faultkit import (
    FAKE_SUDO,
    agent_audit,
    agents_left,
    assert_gone_exactly,
    assert_no_traceback,
    audit_log,
    census,
    install_bins,
    install_old_python,
    real_python,
    reuse_pid,
    run_cli,
    run_on_pty,
    settle,
    signals,
    start_cli,
    finish_cli,
    starttime,
    wait_for,
    write_host_file,
)

SLACK_S = 25
SMI = "/usr/bin/nvidia-smi"


def smi_processes(host: Any) -> dict:
    """Host processes running the fake nvidia-smi (none may outlive an agent)."""
    out = {}
    for entry in host.path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = host.cmdline(int(entry.name))
            except OSError:
                continue
            if any("fake_nvidia_smi" in a for a in argv) and host.alive(int(entry.name)):
                out[int(entry.name)] = argv
    return out


def holder_and_census(host: Any, **holder: Any) -> tuple:
    job = host.spawn_holder(**holder)
    settle(host)
    return job, census(host)


# --------------------------------------------------------------------------- python3


def test_no_python3_signals_nothing(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("no-py", gpus=1, python3=False)
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    inv = lab.inventory_yaml([host])
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    assert run.host("no-py")["error"] == "python3 not found on host (set python: in the inventory)"
    assert run.host("no-py")["signals"] == []
    assert_gone_exactly(host, before, set())


@pytest.mark.parametrize("version,shown", [("3.5.10", "Python 3.5.10"), ("2.7.18", "Python 2")],
                         ids=["py3.5", "py2.7"])
def test_python3_too_old_is_named_and_nothing_is_signalled(lab: Any, make_host: Any, home: Path,
                                                           version: str, shown: str) -> None:
    host = make_host("old-py", gpus=1)
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    install_old_python(host, version)
    assert host.ssh("python3 --version").stderr.strip() == "Python " + version
    inv = lab.inventory_yaml([host])
    expected = ("python3 on old-py is too old (%s; gpufleet needs 3.6+): "
                "set python: in the inventory" % shown)
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 1, str(status)
    assert status.host("old-py")["error"] == expected, str(status)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    assert run.host("old-py")["error"] == expected
    assert run.host("old-py")["signals"] == []
    assert_no_traceback(run)
    assert_gone_exactly(host, before, set())


# --------------------------------------------------------------------------- nvidia-smi


def test_nvidia_smi_missing(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("no-smi", gpus=2, nvidia_smi=None, nvml=False)  # no GPU reader at all
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    inv = lab.inventory_yaml([host])
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 1, str(status)
    assert status.host("no-smi")["error"] == "nvidia-smi not found", str(status)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    doc = run.host("no-smi")
    assert (doc["error"], doc["signals"], doc["targets"]) == (
        "nvidia-smi failed: nvidia-smi not found", [], [])
    assert_gone_exactly(host, before, set())


@pytest.mark.parametrize("driver,fragment", [
    ("fail", "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with the "
             "NVIDIA driver"),
    ("garbage", "nvidia-smi failed: unparsable nvidia-smi --query-gpu output"),
], ids=["exit9", "garbage"])
def test_broken_driver_clean_signals_nothing(lab: Any, make_host: Any, home: Path, driver: str,
                                             fragment: str) -> None:
    host = make_host("drv-" + driver, gpus=2, nvml=False)  # nvidia-smi's own failures
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    host.set_config(**{driver: True})
    inv = lab.inventory_yaml([host])
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    doc = run.host("drv-" + driver)
    assert doc["error"].startswith(fragment), doc["error"]
    assert doc["signals"] == [] and doc["targets"] == []
    assert_gone_exactly(host, before, set())


def test_hanging_driver_clean_is_bounded_and_leaves_nothing_running(lab: Any, make_host: Any,
                                                                   home: Path) -> None:
    host = make_host("drv-hang", gpus=2, driver="hang")
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    command_timeout = 6
    inv = lab.inventory_yaml([host], command_timeout=command_timeout)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    assert run.seconds < command_timeout + SLACK_S, str(run)
    doc = run.host("drv-hang")
    assert doc["error"].startswith("nvidia-smi failed: nvidia-smi timed out after"), doc["error"]
    assert doc["signals"] == []
    wait_for(lambda: not agents_left(host), 15, "the agent to end")
    assert smi_processes(host) == {}
    assert_gone_exactly(host, before, set())


@pytest.mark.slow
def test_driver_hangs_mid_clean_the_sequence_still_ends_in_its_bound(lab: Any, make_host: Any,
                                                                     home: Path) -> None:
    """The driver wedges after TERM: the agent still KILLs after the grace; its memory wait and
    final snapshot hit their bounds (the memory wait NVML's: the agent that planned, the same
    process, opened the library before the driver wedged); it reports within its deadline and
    ends every nvidia-smi it started."""
    host = make_host("drv-wedge", gpus=2)
    job, before = holder_and_census(host, gpus=[0], mib=800, title="stubborn", ignore_term=True)
    inv = lab.inventory_yaml([host])
    timeout = 2.0  # the agent's deadline is timeout + nvidia-smi's bound (10 s)
    proc = start_cli(home, inv, "clean", "--all", "--yes", "--json", "--grace", "1", "--timeout", timeout)
    wait_for(lambda: signals(agent_audit(host)) == [(job, "TERM", "sent")], 60, "TERM")
    host.set_config(hang=True)
    run = finish_cli(proc, timeout=90)
    assert run.rc == 1, str(run)
    assert run.seconds < timeout + 10 + 5 + SLACK_S, str(run)
    doc = run.host("drv-wedge")
    assert signals(doc["signals"]) == [(job, "TERM", "sent"), (job, "KILL", "sent")]
    assert doc["verdict"] != "clean", doc
    assert (doc["memory_wait"] or {}).get("error", "").startswith(
        "NVML: NVML did not answer within 10s"), doc["memory_wait"]
    assert signals(audit_log(home)) == [(job, "TERM", "sent"), (job, "KILL", "sent")]
    wait_for(lambda: not agents_left(host), 15, "the agent to end")
    assert smi_processes(host) == {}
    host.set_config(hang=False)
    assert_gone_exactly(host, before, {job})


TRUNCATE = r'''#!/bin/sh
# The real (fake) nvidia-smi, its CSV cut %(cut)d bytes short: a pipe that broke mid-row.
out=$(%(smi)s "$@"; echo "rc=$?")
rc=${out##*rc=}
out=${out%%rc=*}
case "$*" in
  *%(query)s*) printf '%%s' "$out" | head -c -%(cut)d ;;
  *) printf '%%s' "$out" ;;
esac
exit "$rc"
'''


@pytest.mark.parametrize("query,cut", [
    ("--query-gpu=", 3),           # inside the last GPU row's last number
    ("--query-gpu=", 30),          # several fields of the last GPU row gone
    ("--query-compute-apps=", 6),  # inside the last process's GPU UUID
    ("--query-compute-apps=", 12),  # the GPU UUID and part of the memory of the last process
], ids=["gpu-cut3", "gpu-cut30", "apps-cut6", "apps-cut12"])
def test_truncated_csv_is_an_error_not_a_smaller_truth(lab: Any, make_host: Any, home: Path,
                                                       query: str, cut: int) -> None:
    host = make_host("smi-cut", gpus=2)
    job, before = holder_and_census(host, gpus=[0, 1], mib=[900, 1100], title="job")
    smi = write_host_file(host, "/run/gflab/smi-cut", TRUNCATE % {"smi": SMI, "query": query,
                                                                  "cut": cut})
    out = host.exec([smi, query + ("index,uuid" if "gpu" in query else "pid,gpu_uuid"),
                     "--format=csv,noheader,nounits"]).stdout
    assert not out.endswith("\n") and out.count("\n") == 1, repr(out)  # the premise
    inv = lab.inventory_yaml([host], nvidia_smi=smi)
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 1, str(status)
    assert "truncated" in status.host("smi-cut")["error"], status.host("smi-cut")
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)
    assert "truncated" in run.host("smi-cut")["error"]
    assert run.host("smi-cut")["signals"] == []
    assert_gone_exactly(host, before, set())


GHOST = r'''#!/bin/sh
# nvidia-smi listing one more compute app: PID %(pid)d, which has exited (a stale driver entry).
%(smi)s "$@"
rc=$?
case "$*" in
  *--query-compute-apps=*) echo "%(pid)d, 2000, %(uuid)s" ;;
esac
exit $rc
'''


def test_nvidia_smi_lists_a_pid_that_no_longer_exists(lab: Any, make_host: Any,
                                                      home: Path) -> None:
    host = make_host("smi-ghost", gpus=2)
    gone = host.spawn_holder(gpus=[0], mib=500, title="gone")
    host.kill(gone)
    assert host.wait_gone(gone)
    job, before = holder_and_census(host, gpus=[0], mib=900, title="job")
    other = host.spawn_holder(gpus=[1], mib=700, title="other")
    settle(host)
    before = census(host)
    uuid0 = host.smi("--query-gpu=uuid", "--format=csv,noheader").stdout.split()[0]
    smi = write_host_file(host, "/run/gflab/smi-ghost", GHOST % {"smi": SMI, "pid": gone,
                                                                 "uuid": uuid0})
    inv = lab.inventory_yaml([host], nvidia_smi=smi)
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    doc = status.host("smi-ghost")
    assert any("nvidia-smi lists PIDs not in this /proc" in w and str(gone) in w
               for w in doc["warnings"]), doc["warnings"]
    assert sorted(p["pid"] for p in doc["gpus"][0]["processes"]) == sorted([gone, job])
    assert doc["gpus"][0]["unattributed_mib"] == 0  # 900 used, 2900 "listed": never negative
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--gpus", "0")
    clean = run.host("smi-ghost")
    assert [(x["pid"], x["gpu"]) for x in clean["invisible"]] == [(gone, 0)]
    assert signals(clean["signals"]) == [(job, "TERM", "sent")]
    assert all(s["pid"] != gone for s in clean["signals"])
    assert_gone_exactly(host, before, {job})
    assert host.alive(other)


@pytest.mark.slow
def test_five_thousand_processes(lab: Any, make_host: Any, home: Path) -> None:
    """status stays correct and bounded on a busy host; clean ends the one holder and none of
    the 5,000 bystanders."""
    host = make_host("busy", gpus=2)
    res = host.exec(["sh", "-c", "i=0; while [ $i -lt 5000 ]; do setsid sleep 100000 "
                     "</dev/null >/dev/null 2>&1 & i=$((i+1)); done"], timeout=120)
    assert res.returncode == 0, res.stderr
    job, before = holder_and_census(host, gpus=[1], mib=1200, title="needle")
    assert len(before) >= 5000
    inv = lab.inventory_yaml([host])
    status = run_cli(home, inv, "status", "--json")
    assert status.rc == 0, str(status)
    assert status.seconds < 60, str(status)  # generous: a hang or a quadratic blow-up fails
    gpus = status.host("busy")["gpus"]
    assert [[(p["pid"], p["name"]) for p in g["processes"]] for g in gpus] == [[], [(job,
                                                                                    "needle")]]
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 0, str(run)
    assert signals(run.host("busy")["signals"]) == [(job, "TERM", "sent")]
    assert_gone_exactly(host, before, {job})


# --------------------------------------------------------------------------- races


def test_holder_exits_between_plan_and_signal(lab: Any, make_host: Any, home: Path) -> None:
    """The operator reads the plan; meanwhile the holder ends by itself: it is reported gone,
    never KILLed, the verdict is clean, and the audit log says so."""
    host = make_host("race-exit", gpus=1)
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    inv = lab.inventory_yaml([host])

    def meanwhile() -> None:
        host.kill(job, signal.SIGTERM)
        assert host.wait_gone(job)

    run = run_on_pty(home, inv, "clean", "--all", at_prompt=meanwhile)
    assert run.rc == 0, str(run)
    assert "SIGNAL PID" in run.stdout and str(job) in run.stdout
    assert signals(audit_log(home)) == [(job, "TERM", "gone")]
    assert signals(agent_audit(host)) == [(job, "TERM", "gone")]
    row = [ln.split() for ln in run.stdout.splitlines() if ln.startswith("race-exit ")][-1]
    assert (row[2], row[6]) == ("0", "clean"), run.stdout
    assert_gone_exactly(host, before, {job})


def test_pid_reused_between_plan_and_signal_is_not_signalled(lab: Any, make_host: Any,
                                                             home: Path) -> None:
    """Between plan and confirmation the holder dies and an unrelated process -- itself a GPU
    holder, the worst case -- gets its PID. It must not be signalled: (pid, start time)."""
    host = make_host("race-reuse", gpus=1)
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    inv = lab.inventory_yaml([host])
    innocent = {}

    def meanwhile() -> None:
        host.kill(job)
        assert host.wait_gone(job)
        wait_for(lambda: not host.path("/proc/%d" % job).exists(), 10, "pid %d reaped" % job)
        reuse_pid(host, job, [real_python(), "/run/gflab/fakecuda.py", "--gpus", "0", "--mib",
                              "300", "--title", "innocent", "--ready-file", "/tmp/innocent"])
        wait_for(lambda: host.path("/tmp/innocent").exists(), 20, "the innocent holder")
        innocent["starttime"] = starttime(host, job)

    run = run_on_pty(home, inv, "clean", "--all", "--grace", "1", "--timeout", "2", at_prompt=meanwhile)
    assert innocent["starttime"] != job.starttime
    assert host.alive(job) and starttime(host, job) == innocent["starttime"]
    assert host.comm(job) == "innocent"
    assert signals(audit_log(home)) == [(job, "TERM", "pid reused")]
    assert signals(agent_audit(host)) == [(job, "TERM", "pid reused")]
    assert run.rc == 1, str(run)  # GPU 0 is not free: the innocent holds 300 MiB
    row = [ln.split() for ln in run.stdout.splitlines() if ln.startswith("race-reuse ")][-1]
    assert (row[2], row[6]) == ("0", "dirty"), run.stdout
    # the holder of the plan ended (killed by the test); the innocent with its PID is alive
    after = census(host)
    assert after.get(job) == innocent["starttime"]
    assert_gone_exactly(host, before, {job})


# --------------------------------------------------------------------------- privileges


def test_non_root_cleans_its_own_and_refuses_others(lab: Any, make_host: Any,
                                                    home: Path) -> None:
    host = make_host("shared", gpus=2)
    mine = host.spawn_holder(gpus=[0], mib=1000, title="mine", user=lab.user)
    roots = host.spawn_holder(gpus=[1], mib=2000, title="roots")
    settle(host)
    before = census(host)
    inv = lab.inventory_yaml([host], user=lab.user)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json")
    assert run.rc == 1, str(run)  # GPU 1 keeps root's memory: dirty
    doc = run.host("shared")
    assert signals(doc["signals"]) == [(mine, "TERM", "sent")]
    assert [(r["pid"], r["kind"], r["reason"]) for r in doc["refused"]] == [
        (roots, "owner", "owned by root; connect as root or with sudo")]
    assert doc["verdict"] == "dirty"
    assert signals(agent_audit(host, "/home/" + lab.user)) == [(mine, "TERM", "sent")]
    assert_gone_exactly(host, before, {mine})


def test_sudo_that_wants_a_password_fails_clearly_without_a_prompt(lab: Any, make_host: Any,
                                                                  home: Path) -> None:
    host = make_host("pw-sudo", gpus=1)
    job, before = holder_and_census(host, gpus=[0], mib=800, title="job")
    install_bins(host, {"sudo": FAKE_SUDO})
    probe = host.ssh("sudo -n true", user=lab.user)
    assert (probe.returncode, probe.stderr.strip()) == (1, "sudo: a password is required")
    inv = lab.inventory_yaml([host], user=lab.user, sudo=True, command_timeout=20)
    expected = ("sudo needs a password for %s on this host (gpufleet runs sudo -n and never "
                "prompts): allow it without a password or set sudo: false" % lab.user)
    status = run_cli(home, inv, "status", "--json", timeout=60)
    assert status.rc == 1 and status.host("pw-sudo")["error"] == expected, str(status)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", timeout=60)
    assert run.rc == 1 and run.host("pw-sudo")["error"] == expected, str(run)
    assert run.seconds < SLACK_S and status.seconds < SLACK_S
    assert run.host("pw-sudo")["signals"] == []
    assert_gone_exactly(host, before, set())


def test_stale_nvidia_smi_row_for_a_reused_pid_is_not_signalled(lab: Any, make_host: Any,
                                                                home: Path) -> None:
    """nvidia-smi still lists a holder that has exited (a stale driver entry), and its PID now
    belongs to an unrelated process that never touched a GPU: that process is refused (it
    holds no NVIDIA device file), never signalled."""
    host = make_host("smi-stale", gpus=1)
    old = host.spawn_holder(gpus=[0], mib=500, title="old")
    host.kill(old)
    wait_for(lambda: not host.path("/proc/%d" % old).exists(), 10, "pid %d reaped" % old)
    reuse_pid(host, old, ["/bin/sleep", "100000"])
    job, before = holder_and_census(host, gpus=[0], mib=900, title="job")
    assert before.get(old) == starttime(host, old)
    uuid0 = host.smi("--query-gpu=uuid", "--format=csv,noheader").stdout.split()[0]
    smi = write_host_file(host, "/run/gflab/smi-stale", GHOST % {"smi": SMI, "pid": old,
                                                                 "uuid": uuid0})
    inv = lab.inventory_yaml([host], nvidia_smi=smi)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--grace", "1")
    doc = run.host("smi-stale")
    assert signals(doc["signals"]) == [(job, "TERM", "sent")], doc["signals"]
    assert [(r["pid"], r["kind"]) for r in doc["refused"]] == [(old, "untrusted-row")]
    assert run.rc == 0, str(run)
    assert_gone_exactly(host, before, {job})
    assert host.comm(old) == "sleep"


LISTS = r'''#!/bin/sh
# nvidia-smi listing compute apps that hold nothing of the GPU (stale or forged driver entries).
%(smi)s "$@"
rc=$?
case "$*" in
  *--query-compute-apps=*) printf '%%s\n' %(rows)s ;;
esac
exit $rc
'''
# A CUDA context on GPU 1 only: /dev/nvidia1, /dev/nvidia-uvm and /dev/nvidiactl open and mapped.
GPU1_ONLY = ("import mmap, time\n"
             "fs = [open(p, 'rb') for p in ('/dev/nvidia1', '/dev/nvidia-uvm', '/dev/nvidiactl')]\n"
             "ms = [mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ) for f in fs]\n"
             "time.sleep(100000)\n")


def test_listed_processes_must_hold_the_gpu_they_are_listed_on(lab: Any, make_host: Any,
                                                                home: Path) -> None:
    """nvidia-smi lists, on GPU 0 with memory, a root GPU monitor (every /dev/nvidiaN open,
    nothing mapped: no CUDA context) and a root process with a context on GPU 1 only: whatever
    made those rows, neither holds GPU 0. Both are refused with the reason, never signalled,
    their memory counts as unexplained, and the real GPU-0 holder is cleaned."""
    host = make_host("smi-lists", gpus=2)
    monitor = host.spawn_monitor(title="gpu-exporter", via="exec")
    res = host.exec(["setsid", "sh", "-c", '"$@" </dev/null >/dev/null 2>&1 & echo $!', "sh",
                     real_python(), "-c", GPU1_ONLY], check=True)
    other = int(res.stdout.strip().splitlines()[-1])
    wait_for(lambda: "/dev/nvidia1" in host.fds(other), 10, "pid %d holding /dev/nvidia1" % other)
    job, before = holder_and_census(host, gpus=[0], mib=900, title="job")
    uuid0 = host.smi("--query-gpu=uuid", "--format=csv,noheader").stdout.split()[0]
    rows = " ".join(shlex.quote("%d, 2000, %s" % (p, uuid0)) for p in (monitor, other))
    smi = write_host_file(host, "/run/gflab/smi-lists", LISTS % {"smi": SMI, "rows": rows})
    inv = lab.inventory_yaml([host], nvidia_smi=smi)
    run = run_cli(home, inv, "clean", "--all", "--yes", "--json", "--gpus", "0", "--grace", "1")
    doc = run.host("smi-lists")
    assert signals(doc["signals"]) == [(job, "TERM", "sent")], doc["signals"]
    assert [(r["pid"], r["kind"], r["reason"]) for r in doc["refused"]] == sorted([
        (monitor, "untrusted-row", "listed by nvidia-smi on GPU 0 but has no CUDA context "
                                   "(/dev/nvidia-uvm not mapped)"),
        (other, "untrusted-row", "listed by nvidia-smi on GPU 0 but has no /dev/nvidia0 open")])
    assert any(n.startswith("GPU 0: 4000 MiB listed by nvidia-smi for PIDs ")
               for n in doc["plan_notes"]), doc["plan_notes"]
    assert run.rc == 0, str(run)
    assert_gone_exactly(host, before, {job})
    assert host.alive(monitor) and host.alive(other)
