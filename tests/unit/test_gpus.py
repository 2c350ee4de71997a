"""gpufleet.core.gpus: the one GPU-list parser and its two display formats."""
from __future__ import annotations

from gpufleet.config import selection
from gpufleet.core import gpus


def test_indices_format_is_the_planners() -> None:
    """One definition: core/plan and core/verdict use core/gpus', and keep no copy."""
    from pathlib import Path

    from gpufleet.core import plan

    assert plan.format_gpu_indices is gpus.format_gpu_indices
    core = Path(plan.__file__).resolve().parent.parent
    for path in [*core.joinpath("plan").glob("*.py"), core / "verdict.py", core / "policy.py"]:
        assert "def fmt_gpus" not in path.read_text(), path


def test_the_two_formats() -> None:
    assert gpus.format_gpu_ranges([5, 0, 1, 2, 3, 3]) == "0-3,5"
    assert gpus.format_gpu_indices([5, 0, 1, 2, 3, 3]) == "0,1,2,3,5"
    assert gpus.format_gpu_ranges([]) == gpus.format_gpu_indices([]) == ""


def test_selection_names_are_the_core_functions() -> None:
    assert selection.parse_gpu_list is gpus.parse_gpu_list
    assert selection.format_gpu_list is gpus.format_gpu_ranges
    assert selection.MAX_GPU_INDEX == gpus.MAX_GPU_INDEX
