"""Shared fixtures: the real-sshd test lab and the recorded nvidia-smi output.

The lab (tests/lab/lab.py, documented in tests/lab/README.md) needs root, openssh-server and
unshare. Where it cannot run, its tests SKIP with a loud reason, except under CI (CI=true),
where they FAIL: a CI run that silently skipped every SSH test would prove nothing.
The recorded output lives in tests/fixtures/recorded/logs (raw logs of real H200 hosts, copied in).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
LAB_DIR = REPO_ROOT / "tests" / "lab"
RECORDED_DIR = REPO_ROOT / "tests" / "fixtures" / "recorded" / "logs"

if str(LAB_DIR) not in sys.path:
    sys.path.insert(0, str(LAB_DIR))
# Subprocesses (the CLI, the lab's tools) import this checkout's gpufleet, whichever is installed.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)

_unavailable: dict[str, str] = {}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(what: str, problem: str) -> None:
    """Skip (loudly) or, under CI, fail: a missing prerequisite is never silent in CI."""
    message = "%s unavailable: %s" % (what, problem)
    _unavailable[what] = problem
    if in_ci():
        pytest.fail(message + " (CI=true: lab prerequisites are mandatory)", pytrace=False)
    pytest.skip("!!! " + message)


def pytest_collection_modifyitems(config: Any, items: list) -> None:
    """Tests that use the lab get the `lab` marker, so `-m "not lab"` deselects them."""
    for item in items:
        if {"lab", "make_host", "lab_host"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.lab)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    outcome = "FAILED (CI=true)" if in_ci() else "SKIPPED"
    for what, problem in _unavailable.items():
        terminalreporter.write_sep(
            "!", "%s UNAVAILABLE, its tests %s: %s" % (what, outcome, problem), red=True, bold=True
        )


@pytest.fixture(scope="session")
def prerequisite() -> Callable[[str, str], None]:
    """``require`` for test modules (``from conftest import`` may find another conftest)."""
    return require


@pytest.fixture(scope="session")
def recorded_dir() -> Path:
    """tests/fixtures/recorded/logs: raw logs of real H200 hosts (see its README.md)."""
    if not (RECORDED_DIR / "h200-single-gpu.log").is_file():
        problem = "%s not found (the repository is incomplete)" % RECORDED_DIR
        require("recorded nvidia-smi output", problem)
    return RECORDED_DIR


@pytest.fixture(scope="session")
def fake_nvml_library() -> Path:
    """The lab's fake libnvidia-ml.so.1 (tests/lab/fakenvml), compiled once per source hash with
    the system C compiler; without one its tests skip loudly (fail under CI)."""
    sys.path.insert(0, str(LAB_DIR / "fakenvml"))
    try:
        import fakenvml_build
    finally:
        sys.path.remove(str(LAB_DIR / "fakenvml"))
    try:
        return fakenvml_build.build()
    except fakenvml_build.BuildError as exc:
        require("fake libnvidia-ml.so.1", str(exc))
        raise


@pytest.fixture(scope="session")
def lab(tmp_path_factory: Any) -> Iterator[Any]:
    """The session's Lab: add hosts with ``lab.add_host(...)`` (they live until the session ends;
    use ``make_host`` for hosts that end with the test)."""
    try:
        import lab as lab_module
    except ImportError as exc:  # pragma: no cover - the file is in the repo
        require("test lab", "cannot import tests/lab/lab.py: %s" % exc)
    problem = lab_module.check()
    if problem:
        require("test lab", problem)
    the_lab = lab_module.Lab(tmp_path_factory.mktemp("lab"))
    try:
        yield the_lab
    finally:
        the_lab.close()


@pytest.fixture
def make_host(lab: Any) -> Iterator[Callable[..., Any]]:
    """Factory of fresh lab hosts (``make_host(gpus=8, release_delay_s=1)``), stopped after the
    test; takes Lab.add_host's arguments."""
    made = []

    def factory(name: str | None = None, **options: Any) -> Any:
        host = lab.add_host(name, **options)
        made.append(host)
        return host

    yield factory
    for host in made:
        host.stop()


@pytest.fixture
def lab_host(make_host: Callable[..., Any]) -> Any:
    """A fresh two-GPU lab host, stopped after the test."""
    return make_host(gpus=2)
