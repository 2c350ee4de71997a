#!/usr/bin/env python3
"""One agent snapshot as a lab host runs it: its fake NVML, 8 GPUs, one holder (where the agent's start goes).

    sudo python3 bench/agent_lab.py                          # this checkout, 40 execs x 5
    git archive BASE | tar -x -C /var/tmp/base && sudo python3 bench/agent_lab.py --against /var/tmp/base

bench/agent_start.py measures the agent on this machine, which has no NVIDIA driver (its GPU
part is a fast error value); this one runs it where a lab host's NVML path is real: inside one
lab host (its namespaces, its fake libnvidia-ml), the constant bootstrap command with the
snapshot request of `gpufleet status`, started ``--execs`` times in a row by a shell in the host
(no ssh: the agent's own cost), and ``python3 -S -E -s -c pass`` the same way as the floor.
Rounds of each checkout alternate. Prints, per variant, the median over rounds of the wall and
the CPU (user + system of the execs) per exec, and the modules the agent imported
(``-X importtime``). The agent cache is on, as by default (one exec before the rounds fills it).
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402

REQUEST = {"mode": "snapshot", "deadline_s": 58.0, "smi_timeout_s": 10.0, "cuda_version": False}
PAYLOAD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from gpufleet.remote import BOOTSTRAP, encode_request
sys.stdout.buffer.write(json.dumps(BOOTSTRAP).encode() + b"\n")
sys.stdout.buffer.write(encode_request(json.loads(sys.argv[2])))
"""
WATCHED = ("re", "json", "enum", "signal", "subprocess", "threading", "functools", "ctypes", "_json")


def payload_of(tree: Path) -> tuple[str, bytes]:
    out = subprocess.run([sys.executable, "-c", PAYLOAD, str(tree), json.dumps(REQUEST)],
                         capture_output=True, check=True, timeout=60).stdout
    head, _, body = out.partition(b"\n")
    return json.loads(head), body


def in_host(host: object, script: str) -> tuple[float, float]:
    """(wall s, children's CPU s) of a shell script run inside the lab host."""
    t0, c0 = time.monotonic(), os.times()
    subprocess.run(["nsenter", "-t", str(host.root_pid), "-m", "-u", "-p", "-w", "sh", "-c",  # type: ignore[attr-defined]
                    script], check=True, timeout=600)
    c1 = os.times()
    return time.monotonic() - t0, (c1.children_user + c1.children_system
                                   - c0.children_user - c0.children_system)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, help="another checkout, measured the same way")
    ap.add_argument("--execs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    variants = [("this checkout", REPO)] + ([("against", a.against.resolve())] if a.against else [])
    lab = Lab(Path(tempfile.mkdtemp(prefix="gfbench-agentlab-")))
    try:
        host = lab.add_host("node000", gpus=8, gpu_name="NVIDIA H200", total_mib=143771,
                            reserved_mib=616)
        host.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
        scripts = {}
        for i, (name, tree) in enumerate(variants):
            boot, body = payload_of(tree)
            host.path("/tmp/payload%d" % i).write_bytes(body)
            host.path("/tmp/boot%d" % i).write_text(boot)
            run = 'python3 -S -E -s -c "$B" < /tmp/payload%d > /dev/null' % i
            in_host(host, 'B=$(cat /tmp/boot%d); %s' % (i, run))  # fills the agent cache
            scripts[name] = 'B=$(cat /tmp/boot%d); i=0; while [ $i -lt %d ]; do %s; i=$((i+1)); done' % (
                i, a.execs, run)
            probe = 'python3 -S -E -s -X importtime -c "$(cat /tmp/boot%d)" < /tmp/payload%d 2>&1 >/dev/null' % (i, i)
            log = subprocess.run(["nsenter", "-t", str(host.root_pid), "-m", "-u", "-p", "-w", "sh",
                                  "-c", probe], capture_output=True, text=True, timeout=60).stdout
            mods = {ln.rsplit("|", 1)[1].strip() for ln in log.splitlines() if ln.count("|") == 2}
            print("%s: imports %s; not %s" % (name, ", ".join(m for m in WATCHED if m in mods),
                                               ", ".join(m for m in WATCHED if m not in mods) or "-"))
        scripts["python3 -S -E -s -c pass"] = (
            "i=0; while [ $i -lt %d ]; do python3 -S -E -s -c pass; i=$((i+1)); done" % a.execs)
        rows: dict[str, list[tuple[float, float]]] = {k: [] for k in scripts}
        for _ in range(a.rounds):
            for name, script in scripts.items():
                wall, cpu = in_host(host, script)
                rows[name].append((wall * 1000 / a.execs, cpu * 1000 / a.execs))
        print("| per exec, median of %d rounds of %d | wall ms | CPU ms |" % (a.rounds, a.execs))
        print("|---|---|---|")
        for name, vals in rows.items():
            print("| %s | %.1f | %.1f |" % (name, statistics.median(v[0] for v in vals),
                                          statistics.median(v[1] for v in vals)))
    finally:
        lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
