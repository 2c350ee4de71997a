"""The live fleet's targets (`top`, `status --watch`), measured on test-lab hosts on loopback; prints numbers.

    sudo python3 bench/live_bench.py                  # 64 hosts, 1 s refresh, 30 s
    sudo python3 bench/live_bench.py --hosts 16 --seconds 20
    sudo python3 bench/live_bench.py --hosts 32 --soak-minutes 30 --restart-every 180

What it measures, with `gpufleet status --watch INTERVAL --json` (stdout to a pipe read and
counted here: the same LiveFleet as `top`, plus one JSON document per interval):

* controller CPU, % of one core (utime + stime of the CLI from /proc, after the first 5 s),
  and the same with its live descendants (`controller_with_ssh_cpu_pct`: the ssh processes of
  the OpenSSH client are the controller's work too);
* controller RSS beyond its own baseline, per host: (RSS with N hosts - RSS with 1) / (N - 1),
  and the same for the PSS of the CLI plus its ssh processes (`pss_kib_with_ssh...`);
* --ssh-client: the inventory's ssh_client (auto = OpenSSH where there is an ssh client);
* per-host agent CPU per refresh: every agent's utime + stime (read in its host's /proc)
  over the documents it wrote in that time;
* first full document vs one `status --all --json` (wall seconds, same hosts): --rounds of
  each, alternated (which goes first alternates too), 2 s between runs (so neither starts
  while the other's sessions end on the hosts), after one warm-up status; medians, every run;
* --soak-minutes: fds, threads and RSS of the controller after the first minute and at the
  end, hosts' sshd killed (with their sessions) and restarted every --restart-every seconds
  round-robin, and the agents left on the hosts after the CLI stopped.

Not a test (pytest never collects bench/). Needs root and the lab's prerequisites.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from lab import Lab  # noqa: E402
from watch_helpers import agents_on, start_sshd, stop_sshd_and_sessions  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
GPUFLEET = [sys.executable, "-c", "from gpufleet.cli import main; main()"]


def env(home: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    out["HOME"] = str(home)
    out["PYTHONPATH"] = str(REPO)
    return out


def cpu_s(stat_path: Path, children: bool = False) -> float:
    """utime + stime (and, with ``children``, of its reaped children: nvidia-smi runs)."""
    fields = stat_path.read_text().rsplit(")", 1)[1].split()
    own = int(fields[11]) + int(fields[12])
    return (own + (int(fields[13]) + int(fields[14]) if children else 0)) / CLK


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (its ssh clients under OpenSSH), from /proc's ppid links."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU of the controller and of its live descendants (ssh processes are its work too)."""
    total = 0.0
    for p in [pid] + descendants(pid):
        try:
            total += cpu_s(Path(f"/proc/{p}/stat"))
        except OSError:
            pass
    return total


def tree_pss_kib(pid: int) -> int:
    """Proportional set size of the controller and its live descendants (shared pages of
    many ssh processes counted once in all, not once each as RSS would)."""
    total = 0
    for p in [pid] + descendants(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def status_of(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class Watch:
    def __init__(self, home: Path, inv: Path, interval: float):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            GPUFLEET + ["-i", str(inv), "status", "--watch", str(interval), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env(home), cwd=str(home))
        self.buf = b""
        self.docs = 0
        self.first_s: Optional[float] = None
        self.last: Optional[dict] = None
        self.broken: list[bytes] = []

    def pump(self, seconds: float) -> None:
        """Read (and count) documents for ``seconds``."""
        assert self.proc.stdout is not None
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                continue
            chunk = os.read(self.proc.stdout.fileno(), 1 << 22)
            if not chunk:
                raise SystemExit("status --watch ended")
            self.buf += chunk
            *lines, self.buf = self.buf.split(b"\n")
            for line in lines:
                try:
                    doc = json.loads(line)
                except ValueError:  # a broken line is a finding of the bench, kept whole
                    self.broken.append(line)
                    continue
                self.docs += 1
                if self.first_s is None:
                    self.first_s = time.monotonic() - self.started
                self.last = doc

    def cpu(self) -> float:
        return cpu_s(Path(f"/proc/{self.proc.pid}/stat"))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)  # the CLI this bench started
        self.proc.wait(timeout=30)


def agent_cpu(hosts: list[Any], children: bool = False) -> dict[str, float]:
    out = {}
    for h in hosts:
        for pid in agents_on(h):
            out[f"{h.name}:{pid}"] = cpu_s(h.path(f"/proc/{pid}/stat"), children)
    return out


def per_refresh_ms(before: dict, after: dict, docs: int) -> dict:
    values = sorted((after[k] - before[k]) / max(1, docs) for k in after if k in before)
    if not values:
        return {"median": None, "max": None}
    return {"median": round(1000 * values[len(values) // 2], 2), "max": round(1000 * values[-1], 2)}


def agents_gone(hosts: list[Any], timeout: float = 15.0) -> dict:
    """Agents still running on the hosts after the CLI stopped, polled until none (an agent
    finishes the snapshot it is in, then sees its stdin closed)."""
    started = time.monotonic()
    left = sum(len(agents_on(h)) for h in hosts)
    while left and time.monotonic() - started < timeout:
        time.sleep(0.1)
        left = sum(len(agents_on(h)) for h in hosts)
    return {"agents_left": left, "agents_gone_after_s": round(time.monotonic() - started, 2)}


def status_all_s(inv: Path, home: Path) -> float:
    t0 = time.monotonic()
    subprocess.run(GPUFLEET + ["-i", str(inv), "status", "--all", "--json"], env=env(home),
                   cwd=str(home), stdout=subprocess.DEVNULL, check=False)
    return time.monotonic() - t0


def first_document_s(inv: Path, home: Path, interval: float) -> float:
    watch = Watch(home, inv, interval)
    try:
        while watch.first_s is None:
            watch.pump(1.0)
    finally:
        watch.stop()
    return watch.first_s


def first_vs_status(inv: Path, home: Path, interval: float, rounds: int) -> dict:
    """status --all and the first document of status --watch, ``rounds`` times, which goes
    first alternating; a pause between runs lets the hosts end the last run's sessions."""
    status_all_s(inv, home)  # warm-up: the hosts' agent caches, the page cache
    runs: dict[str, list[float]] = {"status_all_s": [], "first_document_s": []}
    pair = [("status_all_s", lambda: status_all_s(inv, home)),
            ("first_document_s", lambda: first_document_s(inv, home, interval))]
    for n in range(rounds):
        for key, run in pair if n % 2 == 0 else pair[::-1]:
            time.sleep(2.0)
            runs[key].append(round(run(), 2))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in runs.items()}
    out.update({k.replace("_s", "_runs_s"): v for k, v in runs.items()})
    return out


def measure(lab: Lab, hosts: list[Any], home: Path, interval: float, seconds: float,
            client: str = "auto", rounds: int = 3) -> dict:
    inv = lab.inventory_yaml(hosts, connect_timeout=5, ssh_client=client)
    firsts = first_vs_status(inv, home, interval, rounds)
    time.sleep(1.0)
    watch = Watch(home, inv, interval)
    try:
        watch.pump(5.0)
        cpu0, t1, docs0 = watch.cpu(), time.monotonic(), watch.docs
        tree0 = tree_cpu_s(watch.proc.pid)
        agents0, with0 = agent_cpu(hosts), agent_cpu(hosts, children=True)
        watch.pump(seconds)
        cpu1, t2, docs1 = watch.cpu(), time.monotonic(), watch.docs
        tree1 = tree_cpu_s(watch.proc.pid)
        pss_kib = tree_pss_kib(watch.proc.pid)
        helpers = len(descendants(watch.proc.pid))
        agents1, with1 = agent_cpu(hosts), agent_cpu(hosts, children=True)
        rss_kib = status_of(watch.proc.pid, "VmRSS")
    finally:
        watch.stop()
    return {"hosts": len(hosts), "interval_s": interval, "controller_cpu_pct":
            round(100 * (cpu1 - cpu0) / (t2 - t1), 1), "documents": docs1 - docs0,
            "controller_with_ssh_cpu_pct": round(100 * (tree1 - tree0) / (t2 - t1), 1),
            "ssh_processes": helpers, "pss_kib_with_ssh": pss_kib,
            "rss_kib": rss_kib, **firsts,
            "agent_cpu_ms_per_refresh": per_refresh_ms(agents0, agents1, docs1 - docs0),
            "agent_with_nvidia_smi_ms_per_refresh": per_refresh_ms(with0, with1, docs1 - docs0),
            **agents_gone(hosts)}


def soak(lab: Lab, hosts: list[Any], home: Path, interval: float, minutes: float,
         restart_every: float, client: str = "auto") -> dict:
    inv = lab.inventory_yaml(hosts, connect_timeout=5, ssh_client=client)
    watch = Watch(home, inv, interval)
    pid = watch.proc.pid

    def sample() -> dict:
        return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": status_of(pid, "Threads"),
                "rss_kib": status_of(pid, "VmRSS"), "pss_kib_with_ssh": tree_pss_kib(pid),
                "ssh_processes": len(descendants(pid))}

    try:
        watch.pump(60.0)
        first = sample()
        end = time.monotonic() + minutes * 60 - 60
        turn = 0
        while time.monotonic() < end:
            watch.pump(min(restart_every, max(0.0, end - time.monotonic())))
            host = hosts[turn % len(hosts)]
            turn += 1
            for agent in agents_on(host):
                stop_sshd_and_sessions(host, agent)
                break
            time.sleep(2 * interval)
            start_sshd(host)
        last = sample()
    finally:
        watch.stop()
    for n, line in enumerate(watch.broken):
        Path(f"broken-line-{n}.txt").write_bytes(line)
    return {"after_1_min": first, "at_end": last, "restarts": turn, "documents": watch.docs,
            "broken_lines": len(watch.broken), **agents_gone(hosts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--soak-minutes", type=float, default=0.0)
    ap.add_argument("--restart-every", type=float, default=180.0)
    ap.add_argument("--ssh-client", default="auto", choices=("auto", "openssh", "paramiko"),
                    help="the inventory's ssh_client for every host")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of status --all and of the first watch document, alternated")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gf-live-bench-") as tmp, Lab(Path(tmp) / "lab") as lab:
        home = Path(tmp) / "home"
        home.mkdir()
        hosts = []
        for i in range(args.hosts):
            h = lab.add_host(f"live-{i:03d}", gpus=args.gpus)
            h.spawn_holder(gpus=[0], mib=70000 // 8, title="VLLM::Worker_TP0")
            hosts.append(h)
        client = args.ssh_client
        one = measure(lab, hosts[:1], home, args.interval, min(args.seconds, 10.0), client, 1)
        many = measure(lab, hosts, home, args.interval, args.seconds, client, args.rounds)
        if args.hosts > 1:
            many["rss_kib_per_host_beyond_baseline"] = round(
                (many["rss_kib"] - one["rss_kib"]) / (args.hosts - 1), 1)
            many["pss_kib_with_ssh_per_host_beyond_baseline"] = round(
                (many["pss_kib_with_ssh"] - one["pss_kib_with_ssh"]) / (args.hosts - 1), 1)
        print(json.dumps({"one_host": one, "fleet": many}, indent=2))
        if args.soak_minutes > 0:
            print(json.dumps({"soak": soak(lab, hosts, home, args.interval, args.soak_minutes,
                                           args.restart_every, client)}, indent=2))


if __name__ == "__main__":
    main()
