"""`gpufleet status` end to end: the real CLI, real sshd hosts of the test lab, real holders.

One inventory holds the three fleets (a WSL2 workstation, an 8-GPU train node, an inference
node whose nvidia-smi is off PATH), a dead host and a blackholed one; other tests each start
the hosts they need (host keys, non-root user, hidden PIDs, broken drivers).
"""
from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import (
    assert_no_traceback,
    assert_one_line_error,
    home,  # noqa: F401  (fixture)
    host_pids,
    lines_after_table,
    parse_table,
    run_gpufleet,
    sha256_fingerprint,
)

HEADER = "HOST"
CONNECT_TIMEOUT = 2
# A hang (no connect timeout: the kernel's SYN retries last ~2 minutes) breaks this bound;
# Python start-up, the other hosts and a busy, shared 2-core machine do not.
CONNECT_SLACK_S = 45

README_HOST_KEYS = {"host", "ok", "error", "facts", "gpus", "holders"}
README_GPU_KEYS = {"index", "uuid", "name", "memory_used_mib", "memory_total_mib", "attributed_mib",
                   "unattributed_mib", "expected_unattributed_mib", "utilization_pct", "processes"}
README_PROC_KEYS = {"pid", "name", "cmdline", "user", "state", "used_mib", "unit"}
README_HOLDER_KEYS = {"pid", "name", "devices", "listed_by_nvidia_smi"}

WSL_TOTAL = 32607
WSL_GHOST = 1680
WORKER_MIB = 716
TRAINER_MIB = [4100, 4200, 4300, 4400]  # GPUs 4-7, each different so rows cannot be mixed up
INFER_SMI = "/usr/local/nvidia/bin/nvidia-smi"
INFER_MIB = [1500, 1600]


def rows_of(table: list[dict[str, str]], host: str) -> dict[str, dict[str, str]]:
    """GPU -> row for one host ("-" for a host's single error row)."""
    return {r["GPU"]: r for r in table if r["HOST"] == host}


# --- the three fleets, a dead host and a blackholed one ---------------------------------------


@pytest.fixture(scope="module")
def fleet(lab: Any, tmp_path_factory: Any) -> Any:
    """Hosts and holders, plus one table run and one --json run of `status` over all of them
    (the tests below only read these results)."""
    made = []
    try:
        ws = lab.add_host("ws-5090", gpus=1, wsl2=True, gpu_name="NVIDIA GeForce RTX 5090",
                          total_mib=WSL_TOTAL, ghost_mib=WSL_GHOST)
        made.append(ws)
        train = lab.add_host("train-node", gpus=8)
        made.append(train)
        infer = lab.add_host("infer-node", gpus=2, nvidia_smi=INFER_SMI)
        made.append(infer)
        api = train.spawn_vllm(gpus=[0, 1, 2, 3], mib=WORKER_MIB)
        trainer = train.spawn_holder(gpus=[4, 5, 6, 7], mib=TRAINER_MIB, title="trainer")
        server = infer.spawn_holder(gpus=[0, 1], mib=INFER_MIB, title="vllm-infer")
        dead = lab.dead_host("dead-node")
        black = lab.blackholed_host("blackholed-node")
        inv = lab.inventory_yaml([ws, train, infer, dead, black], connect_timeout=CONNECT_TIMEOUT,
                                 **{"ws-5090": {"unattributed_mib": WSL_GHOST}})
        h = tmp_path_factory.mktemp("status-home")
        table_run = run_gpufleet(h, inv, "status")
        json_run = run_gpufleet(h, inv, "status", "--json")
        yield types.SimpleNamespace(
            ws=ws, train=train, infer=infer, dead=dead, black=black, inv=inv, home=h,
            api=api, engine=api.children[0], workers=api.children[0].children, trainer=trainer,
            server=server, table_run=table_run, json_run=json_run,
            table=parse_table(table_run.stdout, HEADER))
    finally:
        for host in made:
            host.stop()


def test_fleet_table_lists_every_gpu_and_its_holders(fleet: Any) -> None:
    run = fleet.table_run
    assert run.rc == 1, str(run)  # two hosts failed
    assert_no_traceback(run)
    train = rows_of(fleet.table, "train-node")
    assert list(train) == [str(i) for i in range(8)] + ["fd"], str(run)
    for n, worker in enumerate(fleet.workers):
        row = train[str(n)]
        assert row["NAME"] == "RTX 6000 Ada"  # "NVIDIA RTX 6000 Ada Generation", short
        assert row["MEMORY (MiB)"] == "%d / 49140" % WORKER_MIB
        assert row["UNATTR (MiB)"] == "0"
        # vLLM renames its processes: the names shown are the new ones, memory is the fake's
        assert row["HOLDERS"] == "%d root %dMiB VLLM::Worker_TP%d" % (worker, WORKER_MIB, n), str(run)
    for i, mib in zip(range(4, 8), TRAINER_MIB):
        row = train[str(i)]
        assert row["MEMORY (MiB)"] == "%d / 49140" % mib
        assert row["HOLDERS"] == "%d root %dMiB trainer" % (fleet.trainer, mib)
    # the engine core opened every GPU's device file (as CUDA does) and nvidia-smi does not
    # list it: one (fd) line for the host; the API server holds no device file at all
    assert train["fd"]["HOLDERS"] == "%d root (fd: GPUs 0-7) VLLM::EngineCore_DP0" % fleet.engine

    ws = rows_of(fleet.table, "ws-5090")
    assert list(ws) == ["0"]
    assert ws["0"]["NAME"] == "GeForce RTX 5090"
    assert ws["0"]["MEMORY (MiB)"] == "%d / %d" % (WSL_GHOST, WSL_TOTAL)
    assert ws["0"]["UNATTR (MiB)"] == "%d (exp)" % WSL_GHOST  # not flagged
    assert ws["0"]["HOLDERS"] == "-"

    infer = rows_of(fleet.table, "infer-node")
    assert [infer[str(i)]["HOLDERS"] for i in (0, 1)] == [
        "%d root %dMiB vllm-infer" % (fleet.server, mib) for mib in INFER_MIB]

    dead = rows_of(fleet.table, "dead-node")
    assert list(dead) == ["-"] and dead["-"]["HOLDERS"].startswith("ERROR: ")
    assert "refused" in dead["-"]["HOLDERS"].lower()
    black = rows_of(fleet.table, "blackholed-node")
    assert list(black) == ["-"] and black["-"]["HOLDERS"].startswith("ERROR: ")
    assert "timed out" in black["-"]["HOLDERS"].lower()

    assert [r["HOST"] for r in fleet.table if r["GPU"] in ("0", "-")] == [
        "ws-5090", "train-node", "infer-node", "dead-node", "blackholed-node"], "inventory order"
    # ws: 1680 MiB expected -> free; train-node: 8 busy; infer-node: 2 busy
    assert lines_after_table(run.stdout, HEADER)[0] == (
        "hosts: 3 ok, 2 failed; GPUs: 10 busy, 1 free; health: 11 OK")


def test_blackholed_host_is_bounded_by_connect_timeout(fleet: Any) -> None:
    for run in (fleet.table_run, fleet.json_run):
        assert run.seconds < CONNECT_TIMEOUT + CONNECT_SLACK_S, str(run)
    doc = fleet.json_run.host("blackholed-node")
    assert doc["ok"] is False and "timed out" in doc["error"].lower()
    assert CONNECT_TIMEOUT * 0.9 <= doc["seconds"] < CONNECT_TIMEOUT + CONNECT_SLACK_S
    assert fleet.json_run.host("dead-node")["ok"] is False
    # the other hosts' rows are complete despite the blackholed one
    assert len(fleet.json_run.host("train-node")["gpus"]) == 8


def test_fleet_json_follows_the_documented_contract(fleet: Any) -> None:
    run = fleet.json_run
    assert run.rc == 1, str(run)
    doc = run.json()
    assert [h["host"] for h in doc["hosts"]] == [
        "ws-5090", "train-node", "infer-node", "dead-node", "blackholed-node"]
    for h in doc["hosts"]:
        assert README_HOST_KEYS <= set(h), h["host"]
        for g in h["gpus"]:
            assert README_GPU_KEYS <= set(g)
            for p in g["processes"]:
                assert README_PROC_KEYS <= set(p)
        for holder in h["holders"]:
            assert README_HOLDER_KEYS <= set(holder)
    for name in ("dead-node", "blackholed-node"):
        h = run.host(name)
        assert h["ok"] is False and h["error"] and h["gpus"] == [] and h["holders"] == []

    train = run.host("train-node")
    assert train["ok"] is True and train["error"] is None
    used = fleet.train.gpu_used()
    assert [g["memory_used_mib"] for g in train["gpus"]] == used == [WORKER_MIB] * 4 + TRAINER_MIB
    uuids = fleet.train.smi("--query-gpu=index,uuid", "--format=csv,noheader").stdout.split("\n")
    assert [g["uuid"] for g in train["gpus"]] == [line.split(", ")[1] for line in uuids if line]
    for n, worker in enumerate(fleet.workers):
        g = train["gpus"][n]
        assert g["memory_total_mib"] == 49140
        assert (g["attributed_mib"], g["unattributed_mib"]) == (WORKER_MIB, 0)
        assert [(p["pid"], p["name"], p["used_mib"], p["user"], p["starttime"])
                for p in g["processes"]] == [
            (worker, "VLLM::Worker_TP%d" % n, WORKER_MIB, "root", worker.starttime)]
    for i, mib in zip(range(4, 8), TRAINER_MIB):
        assert [(p["pid"], p["name"], p["used_mib"]) for p in train["gpus"][i]["processes"]] == [
            (fleet.trainer, "trainer", mib)]
    holders = {h["pid"]: h for h in train["holders"]}
    assert set(holders) == {fleet.engine, fleet.trainer, *fleet.workers}
    assert holders[fleet.engine]["listed_by_nvidia_smi"] is False
    assert holders[fleet.engine]["name"] == "VLLM::EngineCore_DP0"
    assert {"/dev/nvidia%d" % i for i in range(8)} <= set(holders[fleet.engine]["devices"])
    assert all(holders[w]["listed_by_nvidia_smi"] for w in fleet.workers)

    ws = run.host("ws-5090")
    assert ws["facts"]["wsl2"] is True
    assert ws["facts"]["nvidia_smi"] == "/usr/lib/wsl/lib/nvidia-smi"
    (g,) = ws["gpus"]
    assert (g["name"], g["memory_total_mib"], g["memory_used_mib"]) == (
        "NVIDIA GeForce RTX 5090", WSL_TOTAL, WSL_GHOST)
    assert (g["unattributed_mib"], g["expected_unattributed_mib"]) == (WSL_GHOST, WSL_GHOST)
    assert g["processes"] == []

    infer = run.host("infer-node")
    assert infer["ok"] is True
    assert infer["facts"]["nvidia_smi"] == INFER_SMI  # found by the default search
    assert [[p["pid"] for p in g["processes"]] for g in infer["gpus"]] == [[fleet.server]] * 2
    assert [g["memory_used_mib"] for g in infer["gpus"]] == INFER_MIB
    assert isinstance(doc.get("seconds"), (int, float))


def test_inference_node_nvidia_smi_is_really_off_path(fleet: Any) -> None:
    """The premise of the default search: `nvidia-smi` alone does not resolve on that host."""
    res = fleet.infer.ssh("command -v nvidia-smi || echo missing")
    assert res.stdout.strip() == "missing", res


def test_wsl2_reservation_is_flagged_when_the_inventory_expects_none(fleet: Any, lab: Any,
                                                                    home: Path) -> None:
    inv = lab.inventory_yaml([fleet.ws], unattributed_mib=0)
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 0, str(run)
    row = rows_of(parse_table(run.stdout, HEADER), "ws-5090")["0"]
    assert row["UNATTR (MiB)"] == "%d !" % WSL_GHOST
    assert lines_after_table(run.stdout, HEADER)[0] == (
        "hosts: 1 ok, 0 failed; GPUs: 1 busy, 0 free; health: 1 OK")
    doc = run_gpufleet(home, inv, "status", "--json").host("ws-5090")
    (g,) = doc["gpus"]
    assert (g["unattributed_mib"], g["expected_unattributed_mib"]) == (WSL_GHOST, 0)


def test_exit_0_when_every_selected_host_answers(fleet: Any) -> None:
    run = run_gpufleet(fleet.home, fleet.inv, "status", "--host", "train-node", "--host", "*infer*")
    assert run.rc == 0, str(run)
    assert {r["HOST"] for r in parse_table(run.stdout, HEADER)} == {"train-node", "infer-node"}


@pytest.mark.parametrize("args, fragments", [
    (["--host", "nosuch"], ["no host matches 'nosuch'"]),
    (["--host", "train-nod"], ["'train-nod'", "did you mean 'train-node'"]),
    (["--host", "nosuch", "--host", "train-node"], ["nosuch"]),
    (["-g", "nosuch-group"], ["nosuch-group"]),
])
def test_selection_errors_are_one_line_and_exit_2(fleet: Any, args: list[str],
                                                   fragments: list[str]) -> None:
    run = run_gpufleet(fleet.home, fleet.inv, "status", *args)
    assert_one_line_error(run, *fragments)
    assert run.stdout == ""


# --- host keys --------------------------------------------------------------------------------


def test_unknown_host_key_under_strict_is_a_row_error_with_its_fingerprint(
        lab: Any, make_host: Any, home: Path) -> None:
    stranger = make_host("stranger", gpus=1)
    known = make_host("known", gpus=1)
    empty = home / "empty_known_hosts"
    empty.write_text("")
    inv = lab.inventory_yaml([stranger, known], stranger={"known_hosts_file": str(empty)})
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 1, str(run)
    rows = parse_table(run.stdout, HEADER)
    assert rows_of(rows, "known")["0"]["MEMORY (MiB)"] == "0 / 49140"
    assert rows_of(rows, "stranger")["-"]["HOLDERS"].startswith("ERROR: unknown host key")
    # the whole error, with the key's SHA256 fingerprint, is printed below the table
    assert sha256_fingerprint(stranger.host_key_line) in run.stdout, str(run)
    doc = run_gpufleet(home, inv, "status", "--json")
    assert doc.host("stranger")["ok"] is False
    assert sha256_fingerprint(stranger.host_key_line) in doc.host("stranger")["error"]
    assert doc.host("known")["ok"] is True
    assert not (home / ".config" / "gpufleet" / "known_hosts").exists() or \
        stranger.host_key_line.split()[2] not in (home / ".config/gpufleet/known_hosts").read_text()


def test_accept_new_records_the_key_under_home_and_strict_reads_it_back(
        lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("newcomer", gpus=1)
    empty = home / "empty_known_hosts"
    empty.write_text("")
    inv = lab.inventory_yaml([host], known_hosts_file=str(empty), host_key_policy="accept-new")
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 0, str(run)
    recorded = (home / ".config" / "gpufleet" / "known_hosts").read_text()
    _, keytype, key = host.host_key_line.split()
    assert any(line.split()[-2:] == [keytype, key] and "127.0.0.1" in line.split()[0]
               and str(host.port) in line.split()[0] for line in recorded.splitlines()), recorded
    assert empty.read_text() == ""  # the inventory's file is not written
    strict = lab.inventory_yaml([host], known_hosts_file=str(empty), host_key_policy="strict")
    again = run_gpufleet(home, strict, "status")
    assert again.rc == 0, str(again)


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_changed_host_key_is_refused_under_both_policies(lab: Any, make_host: Any, home: Path,
                                                        policy: str) -> None:
    host = make_host("rekeyed", gpus=1)
    other = make_host("steady", gpus=1)
    wrong = home / "wrong_known_hosts"
    wrong.write_text(lab.wrong_host_key_line(host) + "\n")
    inv = lab.inventory_yaml([host, other], rekeyed={"known_hosts_file": str(wrong),
                                                      "host_key_policy": policy})
    run = run_gpufleet(home, inv, "status", "--json")
    assert run.rc == 1, str(run)
    doc = run.host("rekeyed")
    assert doc["ok"] is False and "CHANGED" in doc["error"], doc
    assert sha256_fingerprint(host.host_key_line) in doc["error"]
    assert run.host("steady")["ok"] is True
    wrong_line = wrong.read_text()
    assert host.host_key_line.split()[2] not in wrong_line  # nothing "fixed" the file
    gpufleet_kh = home / ".config" / "gpufleet" / "known_hosts"
    assert not gpufleet_kh.exists() or host.host_key_line.split()[2] not in gpufleet_kh.read_text()


# --- what a non-root user can and cannot see ---------------------------------------------------


@pytest.fixture
def nonroot_host(lab: Any, make_host: Any) -> Any:
    host = make_host("shared-box", gpus=2)
    host.mine = host.spawn_holder(gpus=[0], mib=1000, title="my-notebook", user=lab.user)
    host.roots = host.spawn_holder(gpus=[1], mib=2000, title="root-job")
    host.inv = lab.inventory_yaml([host], user=lab.user)
    return host


def test_non_root_user_sees_own_holder_and_is_warned_about_hidden_ones(
        nonroot_host: Any, home: Path, lab: Any) -> None:
    host = nonroot_host
    run = run_gpufleet(home, host.inv, "status", "--json")
    assert run.rc == 0, str(run)
    doc = run.host("shared-box")
    assert doc["facts"]["is_root"] is False and doc["facts"]["user"] == lab.user
    holders = {h["pid"]: h for h in doc["holders"]}
    assert host.mine in holders and holders[host.mine]["name"] == "my-notebook"
    # root's process: nvidia-smi still lists it, but its file descriptors are unreadable
    assert host.roots not in holders
    assert [(p["pid"], p["user"], p["used_mib"]) for p in doc["gpus"][1]["processes"]] == [
        (host.roots, "root", 2000)]
    # ... and the host says that holders it cannot read may be hidden
    assert any("hidden" in w for w in doc["warnings"]), doc["warnings"]

    table = run_gpufleet(home, host.inv, "status")
    rows = rows_of(parse_table(table.stdout, HEADER), "shared-box")
    assert rows["0"]["HOLDERS"] == "%d %s 1000MiB my-notebook" % (host.mine, lab.user)
    assert rows["1"]["HOLDERS"] == "%d root 2000MiB root-job" % host.roots
    assert host.alive(host.mine) and host.alive(host.roots)


def test_non_root_warning_is_shown_in_the_table_when_it_could_matter(nonroot_host: Any,
                                                                      home: Path) -> None:
    """A warning that cries wolf is not read: with every GPU's memory listed by nvidia-smi, the processes whose
    files cannot be read hide no memory: the warning stays in JSON, off the screen. Memory
    that nobody explains brings it back."""
    run = run_gpufleet(home, nonroot_host.inv, "status")
    assert run.rc == 0, str(run)
    assert "hidden" not in run.output, str(run)
    doc = run_gpufleet(home, nonroot_host.inv, "status", "--json").host("shared-box")
    assert any("would be hidden" in w for w in doc["warnings"])
    assert doc["fd_unreadable"] and all("(not root)" in u["reason"] for u in doc["fd_unreadable"])
    nonroot_host.set_config(ghost_mib={"1": 3000})
    run = run_gpufleet(home, nonroot_host.inv, "status")
    assert "warning" not in run.stdout, str(run)  # on stderr: a grep over the rows never meets it
    assert [ln.split(": warning: ")[0] for ln in run.stderr.splitlines()
            if "warning: cannot read the open files of" in ln] == ["shared-box"], str(run)


# --- hidden PIDs and broken hosts ---------------------------------------------------------------


def test_hidden_pids_memory_is_unattributed_and_device_holders_marked_fd(
        lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("container-host", gpus=2, hidden_pids=True)
    job = host.spawn_holder(gpus=[0], mib=3000, title="hidden-job")
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 0, str(run)
    rows = rows_of(parse_table(run.stdout, HEADER), "container-host")
    assert rows["0"]["MEMORY (MiB)"] == "3000 / 49140"
    assert rows["0"]["UNATTR (MiB)"] == "3000 !"
    assert rows["0"]["HOLDERS"] == "-"  # nvidia-smi lists nobody
    assert rows["1"]["UNATTR (MiB)"] == "0"
    # its device files are what shows it (CUDA opens every GPU's file)
    assert rows["fd"]["HOLDERS"] == "%d root (fd: GPUs 0-1) hidden-job" % job
    doc = run_gpufleet(home, inv, "status", "--json").host("container-host")
    assert doc["gpus"][0]["processes"] == []
    assert (doc["gpus"][0]["attributed_mib"], doc["gpus"][0]["unattributed_mib"]) == (0, 3000)
    assert [(h["pid"], h["listed_by_nvidia_smi"]) for h in doc["holders"]] == [(job, False)]


def test_broken_hosts_are_one_row_each_and_the_rest_is_complete(
        lab: Any, make_host: Any, home: Path) -> None:
    healthy = make_host("healthy", gpus=2)
    job = healthy.spawn_holder(gpus=[1], mib=900, title="job")
    broken = make_host("broken-driver", gpus=2, driver="fail")
    garbage = make_host("garbled-driver", gpus=2, driver="garbage", nvml=False)  # nvidia-smi's garbage
    nopy = make_host("no-python", gpus=2, python3=False)
    assert broken.smi().returncode == 9  # the lab's premise: the recorded exit status
    inv = lab.inventory_yaml([broken, garbage, nopy, healthy])
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 1, str(run)
    assert_no_traceback(run)
    rows = parse_table(run.stdout, HEADER)
    for name in ("broken-driver", "garbled-driver", "no-python"):
        assert list(rows_of(rows, name)) == ["-"], name
    assert "couldn't communicate with the NVIDIA driver" in \
        rows_of(rows, "broken-driver")["-"]["HOLDERS"]
    assert rows_of(rows, "garbled-driver")["-"]["HOLDERS"].startswith("ERROR: unparsable nvidia-smi")
    assert "python3 not found" in rows_of(rows, "no-python")["-"]["HOLDERS"]
    good = rows_of(rows, "healthy")
    assert good["1"]["HOLDERS"] == "%d root 900MiB job" % job and good["0"]["HOLDERS"] == "-"
    assert lines_after_table(run.stdout, HEADER)[0] == (
        "hosts: 1 ok, 3 failed; GPUs: 1 busy, 1 free; health: 2 OK; host findings: 1 CRITICAL")

    doc = run_gpufleet(home, inv, "status", "--json")
    assert doc.rc == 1
    assert_no_traceback(doc)
    assert [h["ok"] for h in doc.json()["hosts"]] == [False, False, False, True]
    assert "couldn't communicate with the NVIDIA driver" in doc.host("broken-driver")["error"]
    assert "unparsable" in doc.host("garbled-driver")["error"]
    assert "python3 not found" in doc.host("no-python")["error"]


def test_hanging_driver_is_bounded_by_command_timeout(lab: Any, make_host: Any, home: Path) -> None:
    hung = make_host("hung-driver", gpus=2, driver="hang")
    healthy = make_host("healthy", gpus=1)
    command_timeout = 6
    inv = lab.inventory_yaml([hung, healthy], command_timeout=command_timeout)
    run = run_gpufleet(home, inv, "status", "--json")
    assert run.rc == 1, str(run)
    assert run.seconds < command_timeout + 40, str(run)  # a hang never ends
    doc = run.host("hung-driver")
    assert doc["ok"] is False and "timed out" in doc["error"], doc
    assert run.host("healthy")["ok"] is True
    # nothing the agent started outlives it: no nvidia-smi left hanging on the host
    left = {pid: argv for pid, argv in host_pids(hung).items()
            if any("nvidia_smi" in a or "nvidia-smi" in a for a in argv)}
    assert left == {}, left


def test_holders_say_what_runs_and_whose_it_is_and_the_plan_too(lab: Any, make_host: Any,
                                                               home: Path) -> None:
    """A trainer started as `python3 train_dflash.py ...` by the lab user: comm is python3,
    which says nothing when every job is python3; status and the clean plan show the script,
    its arguments and the user."""
    host = make_host("py-node", gpus=2)
    job = host.spawn_holder(gpus=[1], mib=3000, user=lab.user, argv=[
        "python3", "/home/%s/dflash/train_dflash.py" % lab.user, "--epochs", "3"])
    assert host.comm(job) == "python3"  # the premise: comm names the interpreter
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "status")
    assert run.rc == 0, str(run)
    row = rows_of(parse_table(run.stdout, HEADER), "py-node")["1"]
    assert row["HOLDERS"] == "%d %s 3000MiB train_dflash.py --epochs 3" % (job, lab.user), str(run)
    plan = run_gpufleet(home, inv, "clean", "--all", "--gpus", "1", "--dry-run")
    assert plan.rc == 0, str(plan)
    target = [line for line in plan.stdout.splitlines() if line.split()[:1] == [str(job)]]
    assert target and lab.user in target[0].split() and \
        target[0].rstrip().endswith("train_dflash.py --epochs 3"), str(plan)
    assert "COMMAND" in plan.stdout and "USER" in plan.stdout
