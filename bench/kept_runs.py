#!/usr/bin/env python3
"""One command over SSH three ways, on one lab host: a fresh connection per run, an ``ssh``
client joining a kept master (``-o ControlPath``), and what gpufleet does through a kept
master (``ssh -O check`` bounded by the connect timeout, then that client); wall and this
side's CPU per run.

    sudo python3 bench/kept_runs.py [--runs 40] [--command true]

The CPU column is the controller's: its children, the ``ssh`` processes (the master's share, encrypting, is not in either and is the same for both
kept ways). Also `status --json` of the host with and without ``ssh_persist``, alternated.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))
sys.path.insert(0, str(REPO))

from lab import Lab  # noqa: E402


def cpu(who: int) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


def timed(runs: int, once, who: int) -> tuple[float, float]:
    """(median wall ms, mean CPU ms) of ``runs`` calls."""
    walls = []
    c0 = cpu(who)
    for _ in range(runs):
        t0 = time.monotonic()
        once()
        walls.append(time.monotonic() - t0)
    return statistics.median(walls) * 1000, (cpu(who) - c0) / runs * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--command", default="true")
    a = ap.parse_args()
    from gpufleet.transport import sshcontrol

    work = Path(tempfile.mkdtemp(prefix="gfbench-kept-"))
    (work / "home").mkdir()
    lab = Lab(work / "lab")
    rows = []
    try:
        h = lab.add_host("kept0", gpus=8, gpu_name="NVIDIA H200", total_mib=143771)
        h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
        base = h.ssh_argv()
        base = base[:1] + ["-o", "KexAlgorithms=curve25519-sha256"] + base[1:]
        sock = str(work / "m")
        master = base[:1] + ["-o", "ControlMaster=yes", "-o", "ControlPath=" + sock,
                             "-o", "ControlPersist=120", "-N", "-f"] + base[1:]
        subprocess.run(master, check=True, timeout=30)
        client = base[:1] + ["-o", "ControlMaster=no", "-o", "ControlPath=" + sock] + base[1:]
        fresh = base[:1] + ["-o", "ControlMaster=no", "-o", "ControlPath=none"] + base[1:]

        def ssh_run(argv: list) -> None:
            r = subprocess.run(argv + ["--", a.command], capture_output=True, timeout=30)
            assert r.returncode == 0, r.stderr

        def checked_run() -> None:
            assert sshcontrol.check(sock, 10).pid is not None
            ssh_run(client)

        rows.append(("a fresh connection (ssh)",) + timed(a.runs, lambda: ssh_run(fresh),
                                                          resource.RUSAGE_CHILDREN))
        rows.append(("ssh -o ControlPath: a client of the kept master",)
                    + timed(a.runs, lambda: ssh_run(client), resource.RUSAGE_CHILDREN))
        rows.append(("gpufleet: ssh -O check, then ssh -o ControlPath",)
                    + timed(a.runs, checked_run, resource.RUSAGE_CHILDREN))
        sshcontrol.stop(sock)

        env = dict(os.environ, HOME=str(work / "home"), PYTHONPATH=str(REPO))
        invs = {k: lab.inventory_yaml([h], path=work / ("fleet-%s.yaml" % k), **extra)
                for k, extra in (("fresh", {"ssh_persist": 0}), ("kept", {"ssh_persist": 120}))}
        walls: dict[str, list] = {k: [] for k in invs}
        for _ in range(max(3, a.runs // 4)):
            for k, inv in invs.items():
                t0 = time.monotonic()
                r = subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(inv), "status",
                                    "--json"], capture_output=True, env=env, timeout=60)
                walls[k].append(time.monotonic() - t0)
                assert r.returncode == 0, r.stderr
        subprocess.run([sys.executable, "-m", "gpufleet", "disconnect"], env=env, timeout=60,
                       capture_output=True)
    finally:
        lab.close()
    print("| `%s` on one lab host, %d runs | wall median ms | controller CPU ms/run |" % (
        a.command, a.runs))
    print("|---|---|---|")
    for name, wall, c in rows:
        print("| %s | %.1f | %.2f |" % (name, wall, c))
    for k, w in walls.items():
        print("| `gpufleet status --json`, %s (%d runs, alternated) | %.0f | |" % (
            "ssh_persist: 120" if k == "kept" else "ssh_persist: 0", len(w),
            statistics.median(w) * 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
