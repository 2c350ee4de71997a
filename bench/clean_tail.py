"""Where the time goes between "the GPU's memory is back" and "gpufleet clean returned".

    sudo python3 bench/clean_tail.py               # 5 runs per variant, a markdown table
    sudo python3 bench/clean_tail.py --runs 10 --json

One test-lab host (tests/lab/: real namespaces, the fake driver; its memory is free the moment
the holder is gone: release_delay_s 0). Each run starts one holder (20 GiB on GPU 0, ends on
TERM) and runs `gpufleet clean --all --gpus 0 --yes --json` INSIDE the host with `connection: local`
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
version, as before the start-up work), and the interpreter's teardown at exit (the CLI now ends with
os._exit once its output is flushed). Needs root and the lab's prerequisites (tests/lab/README.md).
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
    if request.get("mode") == "clean" and PROFILE is not None:
        PROFILE.enable()  # from the document's arrival to the exit
    return reply
tsession.Session.run_agent = run_agent
PROFILE = None
if os.environ.get("GF_PROFILE"):
    import cProfile, pstats
    PROFILE = cProfile.Profile()
def report():
    if "atexit" in marks:
        return
    marks["atexit"] = time.monotonic()
    if PROFILE is not None:
        PROFILE.disable()
        pstats.Stats(PROFILE, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    sys.stderr.write("GF-MARKS " + json.dumps(marks) + "\n")
atexit.register(report)  # the interpreter's exit (GF_SLOW_EXIT, and before the start-up work)
import gpufleet.cli as gcli
_orig_exit = gcli._exit_now
def exit_now(code):  # the CLI's own fast exit: the marks first
    report()
    _orig_exit(code)
gcli._exit_now = exit_now
sys.argv = ["gpufleet"] + sys.argv[1:]
if os.environ.get("GF_SLOW_EXIT"):
    gcli.main(sys.argv[1:])  # main(argv): SystemExit, then the interpreter's teardown
else:
    gcli.main()  # as the `gpufleet` program runs it
"""

VARIANTS = {
    "as the controller sends it": {},
    "as sent, interpreter teardown at exit": {"exit": "slow"},
    "pidfd, no CUDA version": {"pidfd": True, "cuda_version": False},
    "pidfd, CUDA version": {"pidfd": True, "cuda_version": True},
    "polled, no CUDA version": {"pidfd": False, "cuda_version": False},
    "polled, CUDA version, teardown (before the start-up work)": {"pidfd": False, "cuda_version": True,
                                                          "exit": "slow"},
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


def one_run(host: Any, extra: dict[str, Any], profile: bool = False, root: Path = REPO
            ) -> Optional[dict[str, float]]:
    holder = host.spawn_holder(gpus=[0], mib=20480, title="VLLM::Worker", via="exec")
    dead = watch_exit(host.outer_pid(holder))
    argv = ["nsenter", "-t", str(host.root_pid), "-m", "-u", "-p", "-w", "--",
            "env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONPATH=" + str(root), "HOME=/root",
            "GF_REQUEST_EXTRA=" + json.dumps({k: v for k, v in extra.items() if k != "exit"}),
            "GF_SLOW_EXIT=" + ("1" if extra.get("exit") == "slow" else ""),
            "GF_PROFILE=" + ("1" if profile else ""),
            sys.executable, "-c", WRAPPER, "-i", "/tmp/fleet.yaml", "clean", "--all", "--gpus", "0",
            "--yes", "--json", "--grace", "5", "--audit-log", "/tmp/audit.jsonl"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    end = time.monotonic()
    if profile:
        print(res.stderr, file=sys.stderr)
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


def agent_pieces(host: Any, runs: int) -> dict[str, float]:
    """Median wall (s) of what the agent runs after the memory is back, each alone in the host:
    the after-snapshot with and without the CUDA version, and one memory-wait query."""
    sys.path.insert(0, str(REPO))
    from gpufleet.remote import bootstrap_command, encode_request

    enter = ["nsenter", "-t", str(host.root_pid), "-m", "-u", "-p", "-w", "--"]

    def wall(argv: list[str], data: bytes = b"") -> float:
        t0 = time.monotonic()
        subprocess.run(enter + argv, input=data, capture_output=True, timeout=60, check=True)
        return time.monotonic() - t0

    out = {}
    for cuda in (False, True):
        req = encode_request({"mode": "snapshot", "deadline_s": 30, "cuda_version": cuda})
        wall(bootstrap_command(sys.executable), req)
        out["snapshot, cuda_version %s" % str(cuda).lower()] = statistics.median(
            wall(bootstrap_command(sys.executable), req) for _ in range(runs))
    query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    out["one memory-wait query (nvidia-smi)"] = statistics.median(wall(query) for _ in range(runs))
    out["python -S -E -s -c pass"] = statistics.median(
        wall([sys.executable, "-S", "-E", "-s", "-c", "pass"]) for _ in range(runs))
    return out


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--against", type=Path, default=None, metavar="DIR",
                    help="another checkout (e.g. the commit before the start-up work), run as sent, "
                         "alternating with the variants")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="one run; cProfile of the controller from the document's arrival to exit")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (the test lab)", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    with Lab() as lab:
        host = lab.add_host("tail", gpus=1, total_mib=143771, release_delay_s=0.0)
        host.path("/tmp/fleet.yaml").write_text("hosts:\n  tail:\n    connection: local\n")
        one_run(host, {})  # warm-up: .pyc files, page cache
        if args.profile:
            one_run(host, {}, profile=True)
            return 0
        variants = dict(VARIANTS)
        roots = {name: REPO for name in variants}
        if args.against is not None:
            name = "checkout %s, as it sends it" % args.against.resolve().name
            variants[name], roots[name] = {}, args.against.resolve()
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for i in range(args.runs):  # round robin, order rotated: load drifts hit all alike
            names = list(variants)
            for name in names[i % len(names):] + names[:i % len(names)]:
                row = one_run(host, variants[name], root=roots[name])
                if row:
                    runs[name].append(row)
        out = {name: {"runs": rows, "median": summarize(rows)} for name, rows in runs.items()}
        pieces = agent_pieces(host, args.runs)
    if args.json:
        print(json.dumps({"variants": out, "agent_pieces": pieces}, indent=1))
        return 0
    print("median of %d runs, %d cores, load average %.1f at the end; seconds"
          % (args.runs, os.cpu_count() or 0, os.getloadavg()[0]))
    print()
    print("| variant | memory back -> agent's document at the controller | -> CLI's atexit | "
          "-> CLI gone | memory back -> CLI gone | the clean exec | whole command |")
    print("|---|---|---|---|---|---|---|")
    for name, v in out.items():
        m = v["median"]
        if not m:
            print("| %s | failed | | | | | |" % name)
            continue
        print("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
            name, m["agent_tail_s"], m["cli_to_atexit_s"], m["controller_tail_s"], m["total_tail_s"],
            m["clean_exec_s"], m["wall_s"]))
    print()
    print("| in the host, alone (wall, median) | s |")
    print("|---|---|")
    for name, seconds in pieces.items():
        print("| %s | %.3f |" % (name, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
