"""Where each GPU's memory went (pure): used = attributed + unattributed, the driver's own
share for the listed processes, and what CUDA MPS servers are expected to hold.

Its own module (not core/model.py) because it reads core/mps.py, which reads the model: the
model stays the parsed document and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gpufleet.core.model import Snapshot
from gpufleet.core.mps import expected_server_mib


# The driver's own memory for the processes on a GPU, which nvidia-smi counts in memory.used
# but lists under no process. Measured on H200s (driver 580.159.04), memory.used minus the sum
# of the listed used_memory, by number of CUDA processes N on the GPU:
#   N=1: 9 MiB (17149 - 17140, 621 - 612: tests/fixtures/real-h200/smi-background-*.csv,
#        smi-probe-gpu0-*.csv; 5647 - 5638: tests/fixtures/recorded/logs/h200-single-gpu.log);
#   N=2: 15 MiB (26651 - 26636: h200-single-gpu.log; 9243 - 9228: h200-two-gpus.log;
#        17767 - 17752: smi-probe-gpu1-*.csv);  N=3: 20 MiB (docs/real-gpu.md);
#   N=4: 26 MiB (12708 - 12682: smi-round1-pre-*.csv);  N=0: 0 (every idle capture).
# About 2 MiB + 6 MiB per process; 3 + 6 N bounds every capture.
DRIVER_BASE_MIB = 3
DRIVER_PER_PROCESS_MIB = 6


def driver_allowance_mib(processes: int) -> int:
    """Unattributed MiB the driver itself keeps for ``processes`` listed processes on one GPU
    (not hidden memory): 0 with none, else DRIVER_BASE_MIB + DRIVER_PER_PROCESS_MIB each."""
    n = int(processes)
    return 0 if n <= 0 else DRIVER_BASE_MIB + DRIVER_PER_PROCESS_MIB * n


@dataclass(frozen=True)
class GpuLedger:
    """Where one GPU's memory went: used = attributed + unattributed."""

    index: int
    total_mib: Optional[int]
    used_mib: Optional[int]
    attributed_mib: Optional[int]
    unattributed_mib: Optional[int]
    expected_unattributed_mib: int
    driver_allowance_mib: int = 0  # the driver's per-process share (driver_allowance_mib)
    mps_server_mib: int = 0  # attributed to CUDA MPS servers: expected while MPS runs

    @property
    def unexpected_mib(self) -> Optional[int]:
        """Unattributed beyond what the host is expected to have and what the driver keeps
        for the listed processes themselves."""
        if self.unattributed_mib is None:
            return None
        return max(0, self.unattributed_mib - self.expected_unattributed_mib
                   - self.driver_allowance_mib)


def ledger(snapshot: Snapshot, expected_unattributed_mib: int = 0) -> tuple[GpuLedger, ...]:
    """Per-GPU memory ledger; per-process memory that is "not available" leaves attribution
    unknown. Memory of CUDA MPS servers is expected while MPS runs (core/mps.py)."""
    mps = expected_server_mib(snapshot)
    rows = []
    for gpu in snapshot.gpus:
        apps = snapshot.apps_on(gpu.index)
        if any(a.used_mib is None for a in apps):
            attributed: Optional[int] = None
        else:
            attributed = sum(a.used_mib or 0 for a in apps)
        if gpu.memory_used_mib is None:
            unattributed = None
        elif attributed is None:
            unattributed = None
        else:
            unattributed = max(0, gpu.memory_used_mib - attributed)
        rows.append(
            GpuLedger(
                index=gpu.index,
                total_mib=gpu.memory_total_mib,
                used_mib=gpu.memory_used_mib,
                attributed_mib=attributed,
                unattributed_mib=unattributed,
                expected_unattributed_mib=expected_unattributed_mib,
                driver_allowance_mib=driver_allowance_mib(len({a.pid for a in apps})),
                mps_server_mib=mps.get(gpu.index, 0),
            )
        )
    return tuple(rows)
