"""CUDA MPS on a lab host: the real CLI over real SSH frees the MPS clients and never signals
the control daemon or its server (tests/lab/fakemps/fakemps.c: root's binaries named
nvidia-cuda-mps-control and nvidia-cuda-mps-server, as recorded on the H200 in
tests/fixtures/real-h200/clean-cases/probe-1.log part C).

Before the rule, `clean --yes` planned the daemon (the parent of the listed server: the
family root) and ended it, and its server with it: MPS down for every client.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import home, run_gpufleet, signals_of, sshd_pid  # noqa: F401 (fixture)

FAST = ("--grace", "1", "--timeout", "15")
SERVER_MIB = 66  # the H200's recorded server row
CLIENT_MIB = 3588
# measured on H200s: memory.used = listed memory + 3 MiB + 6 MiB per listed process (model.py)
DRIVER = {"unlisted_mib_base": 3, "unlisted_mib_per_process": 6}


@pytest.fixture
def mps_host(make_host: Any) -> Any:
    """2 H200s: MPS on GPU 0 (daemon, server 66 MiB, a client 3588 MiB), a plain job on 1."""
    host = make_host("mps-node", gpus=2, gpu_name="NVIDIA H200", total_mib=143771, **DRIVER)
    host.mps = host.spawn_mps(gpus=[0], server_mib=SERVER_MIB)
    host.client = host.spawn_holder(gpus=[0], mib=CLIENT_MIB, mps=host.mps, via="exec")
    host.other = host.spawn_holder(gpus=[1], mib=5000, title="trainer", via="exec")
    return host


def stop_command(notes: list[str]) -> str:
    """The command the plan's MPS note gives for stopping MPS."""
    note = next((n for n in notes if n.startswith("CUDA MPS runs here")), None)
    assert note is not None, notes
    m = re.search(r"\(quit waits while any is connected\): (echo quit \| \S+ \S+)", note)
    assert m, note
    return m.group(1)


def test_clean_signals_only_the_mps_client_and_says_how_to_stop_mps(lab: Any, mps_host: Any,
                                                                    home: Path) -> None:
    host, mps = mps_host, mps_host.mps
    sshd = sshd_pid(host)
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "clean", "--host", host.name, "--gpus", "0", "--yes", "--json",
                       *FAST, timeout=120)
    doc = run.host(host.name)
    assert run.rc == 0 and doc["verdict"] == "clean", json.dumps(doc)[:3000]
    assert [t["pid"] for t in doc["targets"]] == [host.client]
    assert {s["pid"] for s in doc["signals"]} == {host.client}
    assert signals_of(doc, mps.daemon) == [] and signals_of(doc, mps.server) == []
    refused = {r["pid"]: r["kind"] for r in doc["refused"]}
    assert refused == {mps.daemon: "protected", mps.server: "protected"}, doc["refused"]
    assert not host.alive(host.client)
    assert host.alive(mps.daemon) and host.alive(mps.server) and host.alive(host.other)
    assert host.alive(sshd)
    # the server's memory (and the driver's share for it) is what is left, and expected
    assert host.gpu_used()[0] == SERVER_MIB + 3 + 6
    assert doc["left_mib"] == SERVER_MIB + 3 + 6
    # MPS still serves: the daemon lists its server, and the note's command stops it
    assert mps.ask("get_server_list").stdout.split() == [str(mps.server)]
    command = stop_command(doc["plan_notes"])
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps " in command, command
    quit_run = host.ssh(command, timeout=30)
    assert quit_run.returncode == 0, quit_run.stderr
    assert host.wait_gone(mps.daemon, 10) and host.wait_gone(mps.server, 10)
    assert host.gpu_used()[0] == 0 and host.alive(host.other)


def test_status_shows_the_servers_memory_as_expected(lab: Any, mps_host: Any, home: Path) -> None:
    host, mps = mps_host, mps_host.mps
    host.kill(host.client)
    assert host.wait_gone(host.client, 10)
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "status", "--json")
    assert run.rc == 0, str(run)
    gpu0 = run.json()["hosts"][0]["gpus"][0]
    assert gpu0["mps_server_mib"] == SERVER_MIB
    assert [p["pid"] for p in gpu0["processes"]] == [mps.server]
    table = run_gpufleet(home, inv, "status")
    assert f"{mps.server} root 66MiB (MPS server) nvidia-cuda-mps-server" in table.stdout, \
        table.stdout
    assert "GPUs: 1 busy, 1 free" in table.stdout, table.stdout  # GPU 0: only MPS is left


def test_where_nvml_lists_only_the_server_the_daemons_lists_name_the_clients(
        lab: Any, mps_host: Any, home: Path) -> None:
    """Some drivers and containers list only the server, its row holding its clients'
    memory: the agent asks the daemon (get_server_list, get_client_list) through its own
    binary and pipe directory, and the client is signalled."""
    host, mps = mps_host, mps_host.mps
    host.set_config(mps_server_only=True)
    apps = host.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    assert apps.stdout.split() == [f"{mps.server},", str(SERVER_MIB + CLIENT_MIB), f"{host.other},",
                                   "5000"], apps.stdout
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "clean", "--host", host.name, "--gpus", "0", "--yes", "--json",
                       *FAST, timeout=120)
    doc = run.host(host.name)
    assert [(t["pid"], t["evidence"]) for t in doc["targets"]] == [(host.client, "mps-client")]
    assert run.rc == 0 and doc["verdict"] == "clean", json.dumps(doc)[:3000]
    assert not host.alive(host.client)
    assert host.alive(mps.daemon) and host.alive(mps.server) and host.alive(host.other)


def test_a_pipe_directory_a_user_made_first_is_not_asked(lab: Any, make_host: Any,
                                                         home: Path) -> None:
    """A user pre-creates /tmp/nvidia-mps before root starts MPS: the daemon uses it, and
    anyone could answer on a pipe there; the agent does not ask, and names no client."""
    host = make_host("mps-trap", gpus=1, gpu_name="NVIDIA H200", total_mib=143771, **DRIVER)
    host.exec(["mkdir", "-m", "0777", "/tmp/nvidia-mps"], user="nobody", check=True)
    mps = host.spawn_mps(gpus=[0], server_mib=SERVER_MIB)
    client = host.spawn_holder(gpus=[0], mib=CLIENT_MIB, mps=mps, via="exec")
    host.set_config(mps_server_only=True)
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "clean", "--host", host.name, "--yes", "--json", "--dry-run",
                       timeout=120)
    doc = run.host(host.name)
    assert doc["targets"] == [], json.dumps(doc)[:3000]
    notes = " ".join(doc["plan_notes"])
    assert "CUDA_MPS_PIPE_DIRECTORY=" not in notes and "default /tmp/nvidia-mps" in notes
    assert host.alive(client) and host.alive(mps.daemon)
