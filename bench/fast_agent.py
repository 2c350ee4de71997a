#!/usr/bin/env python3
"""The lab's start-up targets: status over 16 hosts against one bare `ssh host nvidia-smi`, and clean
over 32 hosts beyond the simulated release delay; on this machine, lab hosts on loopback.

    sudo python3 bench/fast_agent.py                    # this checkout
    sudo python3 bench/fast_agent.py --code OLD_TREE    # the CLI of another checkout (before)

Prints a table and writes --out (JSON). Each lab host is a real sshd with 8 fake H200s and one
holder (as bench/run.py's); `gpu_source` is set per run when the code knows it (--sources).
The fake nvidia-smi is a Python program (~60-100 ms a run here, a real one 25-33 ms), so the
bare-ssh baseline is slower than on a real host: the ratio flatters nothing that NVML skips.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402


def median(xs: list) -> float:
    return round(statistics.median(xs), 3)


class Bench:
    def __init__(self, work: Path, code: Path, runs: int) -> None:
        self.work = work
        self.code = code
        self.runs = runs
        self.lab = Lab(work / "lab")
        self.hosts: list = []
        self.env = dict(os.environ, HOME=str(work / "home"), PYTHONPATH=str(code))
        (work / "home").mkdir(exist_ok=True)

    def start(self, n: int) -> None:
        while len(self.hosts) < n:
            h = self.lab.add_host("node%03d" % len(self.hosts), gpus=8, gpu_name="NVIDIA H200",
                                  total_mib=143771, reserved_mib=616)
            h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
            self.hosts.append(h)

    def inventory(self, hosts: list, source: Optional[str], persist: float = 0) -> Path:
        path = self.work / ("fleet-%d-%s-%g.yaml" % (len(hosts), source or "default", persist))
        extra: dict[str, Any] = {"gpu_source": source} if source else {}
        extra["ssh_persist"] = persist  # 0: fresh connections (kept ones are the default)
        return self.lab.inventory_yaml(hosts, path=path, command_timeout=60, **extra)

    def cli(self, inv: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(inv), *args],
                           capture_output=True, text=True, env=self.env, timeout=600)
        return time.monotonic() - t0, r

    def bare_ssh(self) -> float:
        h = self.hosts[0]
        argv = ["ssh", "-F", "/dev/null", "-i", str(self.lab.client_key), "-o", "IdentitiesOnly=yes",
                "-o", "BatchMode=yes", "-o", "UserKnownHostsFile=%s" % self.lab.known_hosts_path,
                "-o", "StrictHostKeyChecking=yes", "-p", str(h.port), "root@%s" % h.address,
                "nvidia-smi --query-gpu=index,memory.used --format=csv"]
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return time.monotonic() - t0

    def status(self, n: int, source: Optional[str]) -> dict[str, Any]:
        self.start(n)
        inv = self.inventory(self.hosts[:n], source)
        self.cli(inv, "status", "--all")  # warm
        walls, bare = [], []
        for _ in range(self.runs):  # interleaved: the same minute for both
            wall, r = self.cli(inv, "status", "--all", "--json")
            assert r.returncode == 0, r.stderr[-500:]
            walls.append(wall)
            bare.append(self.bare_ssh())
        srcs = sorted({(h.get("facts") or {}).get("gpu_source") for h in json.loads(r.stdout)["hosts"]},
                      key=str)
        return {"n": n, "source": source or "default", "status_wall_s": median(walls),
                "bare_ssh_nvidia_smi_s": median(bare), "ratio": round(median(walls) / median(bare), 2),
                "agent_sources": srcs}

    def clean(self, n: int, source: Optional[str], delay: float, persist: float = 0
              ) -> dict[str, Any]:
        """Cleans of ``n`` hosts; with ``persist``, each alternated with one over connections
        kept from the command before (``ssh_persist``: the operator's status, then clean)."""
        self.start(n)
        hosts = self.hosts[:n]
        invs = {"fresh": self.inventory(hosts, source)}
        if persist:
            invs["kept"] = self.inventory(hosts, source, persist)
            self.cli(invs["kept"], "status", "--all")  # the masters, kept from here on
        out: dict[str, Any] = {"n": n, "source": source or "default", "release_delay_s": delay}
        rows: dict[str, list] = {k: [] for k in invs}
        for _ in range(self.runs):
            for mode, inv in invs.items():
                rows[mode].append(self.clean_once(hosts, inv, delay))
        if persist:
            self.cli(invs["kept"], "disconnect")
        for mode, got in rows.items():
            key = "" if mode == "fresh" else "kept_"
            out[key + "beyond_delay_median_s"] = median([x["beyond_delay_s"] for x in got])
            out[key + "runs"] = got
        return out

    def clean_once(self, hosts: list, inv: Path, delay: float) -> dict[str, Any]:
        for h in hosts:
            h.set_config(release_delay_s=delay)
            if not h.records():
                h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
        # the 32 new holders (Python processes) and the last run's sessions finish starting
        # and ending before the clock starts: the bench's set-up is not the clean's time
        time.sleep(1.0)
        wall, r = self.cli(inv, "clean", "--all", "--gpus", "all", "--yes", "--json",
                           "--grace", "5", "--timeout", "30")
        doc = json.loads(r.stdout)
        sent = [sum(1 for s in h.get("signals") or () if s.get("outcome") == "sent")
                for h in doc["hosts"]]
        waits = [float(h["memory_wait"]["seconds"]) for h in doc["hosts"]
                 if isinstance(h.get("memory_wait"), dict) and "seconds" in h["memory_wait"]]
        return {"wall_s": round(wall, 3), "beyond_delay_s": round(wall - delay, 3),
                "clean": sum(1 for h in doc["hosts"] if h.get("verdict") == "clean"),
                # a row is only valid when every host signalled its holder and then
                # waited about the release delay for the memory
                "hosts_signalled": sum(1 for x in sent if x),
                "memory_wait_s": [round(min(waits), 3), round(max(waits), 3)] if waits else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, default=REPO, help="checkout whose CLI runs")
    ap.add_argument("--sources", default="default,nvidia-smi",
                    help="gpu_source per run: default (the inventory says nothing), nvml, nvidia-smi")
    ap.add_argument("--status-n", type=int, default=16)
    ap.add_argument("--clean-n", type=int, default=32)
    ap.add_argument("--release-delay", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--persist", type=float, default=0, metavar="SECONDS",
                    help="also clean over connections kept between commands (ssh_persist), "
                         "alternated with fresh ones")
    ap.add_argument("--out", type=Path, default=Path("bench-fast-agent.json"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gfbench-fast-"))
    b = Bench(work, a.code.resolve(), a.runs)
    out: dict[str, Any] = {"code": str(a.code), "status": [], "clean": []}
    try:
        for src in a.sources.split(","):
            source = None if src == "default" else src
            out["status"].append(b.status(a.status_n, source))
            print(json.dumps(out["status"][-1]), flush=True)
            out["clean"].append(b.clean(a.clean_n, source, a.release_delay, a.persist))
            print(json.dumps(out["clean"][-1]), flush=True)
    finally:
        b.lab.close()
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print("| what | source | N | value |\n|---|---|---|---|")
    for s in out["status"]:
        print("| status wall / bare ssh nvidia-smi | %s | %d | %.2fx (%.2f s / %.2f s) |" % (
            s["source"], s["n"], s["ratio"], s["status_wall_s"], s["bare_ssh_nvidia_smi_s"]))
    for c in out["clean"]:
        print("| clean wall - release delay | %s | %d | %.2f s (delay %.1f s) |" % (
            c["source"], c["n"], c["beyond_delay_median_s"], c["release_delay_s"]))
        if "kept_beyond_delay_median_s" in c:
            print("| clean wall - release delay, kept connections | %s | %d | %.2f s |" % (
                c["source"], c["n"], c["kept_beyond_delay_median_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
