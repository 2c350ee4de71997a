"""Fixtures of the fault and abuse suite, and its session-wide counts.

At the end of a run the terminal summary prints how many fault cases ran, how many hostile
inputs they tried, how many processes the censuses checked, and the number of WRONG KILLS
(processes that ended and were not meant to). A wrong kill already fails its own test; the
session fixture below fails once more at teardown so it cannot scroll by unnoticed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from faultkit import LEDGER, Canary

_CASES = {"passed": 0, "failed": 0, "skipped": 0}
_HERE = Path(__file__).resolve().parent


def _ours(report: Any) -> bool:
    path = Path(str(report.nodeid).split("::")[0])
    return path.parent.name == _HERE.name and (_HERE / path.name).is_file()


def pytest_runtest_logreport(report: Any) -> None:
    if not _ours(report):
        return
    if report.when == "call":
        key = report.outcome if report.outcome in _CASES else "failed"
        _CASES[key] += 1
    elif report.when == "setup" and report.outcome != "passed":
        _CASES["skipped" if report.skipped else "failed"] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    total = sum(_CASES.values())
    if not total:
        return
    kinds = ", ".join("%s %d" % kv for kv in sorted(LEDGER.hostile_kinds.items()))
    terminalreporter.write_sep(
        "-", "faults: %d cases (%d passed, %d failed, %d skipped); %d hostile inputs tried%s; "
        "%d processes checked in %d censuses; %d WRONG KILLS"
        % (total, _CASES["passed"], _CASES["failed"], _CASES["skipped"],
           LEDGER.hostile_inputs, " (%s)" % kinds if kinds else "",
           LEDGER.processes_checked, LEDGER.censuses, LEDGER.wrong_kills),
        red=bool(LEDGER.wrong_kills), bold=bool(LEDGER.wrong_kills))
    for host, pids in LEDGER.wrong:
        terminalreporter.write_line("WRONG KILL on %s: %s" % (host, pids), red=True)


@pytest.fixture(scope="session", autouse=True)
def no_wrong_kills() -> Iterator[None]:
    """The suite's invariant, asserted once more over the whole session."""
    yield
    assert LEDGER.wrong_kills == 0, "wrong kills: %s" % LEDGER.wrong


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A private HOME for one CLI run (audit log, known_hosts, ~/.ssh start empty)."""
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def canary(home: Path) -> Canary:
    return Canary(home)


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "slow: a fault case that takes more than ~10 s "
                            "(still run in CI; deselect with -m 'not slow')")
