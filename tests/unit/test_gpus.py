"""gpufleet.core.gpus: the one GPU-list parser and its two display formats."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpufleet.config import selection
from gpufleet.core import gpus
from gpufleet.core.plan import fmt_gpus

indices = st.lists(st.integers(min_value=0, max_value=64), max_size=12)


@given(indices)
def test_indices_format_is_the_planners(values: list[int]) -> None:
    # core/plan keeps its own fmt_gpus until the bug-fix branches are merged; then it imports this
    assert gpus.format_gpu_indices(values) == fmt_gpus(values)


def test_the_two_formats() -> None:
    assert gpus.format_gpu_ranges([5, 0, 1, 2, 3, 3]) == "0-3,5"
    assert gpus.format_gpu_indices([5, 0, 1, 2, 3, 3]) == "0,1,2,3,5"
    assert gpus.format_gpu_ranges([]) == gpus.format_gpu_indices([]) == ""


def test_selection_names_are_the_core_functions() -> None:
    assert selection.parse_gpu_list is gpus.parse_gpu_list
    assert selection.format_gpu_list is gpus.format_gpu_ranges
    assert selection.MAX_GPU_INDEX == gpus.MAX_GPU_INDEX
