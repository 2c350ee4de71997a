"""How fast the controller starts: wall time per command, and whether it imported the SSH stack.

    python3 bench/startup.py                 # 15 runs per command, prints a markdown table
    python3 bench/startup.py --runs 30 --json
    git archive BASE | tar -x -C /tmp/base && python3 bench/startup.py --against /tmp/base

Each command is run as ``python3 -m gpufleet ...`` with this checkout first on PYTHONPATH, in
a fresh process (start-up and imports are what is measured), against a throw-away inventory:
one ``connection: local`` host, or one SSH host whose port refuses connections (so the SSH
stack is loaded and the run ends at once). Wall time is the median (min-max) over ``--runs``
runs without ``-X importtime``; a separate run with ``-X importtime`` says which of
paramiko / fabric / invoke were imported and how long the imports took in all.
``--against DIR``: the same for another checkout (e.g. the commit before a change), its runs
alternating with this one's, so a busy machine's load hits both alike.

A `status` of a local host runs the real agent on this machine: without nvidia-smi its row
is an error, which is enough to measure the controller. For ``status --json`` the host's own
``seconds`` (session open to the agent's reply: the agent's exec) is read from each run's
document, and "controller s" is the median of wall minus that: the controller's share. The
``python3 -c pass`` row is the interpreter's own start with this machine's site-packages, which
no change to gpufleet can remove.

Bytecode: users' installs have .pyc files (pip compiles them), so by default the runs write and
use them in a throw-away PYTHONPYCACHEPREFIX even where PYTHONDONTWRITEBYTECODE is set (this
machine sets it: every run would otherwise compile gpufleet, click and yaml from source, and
module "self times" would be mostly compile time). ``--no-bytecode`` keeps the environment's.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
WATCHED = ("paramiko", "fabric", "invoke")

LOCAL_YAML = "hosts:\n  here:\n    connection: local\n"
SSH_YAML = ("hosts:\n  refused:\n    address: 127.0.0.1\n    port: {port}\n    connect_timeout: 2\n"
            "    host_key_policy: accept-new\n")


def commands(local: Path, ssh: Path) -> list[tuple[str, list[str]]]:
    """(label, argv after `python3 -m gpufleet`) of each measured command."""
    return [
        ("python3 -c pass", ["-c", "pass"]),
        ("--help", ["--help"]),
        ("hosts (local)", ["-i", str(local), "hosts"]),
        ("fit --weights-gib 10 (local)", ["-i", str(local), "fit", "--weights-gib", "10"]),
        ("status (local)", ["-i", str(local), "status"]),
        ("status --json (local)", ["-i", str(local), "status", "--json"]),
        ("status (ssh, refused)", ["-i", str(ssh), "status"]),
    ]


PYCACHE: dict[str, str] = {}  # {"prefix": DIR} when runs use bytecode (the default)


def env(root: Path = ROOT) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(root) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.pop("GPUFLEET_INVENTORY", None)
    if PYCACHE:
        e.pop("PYTHONDONTWRITEBYTECODE", None)
        e["PYTHONPYCACHEPREFIX"] = PYCACHE["prefix"]
    return e


def timed(argv: list[str], cwd: str, root: Path = ROOT) -> tuple[float, Optional[float]]:
    """Wall time of one run, and the host's own seconds when it printed a status document."""
    cmd = [sys.executable, "-c", "pass"] if argv == ["-c", "pass"] else [sys.executable, "-m", "gpufleet", *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env(root), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - t0
    try:
        return wall, float(json.loads(proc.stdout)["hosts"][0]["seconds"])
    except (ValueError, KeyError, IndexError, TypeError):
        return wall, None


def imports(argv: list[str], cwd: str, root: Path = ROOT, runs: int = 5) -> tuple[dict[str, bool], float]:
    """Which watched packages `-X importtime` shows, and the median over ``runs`` runs of the
    total import time (s) after ``site`` (the interpreter's own start-up hooks are not
    gpufleet's: the ``python3 -c pass`` row has them)."""
    seen: dict[str, bool] = {name: False for name in WATCHED}
    totals = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpufleet", *argv], cwd=cwd,
                              env=env(root), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        total_us, after_site = 0, False
        for line in proc.stderr.splitlines():
            if not line.startswith("import time:") or "|" not in line:
                continue
            fields = [f.strip() for f in line[len("import time:"):].split("|")]
            if len(fields) != 3 or not fields[1].isdigit():
                continue
            name = fields[2]
            if name in seen:
                seen[name] = True
            top = line.split("|")[2][1:2] != " "  # nesting is indentation: count the top level only
            if top and after_site:
                total_us += int(fields[1])
            after_site = after_site or (top and name == "site")
        totals.append(total_us)
    return seen, statistics.median(totals) / 1e6


def refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connect is refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def measure(argv: list[str], cwd: str, roots: list[Path], runs: int) -> list[dict]:
    """One row per checkout for one command; runs alternate between the checkouts."""
    walls: dict[Path, list[float]] = {root: [] for root in roots}
    controller: dict[Path, list[float]] = {root: [] for root in roots}
    for root in roots:
        timed(argv, cwd, root)  # warm the page cache and the .pyc files
    for _ in range(runs):
        for root in roots:
            wall, host_s = timed(argv, cwd, root)
            walls[root].append(wall)
            if host_s is not None:
                controller[root].append(wall - host_s)
    rows = []
    for root in roots:
        seen, import_s = imports(argv, cwd, root) if argv != ["-c", "pass"] else ({}, 0.0)
        w, c = walls[root], controller[root]
        rows.append({"checkout": "this" if root == ROOT else root.name,
                     "median_s": statistics.median(w), "min_s": min(w), "max_s": max(w),
                     "controller_s": statistics.median(c) if c else None,
                     "imports_s": import_s, **{name: seen.get(name, False) for name in WATCHED}})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="timed runs per command (default 15)")
    ap.add_argument("--against", type=Path, default=None, metavar="DIR",
                    help="another checkout to measure alongside (runs alternate)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--no-bytecode", action="store_true",
                    help="keep the environment's bytecode settings (default: write and use .pyc files)")
    args = ap.parse_args()
    roots = [ROOT] + ([args.against.resolve()] if args.against else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpufleet-startup-") as tmp:
        if not args.no_bytecode:
            PYCACHE["prefix"] = str(Path(tmp, "pycache"))
        local, ssh = Path(tmp, "local.yaml"), Path(tmp, "ssh.yaml")
        local.write_text(LOCAL_YAML)
        ssh.write_text(SSH_YAML.format(port=refused_port()))
        for label, argv in commands(local, ssh):
            rows += [dict(r, command=label) for r in measure(argv, tmp, roots, args.runs)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    load = os.getloadavg()[0]
    print(f"python {sys.version.split()[0]}, {args.runs} runs per command and checkout, "
          f"{os.cpu_count()} cores, load average {load:.1f} at the end, "
          f"{'environment bytecode settings' if args.no_bytecode else 'with bytecode'}")
    print()
    print("| command | checkout | wall s median (min-max) | controller s (wall - host) | "
          "imports s after site (-X importtime, median of 5) | " + " | ".join(WATCHED) + " |")
    print("|---|---|---|---|---|" + "---|" * len(WATCHED))
    for r in rows:
        label = r["command"] if r["command"].startswith("python3") else "gpufleet " + r["command"]
        ctrl = "-" if r["controller_s"] is None else f"{r['controller_s']:.3f}"
        print(f"| `{label}` | {r['checkout']} | {r['median_s']:.3f} "
              f"({r['min_s']:.3f}-{r['max_s']:.3f}) | {ctrl} | {r['imports_s']:.3f} | "
              + " | ".join("yes" if r[name] else "no" for name in WATCHED) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
