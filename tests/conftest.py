"""Shared fixtures: the real-sshd test lab and the recorded nvidia-smi output.

The lab (tests/lab/lab.py, documented in tests/lab/README.md) needs root, openssh-server and
unshare. Where it cannot run, its tests SKIP with a loud reason, except under CI (CI=true),
where they FAIL: a CI run that silently skipped every SSH test would prove nothing.
The recorded output lives in tests/fixtures/recorded/logs (raw logs of real H200 hosts, copied in).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

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


def _kept_dirs(runtime: Path, base: Optional[Path]) -> list[Path]:
    """Where a test's CLI runs may have kept SSH masters: its XDG_RUNTIME_DIR, and the cache
    of a HOME under its tmp_path (a CLI run given an environment without XDG_RUNTIME_DIR)."""
    dirs = [runtime / "gpufleet-ssh"]
    if base is not None:
        for pattern in (".cache/gpufleet/ssh", "*/.cache/gpufleet/ssh", "*/*/.cache/gpufleet/ssh"):
            dirs += [p for p in base.glob(pattern) if p.is_dir()]
    return [d for d in dirs if d.is_dir()]


def _masters_of(dirs: list[Path]) -> list[int]:
    """PIDs of live OpenSSH masters whose control socket is in ``dirs``: a ControlPersist
    master names its socket in its process title (``ssh: SOCKET [mux]``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                title = fh.read(4096).replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if title.startswith("ssh: ") and any(f"{d}/" in title for d in dirs):
            found.append(int(entry))
    return found


@pytest.fixture(autouse=True)
def kept_ssh(monkeypatch: Any, request: Any) -> Iterator[Path]:
    """SSH connections are kept between commands by default (``ssh_persist: 60``): each test
    gets its own short private XDG_RUNTIME_DIR for their sockets (a socket path has 108 bytes;
    the CLI runs inherit it), and every master kept there, or in a HOME under its tmp_path, is
    ended at teardown through its control socket, as `gpufleet disconnect` ends it (no
    signal, no process name): none outlives the test that made it. A test counting
    connections therefore starts with none kept."""
    runtime = Path(tempfile.mkdtemp(prefix="gfk-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    base = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    try:
        yield runtime
    finally:
        dirs = _kept_dirs(runtime, base)
        if dirs:
            from gpufleet.transport import keptlist

            for where in dirs:
                for name in os.listdir(where):
                    path = where / name
                    if path.is_socket():
                        keptlist.close_kept(str(path))
            deadline = time.monotonic() + 10
            while _masters_of(dirs) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = _masters_of(dirs)
            shutil.rmtree(runtime, ignore_errors=True)
            assert not left, f"ssh masters left behind by the test (pids {left}) in {dirs}"
        else:
            shutil.rmtree(runtime, ignore_errors=True)
