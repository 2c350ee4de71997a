#!/usr/bin/env python3
"""Real-GPU proof that a zombie leader whose threads hold the GPU is cleaned.

A torch process whose main thread calls pthread_exit while another thread holds 5 GiB (the
process of tests/fixtures/real-h200/clean-cases/probe-1.log part D: state `Zl`, the leader's fd
and maps empty, NVML lists the PID). With `connection: local`:
`gpufleet clean --host h200 --gpus 0 --yes --json` plans it (evidence from its threads), sends
SIGTERM (then SIGKILL if it outlives the grace) to the PID, and says `clean`; the memory is back.

Writes zombie-results.json (checks) and cli-owners-zombie-clean.json to --out.
    PYTHONPATH=$PWD python3 tests/gpu/gpu_zombie.py --out /tmp/gout
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_owners import Run as OwnersRun, used_mib

ZOMBIE = r"""
import ctypes, os, threading, time, torch
ready = threading.Event()
def hold():
    x = torch.empty(5 * 2**30, dtype=torch.uint8, device='cuda:0')
    torch.cuda.synchronize()
    ready.set()
    time.sleep(600)
threading.Thread(target=hold).start()
ready.wait()
print('ready', flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


class Run(OwnersRun):
    def run(self) -> dict[str, Any]:  # type: ignore[override]
        p = subprocess.Popen([sys.executable, "-c", ZOMBIE], stdout=subprocess.PIPE, text=True,
                             env=self.env)
        try:
            assert p.stdout is not None
            p.stdout.readline()
            time.sleep(1.0)
            state = Path("/proc/%d/stat" % p.pid).read_text().rsplit(")", 1)[1].split()[0]
            self.check("the leader is a zombie", state == "Z", state)
            before = used_mib()
            res = self.cli("zombie-clean", "clean", "--host", "h200", "--gpus", "0", "--yes",
                           "--json", "--grace", "2", "--timeout", "30")
            doc = json.loads(res["stdout"])["hosts"][0]
            self.check("exit 0", res["exit_code"] == 0, (res["exit_code"], doc.get("reason")))
            self.check("verdict clean", doc["verdict"] == "clean", doc.get("reason"))
            self.check("the zombie leader was the target",
                       [t["pid"] for t in doc["targets"]] == [p.pid], doc["targets"])
            # TERM first, as for any target (its threads take Python's default: they end);
            # KILL only if it outlives the grace
            self.check("signalled by its PID", any(s["pid"] == p.pid and s["outcome"] == "sent"
                                                   for s in doc.get("signals") or []),
                       doc.get("signals"))
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            after = used_mib()
            self.check("the memory is back", after < before - 4000, (before, after))
            timings = {"clean_s": res["seconds"], "used_before": before, "used_after": after}
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
        doc = {"checks": self.checks, "timings": timings}
        (self.out / "zombie-results.json").write_text(json.dumps(doc, indent=1) + "\n")
        return doc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gout")
    doc = Run(Path(ap.parse_args().out)).run()
    return 0 if all(c["ok"] for c in doc["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
