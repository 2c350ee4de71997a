"""`gpufleet fit` as a table: one row per GPU (or per failed host), the detail lines under it."""
from __future__ import annotations

from typing import Any, Optional

from gpufleet.core.fit import FitReport
from gpufleet.render.common import error_cell
from gpufleet.render.table import render_table

HEADERS = ["HOST", "GPU", "TOTAL", "FREE", "VLLM FREE", "REQUESTED", "START-UP", "KV CACHE",
           "MAX UTIL", "MIN UTIL", "VERDICT"]


def _cell(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def table_rows(report: FitReport) -> list[list[Any]]:
    """One row per GPU, in host order; a host that could not be checked is one error row."""
    rows: list[list[Any]] = []
    for hf in report.hosts:
        if hf.error is not None:
            rows.append([hf.host, "-", "", "", "", "", "", "", "", "", error_cell(hf.error, "error", width=None)])
            continue
        for r in hf.results:
            rows.append([
                hf.host, r.index, _cell(r.total_gib), _cell(r.free_host_gib), _cell(r.free_gib),
                _cell(r.requested_gib), "pass" if r.startup_ok else "FAIL",
                # in parentheses: what vLLM would compute, were start-up not to stop it first
                _cell(r.kv_cache_gib, "{:.2f}" if r.startup_ok else "({:.2f})"),
                _cell(r.max_util_startup, "{:.3f}"), _cell(r.min_util_kv, "{:.3f}"), r.verdict,
            ])
    return rows


def render_text(report: FitReport) -> str:
    """The table, then one line per suggestion / note."""
    text = render_table(table_rows(report), HEADERS, numparse=False)
    return text + ("\n\n" + "\n".join(report.details) if report.details else "")


__all__ = ["HEADERS", "render_text", "table_rows"]
