"""The installed package has what its messages point to: the wheel built from this checkout
holds the shipped runbooks and `gpufleet init`; installed on its own (no checkout beside it),
`gpufleet run model-swap` finds its runbook by name, `gpufleet init` writes a fleet.yaml that
loads, and the first-run hint names `gpufleet init`.

The tree is copied first (setuptools writes build/ and *.egg-info where it builds); the wheel
is built as a user would (`pip wheel --no-deps`), installed with `pip install --target`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache",
                              ".hypothesis", "tests", "bench", ".device", ".whl")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(REPO_ROOT, src, symlinks=True, ignore=SKIP)
    out = base / "out"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                            str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("gpufleet-*.whl")
    target = base / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return wheel, target


def _installed_gpufleet(target: Path, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUFLEET_INVENTORY", "PYTHONPATH")}
    env.update(HOME=str(home), PYTHONPATH=str(target))
    return subprocess.run([sys.executable, "-m", "gpufleet", *args], cwd=str(home), env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_the_wheel_holds_the_runbooks_and_init(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"gpufleet/playbooks/{p.name}" for p in (REPO_ROOT / "playbooks").glob("*.yaml")}
    assert shipped and shipped <= names, sorted(n for n in names if "playbooks" in n)
    assert {"gpufleet/cli/init_cmd.py", "gpufleet/config/starter.py"} <= names


def test_the_installed_package_runs_a_shipped_runbook_by_name(installed: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    _, target = installed
    res = _installed_gpufleet(target, tmp_path, "run", "model-swap", "--dry-run", "--all",
                              "-e", "OLD_UNIT=old", "-e", "NEW_UNIT=new")
    assert res.returncode == 0, res.stdout + res.stderr
    head = res.stdout.splitlines()[0]
    assert head.startswith("runbook model-swap (%s" % target), head  # the installed copy's
    assert "stop old.service" in res.stdout and "start new.service" in res.stdout
    assert "`gpufleet init`" in res.stderr  # the first-run hint, no inventory here


def test_the_installed_package_writes_an_inventory(installed: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    _, target = installed
    res = _installed_gpufleet(target, tmp_path, "init")
    assert res.returncode == 0, res.stdout + res.stderr
    listed = _installed_gpufleet(target, tmp_path, "hosts", "--json")
    assert listed.returncode == 0 and '"localhost"' in listed.stdout, listed.stderr
