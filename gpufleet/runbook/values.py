"""Runbook field values only runbooks have: the `fit` step's dtype, parameter count, GiB and
tensor-parallel size (pure).

Every other value type (seconds, MiB, GPU lists, units, URLs, argv, ...) is validated by the
family shared with the inventory, gpufleet.config.validators; gpufleet.runbook.kinds wires
each step field to its validator.
"""
from __future__ import annotations

from typing import Any

from gpufleet.config.validators import Fail, describe, did_you_mean, number, plain_string
from gpufleet.errors import UsageError

__all__ = ["Fail", "v_dtype", "v_gib", "v_params", "v_positive_int"]


def v_dtype(value: Any, fail: Fail) -> str:
    from gpufleet.core.fit import DTYPE_BYTES

    text = plain_string(value, fail, "a dtype").strip().lower()
    if text not in DTYPE_BYTES:
        fail(f"unknown dtype {value!r}{did_you_mean(text, sorted(DTYPE_BYTES))} "
             f"(known: {', '.join(sorted(DTYPE_BYTES))})")
    return text


def v_params(value: Any, fail: Fail) -> float:
    """A parameter count as `gpufleet fit --params` reads it: 14B, 7b, 500M, 14e9."""
    from gpufleet.core.fit import parse_params

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        fail(f"expected a parameter count like 14B, 7b or 14e9, got {describe(value)}")
    try:
        return parse_params(str(value))
    except UsageError as exc:
        fail(str(exc).replace("--params ", "", 1))


def v_gib(value: Any, fail: Fail) -> float:
    v = number(value, fail, "a number of GiB >= 0")
    if not 0 <= v <= 1e6:
        fail(f"expected a number of GiB >= 0, got {value!r}")
    return float(v)


def v_positive_int(value: Any, fail: Fail) -> int:
    v = number(value, fail, "a whole number >= 1", integer=True)
    if v < 1 or v > 1024:
        fail(f"expected a whole number 1-1024, got {value!r}")
    return int(v)
