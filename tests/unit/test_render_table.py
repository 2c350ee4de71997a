"""gpufleet's own table renderer (render/table.py) against tabulate, the library it replaces at
run time: the same rows and headers through both give the same bytes, for the tables
gpufleet prints (status, clean plans and outcomes, fit, health, hosts, runbooks) and for
generated rows full of what tabulate treats specially: numbers as text ("1e3", "1,000",
"inf", " 7 "), booleans, None, empty, multi-line, wide (CJK), combining and zero-width
characters, ANSI colour codes, tabs. tabulate is a test dependency only.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tabulate_mod = pytest.importorskip("tabulate")  # the reference (setup.cfg: test extra)

from gpufleet.render.table import NARROW, render_table  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def reference(rows: list[list[Any]], headers: list[Any], numparse: bool = True) -> str:
    return tabulate_mod.tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=not numparse)


def same(rows: list[list[Any]], headers: list[Any], numparse: bool = True) -> str:
    ours = render_table(rows, headers, numparse=numparse)
    assert ours == reference(rows, headers, numparse), (rows, headers, numparse)
    return ours


STATUS_HEADERS = ["HOST", "GPU", "NAME", "MEMORY", "UTIL", "UNATTRIBUTED", "HOLDERS", "HEALTH"]


@pytest.mark.parametrize("numparse", [True, False])
def test_tables_as_gpufleet_draws_them(numparse: bool) -> None:
    same([["workstation", 0, "NVIDIA GeForce RTX 5090", "3000MiB / 31.8GiB", "0%", "0MiB",
           "train.py 7 3000MiB", "OK"],
          ["workstation", "clients", "GPU clients (monitors, exporters): no memory", "", "", "",
           "nvtop 11 (fd: GPUs 0)", ""]], STATUS_HEADERS, numparse)
    same([["blackwell", 0, "NVIDIA RTX PRO 6000", "87.9GiB / 95.6GiB", "0%", "0MiB",
           "VLLM::Worker 6 58.6GiB\nVLLM::Worker_TP0 12 29.3GiB", "OK"],
          ["blackwell", 1, "NVIDIA RTX PRO 6000", "87.9GiB / 95.6GiB", "100%", "1680MiB (expected)",
           "-", "CRITICAL xid_79"],
          ["dead", "-", "ERROR: connect refused …", "", "", "", "", ""]], STATUS_HEADERS, numparse)
    same([["here", "(local)", "-", "-", "-", "-"], ["node01", "10.0.0.1", 2222, "root", "a,b", "-"],
          ["node02", "10.0.0.2", 22, "-", "-", "gpu"]],
         ["NAME", "ADDRESS", "PORT", "USER", "TAGS", "GROUPS"], numparse)
    same([[1234, "VLLM::Worker", "0-3", "nvidia-smi", "root", 700, "python -m vllm …"],
          [1240, "python3", "1", "fd+mapped", "child of 1234", "-", ""]],
         ["SIGNAL PID", "NAME", "GPUS", "EVIDENCE", "ORDER", "MiB", "CMDLINE"], numparse)
    same([["h", 0, "79.1", "70.00", "71.20", "10.00", "pass", "(50.12)", "0.912", "0.100", "fits"]],
         ["HOST", "GPU", "TOTAL", "FREE", "VLLM FREE", "REQUESTED", "START-UP", "KV CACHE",
          "MAX UTIL", "MIN UTIL", "VERDICT"], numparse)


def test_empty_tables_and_cells() -> None:
    same([], ["NAME", "ADDRESS", "PORT"])
    same([], ["A"], numparse=False)
    same([["", None, ""]], ["A", "B", "C"])
    same([[None, None], [None, None]], ["A", "B"])
    same([["x", ""], ["", "y\n"]], ["A", "B"])  # an empty line in a multi-line table
    same([["", ""]], ["A", "B"])
    same([["a", "b", "c"]], ["ONE"])  # fewer headers than columns: padded on the left
    same([["a"], ["b", "c"]], ["X", "Y"])  # ragged rows


def test_numbers_as_tabulate_parses_them() -> None:
    same([["1e3"], ["2.50"], ["inf"]], ["N"])
    same([["1,000"], ["12"], [" 7 "]], ["N"])
    same([["1,000.5"], ["-3"]], ["N"])
    same([[1.5], [10], [2.25], [None]], ["FLOAT"])
    same([[True], ["False"], [3]], ["B"])
    same([["nan"], ["NaN"], ["1e999"]], ["N"])
    same([["0x10"], ["1_000"], ["١٢"]], ["N"])
    same([["1e3"], ["2.50"], [7]], ["N"], numparse=False)


def test_wide_combining_and_coloured_cells() -> None:
    same([["漢字テスト", 1], ["ascii", 22]], ["NAME", "N"])
    same([["e\u0301te\u0301", "x"], ["\u200bzero", "y"]], ["A", "B"])
    same([["\x1b[31mred\x1b[0m", "\x1b[32m42\x1b[0m"], ["plain", "7"]], ["A", "N"])
    same([["\x1b[1m1.50\x1b[0m"], ["2"]], ["F"])
    same([["tab\there"], ["x"]], ["T"])
    same([["漢字\nab", "-"], ["x", "y\n漢"]], ["A", "B"])
    same([["".join(sorted(NARROW)), "x"]], ["NARROW", "B"])


def test_narrow_characters_are_one_column_wherever_wcwidth_says_so() -> None:
    """NARROW skips the wcwidth import: it must hold exactly chars wcwidth counts as 1."""
    wcwidth = pytest.importorskip("wcwidth")
    assert all(wcwidth.wcwidth(c) == 1 for c in NARROW)


CELL = st.one_of(
    st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from(["", " ", "1e3", "2.50", "1,000", "1,000.5", "inf", "-inf", "nan", "True",
                     "False", " 7 ", "0%", "3000MiB / 31.8GiB", "n/a", "-", "…", "\x1b[31m5\x1b[0m",
                     "a\nb", "漢字", "e\u0301", "OK", "CRITICAL xid_79", "x\n\ny"]),
    st.text(alphabet="ab 0123456789.,e-+\n漢é…\x1b[m", max_size=12),
)


@settings(max_examples=400, deadline=None)
@given(rows=st.lists(st.lists(CELL, min_size=3, max_size=3), max_size=5),
       headers=st.lists(st.sampled_from(["HOST", "GPU", "", "漢", "MiB", "A\nB"]), min_size=3, max_size=3),
       numparse=st.booleans())
def test_generated_rows_render_as_tabulate_renders_them(rows: list[list[Any]], headers: list[str],
                                                        numparse: bool) -> None:
    same(rows, headers, numparse)


def test_a_plain_table_imports_neither_tabulate_nor_wcwidth() -> None:
    code = ("import sys\nfrom gpufleet.render.table import render_table\n"
            "print(render_table([['a', 1, '…']], ['X', 'Y', 'Z']))\n"
            "print(sorted(m for m in ('tabulate', 'wcwidth') if m in sys.modules))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "[]"


FIXTURES = REPO_ROOT / "tests" / "fixtures"


def _status_results() -> list[Any]:
    import json

    from gpufleet.core.model import HostResult, parse_snapshot

    out = [HostResult(host=p.stem, ok=True, snapshot=parse_snapshot(json.loads(p.read_text())))
           for p in sorted((FIXTURES / "status").glob("*.json"))]
    out += [HostResult(host=p.stem, ok=True, snapshot=parse_snapshot(json.loads(p.read_text())))
            for p in sorted((FIXTURES / "scenarios").glob("*.json"))]
    return out + [HostResult(host="dead", ok=False, error="ssh: connection refused " * 8)]


def _draw_every_table() -> dict[str, str]:
    """The real renderers on the test fixtures: status, health, clean plans, fit."""
    import json

    from gpufleet.core.fit import fit_report, need_from_options
    from gpufleet.core.health import assess_result
    from gpufleet.core.model import parse_snapshot
    from gpufleet.core.plan import make_plan
    from gpufleet.render.clean import plan_text
    from gpufleet.render.fit import render_text
    from gpufleet.render.health import health_table
    from gpufleet.render.status import status_table

    results = _status_results()
    drawn = {"status": status_table(results, {"na_fields": 1680}),
             "health": health_table([assess_result(r) for r in results]),
             "fit": render_text(fit_report(results, need_from_options(weights_gib=10.0), util=0.9))}
    for p in sorted((FIXTURES / "scenarios").glob("*.json")):
        drawn["plan " + p.stem] = plan_text(make_plan(parse_snapshot(json.loads(p.read_text()))))
    return drawn


def test_every_table_gpufleet_draws_is_the_one_tabulate_drew(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpufleet.render.clean
    import gpufleet.render.fit
    import gpufleet.render.health
    import gpufleet.render.status

    ours = _draw_every_table()
    assert sum(t.count("\n") for t in ours.values()) > 100  # the fixtures make real tables
    assert "SIGNAL PID" in "".join(ours.values())  # some plan has targets: its table is drawn
    for module in (gpufleet.render.clean, gpufleet.render.fit, gpufleet.render.health,
                   gpufleet.render.status):
        monkeypatch.setattr(module, "render_table", reference)
    theirs = _draw_every_table()
    for name, text in ours.items():
        assert text == theirs[name], name
