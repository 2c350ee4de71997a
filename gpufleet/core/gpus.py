"""GPU index lists: the one parser of ``--gpus`` (and runbook ``gpus:``) and its two display
formats (pure).

Two formats are shown today and both are part of the visible output: ``format_gpu_ranges``
(``0-3,5``: tables, runbooks, the syntax ``--gpus`` reads back) and ``format_gpu_indices``
(``0,1,2,3,5``: the clean planner's refusal and verdict texts).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

from gpufleet.errors import UsageError

MAX_GPU_INDEX = 1023  # bounds `0-99999999` before it is expanded

_GPU_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")


def format_gpu_ranges(indices: Iterable[int]) -> str:
    """Compact ranges: ``[0, 1, 2, 3, 5]`` -> ``"0-3,5"`` (the syntax ``--gpus`` reads)."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def format_gpu_indices(indices: Iterable[int]) -> str:
    """Every index, sorted and unique: ``[3, 0, 1, 1]`` -> ``"0,1,3"`` (the planner's texts)."""
    return ",".join(str(i) for i in sorted(set(indices)))


def parse_gpu_list(
    text: str,
    available: Optional[Iterable[int]] = None,
    host: Optional[str] = None,
) -> Optional[tuple[int, ...]]:
    """Parse ``--gpus``: ``all`` -> None (every GPU); ``0-3``, ``0,2,5``, ``0-1,4`` -> sorted
    unique indices. With ``available`` (the host's nvidia-smi indices), an index the host does
    not have is an error naming ``host``.
    """
    if not isinstance(text, str):
        raise UsageError(f"--gpus: expected text like 0-3, 0,2,5 or all, got {text!r}")
    stripped = text.strip()
    if stripped.lower() == "all":
        return None
    if not stripped:
        raise UsageError("--gpus: empty GPU list (use e.g. 0-3, 0,2,5 or all)")
    found: set[int] = set()
    for part in stripped.split(","):
        found.update(_parse_item(text, part.strip()))
    result = tuple(sorted(found))
    if available is not None:
        check_available(result, set(available), host)
    return result


def _parse_item(text: str, item: str) -> range:
    m = _GPU_ITEM.match(item)
    if not m:
        raise UsageError(f"--gpus: invalid GPU list {text!r} at {item!r} "
                         "(use e.g. 0-3, 0,2,5, 0-1,4 or all)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise UsageError(f"--gpus: reversed range {item!r} (write {hi}-{lo})")
    if hi > MAX_GPU_INDEX:
        raise UsageError(f"--gpus: GPU index {hi} is too large (at most {MAX_GPU_INDEX})")
    return range(lo, hi + 1)


def check_available(result: Iterable[int], have: set[int], host: Optional[str]) -> None:
    """A GPU the host lacks is the command line's mistake (UsageError, exit 2), the same for
    every command: clean must not act anywhere on a list that names GPUs a host does not
    have, and fit says it the same way."""
    where = f" on {host}" if host else ""
    has = f"has {format_gpu_ranges(have)}" if have else "has no GPUs"
    for index in result:
        if index not in have:
            raise UsageError(f"GPU {index} does not exist{where} ({has})")


__all__ = ["MAX_GPU_INDEX", "check_available", "format_gpu_indices", "format_gpu_ranges",
           "parse_gpu_list"]
