#!/usr/bin/env python3
"""Real-GPU proof that a clean frees CUDA MPS clients and never touches MPS itself.

Recorded before the rule (tests/fixtures/real-h200/clean-cases/probe-1.log part C): `clean
--yes` planned the MPS control daemon as the family root of its listed server, TERMed it, and
the server died with it. This run starts MPS with a private pipe and log directory
(CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY under a temporary directory), one torch client
(3 GiB on GPU 0), then, with a `connection: local` inventory:

1. `gpufleet clean --host h200 --yes --json`: the client was signalled and is gone; the daemon
   and its server were not signalled and are alive (same start times); the verdict is clean
   with the server's memory left and expected (the threshold counts it); the plan's note says
   how to stop MPS, with this pipe directory;
2. `gpufleet status --json`: the ledger shows the server's memory as its (mps_server_mib);
3. `echo quit | nvidia-cuda-mps-control` (the note's way): MPS ends, its memory is back.

Processes are found only as this run started them: the client is our child; the daemon is
the PID of the pid file in THIS run's private pipe directory, running the MPS binary with that
directory in its environment; the server is the one the daemon lists. MPS is ended by `quit`
(the daemon then is a zombie until init reaps it: recorded, probe-mps-agent.log); only if that
fails is the recorded daemon signalled. Writes mps-results.json (checks) and cli-mps-*.json to --out.
    PYTHONPATH=$PWD python3 tests/gpu/gpu_mps.py --out /tmp/gout
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
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from portable import write_json  # noqa: E402  (beside this file)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
MPS_FALLBACKS = ("/usr/local/nvidia/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control")
CLIENT_GIB = 3
CLIENT = r"""
import os, sys, time, torch
x = torch.empty(%d * 2**30, dtype=torch.uint8, device='cuda:0')
torch.cuda.synchronize()
print('up', os.getpid(), flush=True)
time.sleep(600)
""" % CLIENT_GIB


def find_mps() -> Optional[str]:
    found = shutil.which("nvidia-cuda-mps-control")
    return found or next((p for p in MPS_FALLBACKS if os.access(p, os.X_OK)), None)


def starttime(pid: int) -> Optional[int]:
    try:
        data = Path("/proc/%d/stat" % pid).read_text()
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    return None if rest[0] in ("Z", "X") else int(rest[19])


def daemon_of(binary: str, pipe_dir: Path) -> Optional[int]:
    """The MPS daemon this run started: the PID in its pipe directory's
    nvidia-cuda-mps-control.pid (recorded: probe-mps-agent.log), checked to run ``binary``
    with OUR private pipe directory in its environment (no name pattern)."""
    try:
        pid = int((pipe_dir / "nvidia-cuda-mps-control.pid").read_text().split()[0])
        exe = os.readlink("/proc/%d/exe" % pid)
        env = Path("/proc/%d/environ" % pid).read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    mine = ("CUDA_MPS_PIPE_DIRECTORY=%s" % pipe_dir).encode() in env
    return pid if exe == os.path.realpath(binary) and mine and starttime(pid) else None


class Run:
    def __init__(self, out: Path, mps: str) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.mps = mps
        self.tmp = Path(tempfile.mkdtemp(prefix="gpufleet-mps-"))
        os.chmod(self.tmp, 0o755)
        self.pipe = self.tmp / "pipe"
        self.log = self.tmp / "log"
        for d in (self.pipe, self.log, self.tmp / "home"):
            d.mkdir(mode=0o755)
        self.inventory = self.tmp / "fleet.yaml"
        self.inventory.write_text("hosts:\n  h200:\n    connection: local\n")
        base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        base.pop("CUDA_VISIBLE_DEVICES", None)
        self.mps_env = dict(base, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe),
                            CUDA_MPS_LOG_DIRECTORY=str(self.log))
        self.cli_env = dict(base, HOME=str(self.tmp / "home"), PYTHONUNBUFFERED="1")
        self.cli_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)
        self.checks: list[dict[str, Any]] = []
        self.client: Optional[subprocess.Popen] = None
        self.daemon: Optional[int] = None

    def places(self) -> dict[str, Path]:
        """This run's own directories, as words in what it records (tests/gpu/portable.py)."""
        return {"TMPDIR": self.tmp, "OUTDIR": self.out}

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else ": %r" % (detail,)), flush=True)
        return bool(ok)

    def ask(self, command: str, timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run([self.mps], input=command + "\n", capture_output=True, text=True,
                              env=self.mps_env, timeout=timeout)

    def cli(self, name: str, *args: str) -> dict[str, Any]:
        argv = [sys.executable, "-c", "from gpufleet.cli import main; main()",
                "-i", str(self.inventory), *args]
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, env=self.cli_env, timeout=120,
                           cwd=str(self.tmp))
        res = {"argv": ["gpufleet", "-i", "fleet.yaml", *args], "exit_code": r.returncode,
               "stdout": r.stdout, "stderr": r.stderr, "seconds": round(time.monotonic() - t0, 3)}
        write_json(self.out / ("cli-mps-%s.json" % name), res, self.places())
        return res

    def run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            self.start()
            server = self.server()
            if server is not None:
                self.clean(server)
                self.status(server)
            self.quit()
        finally:
            self.cleanup()
        doc = {"checks": self.checks, "ok": all(c["ok"] for c in self.checks),
               "seconds": round(time.monotonic() - t0, 1), "pipe_dir": str(self.pipe)}
        write_json(self.out / "mps-results.json", doc, self.places())
        return doc

    def start(self) -> None:
        res = subprocess.run([self.mps, "-d"], env=self.mps_env, capture_output=True, text=True,
                             timeout=30)
        self.check("MPS daemon started", res.returncode == 0, res.stderr[-300:])
        for _ in range(100):
            self.daemon = daemon_of(self.mps, self.pipe)
            if self.daemon is not None:
                break
            time.sleep(0.05)
        self.check("the daemon is found by its pid file, binary and our pipe directory",
                   self.daemon is not None)
        self.client = subprocess.Popen([sys.executable, "-c", CLIENT], env=self.mps_env,
                                       stdout=subprocess.PIPE, text=True)
        line = self.client.stdout.readline() if self.client.stdout else ""
        self.check("the torch client holds its memory through MPS", line.startswith("up"), line)

    def server(self) -> Optional[int]:
        out = self.ask("get_server_list")
        pids = [int(p) for p in out.stdout.split() if p.isdigit()]
        self.check("the daemon lists one server", len(pids) == 1, (out.returncode, out.stdout))
        if len(pids) != 1:
            return None
        clients = self.ask("get_client_list %d" % pids[0]).stdout.split()
        self.check("the server lists our client", self.client is not None
                   and str(self.client.pid) in clients, clients)
        return pids[0]

    def clean(self, server: int) -> None:
        assert self.client is not None and self.daemon is not None
        before = {p: starttime(p) for p in (self.daemon, server)}
        res = self.cli("clean", "clean", "--host", "h200", "--yes", "--json")
        self.check("clean exit 0", res["exit_code"] == 0, res["stderr"][-500:])
        try:
            host = json.loads(res["stdout"])["hosts"][0]
        except (ValueError, KeyError, IndexError) as exc:
            self.check("clean printed its document", False, "%s: %s" % (exc, res["stdout"][-500:]))
            return
        signalled = sorted({s["pid"] for s in host["signals"]})
        self.check("only the MPS client was signalled", signalled == [self.client.pid], signalled)
        try:
            self.client.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.check("the client is gone", self.client.poll() is not None)
        for name, pid in (("daemon", self.daemon), ("server", server)):
            self.check("the MPS %s is alive, the same process" % name,
                       before[pid] is not None and starttime(pid) == before[pid])
        refused = {r["pid"]: r["kind"] for r in host["refused"]}
        self.check("daemon and server refused as protected",
                   refused.get(self.daemon) == "protected" and refused.get(server) == "protected",
                   host["refused"])
        self.check("verdict clean", host["verdict"] == "clean", host.get("reason"))
        gpus = host["verdict_detail"].get("gpus") or []
        self.check("the server's memory is left and under the threshold",
                   bool(gpus) and (host["left_mib"] or 0) > 0 and all(
                       g["after_mib"] is not None and g["after_mib"] <= g["threshold_mib"]
                       for g in gpus), gpus)
        notes = " ".join(host["plan_notes"])
        self.check("the plan says how to stop MPS with its pipe directory",
                   "echo quit | CUDA_MPS_PIPE_DIRECTORY=%s " % self.pipe in notes, host["plan_notes"])

    def status(self, server: int) -> None:
        res = self.cli("status", "status", "--json")
        self.check("status exit 0", res["exit_code"] == 0, res["stderr"][-300:])
        try:
            gpus = json.loads(res["stdout"])["hosts"][0]["gpus"]
        except (ValueError, KeyError, IndexError) as exc:
            self.check("status printed its document", False, str(exc))
            return
        rows = {p["pid"]: p["used_mib"] for g in gpus for p in g["processes"]}
        mps_mib = sum(g.get("mps_server_mib") or 0 for g in gpus)
        self.check("status shows the server's memory as MPS's", server in rows and
                   mps_mib == sum(p["used_mib"] or 0 for g in gpus for p in g["processes"]
                                  if p["pid"] == server) and mps_mib > 0, (rows, mps_mib))

    def quit(self) -> None:
        if self.daemon is None:
            return
        t0 = time.monotonic()
        try:
            res = self.ask("quit", timeout=20)
            ok, detail = res.returncode == 0, res.stderr[-200:]
        except subprocess.TimeoutExpired:
            ok, detail = False, "no answer in 20 s"
        for _ in range(200):  # gone, or a zombie (starttime None)
            if starttime(self.daemon) is None:
                break
            time.sleep(0.05)
        self.check("echo quit | nvidia-cuda-mps-control ends MPS", ok and
                   starttime(self.daemon) is None, (detail, round(time.monotonic() - t0, 2)))

    def cleanup(self) -> None:
        """Ends only what this run started: its client (our child), and its daemon (recorded
        above) if quit did not end it."""
        if self.client is not None and self.client.poll() is None:
            self.client.kill()
        if self.client is not None:
            self.client.wait()
        if self.daemon is not None and starttime(self.daemon) is not None:
            try:
                os.kill(self.daemon, signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="gout-")))
    mps = find_mps()
    if mps is None:
        print("no nvidia-cuda-mps-control on this machine")
        return 2
    doc = Run(ap.parse_args().out, mps).run()
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
