"""`free_fraction` (wait_free's min_free_fraction, assert's bound) is free / (total - reserved).

Reserved memory is never free (recorded H200: total 143771, reserved 616, free 143156 when
idle), so comparing free with a total that includes it made an idle GPU with a large
reservation look partly used: a `min_free_fraction: 0.99` could never be met.
"""
from __future__ import annotations

import pytest

from gpufleet.runbook import run as runner
from gpufleet.core.model import parse_snapshot
from gpufleet.runbook.load import parse_runbook


def snap(used: int, total: int, reserved, free) -> object:
    return parse_snapshot({
        "agent_version": 1, "facts": {"hostname": "h"}, "nvidia_smi": {"ok": True},
        "gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "minor": 0,
                  "memory_used_mib": used, "memory_total_mib": total, "memory_free_mib": free,
                  "memory_reserved_mib": reserved}],
        "compute_apps": [], "holders": [], "processes": {}})


def test_idle_h200_is_entirely_free() -> None:
    # the recorded idle H200 (tests/fixtures/real-h200/smi-idle-query-gpu.csv)
    m = runner.gpu_metrics(snap(0, 143771, 616, 143156))[0]
    assert m["free_fraction"] == pytest.approx(143156 / 143155, abs=1e-5)  # real: off by 1 MiB
    assert m["free_fraction"] >= 0.9999


@pytest.mark.parametrize("reserved", [4000, 8000])
def test_a_large_reservation_is_not_used_memory(reserved: int) -> None:
    total = 49140
    idle = snap(0, total, reserved, total - reserved)
    assert runner.gpu_metrics(idle)[0]["free_fraction"] == 1.0
    half = snap((total - reserved) // 2, total, reserved, total - reserved - (total - reserved) // 2)
    assert runner.gpu_metrics(half)[0]["free_fraction"] == pytest.approx(0.5, abs=1e-4)
    that = parse_runbook("steps:\n  - {kind: assert, that: {free_fraction_min: 0.95}}\n"
                         ).steps[0].params["that"]
    assert [ok for ok, _ in runner.check_conditions(that, idle, None)] == [True]


def test_no_reservation_reported_uses_the_total() -> None:
    # WSL2 reports no memory.reserved: the total is all there is
    assert runner.gpu_metrics(snap(0, 32607, None, 32607))[0]["free_fraction"] == 1.0
