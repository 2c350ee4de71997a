#!/usr/bin/env python3
"""Real-GPU proof and timings of the NVML reader (the agent's start: NVML instead of four nvidia-smi runs), on one real host.

1. Numbers do not move: beside two torch holders (4 GiB and 1 GiB on GPU 0), the agent's own
   snapshot code reads the GPUs through NVML and through nvidia-smi back to back; memory
   used/total/free/reserved and every process's used memory must be equal (a round that differs
   is retried: memory can move between two reads; every round is recorded).
2. Timings (medians, printed and written): the agent as a host runs it (the constant bootstrap on
   stdin) through NVML and through nvidia-smi; `gpufleet status` with `connection: local`; and,
   when an sshd runs (tests/gpu/ossh.sh, --ssh-state), `gpufleet status` over real SSH (the
   default OpenSSH client, and `ssh_client: paramiko` beside it) against a bare
   `ssh host nvidia-smi --query-gpu=index,memory.used --format=csv` in the same run; and over a
   connection kept from the command before (`ssh_persist`: no handshake, no `ssh` process).
3. Clean latency: a 20 GiB torch holder, a thread polling NVML every millisecond for the moment
   the GPU's memory is back, and `gpufleet clean --all --gpus 0 --yes`: how long after that moment the
   CLI returns (local, and over SSH when there: fresh, and kept from the command before).

    PYTHONPATH=$PWD python3 tests/gpu/gpu_nvml.py --out /tmp/gout [--ssh-state /tmp/ossh-state]
Writes nvml-results.json to --out; exit 1 when a check failed.
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
from typing import Any, Callable, Optional

from portable import write_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from gpufleet.remote import bootstrap_command, encode_request  # noqa: E402

HOLDER = r"""
import sys, time, torch
x = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device='cuda:0')
torch.cuda.synchronize()
print('ready', flush=True)
time.sleep(600)
"""
#: The moment GPU 0's memory is back (< 1 GiB used), by NVML every millisecond, in its own
#: process: CLOCK_MONOTONIC is one clock for every process of the machine.
WATCHER = r"""
import sys, time
sys.path.insert(0, %r)
from gpufleet.remote import nvml
nv, why = nvml.open_nvml()
assert nv is not None, why
print('ready', flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    used, _ = nvml.memory_used(nv, [0])
    if used and used.get(0) is not None and used[0] < 1024:
        print(time.monotonic(), flush=True)
        break
    time.sleep(0.001)
""" % str(REPO)
COMPARED = ("index", "uuid", "name", "pci_bus_id", "memory_used_mib", "memory_total_mib",
            "memory_free_mib", "memory_reserved_mib")


def median_of(n: int, fn: Callable[[], float]) -> dict[str, Any]:
    xs = [fn() for _ in range(n)]
    return {"median_s": round(statistics.median(xs), 4), "min_s": round(min(xs), 4),
            "max_s": round(max(xs), 4), "n": n}


class Run:
    def __init__(self, out: Path, ssh_state: Optional[Path], port: int, smi: str) -> None:
        self.out = out
        self.smi = smi  # as the bare ssh command names it (sshd's PATH may lack it)
        out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="gpufleet-nvml-"))
        (self.tmp / "home").mkdir()
        self.local_inv = self.tmp / "local.yaml"
        self.local_inv.write_text("hosts:\n  h200:\n    connection: local\n")
        self.ssh_state = ssh_state
        self.port = port
        env = dict(os.environ, HOME=str(self.tmp / "home"), PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.env = env
        self.ssh_inv: Optional[Path] = None
        self.kept_inv: Optional[Path] = None
        if ssh_state is not None:
            base = ("hosts:\n  h200:\n    address: 127.0.0.1\n    port: %d\n    user: root\n"
                    "    identity_file: %s\n    known_hosts_file: %s\n"
                    % (port, ssh_state / "id_ed25519", ssh_state / "known_hosts"))
            self.ssh_inv = self.tmp / "ssh.yaml"  # fresh connections (kept is the default)
            self.ssh_inv.write_text(base + "    ssh_persist: 0\n")
            self.kept_inv = self.tmp / "ssh-kept.yaml"
            self.kept_inv.write_text(base + "    ssh_persist: 120\n")
        self.checks: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}
        self.procs: list[subprocess.Popen] = []

    def check(self, name: str, ok: bool, detail: Any = None) -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(("ok   " if ok else "FAIL ") + name + ("" if ok else ": %r" % (detail,)), flush=True)

    def holder(self, mib: int) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(mib)], stdout=subprocess.PIPE,
                             text=True, env=self.env)
        self.procs.append(p)
        if not (p.stdout and p.stdout.readline()):
            raise RuntimeError("holder did not start")
        return p

    def stop_holders(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs = []

    # --- 1. numbers -------------------------------------------------------------------------

    @staticmethod
    def agent_doc(source: str) -> dict[str, Any]:
        """The agent as a host runs it, in a child: this process never opens NVML or a device
        file (it is the holders' parent: with device files open it would be their family root,
        and a clean over SSH would rightly signal it)."""
        r = subprocess.run(bootstrap_command(sys.executable),
                           input=encode_request({"mode": "snapshot", "gpu_source": source}),
                           capture_output=True, timeout=60)
        return json.loads(r.stdout)

    def parity(self) -> None:
        pids = sorted(p.pid for p in (self.holder(4096), self.holder(1024)))
        time.sleep(1.0)
        rounds = []
        for _ in range(8):
            nv, smi = self.agent_doc("nvml"), self.agent_doc("nvidia-smi")
            rows = [[{k: g[k] for k in COMPARED} for g in d["gpus"]] for d in (nv, smi)]
            apps = [sorted((a["pid"], a["used_mib"], a["gpu_uuid"]) for a in d["compute_apps"])
                    for d in (nv, smi)]
            rounds.append({"nvml": rows[0], "nvidia_smi": rows[1], "apps_nvml": apps[0],
                           "apps_nvidia_smi": apps[1], "same": rows[0] == rows[1] and
                           apps[0] == apps[1], "sources": [nv["facts"]["gpu_source"],
                                                          smi["facts"]["gpu_source"]],
                           "nvml_extra": [{k: g.get(k) for k in ("minor", "persistence_mode",
                                           "temperature_c", "power_w", "nvml_errors")}
                                          for g in nv["gpus"]]})
        self.results["parity_rounds"] = rounds
        for r in rounds:
            if not r["same"]:
                print("differs:", json.dumps({k: r[k] for k in ("nvml", "nvidia_smi", "apps_nvml",
                                                                 "apps_nvidia_smi")}))
                break
        self.save()
        self.check("NVML was the source", all(r["sources"] == ["nvml", "nvidia-smi"]
                                              for r in rounds), [r["sources"] for r in rounds])
        same = sum(r["same"] for r in rounds)
        self.check("NVML and nvidia-smi agree (memory, reserved, per-process) in >= 6 of 8 "
                   "back-to-back rounds", same >= 6, same)
        listed = {a[0] for a in rounds[-1]["apps_nvml"]}
        self.check("both holders listed by NVML", set(pids) <= listed, sorted(listed))
        self.stop_holders()

    # --- 2. timings -------------------------------------------------------------------------

    def agent_wall(self, source: str) -> tuple[float, float]:
        payload = encode_request({"mode": "snapshot", "gpu_source": source})
        t0 = time.monotonic()
        r = subprocess.run(bootstrap_command(sys.executable), input=payload,
                           capture_output=True, timeout=60)
        wall = time.monotonic() - t0
        doc = json.loads(r.stdout)
        assert doc["facts"]["gpu_source"] == source, doc["facts"]
        return wall, float(doc["seconds"])

    def cli(self, inv: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
        argv = [sys.executable, "-m", "gpufleet", "-i", str(inv)] + list(args)
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=300)
        return time.monotonic() - t0, r

    def timer(self, inv: Path, *args: str) -> Callable[[], float]:
        return lambda: self.cli(inv, *args)[0]

    def timings(self) -> None:
        self.holder(2048)
        time.sleep(0.5)
        for source in ("nvml", "nvidia-smi"):
            self.agent_wall(source)  # warm the page cache
            runs = [self.agent_wall(source) for _ in range(15)]
            self.results["agent_" + source] = {
                "wall_median_s": round(statistics.median(w for w, _ in runs), 4),
                "reported_median_s": round(statistics.median(s for _, s in runs), 4)}
        self.check("agent snapshot (NVML) reported <= 40 ms",
                   self.results["agent_nvml"]["reported_median_s"] <= 0.040,
                   self.results["agent_nvml"])
        for src in ("auto", "nvidia-smi"):
            inv = self.tmp / ("local-%s.yaml" % src)
            inv.write_text("hosts:\n  h200:\n    connection: local\n    gpu_source: %s\n" % src)
            self.cli(inv, "status")
            self.results["status_local_" + src] = median_of(10, self.timer(inv, "status"))
        self.check("gpufleet status, connection local, <= 0.25 s wall",
                   self.results["status_local_auto"]["median_s"] <= 0.25,
                   self.results["status_local_auto"])
        if self.ssh_inv is not None:
            self.ssh_timings()
        self.stop_holders()

    def ssh_timings(self) -> None:
        assert self.ssh_state is not None and self.ssh_inv is not None and self.kept_inv is not None
        self.cli(self.ssh_inv, "status")
        bare = ["ssh", "-i", str(self.ssh_state / "id_ed25519"), "-p", str(self.port),
                "-o", "UserKnownHostsFile=%s" % (self.ssh_state / "known_hosts"),
                "-o", "BatchMode=yes", "root@127.0.0.1",
                self.smi + " --query-gpu=index,memory.used --format=csv"]

        def bare_ssh() -> float:
            t0 = time.monotonic()
            r = subprocess.run(bare, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            return time.monotonic() - t0

        paramiko_inv = self.tmp / "ssh-paramiko.yaml"
        paramiko_inv.write_text(self.ssh_inv.read_text() + "    ssh_client: paramiko\n")
        self.cli(paramiko_inv, "status")
        self.cli(self.kept_inv, "status")  # the master, kept from here on
        ssh_status: tuple[list[float], ...] = ([], [], [], [])
        for _ in range(10):  # interleaved: the same minute for each
            ssh_status[0].append(self.cli(self.ssh_inv, "status")[0])
            ssh_status[1].append(bare_ssh())
            ssh_status[2].append(self.cli(paramiko_inv, "status")[0])
            ssh_status[3].append(self.cli(self.kept_inv, "status")[0])
        self.results["status_ssh_paramiko"] = {
            "median_s": round(statistics.median(ssh_status[2]), 4),
            "all": [round(x, 4) for x in ssh_status[2]]}
        kept = statistics.median(ssh_status[3])
        self.results["status_ssh_kept"] = {"median_s": round(kept, 4),
                                           "all": [round(x, 4) for x in ssh_status[3]]}
        self.check("status over a kept SSH connection faster than over a fresh one",
                   kept < statistics.median(ssh_status[0]), round(kept, 4))
        st, b = statistics.median(ssh_status[0]), statistics.median(ssh_status[1])
        self.results["status_ssh"] = {"median_s": round(st, 4), "all": [round(x, 4) for x in ssh_status[0]]}
        self.results["bare_ssh_nvidia_smi"] = {"median_s": round(b, 4), "all": [round(x, 4) for x in ssh_status[1]]}
        self.results["status_ssh_over_bare"] = round(st / b, 3)
        self.check("status over SSH <= 1.5x bare ssh nvidia-smi", st <= 1.5 * b,
                   self.results["status_ssh_over_bare"])

    # --- 3. clean latency -------------------------------------------------------------------

    def clean_latency(self, inv: Path, label: str, rounds: int = 3) -> None:
        lags = []
        for _ in range(rounds):
            self.holder(20480)
            time.sleep(0.5)
            watcher = subprocess.Popen([sys.executable, "-c", WATCHER], stdout=subprocess.PIPE,
                                       text=True, env=self.env)
            assert watcher.stdout is not None and watcher.stdout.readline().strip() == "ready"
            wall, r = self.cli(inv, "clean", "--all", "--gpus", "0", "--yes", "--json")
            end = time.monotonic()
            try:
                line = watcher.communicate(timeout=30)[0].strip()
            except subprocess.TimeoutExpired:
                watcher.kill()
                line = watcher.communicate()[0].strip()
            back = [float(line)] if line else []
            self.stop_holders()
            doc = json.loads(r.stdout)["hosts"][0]
            lags.append({"wall_s": round(wall, 3), "after_memory_back_s":
                         round(end - back[0], 4) if back else None, "verdict": doc["verdict"]})
        self.results["clean_" + label] = lags
        ok = all(x["verdict"] == "clean" and x["after_memory_back_s"] is not None for x in lags)
        self.check("clean (%s) verdict clean" % label, ok, lags)
        med = statistics.median(x["after_memory_back_s"] or 99 for x in lags)
        self.check("clean (%s) returns <= 0.1 s after the memory is back" % label, med <= 0.1, med)
        self.save()

    def save(self) -> None:
        doc = {"checks": self.checks, "ok": all(c["ok"] for c in self.checks),
               "results": self.results}
        write_json(self.out / "nvml-results.json", doc, {"TMPDIR": self.tmp, "OUTDIR": self.out})

    def run(self) -> dict[str, Any]:
        try:
            self.parity()
            self.timings()
            self.clean_latency(self.local_inv, "local")
            if self.ssh_inv is not None and self.kept_inv is not None:
                self.clean_latency(self.ssh_inv, "ssh")
                self.clean_latency(self.kept_inv, "ssh-kept")
        finally:
            self.stop_holders()
            if self.kept_inv is not None:  # the masters this run kept, asked to end
                self.cli(self.kept_inv, "disconnect")
        self.save()
        print(json.dumps({k: v for k, v in self.results.items() if k != "parity_rounds"},
                         indent=1)[:6000])
        return {"ok": all(c["ok"] for c in self.checks)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="gout-")))
    ap.add_argument("--ssh-state", type=Path, default=None)
    ap.add_argument("--port", type=int, default=2222)
    ap.add_argument("--smi", default="nvidia-smi", help="nvidia-smi for the bare ssh baseline")
    args = ap.parse_args()
    return 0 if Run(args.out, args.ssh_state, args.port, args.smi).run()["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
