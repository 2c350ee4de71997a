#!/usr/bin/env python3
"""What the health gate costs (the target: `health --all` at most 10 ms more per host
than `status`, because it runs in the same single exec).

Prints numbers, asserts nothing (speed goals live here, never in timed tests). As root, on the
test lab: N hosts with 8 GPUs each and a kernel log of R records (some Xid lines):

  1. the agent's own cost of the health readings, from inside one snapshot: the kernel log's
     read (``kernel_log.seconds``) and the whole NVML pass (``nvml.seconds``, which includes
     the ECC / remapped rows / clocks / PCIe calls), median over runs;
  2. the same agent with ``kernel_log: false`` (request key), to show what the log adds;
  3. wall time of `gpufleet status --all --json` against `gpufleet health --all --json` on
     the same hosts, alternating, median over runs: the per-host difference.

  sudo python3 bench/health_cost.py [--hosts 4] [--runs 7] [--records 2000]
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "lab"))
sys.path.insert(0, str(REPO))

from lab import Lab, kmsg_record  # noqa: E402

XID = json.loads((REPO / "tests" / "fixtures" / "xid" / "lines.json").read_text())


def kernel_log(records: int) -> list[str]:
    out = []
    for i in range(records):
        msg = XID["xid79_bare"]["line"] if i % 100 == 99 else f"eth0: link state change {i}"
        out.append(kmsg_record(msg, i + 1, 10.0 + i / 10))
    return out


def agent_doc(host, kernel: bool) -> dict:
    """One snapshot run on the host over SSH, as the controller sends it."""
    from gpufleet.remote import bootstrap_command, encode_request

    req = {"mode": "snapshot", "deadline_s": 30, "smi_timeout_s": 10, "kernel_log": kernel}
    res = subprocess.run(host.ssh_argv() + [shlex.join(bootstrap_command())],
                         input=encode_request(req), capture_output=True, timeout=60)
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


def cli_wall(inventory: Path, command: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(inventory), command, "--all",
                    "--json"], capture_output=True, timeout=120, cwd=str(REPO))
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--records", type=int, default=2000)
    args = ap.parse_args()
    with Lab() as lab:
        hosts = [lab.add_host(f"h{i}", gpus=8, kmsg=kernel_log(args.records))
                 for i in range(args.hosts)]
        inv = lab.inventory_yaml(hosts)
        with_log, without, log_s, nvml_s = [], [], [], []
        for _ in range(args.runs):
            doc = agent_doc(hosts[0], True)
            with_log.append(doc["seconds"])
            log_s.append(doc["kernel_log"]["seconds"])
            nvml_s.append(doc["nvml"]["seconds"])
            without.append(agent_doc(hosts[0], False)["seconds"])
        status, health = [], []
        for i in range(args.runs):
            pair = [("status", status), ("health", health)]
            for name, bucket in (pair if i % 2 == 0 else pair[::-1]):
                bucket.append(cli_wall(inv, name))
        med = statistics.median
        print(f"hosts {args.hosts} x 8 GPUs, kernel log {args.records} records "
              f"({args.records // 100} Xid), {args.runs} runs, medians:")
        print(f"  agent snapshot: {med(with_log) * 1e3:.1f} ms with the kernel log, "
              f"{med(without) * 1e3:.1f} ms without")
        print(f"  inside it: kernel log read {med(log_s) * 1e3:.1f} ms; NVML pass (8 GPUs, "
              f"health readings included) {med(nvml_s) * 1e3:.1f} ms")
        print(f"  CLI wall: status {med(status) * 1e3:.0f} ms, health {med(health) * 1e3:.0f} ms"
              f" -> {(med(health) - med(status)) * 1e3 / args.hosts:+.1f} ms per host")


if __name__ == "__main__":
    main()
