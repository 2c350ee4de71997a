#!/usr/bin/env python3
"""`gpufleet status --all --json` of this checkout against another, alternated on one lab.

    sudo python3 bench/status_ab.py --against /var/tmp/base              # 32 hosts, 20 ms RTT
    git archive BASE gpufleet | tar -x -C /var/tmp/base                  # (the other tree)
    sudo python3 bench/status_ab.py --against /var/tmp/base --hosts 128 --rtt 100 --runs 9

bench/run.py compares tools; its numbers move by 10-20 % between machines of one kind and
between minutes of one machine, which is as large as most changes to gpufleet. This runs both
trees (``python3 -m gpufleet`` with the tree first on PYTHONPATH) on the same lab hosts behind
the same delay line, alternating (which tree goes first alternates too), each run in a fresh
cgroup, and prints per tree the median wall, the controller's CPU per host (the CLI and its
ssh processes) and the hosts' CPU per host. Each tree has its own HOME (its own controller
caches: known_hosts, the memory of which hosts cached the agent), one warm-up run each first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import benchlab as B  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="the other tree (has gpufleet/)")
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--rtt", type=float, default=20.0, help="round-trip time, ms")
    ap.add_argument("--runs", type=int, default=7, help="runs of each tree")
    ap.add_argument("--forks", type=int, default=32)
    a = ap.parse_args()
    trees = {"this checkout": REPO, "against": a.against.resolve()}
    for name, tree in trees.items():
        if not (tree / "gpufleet" / "__init__.py").is_file():
            print("status_ab: %s has no gpufleet/ (%s)" % (name, tree), file=sys.stderr)
            return 2
    work = Path(tempfile.mkdtemp(prefix="gfbench-ab-"))
    net = B.Net(a.rtt / 2.0)
    lab = B.BenchLab(work, net)
    hosts_cg = B.Cgroup("gfab%d-hosts" % os.getpid())
    tool_cg = B.Cgroup("gfab%d-tool" % os.getpid())
    try:
        hosts_cg.enter_self()  # every host process (sshd, agent) is counted there
        try:
            lab.start_hosts(a.hosts)
        finally:
            B.Cgroup.leave_self()
        # fresh connections each run (kept ones are the default now): the trees' own cost
        inv = lab.gpufleet_inventory(lab.hosts, work / "fleet.yaml", ssh_persist=0)
        envs = {}
        for i, (name, tree) in enumerate(trees.items()):
            home = work / ("home%d" % i)
            home.mkdir()
            envs[name] = dict(os.environ, PYTHONPATH=str(tree), HOME=str(home),
                              XDG_CACHE_HOME=str(home / ".cache"))
        argv = [sys.executable, "-m", "gpufleet", "-i", str(inv), "--forks", str(a.forks),
                "status", "--all", "--json"]
        rows: dict[str, list[B.Measured]] = {k: [] for k in trees}
        order = list(trees)
        for r in range(a.runs + 1):
            for name in (order if r % 2 else order[::-1]):
                m = B.measure(argv, tool_cg, hosts_cg=hosts_cg, env=envs[name])
                if m.rc not in (0, 1):
                    print("status_ab: %s exit %d: %s" % (name, m.rc, m.stderr[-300:]),
                          file=sys.stderr)
                    return 1
                if r:  # run 0: warm-up (first contact: known hosts, host caches)
                    rows[name].append(m)
        print("status --all --json, %d lab hosts, %g ms RTT, --forks %d, %d runs per tree, "
              "alternated (medians):" % (a.hosts, a.rtt, a.forks, a.runs))
        print("| tree | wall s | min s | controller CPU ms/host | hosts CPU ms/host |")
        print("|---|---|---|---|---|")
        for name, ms in rows.items():
            cpu = [m.cpu_s for m in ms if m.cpu_s is not None]
            far = [m.remote_cpu_s for m in ms if m.remote_cpu_s is not None]
            print("| %s (%s) | %.3f | %.3f | %s | %s |" % (
                name, trees[name], statistics.median(m.wall_s for m in ms),
                min(m.wall_s for m in ms),
                "%.1f" % (statistics.median(cpu) * 1000 / a.hosts) if cpu else "-",
                "%.1f" % (statistics.median(far) * 1000 / a.hosts) if far else "-"))
    finally:
        lab.close()
        net.close()
        hosts_cg.remove()
        tool_cg.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
