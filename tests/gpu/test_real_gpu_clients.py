"""GPU clients on a real GPU (tests/gpu/gpu_clients.py): an NVML poller, a cuInit-only process
and an nvidia-smi loop survive a full `clean --yes`; concurrent status runs show no ghost
holders. Skips without a GPU, like test_real_gpu.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scenario  # noqa: E402  (stdlib only at import)

_WHY = gpu_scenario.gpu_unavailable()
if _WHY:
    pytest.skip("real-GPU clients check: %s" % _WHY, allow_module_level=True)

import gpu_clients  # noqa: E402

pytestmark = pytest.mark.gpu


def test_clients_survive_a_full_clean_and_no_ghost_holders(tmp_path: Path) -> None:
    out = Path(os.environ.get("GPUFLEET_GPU_OUT") or tmp_path)
    doc = gpu_clients.Run(out).run()
    failed = [(c["name"], c["detail"]) for c in doc["checks"] if not c["ok"]]
    assert doc["checks"] and not failed, failed
