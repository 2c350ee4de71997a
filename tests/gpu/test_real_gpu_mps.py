"""CUDA MPS on a real GPU (tests/gpu/gpu_mps.py): `clean --yes` frees the MPS client, never
signals the control daemon or its server, says clean with the server's memory expected, and
the plan's way of stopping MPS works. Skips without a GPU, torch or nvidia-cuda-mps-control.

    GPUFLEET_GPU_OUT=DIR   keep mps-results.json and the CLI documents there (default: tmp)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scenario  # noqa: E402  (stdlib only at import)

_WHY = gpu_scenario.gpu_unavailable()
if _WHY:
    pytest.skip("real-GPU MPS check: %s" % _WHY, allow_module_level=True)

import gpu_mps  # noqa: E402

_MPS = gpu_mps.find_mps()
if _MPS is None:
    pytest.skip("real-GPU MPS check: no nvidia-cuda-mps-control on this machine",
                allow_module_level=True)

pytestmark = pytest.mark.gpu


def test_clean_frees_the_mps_client_and_leaves_mps_running(tmp_path: Path) -> None:
    out = Path(os.environ.get("GPUFLEET_GPU_OUT") or tmp_path)
    doc = gpu_mps.Run(out, _MPS).run()
    failed = [(c["name"], c["detail"]) for c in doc["checks"] if not c["ok"]]
    assert doc["checks"] and not failed, failed
    assert doc["seconds"] < 90, doc["seconds"]
