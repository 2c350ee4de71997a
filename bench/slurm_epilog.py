"""How long `gpufleet slurm epilog` holds a node at job end (issue 15's targets), in the lab.

Targets: with nothing left to clean, <= 0.3 s wall (agent + verdict, local, no SSH); with
leftovers, <= grace + the driver's release + 0.2 s. The epilog runs on the lab host exactly as
slurmd starts it (as root, inside the host, only Slurm's variables in the environment), so
the numbers include the interpreter's start-up; the report also gives gpufleet's own time
(what the command measured from its start: the `(N.NNs)` it prints) and the start-up alone
(`python3 -c 'import gpufleet.cli'`).

    sudo python3 bench/slurm_epilog.py [--runs 10] [--grace 1] [--release 0.5]

Prints numbers; asserts nothing (speed goals are not tests).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402


def run_epilog(host, job: int, grace: float) -> tuple[float, float, int, str]:
    argv = ["env", "-i", "PYTHONPATH=%s" % REPO, "SLURM_JOB_ID=%d" % job, "SLURM_JOB_UID=0",
            "SLURM_JOB_GPUS=0,1", "SLURMD_NODENAME=bench", sys.executable, "-m", "gpufleet",
            "slurm", "epilog", "--no-syslog", "--audit-log", "/tmp/audit.jsonl",
            "--grace", str(grace)]
    started = time.monotonic()
    res = host.exec(argv, timeout=120)
    wall = time.monotonic() - started
    m = re.search(r"\(([0-9.]+)s\)", res.stdout)
    return wall, float(m.group(1)) if m else float("nan"), res.returncode, (res.stdout + res.stderr).strip()


def startup(host) -> float:
    started = time.monotonic()
    host.exec(["env", "-i", "PYTHONPATH=%s" % REPO, sys.executable, "-c",
               "import gpufleet.cli.slurm_cmd, gpufleet.ops.slurm"], timeout=60)
    return time.monotonic() - started


def summary(name: str, walls: list[float], owns: list[float]) -> None:
    print("%-34s wall median %.3f s (min %.3f, max %.3f); gpufleet's own median %.3f s"
          % (name, statistics.median(walls), min(walls), max(walls), statistics.median(owns)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--grace", type=float, default=1.0)
    ap.add_argument("--release", type=float, default=0.5, help="the fake driver's release delay")
    args = ap.parse_args()
    with Lab() as lab:
        host = lab.add_host("bench", gpus=2, total_mib=143771)
        ups = [startup(host) for _ in range(args.runs)]
        print("interpreter + gpufleet import, median %.3f s" % statistics.median(ups))
        walls, owns = [], []
        for i in range(args.runs):
            wall, own, rc, out = run_epilog(host, 100 + i, args.grace)
            assert rc == 0, out
            walls.append(wall)
            owns.append(own)
        summary("nothing to clean", walls, owns)
        host.set_config(release_delay_s=args.release)
        for label, kw in (("leftover exits on TERM", {}),
                          ("leftover ignores TERM (KILL)", {"ignore_term": True})):
            walls, owns = [], []
            for i in range(args.runs):
                host.spawn_holder(gpus=[0], mib=70000, title="VLLM::Worker_TP0", via="exec", **kw)
                wall, own, rc, out = run_epilog(host, 200 + i, args.grace)
                assert rc == 0, out
                walls.append(wall)
                owns.append(own)
            summary(label, walls, owns)
        print("target with leftovers: grace %.1f s (only when TERM is ignored) + release %.1f s "
              "+ 0.2 s" % (args.grace, args.release))


if __name__ == "__main__":
    main()
