"""A zombie leader whose threads hold the GPU, on a real GPU (tests/gpu/gpu_zombie.py): the
clean signals it and says `clean`. Skips without a GPU, like test_real_gpu.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_scenario  # noqa: E402  (stdlib only at import)

_WHY = gpu_scenario.gpu_unavailable()
if _WHY:
    pytest.skip("real-GPU zombie-leader check: %s" % _WHY, allow_module_level=True)

import gpu_zombie  # noqa: E402

pytestmark = pytest.mark.gpu


def test_a_zombie_leader_that_holds_the_gpu_is_cleaned(tmp_path: Path) -> None:
    out = Path(os.environ.get("GPUFLEET_GPU_OUT") or tmp_path)
    doc = gpu_zombie.Run(out).run()
    failed = [(c["name"], c["detail"]) for c in doc["checks"] if not c["ok"]]
    assert doc["checks"] and not failed, failed
