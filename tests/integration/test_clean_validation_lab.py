"""Nothing is signalled anywhere on the strength of input that failed validation on one host."""
from __future__ import annotations

import os
import subprocess
import sys


def test_bad_gpus_on_one_host_signals_nothing_on_any_host(make_host, lab, tmp_path) -> None:
    big = make_host(gpus=8)
    small = make_host(gpus=2)
    on_big = big.spawn_holder(gpus=[5], mib=716, title="VLLM::Worker")
    on_small = small.spawn_holder(gpus=[0], mib=716, title="VLLM::Worker")
    fleet = lab.inventory_yaml([big, small], path=tmp_path / "fleet.yaml")
    audit = tmp_path / "audit.jsonl"
    res = subprocess.run(
        [sys.executable, "-m", "gpufleet", "-i", str(fleet), "clean", "--all", "--gpus", "0-7",
         "--yes", "--audit-log", str(audit)],
        capture_output=True, text=True, env=dict(os.environ, HOME=str(tmp_path)), timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"GPU 2 does not exist on {small.name}" in res.stderr or "does not exist" in res.stderr
    assert "nothing signalled on any host" in res.stderr
    assert "Traceback" not in res.stderr
    assert big.alive(on_big) and small.alive(on_small)
    assert not audit.exists()
    assert big.gpu_used()[5] == 716 and small.gpu_used()[0] == 716
