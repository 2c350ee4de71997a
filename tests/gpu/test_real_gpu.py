"""gpufleet against real NVIDIA GPUs and real CUDA holders (tests/gpu/gpu_scenario.py).

Skips (at collection, whatever CI says) on a machine without nvidia-smi, torch or a GPU: CI
machines have none, and this scenario is run by hand on a GPU machine (docs/real-gpu.md has the
command and the results). One scenario run serves every test below; each test asserts the
checks of one phase, so a failure names what went wrong on the real driver.

    GPUFLEET_GPU_OUT=DIR        keep results.json, log.txt and fixtures/ there (default: tmp)
    GPUFLEET_GPU_ROUNDS=N       timed rounds with the SIGTERM-ignoring holder (default 2)
    GPUFLEET_GPU_LIGHT_ROUNDS=N timed rounds of the vLLM-like family alone (default 1)
    GPUFLEET_GPU_GRACE=S        --grace of the timed rounds (default 2)
    GPUFLEET_GPU_SSH_STATE=DIR  tests/gpu/ossh.sh's state dir: round 1 also through SSH (its sshd
    GPUFLEET_GPU_SSH_PORT=PORT  on 127.0.0.1:PORT, default 2222), the same checks, "[ssh] ..."
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scenario  # noqa: E402  (stdlib only at import; never touches CUDA)

_WHY = gpu_scenario.gpu_unavailable()
if _WHY:
    pytest.skip("real-GPU scenario: %s" % _WHY, allow_module_level=True)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    out = Path(os.environ.get("GPUFLEET_GPU_OUT") or tmp_path_factory.mktemp("gpu"))
    return gpu_scenario.Scenario(
        out,
        rounds=int(os.environ.get("GPUFLEET_GPU_ROUNDS", "2")),
        light_rounds=int(os.environ.get("GPUFLEET_GPU_LIGHT_ROUNDS", "1")),
        grace=float(os.environ.get("GPUFLEET_GPU_GRACE", "2")),
        time_budget_s=float(os.environ.get("GPUFLEET_GPU_BUDGET", "420")),
        ssh_state=Path(os.environ["GPUFLEET_GPU_SSH_STATE"]) if os.environ.get("GPUFLEET_GPU_SSH_STATE") else None,
        ssh_port=int(os.environ.get("GPUFLEET_GPU_SSH_PORT", "2222")),
    ).run()


def _failed(res, *phases):
    return [(c["name"], c["detail"]) for c in res["checks"] if c["phase"] in phases and not c["ok"]]


def _ran(res, *phases):
    return [c for c in res["checks"] if c["phase"] in phases]


def test_scenario_ran_without_errors(scenario):
    assert not scenario["errors"], "\n".join(scenario["errors"])


def test_background_trainer_holds_every_device_file_but_is_listed_on_its_gpu(scenario):
    if not scenario.get("background", {}).get("trainer_pid"):
        pytest.skip("one GPU: no trainer on GPU 1")
    assert _ran(scenario, "background")
    assert not _failed(scenario, "background")


def test_status_lists_every_holder_on_its_gpu_with_nvidia_smi_memory(scenario):
    assert _ran(scenario, "status")
    assert not _failed(scenario, "status")


def test_clean_gpu0_frees_it_and_leaves_the_trainer(scenario):
    assert _ran(scenario, "clean")
    assert not _failed(scenario, "clean")


def test_timed_cleans_all_verified(scenario):
    timed = [r for r in scenario["rounds"] if not r.get("checked", r["round"] == 1)]
    assert timed, "no timed round ran"
    assert not _failed(scenario, "clean-timed")
    assert all(r["verdict"] == "clean" for r in timed)


def test_round_one_through_ssh_passes_the_same_checks(scenario):
    """With GPUFLEET_GPU_SSH_STATE, status and clean also ran over real SSH (ossh.sh's sshd),
    every local check of round 1 repeated there."""
    if not os.environ.get("GPUFLEET_GPU_SSH_STATE"):
        pytest.skip("GPUFLEET_GPU_SSH_STATE not set: no sshd on this machine (tests/gpu/ossh.sh)")
    via = [r for r in scenario["rounds"] if r.get("transport") == "ssh"]
    assert via and via[0]["verdict"] == "clean", via
    local = {c["name"] for c in _ran(scenario, "status", "clean") if not c["name"].startswith("[ssh] ")}
    ssh = {c["name"][len("[ssh] "):] for c in _ran(scenario, "status", "clean") if c["name"].startswith("[ssh] ")}
    assert local and local <= ssh, sorted(local - ssh)
    assert not _failed(scenario, "status", "clean")


def test_driver_release_floor_measured(scenario):
    floor = scenario.get("floor") or []
    assert floor and all(f["signal_to_free_s"] is not None for f in floor), floor


def test_fit_agrees_with_what_cuda_sees(scenario):
    assert _ran(scenario, "fit")
    assert not _failed(scenario, "fit")
