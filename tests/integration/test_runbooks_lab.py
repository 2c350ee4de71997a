"""The three shipped runbooks, run by `gpufleet run` over real SSH against the test lab.

Lab hosts have no systemd. The unit steps run a FAKE systemctl that this module writes into
the host's private /root (a tmpfs of that host only) and that the runbook is pointed at with
``-e SYSTEMCTL=/root/bin/systemctl`` (model-swap's vars switch; docs/runbooks.md says so). The
fake keeps a unit's processes in /root/units: ``start`` launches a fakecuda holder (memory on
the unit's GPUs, as a vLLM would) and, when the unit has a health port, a small HTTP server
answering /health after a delay; ``stop`` ends exactly the process groups it started.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest


from fake_systemctl import install_systemctl, unit_pids  # tests/lab, on sys.path via conftest

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = REPO / "playbooks"




def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# HOME of the CLI runs: the retry files a run writes (~/.local/state/gpufleet/retry/) stay here.
HOME = Path(tempfile.mkdtemp(prefix="gf-runbooks-home-"))


@pytest.fixture(scope="module", autouse=True)
def _remove_home() -> Iterator[None]:
    yield
    shutil.rmtree(HOME, ignore_errors=True)


def gpufleet(inventory: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The real CLI in a child process: real exit codes, stdin not a terminal."""
    return subprocess.run(
        [sys.executable, "-c", "from gpufleet.cli import main; main()", "-i", str(inventory), *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(REPO),
        env=dict(os.environ, HOME=str(HOME)))


def outcomes(doc: dict, host: str) -> list[str]:
    run = next(h for h in doc["hosts"] if h["host"] == host)
    return [s["outcome"] for s in run["steps"]]


def step(doc: dict, host: str, name: str) -> dict:
    run = next(h for h in doc["hosts"] if h["host"] == host)
    return next(s for s in run["steps"] if s["name"] == name)


def ssh_logins(host: Any) -> int:
    return (host.dir / "sshd.log").read_text().count("Accepted publickey")


def _wait(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


# ----------------------------------------------------------------------------- model-swap


def _swap_host(make_host: Any, name: str, health: Optional[int], health_delay: float = 1.0) -> tuple[Any, str]:
    host = make_host(name, gpus=4)
    systemctl = install_systemctl(host, {
        "vllm-minimax": {"gpus": [0, 1, 2, 3], "mib": 40000, "title": "VLLM::Worker"},
        "vllm-kimi": {"gpus": [0, 1, 2, 3], "mib": 30000, "title": "VLLM::Worker",
                      "health_port": health, "health_delay": health_delay},
    })
    res = host.exec([systemctl, "start", "vllm-minimax.service"])
    assert res.returncode == 0, res.stderr
    assert host.gpu_used() == [40000] * 4
    return host, systemctl


def _swap_args(host: Any, systemctl: str, port: int, *extra: str) -> list[str]:
    return ["run", str(PLAYBOOKS / "model-swap.yaml"), "--host", host.name,
            "-e", "OLD_UNIT=vllm-minimax", "-e", "NEW_UNIT=vllm-kimi", "-e", f"SYSTEMCTL={systemctl}",
            "-e", f"HEALTH_URL=http://127.0.0.1:{port}/health",
            "-e", "NEW_PARAMS=7B", "-e", "NEW_DTYPE=bf16", "-e", "NEW_TP=4",
            "-e", "HEALTH_INTERVAL=0.25", *extra]


def test_model_swap_end_to_end(lab: Any, make_host: Any) -> None:
    port = _free_port()
    host, systemctl = _swap_host(make_host, "blackwell", port)
    old = unit_pids(host, "vllm-minimax")
    # A worker left over from an earlier crash, outside any unit: the clean step must free it.
    stray = host.spawn_holder(gpus=[2], mib=3000, title="VLLM::Worker_TP2", via="exec")
    shm = host.path("/dev/shm/nccl-stale-1")
    shm.write_bytes(b"x" * 4096)
    os.utime(shm, (time.time() - 3600, time.time() - 3600))
    inv = lab.inventory_yaml([host])
    logins = ssh_logins(host)

    res = gpufleet(inv, *_swap_args(host, systemctl, port, "-e", "START_TIMEOUT=60", "--yes", "--json"))

    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["runbook"] == "model-swap" and doc["ok"] is True
    assert outcomes(doc, "blackwell") == ["ok"] * 8  # the health gate first
    assert [s["kind"] for s in doc["hosts"][0]["steps"]] == [
        "health", "stop_units", "clean", "wait_free", "clear_shm", "fit", "start_unit", "wait_http"]
    assert all(not host.alive(p) for p in old)
    assert not host.alive(stray)
    assert "TERM 1" in step(doc, "blackwell", "free GPUs")["detail"]
    assert not shm.exists()
    assert "nccl-stale-1" in step(doc, "blackwell", "clear /dev/shm")["detail"]
    new = unit_pids(host, "vllm-kimi")
    assert new and all(host.alive(p) for p in new)
    assert host.gpu_used() == [30000] * 4
    assert f"127.0.0.1:{port}/health answered HTTP 200" in step(doc, "blackwell", "new model healthy")["detail"]
    assert "stopped vllm-minimax.service" in step(doc, "blackwell", "stop old unit")["detail"]
    # One SSH connection for the whole runbook (seven steps, many execs).
    assert ssh_logins(host) - logins == 1
    calls = host.path("/root/units/calls.log").read_text()
    # Each systemctl command ran exactly once, as an argv (no shell in between).
    assert calls.count("--no-ask-password stop -- vllm-minimax.service\n") == 1
    assert calls.count("--no-ask-password start -- vllm-kimi.service\n") == 1
    assert calls.count("--no-ask-password is-active -- vllm-minimax.service\n") == 1


def test_model_swap_failed_step_stops_the_host_and_skips_the_rest(lab: Any, make_host: Any) -> None:
    port = _free_port()
    host, systemctl = _swap_host(make_host, "swap-bad-unit", port)
    old = unit_pids(host, "vllm-minimax")
    inv = lab.inventory_yaml([host])
    args = _swap_args(host, systemctl, port, "--yes", "--json")
    args[args.index("OLD_UNIT=vllm-minimax")] = "OLD_UNIT=vllm-typo"

    res = gpufleet(inv, *args)

    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["ok", "failed"] + ["skipped"] * 6  # gate passed
    assert "not loaded" in step(doc, host.name, "stop old unit")["detail"]
    assert doc["hosts"][0]["ok"] is False and "stop old unit" in doc["hosts"][0]["error"]
    # Nothing after the failure ran: the old model still holds its GPUs.
    assert all(host.alive(p) for p in old)
    assert host.gpu_used() == [40000] * 4
    assert unit_pids(host, "vllm-kimi") == []


def test_model_swap_unhealthy_new_model_fails_the_last_step(lab: Any, make_host: Any) -> None:
    host, systemctl = _swap_host(make_host, "swap-unhealthy", None)
    inv = lab.inventory_yaml([host])
    port = _free_port()  # nothing will ever listen here

    started = time.monotonic()
    res = gpufleet(inv, *_swap_args(host, systemctl, port, "-e", "START_TIMEOUT=4", "--yes", "--json"))

    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["ok"] * 7 + ["failed"]
    detail = step(doc, host.name, "new model healthy")["detail"]
    assert f"127.0.0.1:{port}/health not HTTP 200" in detail and "refused" in detail.lower()
    assert step(doc, host.name, "new model healthy")["seconds"] < 10
    assert time.monotonic() - started < 60


def test_model_swap_dry_run_and_missing_yes_touch_nothing(lab: Any, make_host: Any) -> None:
    port = _free_port()
    host, systemctl = _swap_host(make_host, "swap-dry", port)
    old = unit_pids(host, "vllm-minimax")
    inv = lab.inventory_yaml([host])
    logins = ssh_logins(host)

    dry = gpufleet(inv, *_swap_args(host, systemctl, port, "--dry-run"))
    assert dry.returncode == 0, dry.stderr
    lines = [ln for ln in dry.stdout.splitlines() if ln.startswith(host.name)]
    assert len(lines) == 8 and all(" planned " in ln for ln in lines)
    assert "stop vllm-minimax.service with /root/bin/systemctl" in dry.stdout
    assert "start vllm-kimi.service" in dry.stdout

    no_yes = gpufleet(inv, *_swap_args(host, systemctl, port))
    assert no_yes.returncode == 2
    assert "no --yes" in no_yes.stderr and "planned" in no_yes.stdout

    assert ssh_logins(host) == logins  # neither connected
    assert all(host.alive(p) for p in old)
    assert host.gpu_used() == [40000] * 4
    assert not host.path("/root/units/calls.log").read_text().count("stop")


def test_runbook_hosts_run_in_parallel_and_fail_alone(lab: Any, make_host: Any) -> None:
    """Two hosts: one swaps, the other fails its first step; each keeps its own outcome."""
    port = _free_port()
    good, systemctl = _swap_host(make_host, "par-good", port, health_delay=0.5)
    bad = make_host("par-bad", gpus=4)  # no fake systemctl here: the step fails on this host
    bad_holder = bad.spawn_holder(gpus=[0], mib=1000, via="exec")
    inv = lab.inventory_yaml([good, bad])
    args = _swap_args(good, systemctl, port, "--yes", "--json")
    args[args.index("--host") + 1] = "par-*"

    res = gpufleet(inv, *args)

    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert [h["host"] for h in doc["hosts"]] == ["par-good", "par-bad"]
    assert outcomes(doc, "par-good") == ["ok"] * 8
    assert outcomes(doc, "par-bad") == ["ok", "failed"] + ["skipped"] * 6
    assert "systemctl" in step(doc, "par-bad", "stop old unit")["detail"]
    assert bad.alive(bad_holder)
    assert good.gpu_used() == [30000] * 4


# ----------------------------------------------------------------------------- pre-train


def _pretrain_host(make_host: Any, name: str) -> tuple[Any, Any, Any]:
    host = make_host(name, gpus=8)
    vllm = host.spawn_vllm(gpus=[0, 1, 2, 3], mib=20000, via="exec")
    train = host.spawn_holder(gpus=[4, 5, 6, 7], mib=30000, title="train_dflash", via="exec")
    assert host.gpu_used() == [20000] * 4 + [30000] * 4
    return host, vllm, train


def test_pre_train_cleans_0_3_and_proves_4_7_untouched(lab: Any, make_host: Any) -> None:
    host, vllm, train = _pretrain_host(make_host, "node-a")
    inv = lab.inventory_yaml([host])

    res = gpufleet(inv, "run", str(PLAYBOOKS / "pre-train.yaml"), "--host", host.name, "--yes", "--json")

    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["ok"] * 5
    # Every process with GPU evidence is gone (the API server holds none; a clean leaves it).
    assert all(not host.alive(p) for p in vllm.family()[1:])
    assert host.alive(train)
    assert host.gpu_used() == [0] * 4 + [30000] * 4
    untouched = step(doc, host.name, "training untouched")["detail"]
    assert f"train_dflash {int(train)}" in untouched and "ok" in untouched
    assert "no holders on 0-3: ok" in step(doc, host.name, "GPUs free")["detail"]


def test_pre_train_refuses_a_process_spanning_the_line(lab: Any, make_host: Any) -> None:
    """A process with memory on GPU 3 AND 4 must not be killed by a clean of 0-3: the clean
    step fails, the proof steps are skipped, and the training keeps running."""
    host, vllm, train = _pretrain_host(make_host, "node-span")
    spanning = host.spawn_holder(gpus=[3, 4], mib=1000, title="eval_job", via="exec")
    inv = lab.inventory_yaml([host])

    res = gpufleet(inv, "run", str(PLAYBOOKS / "pre-train.yaml"), "--host", host.name,
                   "-e", "CLEAN_TIMEOUT=3", "-e", "GRACE=1", "--yes", "--json")

    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["ok", "failed", "skipped", "skipped", "skipped"]
    detail = step(doc, host.name, "free GPUs")["detail"]
    assert detail.startswith("dirty:")
    assert f"{int(spanning)} eval_job" in detail and "spans GPUs 3,4" in detail
    assert host.alive(spanning) and host.alive(train)


def test_pre_train_without_training_still_cleans(lab: Any, make_host: Any) -> None:
    """Nothing on 4-7 at the start: nothing there can be lost, so `holders_alive_on: 4-7`
    holds (it used to fail the run) and 0-3 are freed."""
    host = make_host("node-idle", gpus=8)
    vllm = host.spawn_vllm(gpus=[0, 1, 2, 3], mib=20000, via="exec")
    inv = lab.inventory_yaml([host])

    res = gpufleet(inv, "run", str(PLAYBOOKS / "pre-train.yaml"), "--host", host.name, "--yes",
                   "--json")

    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["ok"] * 5
    assert step(doc, host.name, "training untouched")["detail"] == (
        "holders alive on 4-7: ok (nothing held these GPUs at the start)")
    assert all(not host.alive(p) for p in vllm.family()[1:])
    assert host.gpu_used() == [0] * 8


def test_wait_free_fraction_leaves_the_reservation_out(lab: Any, make_host: Any,
                                                        tmp_path: Path) -> None:
    """A GPU with 4000 of 49140 MiB reserved is idle: free 45140 is all it can ever have, so
    `min_free_fraction: 0.99` holds at once (free / total was 0.919: it waited, then failed)."""
    host = make_host("rb-reserved", gpus=2, total_mib=49140, reserved_mib=4000)
    inv = lab.inventory_yaml([host])
    book = tmp_path / "free.yaml"
    book.write_text("steps:\n  - {name: idle, kind: wait_free, min_free_fraction: 0.99, "
                    "poll: 0.5, timeout: 3}\n  - {name: proof, kind: assert, that: "
                    "{free_fraction_min: 0.99}}\n")

    res = gpufleet(inv, "run", str(book), "--host", host.name, "--json")

    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["ok", "ok"]
    assert "free after" in step(doc, host.name, "idle")["detail"]


# ----------------------------------------------------------------------------- wsl2-preflight


def test_wsl2_preflight_reports_the_reservation_and_fits(lab: Any, make_host: Any) -> None:
    host = make_host("bigmama", gpus=1, wsl2=True, gpu_name="NVIDIA GeForce RTX 5090",
                     total_mib=32607, reserved_mib=0, ghost_mib=1680)
    inv = lab.inventory_yaml([host], bigmama={"unattributed_mib": 1680})

    # Read-only: runs without --yes even though stdin is not a terminal.
    res = gpufleet(inv, "run", str(PLAYBOOKS / "wsl2-preflight.yaml"), "--host", "bigmama", "--json")

    assert res.returncode == 1, res.stdout + res.stderr  # 14B does not fit: a failed step
    doc = json.loads(res.stdout)
    assert outcomes(doc, "bigmama") == ["ok", "failed", "ok"]  # the 7B check still ran
    report = step(doc, "bigmama", "reservation")["detail"]
    assert report.startswith("WSL2;")
    assert "reservation (unattributed) 1680 MiB (expected 1680)" in report
    assert "used 1680 MiB of 32607 MiB" in report
    assert "does not fit" in step(doc, "bigmama", "fit 14B fp16")["detail"]
    assert "fits" in step(doc, "bigmama", "fit 7B fp16")["detail"]


def test_unreachable_host_skips_every_step(lab: Any) -> None:
    dead = lab.dead_host("rb-dead")
    inv = lab.inventory_yaml([dead], connect_timeout=2)

    res = gpufleet(inv, "run", str(PLAYBOOKS / "wsl2-preflight.yaml"), "--json")

    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert doc["hosts"][0]["ok"] is False and "refused" in doc["hosts"][0]["error"]
    assert outcomes(doc, "rb-dead") == ["skipped"] * 3


def test_validation_error_names_file_line_and_step_and_contacts_nobody(lab: Any, make_host: Any,
                                                                         tmp_path: Path) -> None:
    host = make_host("rb-valid", gpus=1)
    inv = lab.inventory_yaml([host])
    logins = ssh_logins(host)
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps:\n  - name: free\n    kind: clean\n    gpus: 0-3\n    grase: 5\n")

    res = gpufleet(inv, "run", str(bad), "--yes")

    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"gpufleet: error: {bad}:5: step 1 'free' (clean): unknown key 'grase' for a clean step "
        "(did you mean 'grace'?) (keys: name, kind, timeout, continue_on_failure, gpus, grace, "
        "tolerance_mib, protect, include_spanning, stop_units, disable_units, shm, reset)")
    assert ssh_logins(host) == logins


def test_a_clean_step_does_not_wait_its_timeout_for_memory_nothing_can_free(
        lab: Any, make_host: Any, tmp_path: Path) -> None:
    """5000 MiB no process explains (a driver's, another PID namespace's): the step's clean
    signals nothing and ends once the release window has passed, as `gpufleet clean` does,
    not after its 30 s timeout; it fails and says why."""
    host = make_host("rb-ghost", gpus=1, ghost_mib={0: 5000})
    inv = lab.inventory_yaml([host])
    book = tmp_path / "free.yaml"
    book.write_text("steps:\n  - {name: free, kind: clean, grace: 1, timeout: 30}\n")

    started = time.monotonic()
    res = gpufleet(inv, "run", str(book), "--host", host.name, "--yes", "--json")
    took = time.monotonic() - started

    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert outcomes(doc, host.name) == ["failed"]
    assert "5000 MiB no process here explains" in step(doc, host.name, "free")["detail"]
    assert took < 20, took  # the whole run; the step's timeout alone is 30 s
