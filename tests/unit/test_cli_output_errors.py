"""Output that cannot be written (a full disk, here /dev/full) is one line and exit 1, never a
traceback: the table and --json paths, and the inventory listing."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("args", [["hosts"], ["status", "--all"], ["status", "--all", "--json"]])
def test_a_full_disk_is_one_line_and_exit_1(tmp_path: Path, args: list[str], buffered: bool) -> None:
    """Buffered (no PYTHONUNBUFFERED: a fresh shell, most CI) the unwritten text stays in
    stdout's buffer, and the interpreter's own final flush would fail again (exit 120)."""
    inv = tmp_path / "fleet.yaml"
    inv.write_text("hosts:\n  here:\n    connection: local\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp_path), **({} if buffered else {"PYTHONUNBUFFERED": "1"}))
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(inv), *args],
                             stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == \
        "gpufleet: error: output not written: No space left on device"
