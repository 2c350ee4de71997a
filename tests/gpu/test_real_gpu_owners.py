"""A supervisor that restarts its torch child on a real GPU (tests/gpu/gpu_owners.py): the
clean says `retaken` at once, and `--owner` stops the supervisor first. Skips without a GPU,
like test_real_gpu.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scenario  # noqa: E402  (stdlib only at import)

_WHY = gpu_scenario.gpu_unavailable()
if _WHY:
    pytest.skip("real-GPU owners check: %s" % _WHY, allow_module_level=True)

import gpu_owners  # noqa: E402

pytestmark = pytest.mark.gpu


def test_a_restarting_supervisor_is_retaken_then_stopped_by_owner(tmp_path: Path) -> None:
    out = Path(os.environ.get("GPUFLEET_GPU_OUT") or tmp_path)
    doc = gpu_owners.Run(out).run()
    failed = [(c["name"], c["detail"]) for c in doc["checks"] if not c["ok"]]
    assert doc["checks"] and not failed, failed
