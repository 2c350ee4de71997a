#!/usr/bin/env python3
"""Record gpufleet's screens next to nvidia-smi's, nvitop's and gpustat's, for the same GPUs.

Starts the vLLM-like family of the real-GPU scenario (``VLLM::EngineCore_DP0`` and two
``VLLM::Worker`` children, 4 GiB each) and a ``trainer`` holding 6 GiB, waits until each has
allocated, then captures at 120 columns, one after another: nvidia-smi, ``nvitop --once``,
``gpustat -cupF``, and gpufleet's ``status`` and ``health`` (``connection: local``, no
inventory). With ``--old DIR`` (an earlier gpufleet tree, e.g. ``git archive``'s) its
``status`` and ``health`` are captured too, for a before/after. The holders are ended by the
PIDs this program started.

    cd tests/gpu; PYTHONPATH=$PWD/../.. python3 gpu_screens.py --out /tmp/screens [--old /tmp/old-tree]

Writes one text file per screen (``NN-tool.txt``: the command line, then its output) and
screens.json (each command, its exit code and seconds) to --out; the checkout's path is written
REPO (tests/gpu/portable.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from portable import portable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def start_holders(ready_dir: Path) -> list[subprocess.Popen[bytes]]:
    """The engine family on GPU 0 and a trainer beside it; each writes a ready file."""
    py = sys.executable
    holders = HERE / "gpu_holders.py"
    engine = subprocess.Popen([py, str(holders), "engine", "--gpu", "0", "--workers", "2",
                               "--worker-gib", "4", "--ready", str(ready_dir / "engine")],
                              stdin=subprocess.DEVNULL, start_new_session=True)
    trainer = subprocess.Popen([py, str(holders), "trainer", "--gpu", "0", "--gib", "6",
                                "--title", "trainer", "--ready", str(ready_dir / "trainer")],
                               stdin=subprocess.DEVNULL, start_new_session=True,
                               env=dict(os.environ, CUDA_VISIBLE_DEVICES="0"))
    return [engine, trainer]


def wait_ready(ready_dir: Path, names: list[str], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((ready_dir / n).exists() for n in names):
            return True
        time.sleep(0.2)
    return False


def capture(out: Path, index: int, label: str, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        res = subprocess.run(argv, env=env, capture_output=True, timeout=60, cwd="/")
        code, text = res.returncode, (res.stdout + res.stderr).decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        code, text = -1, "not run: %s\n" % exc
    seconds = round(time.monotonic() - started, 3)
    shown = " ".join(a if a != sys.executable else "python3" for a in argv)
    (out / ("%02d-%s.txt" % (index, label))).write_text(
        portable("$ %s\n%s" % (shown, text), {"HOME": Path(env["HOME"])}))
    return {"label": label, "argv": shown, "exit": code, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--old", type=Path, help="an earlier gpufleet tree, for before/after")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="screens-home-"))
    ready = Path(tempfile.mkdtemp(prefix="screens-ready-"))
    base = dict(os.environ, HOME=str(home), COLUMNS="120", LINES="40", NO_COLOR="1",
                TERM="xterm-256color")
    smi = shutil.which("nvidia-smi") or "/usr/local/nvidia/bin/nvidia-smi"
    procs = start_holders(ready)
    records: list[dict[str, Any]] = []
    try:
        if not wait_ready(ready, ["engine", "trainer"], args.timeout):
            records.append({"label": "holders", "exit": -1, "note": "not ready in time"})
        time.sleep(2)  # let the workers' contexts settle in NVML's list
        new_env = dict(base, PYTHONPATH=os.pathsep.join(
            [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        plan = [("nvidia-smi", [smi], base),
                ("nvitop", [sys.executable, "-m", "nvitop", "--once"], base),
                ("gpustat", [sys.executable, "-m", "gpustat", "-cupF", "--no-color"], base),
                ("gpufleet-status", [sys.executable, "-m", "gpufleet", "status"], new_env),
                ("gpufleet-health", [sys.executable, "-m", "gpufleet", "health"], new_env)]
        if args.old is not None:
            old_env = dict(base, PYTHONPATH=os.pathsep.join(
                [str(args.old.resolve())] + [p for p in os.environ.get("PYTHONPATH", "").split(
                    os.pathsep) if p and Path(p).resolve() != REPO]))
            plan += [("gpufleet-old-status", [sys.executable, "-m", "gpufleet", "status"], old_env),
                     ("gpufleet-old-health", [sys.executable, "-m", "gpufleet", "health"], old_env)]
        for i, (label, argv, env) in enumerate(plan, 1):
            records.append(capture(args.out, i, label, argv, env))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(ready, ignore_errors=True)
    (args.out / "screens.json").write_text(json.dumps(records, indent=1) + "\n")
    print(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
