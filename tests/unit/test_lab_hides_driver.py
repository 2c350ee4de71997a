"""The lab's hosts must never see the machine's real NVIDIA driver (the GPU machine has one):
tests/lab/lab_init.py finds the real libnvidia-ml / nvidia-smi files to whiteout, not the fakes."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
import lab_init  # noqa: E402


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A machine with a real driver in two places, and the ld.so cache naming a third."""
    nvidia = tmp_path / "usr/local/nvidia/lib64"
    multiarch = tmp_path / "usr/lib/x86_64-linux-gnu"
    cached = tmp_path / "opt/drv"
    for d in (nvidia, multiarch, cached):
        d.mkdir(parents=True)
    (nvidia / "libnvidia-ml.so.580.159.04").write_bytes(b"real")
    os.symlink("libnvidia-ml.so.580.159.04", nvidia / "libnvidia-ml.so.1")
    (nvidia / "libcuda.so.1").write_bytes(b"other")
    (cached / "libnvidia-ml.so.1").write_bytes(b"real")
    smi = tmp_path / "usr/local/nvidia/bin/nvidia-smi"
    smi.parent.mkdir(parents=True)
    smi.write_bytes(b"#!real")
    monkeypatch.setattr(lab_init, "REAL_NVML_PLACES", (str(nvidia), str(multiarch)))
    monkeypatch.setattr(lab_init, "REAL_SMI_PLACES", (str(smi), str(tmp_path / "usr/bin/nvidia-smi")))
    monkeypatch.setattr(lab_init, "_ldconfig_nvml", lambda: [str(cached / "libnvidia-ml.so.1")])
    return tmp_path


def test_real_driver_files_are_found_and_fakes_are_not(machine):
    fake = machine / "usr/lib/x86_64-linux-gnu"
    (fake / "libnvidia-ml.so.580.159.04").write_bytes(b"fake")
    os.symlink("libnvidia-ml.so.580.159.04", fake / "libnvidia-ml.so.1")
    found = lab_init.real_driver_files({"nvml": str(fake / "libnvidia-ml.so.1"), "nvidia_smi": None})
    assert found == sorted([
        str(machine / "opt/drv/libnvidia-ml.so.1"),
        str(machine / "usr/local/nvidia/bin/nvidia-smi"),
        str(machine / "usr/local/nvidia/lib64/libnvidia-ml.so.1"),
        str(machine / "usr/local/nvidia/lib64/libnvidia-ml.so.580.159.04"),
    ])


def test_a_host_whose_fake_smi_sits_where_the_real_one_was_keeps_it(machine):
    smi = str(machine / "usr/local/nvidia/bin/nvidia-smi")
    found = lab_init.real_driver_files({"nvml": None, "nvidia_smi": smi})
    assert smi not in found
    assert str(machine / "opt/drv/libnvidia-ml.so.1") in found


def test_a_machine_without_a_driver_hides_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(lab_init, "REAL_NVML_PLACES", (str(tmp_path / "none"),))
    monkeypatch.setattr(lab_init, "REAL_SMI_PLACES", (str(tmp_path / "none/nvidia-smi"),))
    monkeypatch.setattr(lab_init, "_ldconfig_nvml", lambda: [])
    assert lab_init.real_driver_files({"nvml": None, "nvidia_smi": None}) == []
