"""Every table gpufleet prints: tabulate's "simple" format.

tabulate (and the wcwidth it loads) is imported inside ``render_table``, on the first table
drawn, so ``--json``, ``--help`` and the commands that print no table never pay its import.
"""
from __future__ import annotations

from typing import Any, Sequence


def render_table(rows: Sequence[Sequence[Any]], headers: Sequence[Any], numparse: bool = True) -> str:
    """``rows`` under ``headers`` in tabulate's "simple" format; ``numparse=False`` keeps
    cells such as ``1e3`` or ``0,1`` as written (GPU lists, names) instead of reading numbers."""
    from tabulate import tabulate

    return tabulate([list(r) for r in rows], headers=list(headers), tablefmt="simple",
                    disable_numparse=not numparse)


__all__ = ["render_table"]
