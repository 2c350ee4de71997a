"""Where the time goes between "the GPU's memory is back" and "gpufleet clean returned".

    sudo python3 bench/clean_tail.py               # 5 runs per variant, a markdown table
    sudo python3 bench/clean_tail.py --runs 10 --json

One test-lab host (tests/lab/: real namespaces, the fake driver; its memory is free the moment
the holder is gone: release_delay_s 0). Each run starts one holder (20 GiB on GPU 0, ends on
TERM) and runs `gpufleet clean --gpus 0 --yes --json` INSIDE the host with `connection: local`
(no SSH: the controller's own work is what is measured), through a wrapper that records, on
the machine-wide monotonic clock:

* ``dead``: the holder's exit, seen here on a pidfd of its pid (the memory is back then);
* ``returned``: the controller has the agent's clean document (Session.run_agent returned);
* ``atexit``: the CLI printed its result and is exiting; ``end``: its process is gone.

So ``agent tail`` = returned - dead (exit wait, memory wait, the after-snapshot, JSON, exit),
``controller tail`` = end - returned (parse, verdict, audit, render, interpreter exit).
Variants change the agent request the controller sends (the wrapper patches
ops.clean.clean_request): ``pidfd`` false (the exit wait polls every 0.1 s, as before issue
12) and ``cuda_version`` true (the after-snapshot also runs a bare nvidia-smi for the CUDA
version, as before issue 12). Needs root and the lab's prerequisites (tests/lab/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402

# Runs in the host: marks on the monotonic clock, printed as one JSON line on stderr at exit.
WRAPPER = r"""
import atexit, json, os, sys, time
marks = {"start": time.monotonic()}
extra = json.loads(os.environ.get("GF_REQUEST_EXTRA") or "{}")
from gpufleet.ops import clean as ops_clean
from gpufleet.transport import session as tsession
_orig_request = ops_clean.clean_request
def clean_request(*a, **kw):
    r = _orig_request(*a, **kw)
    r.update(extra)
    return r
ops_clean.clean_request = clean_request
_orig_run = tsession.Session.run_agent
def run_agent(self, request, timeout=None):
    t0 = time.monotonic()
    reply = _orig_run(self, request, timeout)
    marks[request.get("mode", "?") + "_sent"] = t0
    marks[request.get("mode", "?") + "_returned"] = time.monotonic()
    return reply
tsession.Session.run_agent = run_agent
atexit.register(lambda: sys.stderr.write("GF-MARKS " + json.dumps(dict(marks, atexit=time.monotonic())) + "\n"))
from gpufleet.cli import main
main(sys.argv[1:])
"""

VARIANTS = {
    "as the controller sends it": {},
    "pidfd, no CUDA version": {"pidfd": True, "cuda_version": False},
    "pidfd, CUDA version": {"pidfd": True, "cuda_version": True},
    "polled, no CUDA version": {"pidfd": False, "cuda_version": False},
    "polled, CUDA version (before issue 12)": {"pidfd": False, "cuda_version": True},
}


def watch_exit(pid: int) -> list[float]:
    """The monotonic time the process exits, seen on a pidfd (filled in by a thread)."""
    seen: list[float] = []
    fd = os.pidfd_open(pid)

    def wait() -> None:
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            poller.poll(60000)
            seen.append(time.monotonic())
        finally:
            os.close(fd)

    threading.Thread(target=wait, daemon=True).start()
    return seen


def one_run(host: Any, extra: dict[str, Any]) -> Optional[dict[str, float]]:
    holder = host.spawn_holder(gpus=[0], mib=20480, title="VLLM::Worker", via="exec")
    dead = watch_exit(host.outer_pid(holder))
    argv = ["nsenter", "-t", str(host.root_pid), "-m", "-u", "-p", "-w", "--",
            "env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH=" + str(REPO), "GF_REQUEST_EXTRA=" + json.dumps(extra), "HOME=/root",
            sys.executable, "-c", WRAPPER, "-i", "/tmp/fleet.yaml", "clean", "--gpus", "0",
            "--yes", "--json", "--grace", "5", "--audit-log", "/tmp/audit.jsonl"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    end = time.monotonic()
    marks = next((json.loads(line[len("GF-MARKS "):]) for line in res.stderr.splitlines()
                  if line.startswith("GF-MARKS ")), None)
    if res.returncode != 0 or not marks or not dead or "clean_returned" not in marks:
        print("run failed: rc %s\n%s\n%s" % (res.returncode, res.stdout[-2000:], res.stderr[-2000:]),
              file=sys.stderr)
        return None
    return {"agent_tail_s": marks["clean_returned"] - dead[0],
            "controller_tail_s": end - marks["clean_returned"],
            "cli_to_atexit_s": marks["atexit"] - marks["clean_returned"],
            "total_tail_s": end - dead[0],
            "clean_exec_s": marks["clean_returned"] - marks["clean_sent"],
            "wall_s": end - marks["start"]}


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the test lab)", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    with Lab() as lab:
        host = lab.add_host("tail", gpus=1, total_mib=143771, release_delay_s=0.0)
        host.path("/tmp/fleet.yaml").write_text("hosts:\n  tail:\n    connection: local\n")
        one_run(host, {})  # warm-up: .pyc files, page cache
        for name, extra in VARIANTS.items():
            rows = [r for r in (one_run(host, extra) for _ in range(args.runs)) if r]
            out[name] = {"runs": rows, "median": summarize(rows)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print("median of %d runs, %d cores; seconds" % (args.runs, os.cpu_count() or 0))
    print()
    print("| variant | memory back -> agent's document at the controller | -> CLI gone | "
          "memory back -> CLI gone | the clean exec | whole command |")
    print("|---|---|---|---|---|---|")
    for name, v in out.items():
        m = v["median"]
        if not m:
            print("| %s | failed | | | | |" % name)
            continue
        print("| %s | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
            name, m["agent_tail_s"], m["controller_tail_s"], m["total_tail_s"],
            m["clean_exec_s"], m["wall_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
