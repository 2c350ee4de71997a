"""`gpufleet clean` end to end: the real CLI over real SSH against lab hosts; every test checks
which real processes are alive afterwards.

Small --grace / --timeout values keep the suite quick where the defaults are not the point.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import pytest

from cgroup_helpers import CgroupTree, cgroups, systemd_knows  # noqa: F401 (fixture)
from cli_helpers import (
    GPUFLEET,
    REPO_ROOT,
    assert_no_traceback,
    home,  # noqa: F401  (fixture)
    audit_signals,
    parse_table,
    run_gpufleet,
    signals_of,
    sshd_pid,
    wait_for,
)

FAST = ("--grace", "1", "--timeout", "15")
README_CLEAN_KEYS = {"host", "ok", "error", "verdict", "gpus", "seconds", "targets", "refused",
                     "signals", "units_stopped", "before", "after", "freed_mib"}
TARGET_KEYS = {"pid", "name", "cmdline", "gpus", "evidence"}
REFUSED_KEYS = {"pid", "name", "reason"}
SIGNAL_KEYS = {"pid", "signal", "outcome"}
AUDIT_KEYS = {"host", "pid", "starttime", "cmdline", "signal", "outcome"}
WORKER_MIB = 7000
TRAINER_MIB = [4100, 4200, 4300, 4400]


def clean(home: Path, inv: Path, *args: str, audit: bool = True, timeout: float = 180) -> Any:
    extra = ["--audit-log", str(home / "audit.jsonl")] if audit else []
    return run_gpufleet(home, inv, "clean", "--all", *args, *extra, timeout=timeout)


def family_alive(host: Any, pids: Any) -> dict[int, bool]:
    return {int(p): host.alive(p) for p in pids}


@pytest.fixture
def train_node(lab: Any, make_host: Any) -> Any:
    """8 GPUs: a vLLM family on 0-3 (API server -> EngineCore_DP0 -> Worker_TP0..3), a trainer
    on 4-7."""
    host = make_host("train-node", gpus=8)
    host.api = host.spawn_vllm(gpus=[0, 1, 2, 3], mib=WORKER_MIB)
    host.engine = host.api.children[0]
    host.workers = list(host.engine.children)
    host.trainer = host.spawn_holder(gpus=[4, 5, 6, 7], mib=TRAINER_MIB, title="trainer")
    host.inv = lab.inventory_yaml([host])
    return host


def everyone(host: Any) -> list[int]:
    return [host.api, host.engine, *host.workers, host.trainer]


# --- the train node -------------------------------------------------------------------------


def test_clean_0_3_frees_the_vllm_family_and_spares_the_trainer(train_node: Any, home: Path) -> None:
    host = train_node
    sshd = sshd_pid(host)
    trainer_fds = host.fds(host.trainer)
    run = clean(home, host.inv, "--host", "train-node", "--gpus", "0-3", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("train-node")
    assert README_CLEAN_KEYS <= set(doc)
    assert (doc["ok"], doc["error"], doc["verdict"], doc["gpus"]) == (True, None, "clean", [0, 1, 2, 3])

    # what was signalled: the engine core (family root, device files only) first, then workers
    targets = {t["pid"]: t for t in doc["targets"]}
    assert set(targets) == {host.engine, *host.workers}
    for t in doc["targets"]:
        assert TARGET_KEYS <= set(t)
    assert (targets[host.engine]["name"], targets[host.engine]["evidence"],
            targets[host.engine]["wave"]) == ("VLLM::EngineCore_DP0", "family", 0)
    for n, w in enumerate(host.workers):
        assert (targets[w]["name"], targets[w]["cmdline"], targets[w]["gpus"],
                targets[w]["evidence"], targets[w]["starttime"]) == (
            "VLLM::Worker_TP%d" % n, "VLLM::Worker_TP%d" % n, [n], "nvidia-smi", w.starttime)
    assert doc["refused"] == []
    for s in doc["signals"]:
        assert SIGNAL_KEYS <= set(s)
    assert doc["signals"][0]["pid"] == host.engine
    assert {s["pid"] for s in doc["signals"]} == set(targets)
    assert host.trainer not in {s["pid"] for s in doc["signals"]}
    assert doc["units_stopped"] == []

    # memory: before, after, freed -- checked against the fake driver itself
    assert doc["before"] == [{"index": i, "memory_used_mib": WORKER_MIB} for i in range(4)]
    assert doc["after"] == [{"index": i, "memory_used_mib": 0} for i in range(4)]
    assert doc["freed_mib"] == 4 * WORKER_MIB
    assert host.gpu_used() == [0, 0, 0, 0] + TRAINER_MIB

    # who is alive: the family on 0-3 is gone, the trainer untouched, the API server (no GPU
    # evidence) untouched, sshd untouched and still serving
    assert family_alive(host, [host.engine, *host.workers]) == dict.fromkeys(
        [host.engine, *host.workers], False)
    assert host.alive(host.trainer) and host.fds(host.trainer) == trainer_fds
    assert host.alive(host.api)
    # the engine core is a zombie now (its parent, the API server, does not reap): it holds
    # no GPU memory and is reported as such, with its parent
    assert host.proc_state(host.engine) == "Z"
    (zombie,) = doc["verdict_detail"]["survivors"]
    assert (zombie["pid"], zombie["kind"]) == (host.engine, "zombie")
    assert zombie["detail"].startswith("zombie (exited, no thread left), parent PID %d "
                                       % host.api), zombie
    assert zombie["detail"].endswith("holds nothing"), zombie
    assert host.alive(sshd)
    assert host.ssh("echo still-here").stdout.strip() == "still-here"

    # the audit log: one line per signal, as reported
    audit = audit_signals(home / "audit.jsonl")
    assert len(audit) == len(doc["signals"])
    for line, sig in zip(audit, doc["signals"]):
        assert AUDIT_KEYS <= set(line)
        assert (line["host"], line["pid"], line["starttime"], line["signal"], line["outcome"]) == (
            "train-node", sig["pid"], sig["starttime"], sig["signal"], sig["outcome"])
        assert line["cmdline"] == targets[sig["pid"]]["cmdline"]


def test_dry_run_signals_nothing_and_shows_targets_and_refusals(lab: Any, make_host: Any,
                                                               home: Path) -> None:
    host = make_host("train-node", gpus=8)
    api = host.spawn_vllm(gpus=[0, 1, 2], mib=WORKER_MIB)
    engine = api.children[0]
    spanner = host.spawn_holder(gpus=[3, 4], mib=[500, 600], title="spanner")
    trainer = host.spawn_holder(gpus=[5, 6, 7], mib=900, title="trainer")
    inv = lab.inventory_yaml([host])
    procs = [api, engine, *engine.children, spanner, trainer]

    run = clean(home, inv, "--all", "--gpus", "0-3", "--dry-run", *FAST)
    assert run.rc == 0, str(run)
    assert_no_traceback(run)
    text = run.stdout
    assert "train-node: GPUs 0-3" in text
    def row(pid: int, command: str) -> bool:  # SIGNAL PID, USER ..., COMMAND last
        return any(line.split()[:2] == [str(pid), "root"] and line.split()[-1] == command
                   for line in text.splitlines())

    for n, w in enumerate(engine.children):
        assert row(w, "VLLM::Worker_TP%d" % n), text
    assert row(engine, "VLLM::EngineCore_DP0"), text
    assert "refused %d spanner: spans GPUs 3,4" % spanner in text
    outcome = {r["HOST"]: r for r in parse_table(text, "HOST")}
    assert outcome["train-node"]["VERDICT"] == "planned"
    assert outcome["train-node"]["SIGNALLED"] == "(4)"

    js = clean(home, inv, "--all", "--gpus", "0-3", "--dry-run", "--json", *FAST)
    assert js.rc == 0, str(js)
    doc = js.host("train-node")
    assert js.json()["dry_run"] is True
    assert doc["verdict"] == "planned" and doc["signals"] == [] and doc["after"] == []
    assert {t["pid"] for t in doc["targets"]} == {engine, *engine.children}
    assert [(r["pid"], r["name"]) for r in doc["refused"]] == [(spanner, "spanner")]
    for r in doc["refused"]:
        assert REFUSED_KEYS <= set(r)
    assert "spans GPUs 3,4" in doc["refused"][0]["reason"]
    assert "--include-spanning" in doc["refused"][0]["reason"]

    assert all(family_alive(host, procs).values()), family_alive(host, procs)
    assert host.gpu_used() == [WORKER_MIB] * 3 + [500, 600] + [900] * 3
    assert not (home / "audit.jsonl").exists()


def test_without_yes_in_a_non_interactive_run_nothing_is_signalled(train_node: Any,
                                                                  home: Path) -> None:
    host = train_node
    run = clean(home, host.inv, "--all", "--gpus", "0-3", *FAST)
    assert run.rc == 2, str(run)
    assert "no --yes" in run.stderr and "nothing signalled" in run.stderr
    assert "VLLM::Worker_TP0" in run.stdout  # the plan was shown
    assert_no_traceback(run)
    assert all(family_alive(host, everyone(host)).values())
    assert host.gpu_used() == [WORKER_MIB] * 4 + TRAINER_MIB
    assert not (home / "audit.jsonl").exists()


def test_gpu_index_not_on_the_host_is_exit_2_and_nothing_is_signalled(train_node: Any,
                                                                     home: Path) -> None:
    host = train_node
    for extra in (["--yes"], ["--yes", "--json"], []):
        run = clean(home, host.inv, "--all", "--gpus", "9", *extra, *FAST)
        assert run.rc == 2, str(run)
        assert_no_traceback(run)
        assert "GPU 9" in run.output, str(run)
    assert all(family_alive(host, everyone(host)).values())
    assert host.gpu_used() == [WORKER_MIB] * 4 + TRAINER_MIB
    assert not (home / "audit.jsonl").exists()


def test_holder_ignoring_sigterm_is_killed_after_grace(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("stubborn-box", gpus=2)
    stubborn = host.spawn_holder(gpus=[0], mib=3000, title="stubborn", ignore_term=True)
    polite = host.spawn_holder(gpus=[1], mib=2000, title="polite")
    inv = lab.inventory_yaml([host])
    run = clean(home, inv, "--all", "--yes", "--json", "--grace", "1", "--timeout", "15")
    assert run.rc == 0, str(run)
    doc = run.host("stubborn-box")
    assert doc["verdict"] == "clean"
    assert signals_of(doc, stubborn) == [("TERM", "sent"), ("KILL", "sent")]
    # the polite one exits on TERM (a KILL is only possible when a loaded machine makes it
    # slower than the grace period; it then finds it gone or still exiting)
    assert signals_of(doc, polite)[0] == ("TERM", "sent")
    assert not host.alive(stubborn) and not host.alive(polite)
    assert host.gpu_used() == [0, 0]
    audit = audit_signals(home / "audit.jsonl")
    assert [(a["pid"], a["signal"], a["outcome"]) for a in audit if a["pid"] == stubborn] == [
        (stubborn, "TERM", "sent"), (stubborn, "KILL", "sent")]
    assert all(a["host"] == "stubborn-box" and a["starttime"] is not None for a in audit)
    assert {a["cmdline"] for a in audit} == {"stubborn", "polite"}
    # each line carries the time its signal was sent: KILL came a grace period after TERM
    when = {a["signal"]: _audit_time(a["time"]) for a in audit if a["pid"] == stubborn}
    assert when["KILL"] - when["TERM"] >= 0.9


def _audit_time(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc).timestamp()


def test_workers_orphaned_by_a_killed_engine_are_still_freed(lab: Any, make_host: Any,
                                                             home: Path) -> None:
    host = make_host("orphanage", gpus=2)
    api = host.spawn_vllm(gpus=[0, 1], mib=WORKER_MIB)
    engine = api.children[0]
    workers = list(engine.children)
    assert host.kill(engine)
    assert host.wait_gone(engine)
    wait_for(lambda: all(_ppid(host, w) != engine for w in workers), what="workers reparented")
    assert all(host.alive(w) for w in workers)
    inv = lab.inventory_yaml([host])
    run = clean(home, inv, "--all", "--gpus", "0,1", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("orphanage")
    assert doc["verdict"] == "clean"
    assert {t["pid"] for t in doc["targets"]} == set(workers)
    assert not any(host.alive(w) for w in workers)
    assert host.gpu_used() == [0, 0]
    assert host.alive(api)  # no GPU evidence: never a target


def _ppid(host: Any, pid: int) -> Optional[int]:
    try:
        stat = host.path("/proc/%d/stat" % pid).read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


def test_clean_never_signals_its_own_ancestors(make_host: Any) -> None:
    """gpufleet run ON the host (connection: local, the implicit inventory) by a shell that
    holds /dev/nvidia0 open: the shell and the controller (which inherits the descriptor) are
    the agent's ancestors and device-file holders in a full scope; both must be refused."""
    host = make_host("self-aware", gpus=2)
    job = host.spawn_holder(gpus=[1], mib=1000, title="job")
    gpufleet = " ".join(shlex.quote(a) for a in GPUFLEET)
    script = ("exec 3</dev/nvidia0; echo shell=$$ >&2; export PYTHONPATH=%s; "
              "%s clean --host localhost --yes --json --gpus all --grace 1 --timeout 15 "
              "--audit-log /tmp/audit.jsonl; "
              "rc=$?; echo rc=$rc >&2; exit $rc" % (shlex.quote(str(REPO_ROOT)), gpufleet))
    res = host.exec(["bash", "-c", script], timeout=120)
    assert res.returncode == 0, (res.stdout, res.stderr)
    shell = int(next(line for line in res.stderr.splitlines() if line.startswith("shell="))[6:])
    doc = json.loads(res.stdout)["hosts"][0]
    assert doc["verdict"] == "clean"
    assert [t["pid"] for t in doc["targets"]] == [job]
    refused = {r["pid"]: r for r in doc["refused"]}
    assert shell in refused and "ancestor of the gpufleet agent" in refused[shell]["reason"]
    controller = [p for p, r in refused.items() if p != shell]
    assert len(controller) == 1 and "ancestor of the gpufleet agent" in refused[controller[0]]["reason"]
    assert {s["pid"] for s in doc["signals"]} == {job}
    assert not host.alive(job)


# --- policy: units, protection ------------------------------------------------------------------


@pytest.fixture
def unit_cgroup(cgroups: CgroupTree) -> Any:
    """A real cgroup named like systemd's system.slice/vllm-minimax.service."""
    return cgroups.make("system.slice/vllm-minimax.service")


def test_unit_owned_holder_is_refused_without_stop_units(lab: Any, make_host: Any, home: Path,
                                                        cgroups: Any, unit_cgroup: str,
                                                        request: Any) -> None:
    host = make_host("minimax-node", gpus=2, path_prefix="/root/bin")
    # stop the host before the cgroup fixture removes the directory (finalizers run LIFO)
    request.addfinalizer(host.stop)
    systemd_knows(host, "vllm-minimax", cgroups.control_group(unit_cgroup), gpus=[0], mib=5000)
    served = host.spawn_holder(gpus=[0], mib=5000, title="vllm-minimax")
    loose = host.spawn_holder(gpus=[1], mib=1000, title="loose")
    Path(unit_cgroup, "cgroup.procs").write_text(str(host.outer_pid(served)))
    assert host.path("/proc/%d/cgroup" % served).read_text().rstrip().endswith(
        "/system.slice/vllm-minimax.service")
    inv = lab.inventory_yaml([host])

    status = run_gpufleet(home, inv, "status", "--json").host("minimax-node")
    assert status["gpus"][0]["processes"][0]["unit"] == "vllm-minimax.service"

    run = clean(home, inv, "--all", "--yes", "--json", *FAST)
    assert run.rc == 1, str(run)
    doc = run.host("minimax-node")
    assert doc["verdict"] == "dirty"
    refused = {r["pid"]: r for r in doc["refused"]}
    assert list(refused) == [served]
    assert "belongs to vllm-minimax.service" in refused[served]["reason"]
    assert "--stop-units" in refused[served]["reason"]
    assert [t["pid"] for t in doc["targets"]] == [loose]
    assert host.alive(served) and not host.alive(loose)
    assert host.gpu_used() == [5000, 0]

    plan = clean(home, inv, "--all", "--dry-run", "--stop-units", *FAST)
    assert plan.rc == 0, str(plan)
    assert "stop unit vllm-minimax.service first" in plan.stdout
    assert any(line.split()[:2] == [str(served), "root"] and line.rstrip().endswith("vllm-minimax")
               for line in plan.stdout.splitlines()), plan.stdout
    assert host.alive(served)


def test_protected_processes_are_refused_and_stay_alive(lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("guarded", gpus=3)
    keeper = host.spawn_holder(gpus=[0], mib=1000, title="keeper-of-gpu0")
    precious = host.spawn_holder(gpus=[1], mib=1100, title="precious-run")
    victim = host.spawn_holder(gpus=[2], mib=1200, title="scratch")
    inv = lab.inventory_yaml([host], protect=["*keeper*"])
    run = clean(home, inv, "--all", "--yes", "--json", "--protect", "prec*", *FAST)
    assert run.rc == 1, str(run)
    doc = run.host("guarded")
    assert doc["verdict"] == "dirty"
    refused = {r["pid"]: r["reason"] for r in doc["refused"]}
    assert refused == {keeper: "protected by '*keeper*'", precious: "protected by 'prec*'"}
    assert [t["pid"] for t in doc["targets"]] == [victim]
    assert {s["pid"] for s in doc["signals"]} == {victim}
    assert host.alive(keeper) and host.alive(precious) and not host.alive(victim)
    assert host.gpu_used() == [1000, 1100, 0]


# --- hosts where nvidia-smi cannot attribute everything --------------------------------------


def test_hidden_pids_full_scope_clean_targets_device_file_holders(lab: Any, make_host: Any,
                                                                  home: Path) -> None:
    host = make_host("pid-ns-box", gpus=2, hidden_pids=True)
    a = host.spawn_holder(gpus=[0], mib=3000, title="job-a")
    b = host.spawn_holder(gpus=[1], mib=2000, title="job-b")
    inv = lab.inventory_yaml([host])

    partial = clean(home, inv, "--all", "--gpus", "0", "--dry-run", "--json", *FAST)
    assert partial.rc == 0, str(partial)
    doc = partial.host("pid-ns-box")
    assert doc["targets"] == []
    assert {r["pid"] for r in doc["refused"]} == {a, b}
    assert all("ambiguous" in r["reason"] for r in doc["refused"])

    run = clean(home, inv, "--all", "--gpus", "all", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("pid-ns-box")
    assert doc["verdict"] == "clean"
    assert {(t["pid"], t["evidence"]) for t in doc["targets"]} == {(a, "device-file"),
                                                                  (b, "device-file")}
    assert doc["before"] == [{"index": 0, "memory_used_mib": 3000},
                             {"index": 1, "memory_used_mib": 2000}]
    assert doc["freed_mib"] == 5000
    assert not host.alive(a) and not host.alive(b)
    assert host.gpu_used() == [0, 0]


def test_wsl2_reservation_is_clean_when_expected_and_dirty_when_not(lab: Any, make_host: Any,
                                                                    home: Path) -> None:
    host = make_host("wsl-box", gpus=1, wsl2=True, gpu_name="NVIDIA GeForce RTX 5090",
                     total_mib=32607, ghost_mib=1680)
    job = host.spawn_holder(gpus=[0], mib=2000, title="notebook")
    expected = lab.inventory_yaml([host], unattributed_mib=1680)
    run = clean(home, expected, "--all", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("wsl-box")
    assert doc["verdict"] == "clean", doc["reason"]
    assert doc["after"] == [{"index": 0, "memory_used_mib": 1680}]
    assert doc["freed_mib"] == 2000
    assert not host.alive(job)

    unexpected = lab.inventory_yaml([host], unattributed_mib=0)
    run = clean(home, unexpected, "--all", "--yes", "--json", "--grace", "0.5", "--timeout", "1")
    assert run.rc == 1, str(run)
    doc = run.host("wsl-box")
    assert doc["verdict"] == "dirty"
    assert doc["reason"].startswith("GPU 0: 1680 MiB left (threshold 64): 1680 MiB no process "
                                    "here explains: WSL2"), doc["reason"]
    assert doc["verdict_detail"]["unattributed"][0]["cause"] == "WSL2 reservation"
    assert host.gpu_used() == [1680]


# --- identity, locking, timing ----------------------------------------------------------------


NEWCOMER = r"""
import os, sys
last, ready = int(sys.argv[1]), sys.argv[2]
try:
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(last))
except OSError as exc:
    print("ns_last_pid: %s" % exc)
    sys.exit(3)
pid = os.fork()
if pid == 0:
    os.setsid()
    fd = os.open("/dev/null", os.O_RDWR)
    for i in (0, 1, 2):
        os.dup2(fd, i)
    os.execv(sys.executable, [sys.executable, "/run/gflab/fakecuda.py", "--gpus", "1",
                              "--mib", "300", "--title", "newcomer", "--ready-file", ready])
print(pid)
"""


def test_pid_reused_between_plan_and_signal_is_not_signalled(lab: Any, make_host: Any, home: Path,
                                                             monkeypatch: Any) -> None:
    """The interactive path: plan, (confirm), execute on the same connection. Between plan and
    signal the target dies and a new process takes its PID: it must not be signalled."""
    from gpufleet.ops.clean import CleanOptions, execute_plan, plan_host
    from gpufleet.config.inventory import load_inventory
    from gpufleet.transport import open_session

    monkeypatch.setenv("HOME", str(home))
    host = make_host("reuse-box", gpus=2)
    victim = host.spawn_holder(gpus=[1], mib=500, title="victim")
    inv_host = load_inventory(lab.inventory_yaml([host])).get("reuse-box")
    opts = CleanOptions(gpus="1", grace_s=0.5, timeout_s=3, audit_log=str(home / "audit.jsonl"))
    with open_session(inv_host) as session:
        planned = plan_host(inv_host, session, opts)
        assert planned.ok, planned.error
        assert [(t.pid, t.starttime) for t in planned.plan.targets] == [(victim, victim.starttime)]

        assert host.kill(victim) and host.wait_gone(victim)
        res = host.exec([sys.executable, "-c", NEWCOMER, str(victim - 1), "/tmp/newcomer.ready"],
                        timeout=60)
        if res.returncode == 3:
            pytest.skip("cannot choose the next PID in the host (%s)" % res.stdout.strip())
        assert res.returncode == 0, res.stderr
        if int(res.stdout.strip()) != victim:
            pytest.skip("could not place a new process at PID %d (got %s)" % (victim, res.stdout))
        wait_for(lambda: host.path("/tmp/newcomer.ready").exists(), what="newcomer ready")
        assert host.comm(victim) == "newcomer"

        out = execute_plan(inv_host, session, planned, opts)
    assert [(s["pid"], s["signal"], s["outcome"]) for s in out.agent_doc["signals"]] == [
        (victim, "TERM", "pid reused")]
    assert host.alive(victim) and host.comm(victim) == "newcomer"
    assert host.gpu_used() == [0, 300]
    assert out.verdict == "dirty" and "started during the clean" in out.reason


def test_two_concurrent_cleans_are_serialised_and_both_end(lab: Any, make_host: Any,
                                                           home: Path) -> None:
    host = make_host("contended", gpus=2)
    stubborn = host.spawn_holder(gpus=[0], mib=3000, title="stubborn", ignore_term=True)
    polite = host.spawn_holder(gpus=[1], mib=2000, title="polite")
    inv = lab.inventory_yaml([host])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env["HOME"] = str(home)
    argv = GPUFLEET + ["-i", str(inv), "clean", "--all", "--yes", "--json", "--grace", "1.5",
                       "--timeout", "30", "--audit-log", str(home / "audit.jsonl")]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, stdin=subprocess.DEVNULL) for _ in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=150))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    docs = []
    for p, (out, err) in zip(procs, outs):
        assert "Traceback" not in out + err, err
        assert p.returncode == 0, (out, err)
        (doc,) = json.loads(out)["hosts"]
        assert doc["verdict"] == "clean", doc
        docs.append(doc)
    sent = Counter((s["pid"], s["signal"]) for d in docs for s in d["signals"]
                   if s["outcome"] == "sent")
    # one clean at a time: the second finds the first's targets gone, so each process got
    # exactly one TERM and the stubborn one exactly one KILL
    assert (sent[(stubborn, "TERM")], sent[(stubborn, "KILL")], sent[(polite, "TERM")]) == (1, 1, 1)
    assert sent[(polite, "KILL")] <= 1 and set(sent) <= {
        (stubborn, "TERM"), (stubborn, "KILL"), (polite, "TERM"), (polite, "KILL")}
    assert all(s["outcome"] in ("sent", "gone") for d in docs for s in d["signals"])
    assert not host.alive(stubborn) and not host.alive(polite)
    assert host.gpu_used() == [0, 0]
    assert len(audit_signals(home / "audit.jsonl")) == sum(len(d["signals"]) for d in docs)


def test_verdict_waits_for_memory_released_late(lab: Any, make_host: Any, home: Path) -> None:
    delay = 1.5
    host = make_host("slow-release", gpus=1, release_delay_s=delay)
    job = host.spawn_holder(gpus=[0], mib=8000, title="job")
    inv = lab.inventory_yaml([host])
    run = clean(home, inv, "--all", "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("slow-release")
    assert doc["verdict"] == "clean"
    assert doc["after"] == [{"index": 0, "memory_used_mib": 0}] and doc["freed_mib"] == 8000
    assert doc["memory_wait"]["ok"] is True and doc["memory_wait"]["polls"] >= 2
    assert doc["memory_wait"]["seconds"] >= delay * 0.9
    assert doc["seconds"] >= delay
    assert not host.alive(job)


# --- /dev/shm leftovers ------------------------------------------------------------------------


SHM_HOLDER = ("echo $$ > /tmp/shm-holder.pid.tmp && mv /tmp/shm-holder.pid.tmp /tmp/shm-holder.pid"
              " && exec 3>>/dev/shm/nccl-held-1234 && exec sleep 300")


def test_shm_removes_unheld_leftovers_and_keeps_held_ones(lab: Any, make_host: Any,
                                                          home: Path) -> None:
    host = make_host("shm-box", gpus=1)
    job = host.spawn_holder(gpus=[0], mib=1000, title="job")
    host.ssh("setsid -f sh -c %s </dev/null >/dev/null 2>&1" % shlex.quote(SHM_HOLDER), check=True)
    wait_for(lambda: host.path("/tmp/shm-holder.pid").exists(), what="shm holder")
    holder = int(host.path("/tmp/shm-holder.pid").read_text())
    wait_for(lambda: "/dev/shm/nccl-held-1234" in host.fds(holder), what="shm file open")
    leftover = host.path("/dev/shm/nccl-leftover-5678")
    leftover.write_bytes(b"\0" * 4096)
    unrelated = host.path("/dev/shm/my-own-file")
    unrelated.write_bytes(b"x")
    old = time.time() - 3600  # older than the agent's minimum age for leftovers
    for name in ("nccl-held-1234", "nccl-leftover-5678", "my-own-file"):
        os.utime(host.path("/dev/shm/" + name), (old, old))
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--all", "--yes", "--json", "--shm", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("shm-box")
    assert doc["verdict"] == "clean"
    assert doc["shm_removed"] == ["/dev/shm/nccl-leftover-5678"]
    assert not leftover.exists()
    assert host.path("/dev/shm/nccl-held-1234").exists() and unrelated.exists()
    assert host.alive(holder)  # holds a shm file, not a GPU: not a target
    assert not host.alive(job)


def test_unreachable_host_is_a_row_and_the_others_are_cleaned(lab: Any, make_host: Any,
                                                             home: Path) -> None:
    host = make_host("reachable", gpus=2)
    job = host.spawn_holder(gpus=[1], mib=1000, title="job")
    inv = lab.inventory_yaml([host, lab.dead_host("dead-node")], connect_timeout=2)
    run = clean(home, inv, "--all", "--yes", *FAST)
    assert run.rc == 1, str(run)
    assert_no_traceback(run)
    rows = {r["HOST"]: r for r in parse_table(run.stdout, "HOST")}
    assert (rows["reachable"]["GPUS"], rows["reachable"]["SIGNALLED"], rows["reachable"]["FREED (MiB)"],
            rows["reachable"]["LEFT (MiB)"], rows["reachable"]["VERDICT"]) == ("0-1", "1", "1000", "0",
                                                                            "clean")
    assert rows["dead-node"]["VERDICT"] == "unreachable"
    assert any(line.startswith("dead-node: ") and "refused" in line.lower()
               for line in run.stdout.splitlines()), str(run)
    assert not host.alive(job) and host.gpu_used() == [0, 0]


def test_stop_units_stops_the_unit_then_the_memory_is_verified(lab: Any, make_host: Any, home: Path,
                                                               cgroups: Any, unit_cgroup: str,
                                                               request: Any) -> None:
    """--stop-units with the lab's fake systemctl (no systemd in the lab: the fake is first on
    the session PATH; its `stop` ends the unit's processes, as systemd would)."""
    from fake_systemctl import install_systemctl

    host = make_host("minimax-unit", gpus=2, path_prefix="/root/bin")
    request.addfinalizer(host.stop)
    install_systemctl(host, {"vllm-minimax": {"gpus": [0], "mib": 5000, "title": "vllm-minimax",
                                              "cgroup": cgroups.control_group(unit_cgroup)}})
    assert host.exec(["/root/bin/systemctl", "start", "vllm-minimax.service"]).returncode == 0
    served = json.loads(host.path("/root/units/vllm-minimax.service.state").read_text())["pids"][0]
    Path(unit_cgroup, "cgroup.procs").write_text(str(host.outer_pid(served)))
    other = host.spawn_holder(gpus=[1], mib=1000, title="bystander")
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--all", "--gpus", "0", "--yes", "--json", "--stop-units", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("minimax-unit")
    assert doc["verdict"] == "clean"
    assert [u["unit"] for u in doc["units_stopped"]] == ["vllm-minimax.service"]
    assert all(u["ok"] for u in doc["units_stopped"])
    assert not host.alive(served) and host.alive(other)
    assert host.gpu_used() == [0, 1000]
    calls = host.path("/root/units/calls.log").read_text()
    assert "stopped vllm-minimax.service" in calls
