"""The agent's NVML reader (gpufleet/remote/nvml.py) against the lab's fake libnvidia-ml.so.1.

The same fake GPU state is read twice by the agent's own snapshot code: once through NVML, once
through the fake nvidia-smi (the fallback path); the GPU rows and compute apps must be the same
values (switching the reader must not move a number an operator sees). Failures (no library, init failing, a lost GPU, a
hung driver) are values in the document. No lab, no root needed: the state is a temporary
FAKEGPU_ROOT and holders are `sleep` processes of this machine.
"""
from __future__ import annotations

import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.core.model import parse_snapshot
from gpufleet.remote import nvml as agent_nvml
from gpufleet.remote.memwait import wait_memory
from gpufleet.remote.jobs import Deadline
from gpufleet.remote.main import parse_request
from gpufleet.remote.snapshot import snapshot

from test_fake_nvml import FAKE_SMI, SCENARIOS, State  # tests/unit/test_fake_nvml.py


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKEGPU_ROOT", str(tmp_path / "gpu"))
    s = State(tmp_path / "gpu")
    agent_nvml._STATE.clear()  # one library per agent process: each test is a new agent
    yield s
    nv = agent_nvml._STATE.get("nvml")
    if nv is not None:  # the library is shared by the process: leave it uninitialised, as
        nv.lib.nvmlShutdown()  # the other NVML tests expect (a hang is over by now)
    agent_nvml._STATE.clear()
    s.close()


@pytest.fixture
def fake_smi(tmp_path: Path) -> str:
    """An nvidia-smi executable: the lab's fake, run by this interpreter."""
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\nexec %s %s \"$@\"\n" % (sys.executable, FAKE_SMI))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def run_snapshot(**req: Any) -> dict:
    return snapshot(parse_request(__import__("json").dumps(dict({"mode": "snapshot"}, **req))),
                    Deadline(30))


def via_nvml(lib: Path) -> dict:
    return run_snapshot(gpu_source="nvml", nvml_library=str(lib))


def via_smi(smi: str) -> dict:
    return run_snapshot(gpu_source="nvidia-smi", nvidia_smi=smi)


COMPARED = ("index", "uuid", "name", "pci_bus_id", "memory_used_mib", "memory_total_mib",
            "memory_free_mib", "memory_reserved_mib", "utilization_pct")


def gpu_rows(doc: dict) -> list:
    return [{k: g[k] for k in COMPARED} for g in doc["gpus"]]


def apps(doc: dict) -> list:
    return sorted((a["pid"], a["process_name"], a["used_mib"], a["gpu_uuid"], a["gpu_index"])
                  for a in doc["compute_apps"])


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[f.__name__.strip("_") for f in SCENARIOS])
def test_nvml_and_nvidia_smi_paths_give_the_same_document(
        fake_nvml_library: Path, fake_smi: str, state: State, scenario: Any) -> None:
    scenario(state)
    nv = via_nvml(fake_nvml_library)
    smi = via_smi(fake_smi)
    assert nv["facts"]["gpu_source"] == "nvml" and nv["nvidia_smi"]["ok"], nv["nvidia_smi"]
    assert smi["facts"]["gpu_source"] == "nvidia-smi" and smi["nvidia_smi"]["ok"]
    assert gpu_rows(nv) == gpu_rows(smi)
    assert apps(nv) == apps(smi)
    assert nv["facts"]["driver_version"] == smi["facts"]["driver_version"]
    assert nv["facts"]["cuda_version"] == smi["facts"]["cuda_version"]
    parse_snapshot(nv)  # the controller reads it


def test_the_compared_scenarios_carry_real_numbers(fake_nvml_library: Path, state: State) -> None:
    SCENARIOS[1](state)  # holders: 3 H200s, 20 GiB + 1 GiB + 716 MiB
    doc = via_nvml(fake_nvml_library)
    assert [g["memory_used_mib"] for g in doc["gpus"]] == [21504, 0, 716]
    assert [g["memory_reserved_mib"] for g in doc["gpus"]] == [615, 616, 616]
    assert sorted(a["used_mib"] for a in doc["compute_apps"]) == [716, 1024, 20480]
    assert [g["minor"] for g in doc["gpus"]] == [0, 1, 2]
    g = doc["gpus"][0]
    assert g["persistence_mode"] is True and isinstance(g["temperature_c"], int)
    assert isinstance(g["power_w"], float) and g["nvml_errors"] == {}
    assert doc["nvml"]["library"] == str(fake_nvml_library) and doc["nvml"]["error"] is None


def test_process_names_are_argv0_like_nvidia_smi(fake_nvml_library: Path, fake_smi: str,
                                                 state: State) -> None:
    state.config(gpus=1)
    p = state.holder({"0": 512})
    doc = via_nvml(fake_nvml_library)
    assert [(a["pid"], a["process_name"]) for a in doc["compute_apps"]] == [(p.pid, "sleep")]


def test_auto_uses_nvml_and_says_nothing(fake_nvml_library: Path, state: State) -> None:
    doc = run_snapshot(nvml_library=str(fake_nvml_library))
    assert doc["facts"]["gpu_source"] == "nvml"
    assert doc["facts"]["gpu_source_reason"] is None


def test_auto_falls_back_to_nvidia_smi_when_the_library_is_missing(
        tmp_path: Path, fake_smi: str, state: State, monkeypatch: pytest.MonkeyPatch) -> None:
    state.config(gpus=2)
    missing = str(tmp_path / "no" / "libnvidia-ml.so.1")
    monkeypatch.setenv("PATH", str(Path(fake_smi).parent) + os.pathsep + os.environ["PATH"])
    doc = run_snapshot(nvml_library=missing)
    assert doc["facts"]["gpu_source"] == "nvidia-smi"
    assert doc["facts"]["gpu_source_reason"].startswith("NVML unavailable: ")
    assert missing in doc["facts"]["gpu_source_reason"]
    assert doc["nvidia_smi"]["ok"] and len(doc["gpus"]) == 2


def test_auto_falls_back_when_init_fails(fake_nvml_library: Path, fake_smi: str,
                                         state: State, monkeypatch: pytest.MonkeyPatch) -> None:
    state.config(nvml_init_error=18)  # NVML_ERROR_LIB_RM_VERSION_MISMATCH: the lab's "broken"
    monkeypatch.setenv("PATH", str(Path(fake_smi).parent) + os.pathsep + os.environ["PATH"])
    doc = run_snapshot(nvml_library=str(fake_nvml_library))
    assert doc["facts"]["gpu_source"] == "nvidia-smi"
    assert "nvmlInit" in doc["facts"]["gpu_source_reason"]
    assert "(18)" in doc["facts"]["gpu_source_reason"]
    assert doc["nvidia_smi"]["ok"]


def test_forced_nvml_never_falls_back(tmp_path: Path, fake_smi: str, state: State) -> None:
    doc = run_snapshot(gpu_source="nvml", nvml_library=str(tmp_path / "absent.so"),
                       nvidia_smi=fake_smi)
    assert doc["facts"]["gpu_source"] == "nvml"
    assert not doc["nvidia_smi"]["ok"] and doc["gpus"] == []
    assert "unavailable" in doc["nvidia_smi"]["error"]
    snap = parse_snapshot(doc)
    assert snap.gpu_reader == "NVML" and not snap.nvidia_smi_ok


def test_nvidia_smi_path_in_the_inventory_forces_nvidia_smi(
        fake_nvml_library: Path, fake_smi: str, state: State) -> None:
    doc = run_snapshot(nvidia_smi=fake_smi, nvml_library=str(fake_nvml_library))
    assert doc["facts"]["gpu_source"] == "nvidia-smi"
    assert "nvidia_smi is set" in doc["facts"]["gpu_source_reason"]
    # ... unless NVML is asked for by name
    doc = run_snapshot(nvidia_smi=fake_smi, nvml_library=str(fake_nvml_library),
                       gpu_source="nvml")
    assert doc["facts"]["gpu_source"] == "nvml" and doc["nvidia_smi"]["ok"]


def test_a_lost_gpu_is_a_value_and_fails_the_readings(fake_nvml_library: Path,
                                                       state: State) -> None:
    state.config(gpus=3, lost=[1])
    doc = via_nvml(fake_nvml_library)
    assert [g["index"] for g in doc["gpus"]] == [0, 2]
    assert doc["gpu_errors"] == [{"index": 1, "error": "GPU is lost (15)", "code": 15,
                                 "pci_bus_id": None}]  # no /proc/driver listing here
    assert not doc["nvidia_smi"]["ok"]  # a host with a lost GPU is not cleaned on half a view
    assert doc["nvidia_smi"]["error"] == "GPU 1: GPU is lost (15)"
    snap = parse_snapshot(doc)
    assert [(e.index, e.code) for e in snap.gpu_errors] == [(1, 15)]


def test_bad_request_values_are_refused() -> None:
    with pytest.raises(ValueError, match="gpu_source"):
        parse_request('{"gpu_source": "cuda"}')
    with pytest.raises(ValueError, match="nvml_library"):
        parse_request('{"nvml_library": 3}')


def test_a_hung_driver_is_bounded_and_the_library_is_not_called_again(
        fake_nvml_library: Path, state: State, monkeypatch: pytest.MonkeyPatch) -> None:
    state.config(gpus=1)
    nv, why = agent_nvml.open_nvml(str(fake_nvml_library))
    assert why is None
    state.config(hang=True)
    try:
        t0 = time.monotonic()
        doc = run_snapshot(gpu_source="nvml", nvml_library=str(fake_nvml_library),
                           smi_timeout_s=0.5)
        took = time.monotonic() - t0
        assert not doc["nvidia_smi"]["ok"]
        assert "did not answer" in doc["nvidia_smi"]["error"]
        assert took < 5.0, took  # bounded by smi_timeout_s, not by the fake's 10 minutes
        again = via_nvml(fake_nvml_library)  # wedged: not called again, says why
        assert "did not answer" in again["nvidia_smi"]["error"]
    finally:
        state.config(hang=False)


def _clean_req(**extra: Any) -> dict:
    raw = dict({"mode": "clean", "poll_s": 0.1, "timeout_s": 10, "grace_s": 1}, **extra)
    return parse_request(__import__("json").dumps(raw))


def test_memory_wait_polls_nvml_and_sees_the_release(fake_nvml_library: Path,
                                                     state: State) -> None:
    state.config(gpus=2, release_delay_s=0.4)
    p = state.holder({"1": 4000})
    req = _clean_req(gpu_source="nvml", nvml_library=str(fake_nvml_library))
    threading.Timer(0.2, p.kill).start()
    t0 = time.monotonic()
    out = wait_memory(req, [1], time.monotonic() + 10, Deadline(20))
    took = time.monotonic() - t0
    p.wait()
    assert out["ok"], out
    assert out["source"] == "nvml" and out["used_mib"] == {"1": 0}
    # a poll every 10-20 ms over ~0.6 s: far more polls than nvidia-smi's 0.1 s cadence allows
    assert out["polls"] > took / 0.1 + 2, (out["polls"], took)


def test_memory_wait_falls_back_to_nvidia_smi(fake_smi: str, state: State) -> None:
    state.config(gpus=1)
    req = _clean_req(gpu_source="nvidia-smi", nvidia_smi=fake_smi)
    out = wait_memory(req, [0], time.monotonic() + 5, Deadline(10))
    assert out["ok"] and out["source"] == "nvidia-smi" and out["polls"] == 1


def test_memory_wait_reports_a_gpu_nvml_does_not_have(fake_nvml_library: Path,
                                                      state: State) -> None:
    state.config(gpus=1)
    req = _clean_req(gpu_source="nvml", nvml_library=str(fake_nvml_library))
    out = wait_memory(req, [0, 5], time.monotonic() + 5, Deadline(10))
    assert not out["ok"] and out["error"] == "no GPU with index 5"


def test_handles_are_learned_once(fake_nvml_library: Path, state: State) -> None:
    state.config(gpus=2)
    via_nvml(fake_nvml_library)
    nv = agent_nvml._STATE["nvml"]
    first = dict(nv.handles)
    assert nv.minors == {0: 0, 1: 1}
    nv.minors[1] = 7  # a learned value is used, not read again
    doc = via_nvml(fake_nvml_library)
    assert nv.handles == first and sorted(first) == [0, 1]
    assert [g["minor"] for g in doc["gpus"]] == [0, 7]


def test_the_fakes_release_delay_holds_on_a_filesystem_without_hard_links(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first sighting of a death is kept where link(2) fails (EPERM): without it the
    delay never ended (fake nvidia-smi) or never started (fake NVML)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_smi_for_test", FAKE_SMI)
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)

    def no_links(src: str, dst: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(fake.os, "link", no_links)
    dead = str(tmp_path / "42.dead")
    first = fake.dead_since(dead, 2.0, 1000.0)
    assert first == 1000.0 and Path(dead).read_text().strip() == "1000.000000"
    assert fake.dead_since(dead, 2.0, 1001.5) == 1000.0  # the first sighting, not "now"


def test_a_snapshot_through_nvml_as_a_host_runs_it_imports_only_the_standard_library(
        fake_nvml_library: Path, state: Any) -> None:
    """The whole one-shot snapshot through NVML, run as a host runs it (bootstrap, loader,
    joined agent, ``-S -E -s``): every module it imports is the standard library's (the plain
    json, re, signal, threading and ctypes), none from a site directory, and it starts no
    process module (subprocess, traceback: loaded only where a command runs or an error is
    reported); its /proc scan runs while NVML loads on a thread, and it finds the holder."""
    import json
    import subprocess

    from gpufleet.remote import BOOTSTRAP, encode_request

    state.config(gpus=2, name="NVIDIA H200")
    p = state.holder({"0": 2048})
    payload = encode_request({"mode": "snapshot", "gpu_source": "nvml", "agent_cache": False,
                              "nvml_library": str(fake_nvml_library), "cuda_version": False})
    out = subprocess.run([sys.executable, "-S", "-E", "-s", "-X", "importtime", "-c", BOOTSTRAP],
                         input=payload, capture_output=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    loaded = {line.rsplit("|", 1)[1].strip() for line in out.stderr.decode().splitlines()
              if line.startswith("import time:") and line.count("|") == 2
              and not line.endswith("imported package")}  # not the log's header line
    assert {"ctypes", "json", "re", "signal", "threading"} <= loaded  # the log is read right
    outside = {m for m in loaded if m.split(".")[0] not in sys.stdlib_module_names}
    assert outside == set() and "site" not in loaded, outside
    assert loaded.isdisjoint({"subprocess", "traceback"}), loaded
    doc = json.loads(out.stdout)
    assert doc["facts"]["gpu_source"] == "nvml"
    assert [a["pid"] for a in doc["compute_apps"]] == [p.pid]
