"""render_table is tabulate's "simple" format, with tabulate imported only when a table is drawn."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tabulate import tabulate

from gpufleet.render.table import render_table

REPO_ROOT = Path(__file__).resolve().parents[2]


def simple(rows: list[list[Any]], headers: list[Any], numparse: bool = True) -> str:
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=not numparse)


def test_the_simple_format_itself() -> None:
    """Numbers right-aligned on the point, text left, a dashed rule, two spaces between columns."""
    assert render_table([["a", 1, "2.5"], ["bbb", 10, "0.25"]], ["X", "N", "F"]) == (
        "X      N     F\n"
        "---  ---  ----\n"
        "a      1  2.5\n"
        "bbb   10  0.25")


@pytest.mark.parametrize("rows, headers", [
    ([["workstation", 0, "NVIDIA GeForce RTX 5090", "3000MiB / 31.8GiB", "0%", "train.py 7 3000MiB"],
      ["dead", "-", "ERROR: connect refused …", "", "", ""]],
     ["HOST", "GPU", "NAME", "MEMORY", "UTIL", "HOLDERS"]),
    ([["漢字のホスト", 0, "é\u0301"], ["h", 1, "ｗｉｄｅ"]], ["HOST", "GPU", "名前"]),  # wide, combining
    ([["", None, ""], [None, "x", None]], ["A", "B", "C"]),  # empty cells
    ([["VLLM::Worker 6\nVLLM::Worker_TP0 12", "58.6GiB"]], ["HOLDERS", "MiB"]),  # multi-line
    ([], ["NAME", "ADDRESS", "PORT"]),  # no rows
])
@pytest.mark.parametrize("numparse", [True, False])
def test_tables_are_tabulates(rows: list[list[Any]], headers: list[str], numparse: bool) -> None:
    assert render_table(rows, headers, numparse=numparse) == simple(rows, headers, numparse)


def test_numparse_false_keeps_gpu_lists_and_exponents_as_written() -> None:
    text = render_table([["0,1", "1e3"]], ["GPUS", "X"], numparse=False)
    assert text.splitlines()[-1] == "0,1     1e3"
    assert render_table([["1e3"]], ["X"]).splitlines()[-1] == "1000"


def test_tabulate_is_imported_by_the_first_table_not_before() -> None:
    code = ("import sys\nfrom gpufleet.render.table import render_table\n"
            "print('tabulate' in sys.modules)\n"
            "render_table([['a', 1]], ['X', 'Y'])\n"
            "print('tabulate' in sys.modules)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False", "True"]
