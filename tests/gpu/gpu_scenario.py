#!/usr/bin/env python3
"""The real-GPU scenario: real CUDA holders, then `gpufleet status`, `clean`, `fit` on them.

Needs a machine with NVIDIA GPUs, nvidia-smi and torch (root is not needed but the device
machine runs as root). ``gpu_unavailable()`` says why a machine does not qualify; the pytest
module beside this (test_real_gpu.py) skips then. Run it directly to get the measurements::

    PYTHONPATH=$PWD python3 tests/gpu/gpu_scenario.py --out /tmp/gpu-out --rounds 5

What one run does (docs/real-gpu.md has the results):

1. starts an NVML poller (a monitoring tool holding every /dev/nvidiaN; the release-time ruler)
   and, with two or more GPUs, a "trainer" on GPU 1 (CUDA_VISIBLE_DEVICES=1, 16 GiB, matmuls);
2. measures what a fresh CUDA process sees (probe: mem_get_info vs nvidia-smi, context size);
3. round 1: a vLLM-like family on GPU 0 (VLLM::EngineCore_DP0 with a small context, two
   VLLM::Worker children with GiBs) and a holder that ignores SIGTERM; `gpufleet status --json`
   (and the table) checked against nvidia-smi's own numbers; then exactly
   `gpufleet clean --all --gpus 0 --yes --json` checked: GPU 0 holders gone, trainer alive with the
   same memory, verdict clean, reported memory after == nvidia-smi after;
4. timing rounds: the same family (with and without the SIGTERM-ignoring holder, --grace G),
   each clean timed from its start to verified-free (the CLI's exit) against the driver's
   release after the last holder exited (pidfd exit times, NVML memory samples);
5. the driver-release floor alone: holders killed one at a time by the runner;
6. `gpufleet fit` for a model that fits GPU 0 and one that does not, and on the trainer's GPU,
   each compared with what a fresh CUDA process measures there (vLLM's start-up check).

Everything seen is written under --out: results.json (checks, timings, captures index) and
fixtures/ (raw nvidia-smi text, CLI outputs, the raw agent documents behind them).
The runner itself never initialises CUDA or NVML (it would become a device-file holder).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from portable import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HOLDERS = HERE / "gpu_holders.py"
POLLER = HERE / "gpu_nvml_poll.py"
CLI = HERE / "gpu_cli_capture.py"
SMI_FALLBACKS = ("/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi")
GPU_FIELDS = ("index,uuid,name,pci.bus_id,memory.used,memory.total,memory.free,"
              "utilization.gpu,driver_version,memory.reserved")
APP_FIELDS = "pid,used_memory,gpu_uuid"  # the agent's query: nvidia-smi's names are not asked

WORKER_GIB = 4.0
STUBBORN_GIB = 2.0
TRAINER_GIB = 16.0
PLAIN_GIB = 4.0
ENGINE_TITLE = "VLLM::EngineCore_DP0"
WORKER_TITLE = "VLLM::Worker"
STUBBORN_TITLE = "stubborn-holder"
RELEASED_SLACK_MIB = 16  # GPU 0 counts as released within this of its idle level (NVML)


def find_smi() -> Optional[str]:
    found = shutil.which("nvidia-smi")
    if found:
        return found
    return next((p for p in SMI_FALLBACKS if os.access(p, os.X_OK)), None)


def gpu_unavailable() -> Optional[str]:
    """Why this machine cannot run the scenario, or None. Never initialises CUDA here."""
    smi = find_smi()
    if smi is None:
        return "no nvidia-smi on this machine"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "nvidia-smi -L failed: %s" % exc
    if r.returncode != 0 or "GPU 0:" not in r.stdout:
        return "nvidia-smi -L lists no GPU (exit %s): %s" % (r.returncode, (r.stderr or r.stdout).strip()[:200])
    return None


def _agent_parsers():
    from gpufleet.remote import agent

    return agent


def starttime(pid: int) -> Optional[int]:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def proc_text(pid: int, what: str) -> Optional[str]:
    try:
        with open("/proc/%d/%s" % (pid, what), "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if what == "cmdline":
        return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return raw.decode("utf-8", "replace").strip()


def nvidia_fds(pid: int) -> dict[str, int]:
    """{device path: number of fds} of one process (what `fuser -v /dev/nvidia*` would show)."""
    out: dict[str, int] = {}
    base = "/proc/%d/fd" % pid
    try:
        fds = os.listdir(base)
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(os.path.join(base, fd))
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            out[target] = out.get(target, 0) + 1
    return dict(sorted(out.items()))


class ExitWatcher:
    """Exit times of processes (any parent) through pidfds; reaps the ones we started."""

    def __init__(self) -> None:
        self.exits: dict[int, float] = {}
        self._fds: dict[int, tuple[int, Any]] = {}
        self._poll = select.poll()
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def watch(self, pid: int, popen: Any = None) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.exits[pid] = time.monotonic()
            return
        with self._lock:
            self._fds[fd] = (pid, popen)
            self._poll.register(fd, select.POLLIN)

    def _run(self) -> None:
        while not self._stop:
            events = self._poll.poll(5)
            now = time.monotonic()
            for fd, _ in events:
                with self._lock:
                    pid, popen = self._fds.pop(fd, (None, None))
                    try:
                        self._poll.unregister(fd)
                    except KeyError:
                        pass
                if pid is None:
                    continue
                self.exits.setdefault(pid, now)
                os.close(fd)
                if popen is not None:
                    try:
                        popen.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass

    def wait(self, pids, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(p in self.exits for p in pids):
                return True
            time.sleep(0.01)
        return all(p in self.exits for p in pids)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)


class Poller:
    """The NVML poller process and its samples ({t, used, pids} on every change)."""

    def __init__(self, env: dict[str, str], log: Any) -> None:
        self.samples: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, str(POLLER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=env,
                                     start_new_session=True)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("NVML poller not ready (exit %s)" % self.proc.poll())

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("ready"):
                self.info = doc
                self._ready.set()
                continue
            with self._lock:
                self.samples.append(doc)

    def at(self, t: float) -> Optional[dict[str, Any]]:
        """The state in force at time t (the last change at or before it)."""
        with self._lock:
            found = None
            for s in self.samples:
                if s["t"] <= t:
                    found = s
                else:
                    break
            return found

    def between(self, a: float, b: float) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.samples if a <= s["t"] <= b]

    def wait_for(self, pred, timeout: float, after: float = 0.0) -> Optional[dict[str, Any]]:
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                for s in self.samples:
                    if s["t"] >= after and pred(s):
                        return s
            if time.monotonic() > end:
                return None
            time.sleep(0.005)

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


class Scenario:
    def __init__(self, out: Path, rounds: int = 5, light_rounds: int = 5, grace: float = 2.0,
                 floor_holders: int = 4, time_budget_s: float = 420.0,
                 ssh_state: Optional[Path] = None, ssh_port: int = 2222) -> None:
        """``ssh_state``: a tests/gpu/ossh.sh state dir (its sshd on 127.0.0.1:``ssh_port``):
        round 1 (status and clean, every check) runs once more through SSH, the transport
        users use, its checks named "[ssh] ..."."""
        self.out = Path(out)
        self.fix = self.out / "fixtures"
        self.fix.mkdir(parents=True, exist_ok=True)
        self.rounds = rounds
        self.light_rounds = light_rounds
        self.grace = grace
        self.floor_holders = floor_holders
        self.budget_end = time.monotonic() + time_budget_s
        self.tmp = Path(tempfile.mkdtemp(prefix="gpufleet-gpu-"))
        self.home = self.tmp / "home"
        self.home.mkdir()
        self.inventory = self.tmp / "fleet.yaml"
        self.inventory.write_text("hosts:\n  h200:\n    connection: local\n")
        self.inventories = {"local": self.inventory}
        if ssh_state is not None:
            ssh_inv = self.tmp / "fleet-ssh.yaml"
            ssh_inv.write_text(
                "hosts:\n  h200:\n    address: 127.0.0.1\n    port: %d\n    user: root\n"
                "    identity_file: %s\n    known_hosts_file: %s\n"
                % (ssh_port, Path(ssh_state).resolve() / "id_ed25519",
                   Path(ssh_state).resolve() / "known_hosts"))
            self.inventories["ssh"] = ssh_inv
        self.transport = "local"
        self.smi = find_smi()
        env = dict(os.environ)
        env["HOME"] = str(self.home)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONUNBUFFERED"] = "1"
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA index == nvidia-smi index
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.env = env
        self.logf = open(self.out / "log.txt", "a")
        self.started: list[subprocess.Popen] = []
        self.watcher = ExitWatcher()
        self.poller: Optional[Poller] = None
        self.trainer: Optional[subprocess.Popen] = None
        self.ngpus = 0
        self.gpu: dict[int, dict[str, Any]] = {}
        self.n_cli = 0
        self.phase = "setup"
        self.results: dict[str, Any] = {"checks": [], "rounds": [], "errors": []}

    # ------------------------------------------------------------------ plumbing

    def places(self) -> dict[str, Path]:
        """This run's own directories, as words in what it records (tests/gpu/portable.py)."""
        return {"TMPDIR": self.tmp, "OUTDIR": self.out}

    def log(self, msg: str) -> None:
        line = "[%8.3f] %s" % (time.monotonic() % 100000, msg)
        self.logf.write(line + "\n")
        self.logf.flush()
        sys.stderr.write(line + "\n")

    def use(self, transport: str) -> None:
        """The inventory (connection: local, or SSH to this machine) the next CLI runs use."""
        self.transport = transport
        self.inventory = self.inventories[transport]
        # the SSH round's captures beside, not over, the local ones (the unit tests replay those)
        self.fix = self.out / ("fixtures" if transport == "local" else "fixtures-" + transport)
        self.fix.mkdir(parents=True, exist_ok=True)

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        if self.transport != "local":
            name = "[%s] %s" % (self.transport, name)
        self.results["checks"].append({"phase": self.phase, "name": name, "ok": bool(ok), "detail": detail})
        if not ok:
            self.log("CHECK FAILED %s: %s" % (name, detail))
        return bool(ok)

    def run_smi(self, args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([self.smi] + args, capture_output=True, text=True, timeout=30)

    def smi_names(self) -> dict[int, str]:
        """nvidia-smi's process_name per PID, for the record only (the agent never asks for
        it: its CSV prints a name's newlines verbatim); our holders' names hold no newline."""
        out = self.run_smi(["--query-compute-apps=pid,process_name", "--format=csv,noheader"])
        rows = [line.split(", ", 1) for line in out.stdout.splitlines() if ", " in line]
        return {int(pid): name for pid, name in rows if pid.isdigit()}

    def smi_state(self, save: Optional[str] = None, full: bool = False) -> dict[str, Any]:
        """nvidia-smi's own numbers (the agent's query fields), raw text saved under fixtures."""
        agent = _agent_parsers()
        g = self.run_smi(["--query-gpu=" + GPU_FIELDS, "--format=csv,noheader,nounits"])
        a = self.run_smi(["--query-compute-apps=" + APP_FIELDS, "--format=csv,noheader,nounits"])
        gpus = agent.parse_gpu_csv(g.stdout, GPU_FIELDS.split(","))
        apps, _, _ = agent.parse_apps_csv(a.stdout)
        if save:
            (self.fix / ("smi-%s-query-gpu.csv" % save)).write_text(g.stdout)
            (self.fix / ("smi-%s-compute-apps.csv" % save)).write_text(a.stdout)
            if full:
                (self.fix / ("smi-%s-table.txt" % save)).write_text(self.run_smi([]).stdout)
                (self.fix / ("smi-%s-q-pids.txt" % save)).write_text(self.run_smi(["-q", "-d", "PIDS"]).stdout)
        by_uuid = {x["uuid"]: x["index"] for x in gpus}
        return {
            "gpus": {x["index"]: x for x in gpus},
            "apps": [dict(x, gpu=by_uuid.get(x["gpu_uuid"])) for x in apps],
        }

    @staticmethod
    def app_used(state: dict[str, Any], pid: int, gpu: int) -> Optional[int]:
        for a in state["apps"]:
            if a["pid"] == pid and a["gpu"] == gpu:
                return a["used_mib"]
        return None

    def cli(self, args: list[str], tag: str) -> dict[str, Any]:
        """Run gpufleet (through the capture wrapper) with -i <local inventory>."""
        self.n_cli += 1
        cap = self.tmp / ("capture-%d.jsonl" % self.n_cli)
        env = dict(self.env, GPUFLEET_CAPTURE=str(cap))
        argv = [sys.executable, str(CLI), "-i", str(self.inventory)] + args
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        t1 = time.monotonic()
        agent = []
        if cap.exists():
            agent = [json.loads(line) for line in cap.read_text().splitlines() if line.strip()]
        self.log("gpufleet %s -> exit %d in %.3fs%s" % (" ".join(args), r.returncode, t1 - t0,
                                                      (" stderr: " + r.stderr.strip()[:300]) if r.stderr.strip() else ""))
        return {"tag": tag, "argv": ["gpufleet", "-i", "fleet.yaml"] + args, "rc": r.returncode,
                "stdout": r.stdout, "stderr": r.stderr, "t0": t0, "t1": t1,
                "seconds": round(t1 - t0, 4), "agent": agent}

    def save_cli(self, res: dict[str, Any], name: str) -> None:
        """CLI output + the raw agent exchanges behind it, as fixtures."""
        doc = {"argv": res["argv"], "exit_code": res["rc"], "stdout": res["stdout"],
               "stderr": res["stderr"], "agent": res["agent"]}
        write_json(self.fix / ("cli-%s.json" % name), doc, self.places())

    def start(self, role: str, *args: str, env_extra: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, Path]:
        n = len(self.started)
        ready = self.tmp / ("ready-%s-%d.json" % (role, n))
        log = open(self.tmp / ("%s-%d.log" % (role, n)), "ab")
        env = dict(self.env, **(env_extra or {}))
        p = subprocess.Popen([sys.executable, str(HOLDERS), role, "--ready", str(ready)] + list(args),
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, close_fds=True)
        p.log_path = self.tmp / ("%s-%d.log" % (role, n))  # type: ignore[attr-defined]
        self.started.append(p)
        return p, ready

    def wait_ready(self, items: list[tuple[subprocess.Popen, Path]], timeout: float = 180) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        docs = []
        for p, ready in items:
            while not ready.exists():
                if p.poll() is not None or time.monotonic() > end:
                    tail = Path(p.log_path).read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]
                    raise RuntimeError("holder %d not ready (exit %s): %s" % (p.pid, p.poll(), tail))
                time.sleep(0.02)
            docs.append(json.loads(ready.read_text()))
        return docs

    def wait_listed(self, pids: list[int], gpu: int, timeout: float = 60) -> dict[str, Any]:
        """Until nvidia-smi lists every pid on the GPU and two reads in a row agree."""
        end = time.monotonic() + timeout
        last = None
        while True:
            state = self.smi_state()
            listed = {a["pid"] for a in state["apps"] if a["gpu"] == gpu}
            key = json.dumps([state["apps"], {i: g["memory_used_mib"] for i, g in state["gpus"].items()}], sort_keys=True)
            if set(pids) <= listed and key == last:
                return state
            last = key
            if time.monotonic() > end:
                raise RuntimeError("nvidia-smi does not list %s on GPU %d (lists %s)" % (pids, gpu, sorted(listed)))
            time.sleep(0.2)

    def kill_started(self) -> None:
        """End every process this runner started (by its own PIDs), and their workers."""
        for p in self.started:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session/group: we made it so
                except OSError:
                    pass
        for p in self.started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def idle_nvml(self, gpu: int) -> Optional[int]:
        s = self.poller.at(time.monotonic()) if self.poller else None
        return s["used"][gpu] if s else None

    # ------------------------------------------------------------------ phases

    def environment(self) -> None:
        r = self.run_smi([])
        (self.fix / "smi-idle-table.txt").write_text(r.stdout)
        q = self.run_smi(["-q"])
        (self.fix / "smi-idle-q.txt").write_text(q.stdout)
        state = self.smi_state(save="idle")
        self.ngpus = len(state["gpus"])
        self.gpu = state["gpus"]
        torch_v = subprocess.run([sys.executable, "-c", "import torch;print(torch.__version__, torch.version.cuda)"],
                                 capture_output=True, text=True, env=self.env, timeout=120).stdout.strip()
        minors = {}
        for m in re.finditer(r"Minor Number\s*:\s*(\d+)", q.stdout):
            minors[len(minors)] = int(m.group(1))
        self.minor = minors
        self.results["environment"] = {
            "gpus": {i: {k: g.get(k) for k in ("name", "uuid", "pci_bus_id", "memory_total_mib",
                                                "memory_reserved_mib", "memory_used_mib", "driver_version")}
                     for i, g in state["gpus"].items()},
            "minors": minors, "torch": torch_v, "python": sys.version.split()[0],
            "kernel": os.uname().release, "nvidia_smi": self.smi, "euid": os.geteuid(),
        }
        self.log("environment: %s" % json.dumps(self.results["environment"]))

    def start_background(self) -> None:
        self.phase = "background"
        self.poller = Poller(self.env, self.logf)
        self.started.append(self.poller.proc)
        self.results["poller"] = dict(self.poller.info)
        if self.ngpus >= 2:
            p, ready = self.start("trainer", "--gib", str(TRAINER_GIB), env_extra={"CUDA_VISIBLE_DEVICES": "1"})
            self.wait_ready([(p, ready)])
            self.trainer = p
            self.wait_listed([p.pid], 1)
        time.sleep(0.3)
        state = self.smi_state(save="background", full=True)
        self.baseline = state
        poller_fds = nvidia_fds(self.poller.proc.pid)
        self.results["background"] = {
            "poller_pid": self.poller.proc.pid, "poller_fds": poller_fds,
            "trainer_pid": self.trainer.pid if self.trainer else None,
            "trainer_fds": nvidia_fds(self.trainer.pid) if self.trainer else None,
            "gpu_used_mib": {i: g["memory_used_mib"] for i, g in state["gpus"].items()},
            "apps": state["apps"],
        }
        if self.trainer:
            fds = self.results["background"]["trainer_fds"]
            dev0 = "/dev/nvidia%d" % self.minor.get(0, 0)
            self.check("trainer (CUDA_VISIBLE_DEVICES=1) holds GPU 0's device file too", dev0 in fds, fds)
            self.check("nvidia-smi lists the trainer on GPU 1 only",
                       {a["gpu"] for a in state["apps"] if a["pid"] == self.trainer.pid} == {1}, state["apps"])
            self.results["background"]["gpu0_used_with_trainer_only_mib"] = state["gpus"][0]["memory_used_mib"]
        self.log("background: %s" % json.dumps(self.results["background"]))

    def probe(self, gpu: int, tag: str) -> dict[str, Any]:
        """A fresh CUDA process on `gpu`: what vLLM's start-up snapshot would see there."""
        before = self.smi_state()
        p = subprocess.Popen([sys.executable, str(HOLDERS), "probe"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=self.logf, text=True,
                             env=dict(self.env, CUDA_VISIBLE_DEVICES=str(gpu)), start_new_session=True)
        self.started.append(p)
        line = p.stdout.readline()
        doc = json.loads(line)
        time.sleep(0.2)
        during = self.smi_state(save="probe-%s" % tag)
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
        g0, g1 = before["gpus"][gpu], during["gpus"][gpu]
        out = {
            "gpu": gpu,
            "smi_before": {k: g0[k] for k in ("memory_used_mib", "memory_free_mib", "memory_total_mib", "memory_reserved_mib")},
            "smi_during": {k: g1[k] for k in ("memory_used_mib", "memory_free_mib")},
            "probe_listed_mib": self.app_used(during, doc["pid"], gpu),
            "mem_get_info_free_mib": round(doc["free_bytes"] / 2**20, 2),
            "mem_get_info_total_mib": round(doc["total_bytes"] / 2**20, 2),
            "context_mib_from_free": round(g0["memory_free_mib"] - doc["free_bytes"] / 2**20, 2),
            # nvidia-smi floors to whole MiB (measured: 143155.94 vs 143771 - 616)
            "total_equals_smi_total_minus_reserved": abs(doc["total_bytes"] / 2**20 - (
                g0["memory_total_mib"] - g0["memory_reserved_mib"])) < 1.0,
            "torch": doc.get("torch"), "device_name": doc.get("device_name"),
        }
        self.log("probe %s: %s" % (tag, json.dumps(out)))
        return out

    def start_family(self, stubborn: bool) -> dict[str, Any]:
        items = [self.start("engine", "--gpu", "0", "--workers", "2", "--worker-gib", str(WORKER_GIB))]
        if stubborn:
            items.append(self.start("stubborn", "--gpu", "0", "--gib", str(STUBBORN_GIB), "--title", STUBBORN_TITLE))
        docs = self.wait_ready(items)
        m: dict[str, Any] = {"engine": docs[0]["pid"], "workers": docs[0]["workers"],
                             "stubborn": docs[1]["pid"] if stubborn else None,
                             "trainer": self.trainer.pid if self.trainer else None,
                             "poller": self.poller.proc.pid,
                             "popens": {p.pid: p for p, _ in items}}
        m["gpu0"] = [m["engine"]] + list(m["workers"]) + ([m["stubborn"]] if stubborn else [])
        m["starttimes"] = {pid: starttime(pid) for pid in m["gpu0"] + ([m["trainer"]] if m["trainer"] else [])}
        self.wait_listed(m["gpu0"], 0)
        return m

    @staticmethod
    def manifest_doc(m: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in m.items() if k != "popens"}

    def status_phase(self, m: dict[str, Any]) -> None:
        self.phase = "status"
        a = self.smi_state(save="status-before", full=True)
        js = self.cli(["status", "--json"], "status-json")
        tx = self.cli(["status"], "status-text")
        b = self.smi_state(save="status-after")
        self.save_cli(js, "status-json")
        self.save_cli(tx, "status-text")
        stable = a["apps"] == b["apps"] and all(
            a["gpus"][i]["memory_used_mib"] == b["gpus"][i]["memory_used_mib"] for i in a["gpus"])
        self.check("nvidia-smi stable around status", stable, {"before": a["apps"], "after": b["apps"]})
        self.check("status --json exit 0", js["rc"] == 0, js["stderr"][-500:])
        self.check("status (table) exit 0", tx["rc"] == 0, tx["stderr"][-500:])
        try:
            host = json.loads(js["stdout"])["hosts"][0]
        except (ValueError, IndexError, KeyError) as exc:
            self.check("status --json parses", False, str(exc))
            return
        self.check("status host ok", host["ok"] is True, host.get("error"))
        by_gpu = {g["index"]: g for g in host["gpus"]}
        for i, g in a["gpus"].items():
            got = by_gpu.get(i, {}).get("memory_used_mib")
            self.check("GPU %d memory.used as nvidia-smi" % i, got == g["memory_used_mib"],
                       {"status": got, "nvidia-smi": g["memory_used_mib"]})
            got_t = by_gpu.get(i, {}).get("memory_total_mib")
            self.check("GPU %d memory.total as nvidia-smi" % i, got_t == g["memory_total_mib"],
                       {"status": got_t, "nvidia-smi": g["memory_total_mib"]})
        expect = [("engine", m["engine"], 0, ENGINE_TITLE)]
        expect += [("worker", w, 0, WORKER_TITLE) for w in m["workers"]]
        if m["stubborn"]:
            expect.append(("stubborn", m["stubborn"], 0, None))
        if m["trainer"]:
            expect.append(("trainer", m["trainer"], 1, None))
        names = {}
        for role, pid, gpu, title in expect:
            rows = {gi: [p for p in gd["processes"] if p["pid"] == pid] for gi, gd in by_gpu.items()}
            on = sorted(gi for gi, r in rows.items() if r)
            self.check("%s %d listed on GPU %d only" % (role, pid, gpu), on == [gpu], on)
            if rows.get(gpu):
                row = rows[gpu][0]
                smi_used = self.app_used(a, pid, gpu)
                self.check("%s %d memory as nvidia-smi" % (role, pid), row["used_mib"] == smi_used,
                           {"status": row["used_mib"], "nvidia-smi": smi_used})
                names[role] = {"status_name": row["name"], "cmdline": row["cmdline"],
                               "smi_process_name": self.smi_names().get(pid),
                               "comm": proc_text(pid, "comm"), "used_mib": row["used_mib"]}
                if title:
                    self.check("%s shown as %s" % (role, title), row["name"] == title, row["name"])
        self.results["names"] = names
        holders = {h["pid"]: h for h in host["holders"]}
        if m["trainer"]:
            h = holders.get(m["trainer"])
            dev0 = "/dev/nvidia%d" % self.minor.get(0, 0)
            self.check("status: trainer holds GPU 0's device file and is listed by nvidia-smi",
                       bool(h) and dev0 in h["devices"] and h["listed_by_nvidia_smi"] is True, h)
        hp = holders.get(m["poller"])
        self.check("status: NVML poller is an unlisted device-file holder",
                   bool(hp) and hp["listed_by_nvidia_smi"] is False, hp)
        for gi, gd in by_gpu.items():
            listed = sum(p["used_mib"] or 0 for p in gd["processes"])
            self.check("GPU %d ledger: used = attributed + unattributed" % gi,
                       gd["attributed_mib"] == listed and gd["memory_used_mib"] == listed + gd["unattributed_mib"], gd)
        self.results["status"] = {"seconds_json": js["seconds"], "seconds_table": tx["seconds"],
                                  "unattributed_mib": {gi: gd["unattributed_mib"] for gi, gd in by_gpu.items()},
                                  "table": tx["stdout"]}

    def clean_round(self, n: int, stubborn: bool, grace: Optional[float], checks: bool) -> dict[str, Any]:
        idle0 = self.idle_nvml(0)
        m = self.start_family(stubborn)
        rec: dict[str, Any] = {"round": n, "stubborn": stubborn, "grace_s": grace if grace is not None else 10.0,
                               "manifest": self.manifest_doc(m), "idle0_nvml_mib": idle0}
        if checks:
            write_json(self.fix / "manifest.json", self.manifest_doc(m), self.places())
            self.status_phase(m)
        self.phase = "clean" if n == 1 else "clean-timed"
        pre = self.smi_state(save="round%d-pre" % n if checks else None, full=checks)
        for pid in m["gpu0"]:
            self.watcher.watch(pid, m["popens"].get(pid))
        args = ["clean", "--all", "--gpus", "0", "--yes", "--json"] + ([] if grace is None else ["--grace", "%g" % grace])
        res = self.cli(args, "clean-%d" % n)
        t0, t1 = res["t0"], res["t1"]
        self.watcher.wait(m["gpu0"], 10)
        post = self.smi_state(save="round%d-post" % n if checks else None, full=checks)
        if checks:
            self.save_cli(res, "clean")
        tag = "round %d: " % n
        self.check(tag + "clean exit 0", res["rc"] == 0, res["stderr"][-500:])
        try:
            host = json.loads(res["stdout"])["hosts"][0]
        except (ValueError, IndexError, KeyError) as exc:
            self.check(tag + "clean --json parses", False, "%s: %s" % (exc, res["stdout"][-500:]))
            host = {}
        self.check(tag + "verdict clean", host.get("verdict") == "clean", {"verdict": host.get("verdict"), "reason": host.get("reason")})
        gone = {pid: starttime(pid) != m["starttimes"][pid] for pid in m["gpu0"]}
        self.check(tag + "GPU 0 holders gone", all(gone.values()), gone)
        self.check(tag + "nvidia-smi lists nobody on GPU 0", not [a for a in post["apps"] if a["gpu"] == 0], post["apps"])
        targets = {t["pid"]: t for t in host.get("targets", [])}
        self.check(tag + "targets are exactly the GPU 0 holders", set(targets) == set(m["gpu0"]),
                   {"targets": sorted(targets), "gpu0": m["gpu0"]})
        if m["engine"] in targets:
            waves = {pid: (targets[pid]["wave"], targets[pid]["family_root"]) for pid in targets}
            self.check(tag + "EngineCore is the family root (wave 0), workers wave 1",
                       waves[m["engine"]][0] == 0 and all(waves.get(w) == (1, m["engine"]) for w in m["workers"]), waves)
        if m["stubborn"]:
            sig = [(s["signal"], s["outcome"]) for s in host.get("signals", []) if s["pid"] == m["stubborn"]]
            self.check(tag + "SIGTERM-ignoring holder got TERM then KILL", sig == [("TERM", "sent"), ("KILL", "sent")], sig)
        refused = {r["pid"]: r for r in host.get("refused", [])}
        rec["refused"] = list(refused.values())
        clients = {c["pid"]: c for c in host.get("clients", [])}
        self.check(tag + "NVML poller is a GPU client, not signalled",  # maps no GPU device
                   m["poller"] not in targets and m["poller"] in clients and m["poller"] not in refused,
                   {"client": clients.get(m["poller"]), "refused": refused.get(m["poller"])})
        self.check(tag + "NVML poller alive", self.poller.proc.poll() is None)
        after0 = next((x["memory_used_mib"] for x in host.get("after", []) if x["index"] == 0), None)
        self.check(tag + "reported GPU 0 memory after == nvidia-smi", after0 == post["gpus"][0]["memory_used_mib"],
                   {"reported": after0, "nvidia-smi": post["gpus"][0]["memory_used_mib"]})
        if m["trainer"]:
            tp = m["trainer"]
            self.check(tag + "trainer not targeted", tp not in targets and tp not in refused, refused.get(tp))
            self.check(tag + "trainer alive (same start time)", starttime(tp) == m["starttimes"][tp])
            self.check(tag + "trainer memory untouched",
                       self.app_used(pre, tp, 1) == self.app_used(post, tp, 1) is not None,
                       {"before": self.app_used(pre, tp, 1), "after": self.app_used(post, tp, 1)})
            self.check(tag + "GPU 1 memory.used untouched",
                       pre["gpus"][1]["memory_used_mib"] == post["gpus"][1]["memory_used_mib"],
                       {"before": pre["gpus"][1]["memory_used_mib"], "after": post["gpus"][1]["memory_used_mib"]})
        # timing
        exits = {pid: round(self.watcher.exits[pid] - t0, 4) for pid in m["gpu0"] if pid in self.watcher.exits}
        t_last = max(self.watcher.exits[p] for p in m["gpu0"]) if len(exits) == len(m["gpu0"]) else None
        freed = None
        unlisted = None
        if idle0 is not None:
            s = self.poller.wait_for(lambda s: s["used"][0] <= idle0 + RELEASED_SLACK_MIB, 5, after=t0)
            freed = s["t"] if s else None
            u = self.poller.wait_for(lambda s: s["pids"][0] is not None and not set(s["pids"][0]) & set(m["gpu0"]), 5, after=t0)
            unlisted = u["t"] if u else None
        pre_nvml = self.poller.at(t0)
        agent_clean = next((x["doc"] for x in res["agent"] if x["request"].get("mode") == "clean"), None) or {}
        rec.update({
            "exit_code": res["rc"], "verdict": host.get("verdict"),
            "cli_seconds": res["seconds"],
            "exits_rel_s": exits,
            "last_exit_rel_s": round(t_last - t0, 4) if t_last else None,
            "memory_free_rel_s": round(freed - t0, 4) if freed else None,
            "unlisted_rel_s": round(unlisted - t0, 4) if unlisted else None,
            "floor_s": round(freed - t_last, 4) if freed and t_last else None,
            "after_free_to_cli_exit_s": round(t1 - freed, 4) if freed else None,
            "overhead_vs_last_exit_s": round(t1 - t_last, 4) if t_last else None,
            "agent_clean_seconds": agent_clean.get("seconds"),
            "agent_memory_wait": agent_clean.get("memory_wait"),
            "agent_signals": agent_clean.get("signals"),
            "agent_exchanges_s": [x["seconds"] for x in res["agent"]],
            "gpu0_before_nvml_mib": pre_nvml["used"][0] if pre_nvml else None,
            "gpu0_before_smi_mib": pre["gpus"][0]["memory_used_mib"],
            "gpu0_after_smi_mib": post["gpus"][0]["memory_used_mib"],
            "nvml_samples": [s for s in self.poller.between(t0 - 0.2, t1 + 0.2)],
        })
        self.log("round %d: cli %.3fs last exit %s freed %s floor %s verdict %s" % (
            n, res["seconds"], rec["last_exit_rel_s"], rec["memory_free_rel_s"], rec["floor_s"], rec["verdict"]))
        # anything of this round still alive (a failed clean) must not leak into the next
        for pid in m["gpu0"]:
            if starttime(pid) == m["starttimes"][pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.watcher.wait(m["gpu0"], 10)
        return rec

    def floor_experiment(self) -> list[dict[str, Any]]:
        """The driver alone: the runner kills holders one at a time; exit -> memory back."""
        self.phase = "floor"
        items = [self.start("plain", "--gpu", "0", "--gib", str(PLAIN_GIB)) for _ in range(self.floor_holders)]
        docs = self.wait_ready(items)
        pids = [d["pid"] for d in docs]
        state = self.wait_listed(pids, 0)
        out = []
        time.sleep(0.3)
        for k, ((p, _), pid) in enumerate(zip(items, pids)):
            sig = signal.SIGKILL if k % 2 == 0 else signal.SIGTERM
            mib = self.app_used(state, pid, 0) or int(PLAIN_GIB * 1024)
            before = self.poller.at(time.monotonic())["used"][0]
            self.watcher.watch(pid, p)
            time.sleep(0.05)  # the watcher's next poll includes the new pidfd
            ts = time.monotonic()
            os.kill(pid, sig)
            self.watcher.wait([pid], 10)
            te = self.watcher.exits.get(pid)
            s = self.poller.wait_for(lambda s, b=before, m=mib: s["used"][0] <= b - 0.9 * m, 10, after=ts)
            gone = self.poller.wait_for(lambda s, q=pid: s["pids"][0] is not None and q not in s["pids"][0], 10, after=ts)
            tf = s["t"] if s else None
            out.append({"pid": pid, "signal": signal.Signals(sig).name, "listed_mib": mib,
                        "signal_to_exit_s": round(te - ts, 4) if te else None,
                        "exit_to_free_s": round(tf - te, 4) if tf and te else None,
                        "signal_to_free_s": round(tf - ts, 4) if tf else None,
                        "signal_to_unlisted_s": round(gone["t"] - ts, 4) if gone else None,
                        "nvml_samples": self.poller.between(ts - 0.05, (tf or ts) + 0.05)})
            self.log("floor %s: %s" % (signal.Signals(sig).name, {k2: v for k2, v in out[-1].items() if k2 != "nvml_samples"}))
            time.sleep(0.5)
        return out

    def fit_phase(self) -> dict[str, Any]:
        self.phase = "fit"
        out: dict[str, Any] = {"probes": {}, "cases": []}
        out["probes"]["0"] = self.probe(0, "gpu0")
        if self.trainer:
            out["probes"]["1"] = self.probe(1, "gpu1")
        self.smi_state(save="fit", full=True)
        cases = [("fits", ["--gpus", "0", "--weights-gib", "100", "--activations-gib", "2"], 0),
                 ("too-big", ["--gpus", "0", "--weights-gib", "130", "--activations-gib", "2"], 1)]
        if self.trainer:
            cases.append(("trainer-gpu", ["--gpus", "1", "--weights-gib", "20"], None))
        for name, args, want in cases:
            res = self.cli(["fit"] + args + ["--json"], "fit-" + name)
            self.save_cli(res, "fit-" + name)
            try:
                doc = json.loads(res["stdout"])
                gpu = doc["hosts"][0]["gpus"][0]
            except (ValueError, IndexError, KeyError) as exc:
                self.check("fit %s parses" % name, False, "%s: %s %s" % (exc, res["stdout"][-300:], res["stderr"][-300:]))
                continue
            probe = out["probes"][str(gpu["index"])]
            real_startup = probe["mem_get_info_free_mib"] >= doc["util"] * probe["mem_get_info_total_mib"]
            case = {"name": name, "exit_code": res["rc"], "verdict": gpu["verdict"], "ok": gpu["ok"],
                    "startup_ok": gpu["startup_ok"], "real_startup_ok": real_startup,
                    "total_gib": gpu["total_gib"], "real_total_gib": round(probe["mem_get_info_total_mib"] / 1024, 3),
                    "vllm_free_gib": gpu["vllm_free_gib"], "real_free_gib": round(probe["mem_get_info_free_mib"] / 1024, 3),
                    "kv_cache_gib": gpu["kv_cache_gib"], "seconds": res["seconds"]}
            out["cases"].append(case)
            if want is not None:
                self.check("fit %s exit %d" % (name, want), res["rc"] == want, case)
            self.check("fit %s: total = what CUDA reports" % name, abs(case["total_gib"] - case["real_total_gib"]) < 0.002, case)
            self.check("fit %s: start-up check as a real CUDA process sees it" % name,
                       case["startup_ok"] == real_startup, case)
        txt = self.cli(["fit", "--gpus", "0", "--weights-gib", "130", "--activations-gib", "2"], "fit-text")
        self.save_cli(txt, "fit-too-big-text")
        return out

    # ------------------------------------------------------------------ driver

    def run(self) -> dict[str, Any]:
        t_start = time.monotonic()
        try:
            self.environment()
            self.start_background()
            try:
                self.results["probe_idle_gpu0"] = self.probe(0, "idle")
            except Exception as exc:
                self.results["errors"].append("probe: %s" % exc)
            # round 1: exactly `clean --gpus 0 --yes --json`, every check; again through SSH
            rounds = [(True, None, True, t) for t in self.inventories]
            rounds += [(True, self.grace, False, "local")] * self.rounds
            rounds += [(False, self.grace, False, "local")] * self.light_rounds
            for n, (stubborn, grace, checks, transport) in enumerate(rounds, 1):
                if not checks and time.monotonic() > self.budget_end:
                    self.results["errors"].append("time budget spent: rounds %d.. not run" % n)
                    break
                self.use(transport)
                try:
                    rec = self.clean_round(n, stubborn, grace, checks)
                    rec["transport"], rec["checked"] = transport, checks
                    self.results["rounds"].append(rec)
                except Exception as exc:
                    self.results["errors"].append("round %d (%s): %s\n%s" % (
                        n, transport, exc, traceback.format_exc()[-2000:]))
                    self.kill_round_leftovers()
                finally:
                    self.use("local")
            try:
                self.results["floor"] = self.floor_experiment()
            except Exception as exc:
                self.results["errors"].append("floor: %s\n%s" % (exc, traceback.format_exc()[-2000:]))
            try:
                self.results["fit"] = self.fit_phase()
            except Exception as exc:
                self.results["errors"].append("fit: %s\n%s" % (exc, traceback.format_exc()[-2000:]))
        except Exception as exc:
            self.results["errors"].append("scenario: %s\n%s" % (exc, traceback.format_exc()[-3000:]))
        finally:
            self.results["summary"] = self.summary()
            self.results["seconds"] = round(time.monotonic() - t_start, 2)
            if self.poller:
                self.poller.stop()
            if "ssh" in self.inventories:  # the connections its ssh rounds kept (ssh_persist's
                try:  # default), asked to end through their sockets
                    subprocess.run([sys.executable, str(CLI), "-i", str(self.inventories["ssh"]),
                                    "disconnect"], capture_output=True, env=self.env, timeout=60)
                except (OSError, subprocess.SubprocessError):
                    pass
            self.kill_started()
            self.watcher.close()
            write_json(self.out / "results.json", self.results, self.places(), default=str)
            self.logf.close()
        return self.results

    def kill_round_leftovers(self) -> None:
        keep = {self.poller.proc.pid if self.poller else None, self.trainer.pid if self.trainer else None}
        for p in self.started:
            if p.pid not in keep and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass

    def summary(self) -> dict[str, Any]:
        def group(stubborn: bool, timed: bool):
            return [r for r in self.results["rounds"] if r["stubborn"] == stubborn
                    and (not r.get("checked", r["round"] == 1)) == timed]

        out: dict[str, Any] = {"failed_checks": [c["name"] for c in self.results["checks"] if not c["ok"]],
                               "checks": len(self.results["checks"])}
        for label, rs in (("round1_default_grace", group(True, False)),
                          ("with_sigterm_ignorer", group(True, True)),
                          ("vllm_family_only", group(False, True))):
            out[label] = {
                "n": len(rs),
                "median_cli_s": median(r["cli_seconds"] for r in rs),
                "median_last_exit_s": median(r["last_exit_rel_s"] for r in rs),
                "median_memory_free_s": median(r["memory_free_rel_s"] for r in rs),
                "median_floor_s": median(r["floor_s"] for r in rs),
                "median_after_free_to_cli_exit_s": median(r["after_free_to_cli_exit_s"] for r in rs),
                "median_agent_memory_wait_s": median((r.get("agent_memory_wait") or {}).get("seconds") for r in rs),
                "verdicts": [r["verdict"] for r in rs],
            }
        fl = self.results.get("floor") or []
        out["floor_alone"] = {
            "n": len(fl),
            "median_exit_to_free_s": median(f["exit_to_free_s"] for f in fl),
            "median_signal_to_exit_s": median(f["signal_to_exit_s"] for f in fl),
            "max_exit_to_free_s": max((f["exit_to_free_s"] for f in fl if f["exit_to_free_s"] is not None), default=None),
        }
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds with the SIGTERM-ignoring holder")
    p.add_argument("--light-rounds", type=int, default=5, help="timed rounds of the vLLM family alone")
    p.add_argument("--grace", type=float, default=2.0, help="--grace of the timed rounds")
    p.add_argument("--floor-holders", type=int, default=4)
    p.add_argument("--budget", type=float, default=420.0, help="seconds; no new round starts after")
    p.add_argument("--ssh-state", type=Path, default=None,
                   help="tests/gpu/ossh.sh's state dir: round 1 also through SSH to its sshd")
    p.add_argument("--ssh-port", type=int, default=2222, help="that sshd's port on 127.0.0.1")
    args = p.parse_args(argv)
    why = gpu_unavailable()
    if why:
        print("gpu scenario: skipped: %s" % why)
        return 0
    res = Scenario(Path(args.out), args.rounds, args.light_rounds, args.grace, args.floor_holders,
                   args.budget, args.ssh_state, args.ssh_port).run()
    print(json.dumps(res["summary"], indent=1))
    if res["errors"]:
        print("errors:\n" + "\n".join(res["errors"]))
    return 1 if res["errors"] or res["summary"]["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
