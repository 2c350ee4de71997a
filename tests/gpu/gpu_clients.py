#!/usr/bin/env python3
"""Real-GPU proof that GPU *clients* survive a full clean and leave no ghost holders.

Beside one CUDA holder (torch, 4 GiB on GPU 0) it starts three kinds of client recorded in
tests/fixtures/recorded/probe/h200-clients-probe3.log: an NVML poller (tests/gpu/gpu_nvml_poll.py,
handles on every GPU), a process that only called cuInit (maps /dev/nvidia0, holds nothing) and
a running `nvidia-smi --query-gpu -lms 100` loop. Then, with `connection: local`:

1. two `gpufleet status --json` at once, while the nvidia-smi loop runs: every holder in the
   documents has its process details (no `?` ghost holders of the other run's nvidia-smi), and
   the three clients have the role `client`;
2. `gpufleet clean --all --yes --json` of EVERY GPU: the verdict is clean, only the CUDA holder was
   signalled, it is gone, and every client is still alive.

Writes clients-results.json (checks) and cli-clients-*.json (the CLI documents) to --out.
    PYTHONPATH=$PWD python3 tests/gpu/gpu_clients.py --out /tmp/gout
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from portable import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
POLLER = HERE / "gpu_nvml_poll.py"

HOLDER = r"""
import time, torch
x = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda:0')
torch.cuda.synchronize()
print('ready', flush=True)
time.sleep(600)
"""
CUINIT_ONLY = r"""
import ctypes, time
cu = ctypes.CDLL('libcuda.so.1')
assert cu.cuInit(0) == 0
print('ready', flush=True)
time.sleep(600)
"""


def find_smi() -> Optional[str]:
    for p in [os.path.join(d, "nvidia-smi") for d in os.environ.get("PATH", "").split(os.pathsep)] + [
            "/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi"]:
        if os.access(p, os.X_OK):
            return p
    return None


class Run:
    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="gpufleet-clients-"))
        (self.tmp / "home").mkdir()
        self.inventory = self.tmp / "fleet.yaml"
        self.inventory.write_text("hosts:\n  h200:\n    connection: local\n")
        env = dict(os.environ, HOME=str(self.tmp / "home"), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.env = env
        self.checks: list[dict[str, Any]] = []
        self.procs: dict[str, subprocess.Popen] = {}

    def check(self, name: str, ok: bool, detail: Any = None) -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else ": %r" % (detail,)), flush=True)

    def start(self, name: str, argv: list[str], ready: bool = True) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env)
        self.procs[name] = p
        if ready:
            line = p.stdout.readline() if p.stdout else ""
            if not line:
                raise RuntimeError("%s did not start" % name)
        return p

    def cli(self, *args: str) -> dict[str, Any]:
        argv = [sys.executable, "-c", "from gpufleet.cli import main; main()", "-i", str(self.inventory)]
        t0 = time.monotonic()
        r = subprocess.run(argv + list(args), capture_output=True, text=True, env=self.env, timeout=300,
                           cwd=str(self.tmp))
        return {"argv": ["gpufleet", "-i", "fleet.yaml"] + list(args), "exit_code": r.returncode,
                "stdout": r.stdout, "stderr": r.stderr, "seconds": round(time.monotonic() - t0, 3)}

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def run(self) -> dict[str, Any]:
        smi = find_smi()
        try:
            self.start("holder", [sys.executable, "-c", HOLDER])
            self.start("poller", [sys.executable, str(POLLER)])
            self.start("cuinit", [sys.executable, "-c", CUINIT_ONLY])
            self.start("smi-loop", [smi or "nvidia-smi", "--query-gpu=index,memory.used",
                                    "--format=csv,noheader", "-lms", "100"], ready=False)
            time.sleep(1.0)
            pids = {k: p.pid for k, p in self.procs.items()}
            with cf.ThreadPoolExecutor(2) as pool:
                docs = list(pool.map(lambda _: self.cli("status", "--json"), range(2)))
            for i, res in enumerate(docs):
                write_json(self.out / ("cli-clients-status-%d.json" % i), res, {"TMPDIR": self.tmp, "OUTDIR": self.out})
                self.check_status(i, res, pids)
            clean = self.cli("clean", "--all", "--yes", "--json")
            write_json(self.out / "cli-clients-clean.json", clean, {"TMPDIR": self.tmp, "OUTDIR": self.out})
            self.check_clean(clean, pids)
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
        doc = {"checks": self.checks, "ok": all(c["ok"] for c in self.checks)}
        write_json(self.out / "clients-results.json", doc, {"TMPDIR": self.tmp, "OUTDIR": self.out})
        return doc

    def check_status(self, i: int, res: dict[str, Any], pids: dict[str, int]) -> None:
        self.check("status %d exit 0" % i, res["exit_code"] == 0, res["stderr"][-300:])
        host = json.loads(res["stdout"])["hosts"][0]
        ghosts = [h for h in host["holders"] if h.get("name") in (None, "?")]
        self.check("status %d: no ghost holders" % i, not ghosts, ghosts)
        roles = {h["pid"]: h.get("role") for h in host["holders"]}
        for name in ("poller", "cuinit", "smi-loop"):
            if pids[name] in roles:
                self.check("status %d: %s is a client" % (i, name), roles[pids[name]] == "client",
                           roles[pids[name]])
        self.check("status %d: the poller holds device files" % i, pids["poller"] in roles, sorted(roles))
        listed = {p["pid"] for g in host["gpus"] for p in g["processes"]}
        self.check("status %d: the CUDA holder is listed" % i, pids["holder"] in listed, sorted(listed))

    def check_clean(self, res: dict[str, Any], pids: dict[str, int]) -> None:
        self.check("clean exit 0", res["exit_code"] == 0, res["stderr"][-300:])
        host = json.loads(res["stdout"])["hosts"][0]
        self.check("clean verdict clean", host["verdict"] == "clean", host.get("reason"))
        signalled = sorted({s["pid"] for s in host["signals"]})
        self.check("only the CUDA holder signalled", signalled == [pids["holder"]], signalled)
        time.sleep(0.2)
        self.check("the CUDA holder is gone", not self.alive("holder"))
        for name in ("poller", "cuinit", "smi-loop"):
            self.check("%s still alive after a full clean" % name, self.alive(name))
        client_pids = {c["pid"] for c in host["clients"]}
        self.check("the poller is among the plan's clients", pids["poller"] in client_pids, sorted(client_pids))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="gout-")))
    doc = Run(ap.parse_args().out).run()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
