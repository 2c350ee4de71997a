"""How long `gpufleet slurm epilog` holds a node at job end (its targets: a job's end must stay short), in the lab.

Targets: with nothing left to clean, <= 0.3 s wall (agent + verdict, local, no SSH); with
leftovers, <= grace + the driver's release + 0.2 s. The epilog runs on the lab host exactly as
slurmd starts it (as root, inside the host, only Slurm's variables in the environment), so
the numbers include the interpreter's start-up; the report also gives gpufleet's own time
(what the command measured from its start: the `(N.NNs)` it prints) and the start-up alone
(`python3 -c 'import gpufleet.cli'`).

    sudo python3 bench/slurm_epilog.py [--runs 10] [--grace 1] [--release 0.5]
    sudo python3 bench/slurm_epilog.py --real [--runs 5] [--gpu 0] [--mib 20000]

``--real``: on a machine with NVIDIA GPUs and torch (the H200): the epilog on this machine
itself, with nothing left on ``--gpu``, then with a torch process (``setsid``, holding
``--mib``) left behind each run.

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


def run_epilog(host, job: int, grace: float, gpus: str = "0,1") -> tuple[float, float, int, str]:
    import os

    argv = ["env", "-i", "PYTHONPATH=%s" % REPO, "SLURM_JOB_ID=%d" % job,
            "SLURM_JOB_UID=%d" % os.getuid(), "SLURM_JOB_GPUS=%s" % gpus,
            "SLURMD_NODENAME=bench", sys.executable, "-m", "gpufleet",
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


class Here:
    """This machine, for --real: exec runs the command here."""

    def exec(self, argv, timeout=60):
        import subprocess

        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


TORCH_LEFTOVER = ("import os,sys,time,torch; os.setsid(); "
                  "x=torch.empty(int(sys.argv[1])<<20,dtype=torch.uint8,device='cuda'); "
                  "torch.cuda.synchronize(); print('ready',flush=True); time.sleep(3600)")


def real(args) -> None:
    import os
    import subprocess

    here = Here()
    env = {"CUDA_VISIBLE_DEVICES": str(args.gpu)}
    walls, owns = [], []
    for i in range(args.runs):
        wall, own, rc, out = run_epilog(here, 300 + i, args.grace, gpus=str(args.gpu))
        assert rc == 0, out
        walls.append(wall)
        owns.append(own)
    summary("real: nothing to clean", walls, owns)
    walls, owns = [], []
    for i in range(args.runs):
        p = subprocess.Popen([sys.executable, "-c", TORCH_LEFTOVER, str(args.mib)],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, **env))
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        wall, own, rc, out = run_epilog(here, 400 + i, args.grace, gpus=str(args.gpu))
        p.wait(10)  # the epilog ended it (our child: reap it)
        assert rc == 0, out
        walls.append(wall)
        owns.append(own)
    summary("real: torch leftover (%d MiB)" % args.mib, walls, owns)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--grace", type=float, default=1.0)
    ap.add_argument("--release", type=float, default=0.5, help="the fake driver's release delay")
    ap.add_argument("--real", action="store_true", help="this machine's real GPUs (torch)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--mib", type=int, default=20000)
    args = ap.parse_args()
    if args.real:
        real(args)
        return
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
