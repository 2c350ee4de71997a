#!/usr/bin/env python3
"""Where the controller's CPU per host goes in `gpufleet status --all --json` (the 16-core comparison's target: <= 5 ms per host).

    sudo python3 bench/controller_cpu.py                 # 32 lab hosts, 3 runs
    sudo python3 bench/controller_cpu.py --hosts 128 --runs 3

bench/run.py reports the controller's CPU per host (the CLI and every process it starts); this
splits it, against the same lab hosts (8 fake H200s and a holder each), into:

* the CLI's own Python (its user + system time, read in the CLI's process as it exits);
* its children (the ``ssh`` processes: one ``ssh -G`` and one session per host);
* the same children's work done alone, by this bench: ``ssh -G`` for every host (as gpufleet
  asks it: ``-p PORT -l USER -- ADDRESS``), and a bare OpenSSH session per host, all at once,
  running ``true`` with the key exchange gpufleet puts first (curve25519) and with OpenSSH's
  default one (the lab's ssh_argv);

as milliseconds per host (medians of --runs). Nothing here is a target; it says what a target
on controller CPU per host is made of.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402

#: Runs the CLI and writes its own and its children's CPU to $GF_RUSAGE as it exits (the CLI
#: ends with os._exit once its output is flushed: that is where it is read).
DRIVER = r"""
import os, sys, resource, runpy
def report():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.environ["GF_RUSAGE"], "w") as f:
        f.write("%f %f\n" % (s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime))
_exit = os._exit
def exit_(code):
    report()
    _exit(code)
os._exit = exit_
sys.argv = ["gpufleet"] + sys.argv[1:]
try:
    runpy.run_module("gpufleet", run_name="__main__")
finally:
    report()
"""


def children_cpu(fn: Callable[[], Any]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def all_at_once(argvs: list[list[str]]) -> None:
    procs = [subprocess.Popen(a, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for a in argvs]
    for p in procs:
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gfbench-ctlcpu-"))
    (work / "home").mkdir()
    env = dict(os.environ, HOME=str(work / "home"), PYTHONPATH=str(REPO))
    lab = Lab(work / "lab")
    rows: dict[str, list[float]] = {}
    try:
        hosts = [lab.add_host("node%03d" % i, gpus=8, gpu_name="NVIDIA H200", total_mib=143771,
                              reserved_mib=616) for i in range(a.hosts)]
        for h in hosts:
            h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
        # fresh connections each run, as its ssh processes are counted (kept ones: the default)
        inv = lab.inventory_yaml(hosts, path=work / "fleet.yaml", command_timeout=60,
                                 ssh_persist=0)
        forks = str(min(32, a.hosts))
        ssh_g = [["ssh", "-G", "-p", str(h.port), "-l", "root", "--", h.address] for h in hosts]
        fast = [h.ssh_argv()[:1] + ["-o", "KexAlgorithms=curve25519-sha256"] + h.ssh_argv()[1:]
                + ["true"] for h in hosts]
        plain = [h.ssh_argv() + ["true"] for h in hosts]
        rusage = work / "rusage"
        for i in range(a.runs + 1):  # the first: warm (agent caches, page cache)
            r = subprocess.run([sys.executable, "-c", DRIVER, "-i", str(inv), "--forks", forks,
                                "status", "--all", "--json"], capture_output=True, text=True,
                               env=dict(env, GF_RUSAGE=str(rusage)), timeout=600)
            if r.returncode != 0:
                raise SystemExit("status failed: %s" % r.stderr[-400:])
            ok = sum(1 for h in json.loads(r.stdout)["hosts"] if h["ok"])
            if ok != a.hosts:
                raise SystemExit("%d of %d hosts answered" % (ok, a.hosts))
            own, kids = (float(x) for x in rusage.read_text().split())
            sample = {
                "gpufleet status: the CLI's own Python": own,
                "gpufleet status: its ssh processes": kids,
                "gpufleet status: all": own + kids,
                "ssh -G per host, alone": children_cpu(lambda: [subprocess.run(
                    g, capture_output=True, check=True) for g in ssh_g]),
                "bare ssh session (curve25519), all at once": children_cpu(lambda: all_at_once(fast)),
                "bare ssh session (OpenSSH's default kex), all at once": children_cpu(
                    lambda: all_at_once(plain)),
            }
            if i == 0:
                continue
            for k, v in sample.items():
                rows.setdefault(k, []).append(v * 1000.0 / a.hosts)
    finally:
        lab.close()
    print(json.dumps({"hosts": a.hosts, "ms_per_host": rows}))
    print("| controller CPU, %d hosts, --forks %s | ms per host (median of %d) | runs |" % (
        a.hosts, forks, a.runs))
    print("|---|---|---|")
    for k, v in rows.items():
        print("| %s | **%.1f** | %s |" % (k, statistics.median(v), ", ".join("%.1f" % x for x in v)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
