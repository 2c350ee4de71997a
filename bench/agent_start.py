"""What one agent exec costs on this machine, and where it goes (the agent's start, paid by every command).

    python3 bench/agent_start.py                         # 21 runs each, a markdown table
    python3 bench/agent_start.py --runs 41 --json
    git archive BASE | tar -x -C /var/tmp/base && python3 bench/agent_start.py --against /var/tmp/base

Rows (medians, min-max; prints numbers, asserts nothing):

* ``exec``: wall of one agent exec as ``connection: local`` runs it (the constant bootstrap
  argv through ``subprocess``, no shell; the stdin payload of ``encode_request``), a snapshot
  request: cache off (``agent_cache: false``), cold (an empty cache directory each run), warm
  (the same directory: a hit). ``--against DIR``: the same request with that checkout's
  bootstrap and payload (before the cache: there is only one row), runs alternating.
* ``seconds``: the agent's own ``seconds`` in the document (the snapshot, after start-up).
* ``status``: ``python3 -m gpufleet -i fleet.yaml status`` of one ``connection: local`` host,
  ``agent_cache`` false / true (warm), the whole CLI.
* In a ``python3 -S -E -s`` child: ``compile()`` of the joined agent, ``marshal.loads`` of its
  code object, and the module-level work (exec of the code with a ``__name__`` that runs no
  mode: the imports and definitions before a snapshot starts).
* The controller: ``zlib.compress`` of the agent per level (time, size), ``agent_key()``.

This machine has no NVIDIA driver, so the snapshot's GPU part is an error value (fast); the
start-up, the /proc scan and everything before them are the real thing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
REQUEST = {"mode": "snapshot", "deadline_s": 20.0, "smi_timeout_s": 5.0}

#: Run in a fresh `python3 -S -E -s`: compile, marshal.loads, module-level exec of the agent.
CHILD = r"""
import marshal, sys, time
src = sys.stdin.buffer.read()
t = time.perf_counter(); code = compile(src, "gpufleet-agent", "exec"); c = time.perf_counter() - t
data = marshal.dumps(code)
t = time.perf_counter(); marshal.loads(data); m = time.perf_counter() - t
t = time.perf_counter(); exec(code, {"__name__": "gpufleet_bench"}); x = time.perf_counter() - t
print("%f %f %f %d" % (c, m, x, len(data)))
"""

#: Run with another checkout first on sys.path: its argv and payload for REQUEST.
PAYLOAD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from gpufleet.remote import bootstrap_command, encode_request
sys.stdout.buffer.write(json.dumps(bootstrap_command(sys.argv[2])).encode() + b"\n")
sys.stdout.buffer.write(encode_request(json.loads(sys.argv[3])))
"""


def stats(xs: list[float], scale: float = 1000.0) -> str:
    """median (min-max) in ms."""
    return "%.1f (%.1f-%.1f)" % (statistics.median(xs) * scale, min(xs) * scale, max(xs) * scale)


def payload_of(code: Path, request: dict[str, Any]) -> tuple[list[str], bytes]:
    out = subprocess.run([sys.executable, "-S", "-c", PAYLOAD, str(code), sys.executable,
                          json.dumps(request)], capture_output=True, check=True).stdout
    head, _, data = out.partition(b"\n")
    return json.loads(head), data


def one_exec(argv: list[str], data: bytes) -> tuple[float, dict[str, Any]]:
    t = time.perf_counter()
    out = subprocess.run(argv, input=data, capture_output=True, timeout=60)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit("agent failed: %s" % out.stderr.decode()[-500:])
    return wall, json.loads(out.stdout)


def exec_rows(runs: int, against: Optional[Path], work: Path) -> list[tuple[str, list, list, list]]:
    """(label, walls, agent seconds, cache states) per variant, runs interleaved."""
    warm = work / "warm"
    variants: dict[str, Callable[[int], tuple[list[str], bytes]]] = {
        "exec, cache off": lambda i: payload_of(ROOT, dict(REQUEST, agent_cache=False)),
        "exec, cache cold": lambda i: payload_of(
            ROOT, dict(REQUEST, agent_cache_dir=str(work / ("cold%d" % i)))),
        "exec, cache warm": lambda i: payload_of(ROOT, dict(REQUEST, agent_cache_dir=str(warm))),
    }
    if against is not None:
        variants["exec, --against (before)"] = lambda i: payload_of(against, REQUEST)
    prepared = {label: [make(i) for i in range(runs)] for label, make in variants.items()}
    one_exec(*prepared["exec, cache warm"][0])  # fill the warm cache
    results: dict[str, tuple[list, list, list]] = {k: ([], [], []) for k in variants}
    for i in range(runs):
        for label in variants:
            wall, doc = one_exec(*prepared[label][i])
            results[label][0].append(wall)
            results[label][1].append(float(doc.get("seconds") or 0.0))
            results[label][2].append((doc.get("facts") or {}).get("agent_cache"))
    return [(label,) + results[label] for label in variants]


def status_rows(runs: int, work: Path) -> list[tuple[str, list]]:
    """`gpufleet status` of one local host, agent_cache false / true (warm)."""
    rows = []
    env = dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(work / "home"))
    env.pop("GPUFLEET_INVENTORY", None)
    (work / "home").mkdir(exist_ok=True)
    fleets = {}
    for flag in ("false", "true"):
        fleets[flag] = work / ("fleet-%s.yaml" % flag)
        fleets[flag].write_text("hosts:\n  here:\n    connection: local\n    agent_cache: %s\n"
                                % flag)
    subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(fleets["true"]), "status"],
                   env=env, capture_output=True)  # warm the host's cache
    walls: dict[str, list] = {"false": [], "true": []}
    for _ in range(runs):
        for flag, path in fleets.items():
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "gpufleet", "-i", str(path), "status"],
                           env=env, capture_output=True)
            walls[flag].append(time.perf_counter() - t)
    for flag in ("false", "true"):
        rows.append(("`gpufleet status` (local), agent_cache: %s" % flag, walls[flag]))
    return rows


def source_of(code: Path) -> bytes:
    """The joined agent of a checkout."""
    return subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path.insert(0, %r); "
                           "from gpufleet.remote import agent_source; "
                           "sys.stdout.buffer.write(agent_source())" % str(code)],
                          capture_output=True, check=True).stdout


def child_rows(runs: int, code: Path) -> dict[str, list]:
    """compile, marshal.loads and module-level exec of a checkout's agent, fresh child each."""
    src = source_of(code)
    out: dict[str, list] = {"compile": [], "marshal.loads": [], "module-level": [], "bytes": []}
    for _ in range(runs):
        r = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", CHILD], input=src,
                           capture_output=True, check=True, cwd="/")
        c, m, x, n = r.stdout.split()
        out["compile"].append(float(c))
        out["marshal.loads"].append(float(m))
        out["module-level"].append(float(x))
        out["bytes"].append(int(n))
    out["source_bytes"] = [len(src)]
    return out


def controller_rows(runs: int) -> list[tuple[int, int, list]]:
    """zlib.compress of this checkout's agent per level (time, size)."""
    import zlib

    sys.path.insert(0, str(ROOT))  # this checkout, not an installed gpufleet
    from gpufleet.remote import agent_source

    src = agent_source()
    rows = []
    for level in (1, 2, 3, 4, 6, 9):
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            size = len(zlib.compress(src, level))
            times.append(time.perf_counter() - t)
        rows.append((level, size, times))
    return rows


def key_time() -> float:
    """agent_key() in a fresh interpreter: its import and one hash, as a controller pays it."""
    code = ("import sys,time; sys.path.insert(0, %r); from gpufleet.remote import agent_source, "
            "agent_key; agent_source(); t=time.perf_counter(); agent_key(); "
            "print(time.perf_counter()-t)" % str(ROOT))
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--against", type=Path, help="another checkout (before), same request")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-status", action="store_true", help="skip the CLI rows")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpufleet-agent-start-"))
    try:
        execs = exec_rows(args.runs, args.against, work)
        status = [] if args.no_status else status_rows(args.runs, work)
        child = child_rows(args.runs, ROOT)
        before = child_rows(args.runs, args.against) if args.against else None
        levels = controller_rows(args.runs)
        key = key_time()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"exec": {k: {"wall": w, "seconds": s, "cache": c}
                                   for k, w, s, c in execs},
                          "status": dict(status), "child": child, "child_before": before,
                          "zlib": {lv: {"bytes": n, "s": t} for lv, n, t in levels},
                          "agent_key_s": key}))
        return
    print("python %s, %d runs each, ms median (min-max)\n" % (sys.version.split()[0], args.runs))
    print("| what | wall ms | agent's `seconds` ms | facts.agent_cache |\n|---|---|---|---|")
    for label, walls, secs, states in execs:
        print("| %s | %s | %s | %s |" % (label, stats(walls), stats(secs),
                                         "/".join(sorted(set(str(s) for s in states)))))
    for label, walls in status:
        print("| %s | %s | | |" % (label, stats(walls)))
    print("\n| in `python3 -S -E -s` | this checkout, ms | --against, ms |\n|---|---|---|")
    for label in ("compile", "marshal.loads", "module-level"):
        print("| %s | %s | %s |" % (label, stats(child[label]),
                                    stats(before[label]) if before else "-"))
    print("| source / code object (marshal) | %d / %d bytes | %s |" % (
        child["source_bytes"][0], child["bytes"][0],
        "%d / %d bytes" % (before["source_bytes"][0], before["bytes"][0]) if before else "-"))
    print("\n| zlib level | bytes | compress ms |\n|---|---|---|")
    for level, size, times in levels:
        print("| %d | %d | %s |" % (level, size, stats(times)))
    print("\nagent_key() once per process: %.2f ms" % (key * 1000))


if __name__ == "__main__":
    main()
