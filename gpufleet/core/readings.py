"""Which health readings a GPU gave (pure): a reading that could not be taken is unknown.

A GPU whose every reading is ``None`` (the nvidia-smi path of an older driver, a consumer GPU
without ECC, an agent before the health readings) has no finding at all, and "no finding"
must not read as OK: the health gate would pass a GPU it never looked at. So each group of
readings is either taken or unknown, and core/health.py turns "none taken" into UNKNOWN and
"some not taken" into a finding that names them.

Groups (docs/health.md, "Readings"): ECC (volatile or aggregate uncorrected count), memory
retirement (row remapping, or page retirement on GPUs before it: the H200's NVML answers
NOT_SUPPORTED for retired pages and has remapped rows), the PCIe link (current and maximum,
generation or width) and the clocks event reasons. Persistence mode is a setting, not a
reading of the GPU's soundness, and counts for neither.
"""
from __future__ import annotations

from gpufleet.core.model import GpuInfo

ECC = "ecc"
RETIREMENT = "row_remapping"
PCIE = "pcie_link"
CLOCKS = "clocks_events"
READINGS = (ECC, RETIREMENT, PCIE, CLOCKS)
LABELS = {ECC: "ECC", RETIREMENT: "row remapping", PCIE: "PCIe link", CLOCKS: "clocks events"}


def taken(gpu: GpuInfo) -> dict[str, bool]:
    """Reading group -> whether the GPU answered it."""
    pcie = ((gpu.pcie_gen_current is not None and gpu.pcie_gen_max is not None)
            or (gpu.pcie_width_current is not None and gpu.pcie_width_max is not None))
    return {
        ECC: gpu.ecc_uncorrected_volatile is not None or gpu.ecc_uncorrected_aggregate is not None,
        RETIREMENT: any(v is not None for v in (
            gpu.remapped_rows_pending, gpu.remapped_rows_failure,
            gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable,
            gpu.retired_pages_pending)),
        PCIE: pcie,
        CLOCKS: gpu.clocks_event_reasons is not None or gpu.clocks_event_names is not None,
    }


def unknown(gpu: GpuInfo) -> tuple[str, ...]:
    """The reading groups this GPU did not answer, in READINGS order."""
    got = taken(gpu)
    return tuple(r for r in READINGS if not got[r])


def describe(groups: tuple[str, ...]) -> str:
    """``ECC, row remapping`` for a finding's message."""
    return ", ".join(LABELS[g] for g in groups)
