#!/usr/bin/env python3
"""Real-GPU proof that a clean does not say `clean` while a supervisor restarts its target.

A supervisor (a plain Python loop: start the child, wait for it, sleep 0.3 s, start it again)
and its child `trainer` (torch, 6 GiB on GPU 0), as operators meet with supervisord, torchrun
or a shell loop. With `connection: local`:

1. `gpufleet clean --host h200 --gpus 0 --yes --json`: only the trainer is signalled, the
   supervisor stays, the verdict is `retaken` (exit 1) and names the new trainer and the
   supervisor, long before the timeout;
2. `clean --owner SUPERVISOR`: the supervisor goes first, then the trainer; the verdict is
   `clean` and the memory stays free.

Writes owners-results.json (checks, timings) and cli-owners-*.json to --out.
    PYTHONPATH=$PWD python3 tests/gpu/gpu_owners.py --out /tmp/gout
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from portable import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TRAINER = r"""
import time, torch
x = torch.empty(6 * 2**30, dtype=torch.uint8, device='cuda:0')
torch.cuda.synchronize()
print('ready', flush=True)
time.sleep(600)
"""
SUPERVISOR = r"""
import subprocess, sys, time
while True:
    child = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)
    child.wait()
    time.sleep(0.3)
"""


def used_mib() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used >> 20
    finally:
        pynvml.nvmlShutdown()


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="gpufleet-owners-"))
        (self.tmp / "home").mkdir()
        self.inventory = self.tmp / "fleet.yaml"
        self.inventory.write_text("hosts:\n  h200:\n    connection: local\n")
        env = dict(os.environ, HOME=str(self.tmp / "home"), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.env = env
        self.checks: list[dict[str, Any]] = []

    def check(self, name: str, ok: bool, detail: Any = None) -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else ": %r" % (detail,)), flush=True)

    def cli(self, name: str, *args: str) -> dict[str, Any]:
        argv = [sys.executable, "-c", "from gpufleet.cli import main; main()", "-i",
                str(self.inventory)]
        t0 = time.monotonic()
        r = subprocess.run(argv + list(args), capture_output=True, text=True, env=self.env,
                           timeout=300, cwd=str(self.tmp))
        res = {"argv": ["gpufleet", "-i", "fleet.yaml"] + list(args), "exit_code": r.returncode,
               "stdout": r.stdout, "stderr": r.stderr, "seconds": round(time.monotonic() - t0, 3)}
        write_json(self.out / ("cli-owners-%s.json" % name), res, {"TMPDIR": self.tmp, "OUTDIR": self.out})
        return res

    def wait_child(self, sup: subprocess.Popen, timeout: float = 120) -> int:
        """The supervisor's newest child, once it holds its 6 GiB."""
        assert sup.stdout is not None
        child = int(sup.stdout.readline())
        end = time.monotonic() + timeout
        while time.monotonic() < end and used_mib() < 6000:
            time.sleep(0.1)
        return child

    def run(self) -> dict[str, Any]:
        sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, TRAINER], stdout=subprocess.PIPE,
                               text=True, env=self.env)
        timings: dict[str, Any] = {}
        try:
            trainer = self.wait_child(sup)
            res = self.cli("clean-retaken", "clean", "--host", "h200", "--gpus", "0", "--yes",
                           "--json", "--grace", "3", "--timeout", "60")
            timings["retaken_clean_s"] = res["seconds"]
            doc = json.loads(res["stdout"])["hosts"][0]
            self.check("retaken: exit 1", res["exit_code"] == 1, res["exit_code"])
            self.check("retaken: verdict", doc["verdict"] == "retaken", doc.get("reason"))
            self.check("retaken: only the trainer signalled",
                       [t["pid"] for t in doc["targets"]] == [trainer], doc["targets"])
            self.check("retaken: the supervisor is alive", sup.poll() is None)
            self.check("retaken: the reason names the supervisor",
                       "PID %d" % sup.pid in doc.get("reason", ""), doc.get("reason"))
            self.check("retaken: well before the timeout", res["seconds"] < 30, res["seconds"])
            timings["settle"] = (doc.get("agent") or {}).get("settle") if isinstance(
                doc.get("agent"), dict) else None
            self.wait_child(sup)
            res = self.cli("clean-owner", "clean", "--host", "h200", "--gpus", "0", "--owner",
                           str(sup.pid), "--yes", "--json", "--grace", "3", "--timeout", "60")
            timings["owner_clean_s"] = res["seconds"]
            doc = json.loads(res["stdout"])["hosts"][0]
            self.check("owner: exit 0", res["exit_code"] == 0, (res["exit_code"], doc.get("reason")))
            self.check("owner: verdict clean", doc["verdict"] == "clean", doc.get("reason"))
            try:
                sup.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.check("owner: the supervisor is gone", sup.poll() is not None)
            time.sleep(5.0)
            after = used_mib()
            timings["used_mib_5s_after"] = after
            self.check("owner: the memory stays free", after < 1000, after)
        finally:
            if sup.poll() is None:
                sup.kill()
            sup.wait()
        doc = {"checks": self.checks, "timings": timings}
        write_json(self.out / "owners-results.json", doc, {"TMPDIR": self.tmp, "OUTDIR": self.out})
        return doc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gout")
    doc = Run(Path(ap.parse_args().out)).run()
    return 0 if all(c["ok"] for c in doc["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
