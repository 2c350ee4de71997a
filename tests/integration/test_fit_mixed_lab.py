"""`fit` over a mixed fleet, and one rule for GPUs a host lacks (`fit` and `clean` alike).

An 8-GPU host and a 1-GPU one: `fit --all --tp 8` checks the big host and gives the small
one its own row (exit 1), where it used to stop the whole command (exit 2). `--gpus 0-9`
names GPUs both hosts lack: exit 2 with one line for `fit`, as `clean` refuses it (nothing
signalled anywhere on a list that is wrong for some host).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_helpers import assert_one_line_error, home, parse_table, run_gpufleet  # noqa: F401


@pytest.fixture
def mixed(lab: Any, make_host: Any) -> Path:
    big = make_host("fit-big", gpus=8)
    small = make_host("fit-small", gpus=1)
    return lab.inventory_yaml([big, small])


def test_a_host_with_too_few_gpus_for_tp_gets_its_own_row(mixed: Path, home: Path) -> None:
    run = run_gpufleet(home, mixed, "fit", "--all", "--params", "70B", "--dtype", "bf16", "--tp", "8")
    assert run.rc == 1, str(run)
    rows = parse_table(run.stdout, "HOST")
    assert [r["HOST"] for r in rows] == ["fit-big"] * 8 + ["fit-small"]
    assert all(r["VERDICT"].startswith("fits") for r in rows[:8]), str(run)
    assert rows[8]["VERDICT"] == "error: --tp 8 needs 8 GPUs, only 1 selected"
    doc = run_gpufleet(home, mixed, "fit", "--all", "--params", "70B", "--dtype", "bf16",
                       "--tp", "8", "--json").json()
    assert [(h["host"], h["ok"], h.get("error_kind")) for h in doc["hosts"]] == [
        ("fit-big", True, None), ("fit-small", False, "usage")]


@pytest.mark.parametrize("command", [["fit", "--params", "7B", "--dtype", "fp16"],
                                     ["clean", "--dry-run"]], ids=lambda c: c[0])
def test_gpus_a_host_lacks_are_exit_2_for_fit_and_clean(mixed: Path, home: Path,
                                                        command: list[str]) -> None:
    run = run_gpufleet(home, mixed, *command, "--all", "--gpus", "0-9")
    assert run.rc == 2, str(run)
    assert "GPU 8 does not exist on fit-big (has 0-7)" in run.output, str(run)
    assert "GPU 1 does not exist on fit-small (has 0)" in run.output, str(run)
    if command[0] == "fit":
        assert_one_line_error(run, "GPU 8 does not exist on fit-big", "fit-small")


def test_params_without_dtype_says_what_it_assumed(mixed: Path, home: Path) -> None:
    run = run_gpufleet(home, mixed, "fit", "--host", "fit-small", "--params", "7B")
    assert run.rc == 0, str(run)
    assert ("note: --dtype not given: fp16 assumed (2 bytes per parameter): 7B parameters are "
            "13.04 GiB of weights") in run.stdout.splitlines(), str(run)
    both = run_gpufleet(home, mixed, "fit", "--host", "fit-small", "--params", "7B",
                        "--weights-gib", "13")
    assert_one_line_error(both, "not both")


def test_the_help_explains_the_kv_cache_parentheses(home: Path) -> None:
    run = run_gpufleet(home, None, "fit", "--help")
    text = " ".join(run.stdout.split())
    assert "KV CACHE" in text and "in parentheses when START-UP is FAIL" in text, run.stdout
