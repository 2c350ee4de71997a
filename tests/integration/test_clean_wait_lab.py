"""The memory wait ends when only memory the plan does not signal is left (no blind timeout)."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_refused_holder_does_not_make_clean_wait_out_its_timeout(make_host, lab, tmp_path) -> None:
    host = make_host(gpus=8)
    worker = host.spawn_holder(gpus=[0], mib=716, title="VLLM::Worker_TP0")
    spanning = host.spawn_holder(gpus=[3, 4], mib=[2000, 2000], title="spanner")
    fleet = lab.inventory_yaml([host], path=tmp_path / "fleet.yaml")
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    res = subprocess.run(
        [sys.executable, "-m", "gpufleet", "-i", str(fleet), "clean", "--all", "--gpus", "0-3",
         "--yes", "--json", "--timeout", "120", "--grace", "2",
         "--audit-log", str(tmp_path / "audit.jsonl")],
        capture_output=True, text=True, env=env, timeout=200)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)["hosts"][0]
    assert doc["verdict"] == "dirty"
    assert [r["pid"] for r in doc["refused"]] == [spanning]
    assert "spans GPUs 3,4" in doc["refused"][0]["reason"]
    assert doc["memory_wait"]["held_by_others"] is True
    # The wait stopped once only the refused process's 2000 MiB on GPU 3 was left; a blind
    # wait would have taken the whole --timeout of 120 s.
    assert doc["seconds"] < 60
    assert not host.alive(worker) and host.alive(spanning)
    assert [g["memory_used_mib"] for g in doc["after"]] == [0, 0, 0, 2000]
