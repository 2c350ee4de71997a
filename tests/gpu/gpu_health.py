#!/usr/bin/env python3
"""Real-GPU proof of the health gate (`gpufleet health`), on one real host (not collected by pytest).

1. The agent as a host runs it (the constant bootstrap on stdin), once through NVML and once
   through nvidia-smi: every health reading of every GPU (ECC, remapped rows, retired pages,
   clocks event reasons, PCIe link, persistence) and the kernel log's source, recorded whole
   (health-snapshot-nvml.json, health-snapshot-smi.json: the fixtures).
2. Checks: each reading is a value or null (null: this GPU / driver / VM does not give it, a
   note in the results, not a failure); the NVML and nvidia-smi readings agree where both have
   them; `gpufleet health --json` with `connection: local` exits 0 and every GPU is OK (a
   healthy machine), and the table is recorded (health-table.txt).
3. Timings (medians of 9): the agent with and without the kernel log (``kernel_log: false``),
   and `gpufleet status --json` against `gpufleet health --json` (the target: health at most
   10 ms more per host than status).

    PYTHONPATH=$PWD python3 tests/gpu/gpu_health.py --out /tmp/gout
Writes health-results.json to --out; exit 1 when a check failed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from gpufleet.core.model import HEALTH_BOOL_KEYS, HEALTH_INT_KEYS  # noqa: E402
from gpufleet.remote import bootstrap_command, encode_request  # noqa: E402

READINGS = HEALTH_INT_KEYS + HEALTH_BOOL_KEYS + ("persistence_mode", "clocks_event_names")
BOTH = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "retired_pages_pending",
        "clocks_event_reasons", "pcie_gen_max", "pcie_width_current", "pcie_width_max",
        "persistence_mode")


def agent(request: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    res = subprocess.run(bootstrap_command(sys.executable), input=encode_request(request),
                         capture_output=True, timeout=120)
    return json.loads(res.stdout.decode()), time.monotonic() - t0


def cli(inventory: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(inventory), *args],
                         capture_output=True, text=True, timeout=120, cwd=str(REPO))
    return res, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    out = ap.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    base = {"mode": "snapshot", "deadline_s": 60, "smi_timeout_s": 20}
    results: dict[str, Any] = {"checks": [], "notes": []}

    def check(ok: bool, what: str) -> None:
        results["checks"].append({"ok": bool(ok), "what": what})

    nv, _ = agent(dict(base, gpu_source="nvml"))
    smi, _ = agent(dict(base, gpu_source="nvidia-smi"))
    (out / "health-snapshot-nvml.json").write_text(json.dumps(nv, indent=1))
    (out / "health-snapshot-smi.json").write_text(json.dumps(smi, indent=1))
    check(nv["facts"]["gpu_source"] == "nvml" and nv["gpus"], "NVML read the GPUs")
    for doc, path in ((nv, "nvml"), (smi, "nvidia-smi")):
        for g in doc["gpus"]:
            missing = [k for k in READINGS if g.get(k) is None]
            if missing:
                results["notes"].append(f"{path} GPU {g['index']}: not available: {missing}")
    for a, b in zip(nv["gpus"], smi["gpus"]):
        for key in BOTH:
            if a.get(key) is not None and b.get(key) is not None:
                check(a[key] == b[key], f"GPU {a['index']} {key}: NVML {a[key]!r} == "
                                        f"nvidia-smi {b[key]!r}")
    log = nv.get("kernel_log") or {}
    results["kernel_log"] = {k: log.get(k) for k in ("source", "error", "bytes", "truncated",
                                                      "seconds")}
    results["xid"] = log.get("xid")
    if log.get("source") is None:
        results["notes"].append(f"kernel log not readable here: {log.get('error')}")
    with tempfile.TemporaryDirectory() as tmp:
        inv = Path(tmp) / "fleet.yaml"
        inv.write_text("hosts:\n  this:\n    connection: local\n")
        table, _ = cli(inv, "health")
        (out / "health-table.txt").write_text(table.stdout + table.stderr)
        doc, _ = cli(inv, "health", "--json")
        check(doc.returncode == 0, f"gpufleet health exits 0 (got {doc.returncode})")
        hosts = json.loads(doc.stdout)["hosts"] if doc.stdout.strip() else []
        check(bool(hosts) and all(g["severity"] == "OK" for h in hosts for g in h["gpus"]),
              "every GPU OK")
        with_log, without, status, health = [], [], [], []
        for i in range(9):
            with_log.append(agent(dict(base))[1])
            without.append(agent(dict(base, kernel_log=False))[1])
            for name, bucket in ((("status", status), ("health", health)) if i % 2 == 0
                                 else (("health", health), ("status", status))):
                bucket.append(cli(inv, name, "--json")[1])
    med = statistics.median
    results["timings_ms"] = {"agent_with_kernel_log": round(med(with_log) * 1e3, 1),
                             "agent_without_kernel_log": round(med(without) * 1e3, 1),
                             "status_cli": round(med(status) * 1e3, 1),
                             "health_cli": round(med(health) * 1e3, 1)}
    (out / "health-results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0 if all(c["ok"] for c in results["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
