"""Host warnings go to stderr, from every command that reads hosts; stdout keeps only rows.

A non-root connection cannot read root's open files; with memory nobody explains (the fake
driver's ghost memory) the host says holders may be hidden. That line used to come after the
status table on stdout, where `gpufleet status | awk` met it as a row. Every command that
reads the host (status, status --watch, health, fit, clean --dry-run, export, run) now writes
`HOST: warning: ...` on stderr and nothing of it on stdout; status --json keeps it in the
document's `warnings`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import GPUFLEET, REPO_ROOT, home, run_gpufleet  # noqa: F401  (fixture)

WARNING = "warned-box: warning: cannot read the open files of"


@pytest.fixture
def warned_host(lab: Any, make_host: Any, tmp_path: Path) -> Any:
    host = make_host("warned-box", gpus=2, ghost_mib={"1": 3000})
    host.spawn_holder(gpus=[1], mib=2000, title="root-job")
    host.inv = lab.inventory_yaml([host], user=lab.user)
    (tmp_path / "look.yaml").write_text("steps:\n  - name: look\n    kind: report\n")
    host.runbook = tmp_path / "look.yaml"
    return host


@pytest.mark.parametrize("args", [
    ["status"],
    ["health"],
    ["health", "--json"],
    ["fit", "--weights-gib", "1"],
    ["clean", "--dry-run"],
    ["export"],
    ["run", "RUNBOOK"],
], ids=lambda a: " ".join(a))
def test_a_host_warning_is_on_stderr_and_never_on_stdout(warned_host: Any, home: Path,
                                                         args: list[str]) -> None:
    argv = [str(warned_host.runbook) if a == "RUNBOOK" else a for a in args]
    run = run_gpufleet(home, warned_host.inv, *argv, "--host", "warned-box")
    assert "Traceback" not in run.stderr, str(run)
    assert "warning" not in run.stdout, str(run)
    assert [ln for ln in run.stderr.splitlines() if ln.startswith(WARNING)] != [], str(run)


def test_status_json_keeps_the_warning_in_the_document_only(warned_host: Any, home: Path) -> None:
    run = run_gpufleet(home, warned_host.inv, "status", "--json")
    doc = run.host("warned-box")
    assert any("cannot read the open files of" in w for w in doc["warnings"]), str(run)
    assert "warning" not in run.stderr, str(run)


def test_status_watch_text_writes_the_warning_on_stderr(warned_host: Any, home: Path) -> None:
    env = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO_ROOT))
    env.pop("GPUFLEET_INVENTORY", None)
    proc = subprocess.Popen(GPUFLEET + ["-i", str(warned_host.inv), "status", "--watch", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL, cwd=str(home))
    try:
        time.sleep(8)  # the first round waits for the host; then one table every 0.5 s
    finally:
        proc.send_signal(signal.SIGINT)  # the CLI this test started, by its own pid
        out, err = proc.communicate(timeout=30)
    assert out.count("warned-box") >= 2 and "warning" not in out, out + err
    assert any(ln.startswith(WARNING) for ln in err.splitlines()), out + err


@pytest.mark.parametrize("reader", ["nvml", "nvidia-smi"])
def test_the_lab_tells_every_gpus_minor_number(make_host: Any, lab: Any, home: Path,
                                               reader: str) -> None:
    """Index != minor, as on real hosts: each GPU's minor comes from NVML or the driver's
    /proc/driver/nvidia/gpus/BUS/information (else `nvidia-smi -q`'s "Minor Number"), so no
    lab host warns "minor numbers unknown" and a holder of index 0 (/dev/nvidia1) is verified."""
    host = make_host("minors-" + reader, gpus=2, minors=[1, 0], nvml=(reader == "nvml"))
    pid = host.spawn_holder(gpus=[0], mib=700, title="on-index-0")
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(home, inv, "status", "--json")
    doc = run.host(host.name)
    assert doc["facts"]["gpu_source"] == reader, doc["facts"]
    assert not any("minor" in w for w in doc["warnings"]), doc["warnings"]
    listed = {p["pid"]: p["listing"] for p in doc["gpus"][0]["processes"]}
    assert listed == {pid: "verified"}, doc["gpus"][0]["processes"]
    assert "minor" not in run_gpufleet(home, inv, "status").stderr
