#!/usr/bin/env python3
"""gpufleet against parallel-ssh, Ansible and a sequential ssh loop, on the same lab hosts.

    sudo python3 bench/run.py            # the full run (~10 min on 2 cores) -> bench/RESULTS-run.md
    sudo python3 bench/run.py --quick    # a short smoke run (~1 min) -> RESULTS-run.md too
    sudo python3 bench/run.py --warm     # also each tool over the connections it keeps

What and how: bench/README.md. Needs root (namespaces, TUN, cgroups), the test lab's
prerequisites and `pip install -e '.[bench]'`. Not a test: pytest never collects bench/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import benchlab as B  # noqa: E402
import remote_work  # noqa: E402

TOOLS = ("gpufleet", "pssh", "ansible", "ssh")
#: Tools that keep their SSH connections between commands by default: gpufleet (ssh_persist,
#: 60 s) and Ansible (ssh's ControlPersist=60s in its default ssh_args). parallel-ssh and the
#: ssh loop keep none: their warm run is their cold one.
KEEPS = ("gpufleet", "ansible", "ansible_pl")
LABEL = {"gpufleet": "gpufleet status", "pssh": "parallel-ssh", "ansible": "ansible -m shell",
         "ssh": "ssh loop (sequential)", "ansible_pl": "ansible -m shell, pipelining on"}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small N, one RTT, two runs: a smoke run")
    ap.add_argument("--warm", action="store_true",
                    help="also time each tool that keeps connections (gpufleet, Ansible) right "
                    "after an untimed run of the same command, within its keep window (60 s): its "
                    "runs go through the masters the untimed one left; cold and warm side by side")
    ap.add_argument("--ns", type=ints, default=[1, 8, 32, 128], help="host counts at the first RTT")
    ap.add_argument("--rtts", type=floats, default=[20.0, 100.0], help="round-trip times, ms")
    ap.add_argument("--ns-far", type=ints, default=[1, 32],
                    help="host counts at the other RTTs (time budget)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each tool per cell, alternating")
    ap.add_argument("--slow-runs", type=int, default=1,
                    help="runs of a tool in cells where its first run took more than --slow-s")
    ap.add_argument("--slow-s", type=float, default=15.0)
    ap.add_argument("--seq-max-n", type=int, default=128,
                    help="largest N for the sequential ssh loop at RTTs above the first")
    ap.add_argument("--seq-max-n-first", type=int, default=128,
                    help="largest N for the sequential ssh loop at the first RTT (its wall is N × one host's)")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--pipelining-ns", type=ints, default=[1, 32],
                    help="also run ansible with ANSIBLE_PIPELINING=True at these N (first RTT)")
    ap.add_argument("--forks", type=int, default=32, help="parallelism of every tool (gpufleet's default)")
    ap.add_argument("--scale-forks", type=int, default=0, metavar="F",
                    help="also run gpufleet and parallel-ssh at N=1 and the largest N with this "
                    "parallelism (first RTT, same run): how the wall scales when N <= F")
    ap.add_argument("--scale-runs", type=int, default=2, help="runs of each --scale-forks cell")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per host")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--fail-n", type=int, default=32,
                    help="hosts in the dead/blackholed runs (k dead + k blackholed among them)")
    ap.add_argument("--fail-k", type=ints, default=[0, 1, 4, 8], help="k dead and k blackholed")
    ap.add_argument("--fail-over", type=int, default=8,
                    help="also: N healthy + this many dead + blackholed (more hosts than --forks)")
    ap.add_argument("--pssh-timeout", type=float, default=30.0,
                    help="parallel-ssh's timeout (it bounds every libssh2 call, not only connect)")
    ap.add_argument("--fail-timeout", type=float, default=3.0, help="connect_timeout there")
    ap.add_argument("--clean-ns", type=ints, default=[1, 32])
    ap.add_argument("--clean-runs", type=int, default=3)
    ap.add_argument("--clean-rtts", type=floats, default=None,
                    help="round-trip times of the clean runs, ms (default: the first of --rtts; "
                    "0: loopback speed through the same link)")
    ap.add_argument("--release-delay", type=float, default=2.0,
                    help="simulated driver release delay (s) in the clean runs")
    ap.add_argument("--real-host", default=None, metavar="ADDR:PORT:KEY:KNOWN_HOSTS",
                    help="also run every tool on this real host (N=1, its own sshd, e.g. "
                    "tests/gpu/ossh.sh's), next to a lab host on loopback")
    ap.add_argument("--real-host-cgroup", type=Path, default=None, metavar="DIR",
                    help="the cgroup directory the real host's sshd runs in: its host-side CPU")
    ap.add_argument("--real-runs", type=int, default=3, help="runs per tool on the real host")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="skip what is left (listed in the report) once the run is this old; 0: none")
    ap.add_argument("--machine-label", default="", help="names the machine in the report's title")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS-run.md")
    ap.add_argument("--plot", type=Path, default=HERE / "wall_vs_n.png")
    ap.add_argument("--raw", type=Path, default=HERE / "results.json")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ap.add_argument("--from-json", type=Path, default=None, metavar="RESULTS_JSON",
                    help="only rewrite the report and plot from a results.json (no runs)")
    a = ap.parse_args(argv)
    if a.quick:
        a.ns, a.rtts, a.ns_far, a.runs, a.pipelining_ns = [1, 8], [20.0], [], 2, []
        a.fail_n, a.fail_k, a.fail_over, a.clean_ns, a.clean_runs = 4, [0, 1], 0, [1], 1
    a.tools = [t for t in a.tools.split(",") if t]
    a.real = None
    if a.real_host and not a.from_json:
        try:
            a.real = B.RealHost.parse(a.real_host)
        except ValueError as exc:
            ap.error(str(exc))
    if a.real_host_cgroup and not (a.real_host_cgroup / "cgroup.procs").exists():
        ap.error("--real-host-cgroup: %s is not a cgroup directory" % a.real_host_cgroup)
    return a


# ------------------------------------------------------------------------------- tools


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.a = args
        self.work = work
        tag = os.getpid()
        self.cg_tool = B.Cgroup("gfbench%d-tool" % tag)
        self.cg_hosts = B.Cgroup("gfbench%d-hosts" % tag)
        self.cg_wire = B.Cgroup("gfbench%d-wire" % tag)
        rtt0 = args.rtts[0]
        self.net: Optional[B.Net] = None
        self.lab: Optional[B.BenchLab] = None
        self.rtt = rtt0
        try:
            self.net = B.Net(rtt0 / 2.0, cgroup=self.cg_wire)
            self.lab = B.BenchLab(work, self.net)
        except BaseException:
            self.close()
            raise
        self.runs: list[dict] = []
        self.sessions: dict[str, dict] = {}  # tool -> {"N": (conns/host, execs/host)}
        self.fail_rows: list[dict] = []
        self.clean_rows: list[dict] = []
        self.real_rows: list[dict] = []  # --real-host: the real host and a loopback lab host, N=1
        self.scale_rows: list[dict] = []  # --scale-forks: runs at that parallelism
        self.forks = 0  # when set: the parallelism of the next runs instead of --forks
        self.skipped: list[str] = []  # what --deadline-s left out
        self.measured_rtt: dict[float, float] = {}
        self.seq = 0
        self.log = open(work / "bench.log", "a")

    def say(self, text: str) -> None:
        line = "[%6.1fs] %s" % (time.monotonic() - T0, text)
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def close(self) -> None:
        closers = [x.close for x in (self.lab, self.net) if x is not None]
        for closer in closers + [self.cg_tool.remove, self.cg_hosts.remove, self.cg_wire.remove]:
            try:
                closer()
            except Exception as exc:  # keep cleaning up the rest
                print("cleanup: %s" % exc, file=sys.stderr)

    def late(self, what: str) -> bool:
        """True (and noted) when --deadline-s has passed: ``what`` is skipped."""
        if self.a.deadline_s and time.monotonic() - T0 > self.a.deadline_s:
            self.skipped.append(what)
            self.say("deadline %gs passed: skipping %s" % (self.a.deadline_s, what))
            return True
        return False

    def start_hosts(self, n: int) -> None:
        t = time.monotonic()
        self.cg_hosts.enter_self()  # every host process (sshd, agent, nvidia-smi) is counted there
        try:
            self.lab.start_hosts(n, gpus=self.a.gpus)
        finally:
            B.Cgroup.leave_self()
        self.say("%d hosts up (%.1fs)" % (len(self.lab.hosts), time.monotonic() - t))

    def set_rtt(self, rtt: float) -> None:
        self.net.set_rtt(rtt)
        self.rtt = rtt
        self.measured_rtt[rtt] = B.measured_rtt_ms(self.lab.hosts[0].port)
        self.say("RTT %g ms (TCP connect: %.1f ms)" % (rtt, self.measured_rtt[rtt]))

    # one tool, one run ------------------------------------------------------------------------

    def argv_env(self, tool: str, hosts: list, real: Optional[B.RealHost] = None
                 ) -> tuple[list[str], dict]:
        """The command line of one run; ``real``: the hosts are that real host (its key)."""
        key = real.key if real else self.lab.lab.client_key
        known = real.known_hosts if real else self.lab.lab.known_hosts_path
        n = len(hosts)
        forks = str(max(1, min(self.forks or self.a.forks, n)))
        self.seq += 1
        d = self.work / ("run%04d" % self.seq)
        d.mkdir()
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        ct = "%g" % self.a.connect_timeout
        if tool == "gpufleet":
            inv = self.lab.gpufleet_inventory(hosts, d / "fleet.yaml", self.a.connect_timeout,
                                              key=key, known_hosts=known)
            return [B.tool_path("gpufleet"), "-i", str(inv), "--forks", forks, "status", "--all",
                    "--json"], env
        if tool == "pssh":
            hj = self.lab.hosts_json(hosts, d / "hosts.json", key, known)
            return [sys.executable, str(HERE / "pssh_status.py"), str(hj), forks,
                    "%g" % self.a.pssh_timeout], env
        if tool in ("ansible", "ansible_pl"):
            inv = self.lab.ansible_inventory(hosts, d / "hosts.ini", key, known)
            if tool == "ansible_pl":
                env["ANSIBLE_PIPELINING"] = "True"
            env.update(ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_SSH_CONTROL_PATH_DIR=str(d / "cp"),
                       ANSIBLE_LOCAL_TEMP=str(d / "tmp"), ANSIBLE_HOME=str(d / "home"),
                       ANSIBLE_NOCOLOR="1", ANSIBLE_TIMEOUT=str(int(self.a.connect_timeout)),
                       ANSIBLE_DEPRECATION_WARNINGS="False")
            return [B.tool_path("ansible"), "all", "-i", str(inv), "-m", "shell", "-a",
                    remote_work.SCRIPT, "-f", forks], env
        if tool == "ssh":
            tsv = d / "hosts.tsv"
            tsv.write_text("".join("%s %s %d\n" % (h.name, h.address, h.port) for h in hosts))
            script = d / "script.sh"
            script.write_text(remote_work.SCRIPT)
            return [str(HERE / "ssh_loop.sh"), str(tsv), str(key), str(known), ct, str(script)], env
        raise ValueError(tool)

    def check(self, tool: str, m: B.Measured, n: int) -> tuple[bool, str]:
        out = m.stdout.decode(errors="replace")
        if m.rc != 0 and tool == "gpufleet" and out.lstrip().startswith("{"):
            try:  # the hosts' own errors, not the JSON's last line
                errs = [str(h.get("error")) for h in json.loads(out)["hosts"] if not h.get("ok")]
                return False, "exit %d: %s" % (m.rc, "; ".join(errs)[:200])
            except (ValueError, KeyError, TypeError):
                pass
        if m.rc != 0:
            text = (out.strip() or m.stderr.decode(errors="replace").strip()).splitlines()
            return False, "exit %d: %s" % (m.rc, (text[-1] if text else "")[:200])
        if tool == "gpufleet":
            doc = json.loads(out)
            ok = sum(1 for h in doc["hosts"] if h["ok"] and h["gpus"])
            # a lab host reads its fake GPUs: on a machine with a real driver, the real one
            # showing through (one real GPU instead of --gpus fakes) would make the run invalid
            wrong = [h["host"] for h in doc["hosts"] if h["ok"] and len(h["gpus"]) != self.a.gpus
                     and not h["host"].startswith(B.REAL_NAME_PREFIX)]
            if wrong:
                return False, "%d hosts do not show their %d fake GPUs (%s...)" % (
                    len(wrong), self.a.gpus, wrong[0])
            return ok == n, "%d/%d hosts ok" % (ok, n)
        if tool == "pssh":
            doc = json.loads(out.strip().splitlines()[-1])
            return doc["ok"] == n, "%d/%d hosts ok" % (doc["ok"], n)
        if tool in ("ansible", "ansible_pl"):
            ok = out.count("| CHANGED | rc=0 >>")
            return ok == n, "%d/%d hosts ok" % (ok, n)
        ok = out.count("@@procs")
        return ok == n, "%d/%d hosts ok" % (ok, n)

    def run_tool(self, tool: str, n: int, count_sessions: bool, warm: bool = False) -> dict:
        """One timed run; ``warm``: right after an untimed run of the same command line and
        environment (the same inventory, the same ControlPath directory), whose masters are
        left running for it; what both left is ended after the timed one (every run of the
        tool ends with nothing of it left: the next cold run is cold)."""
        hosts = self.lab.hosts[:n]
        argv, env = self.argv_env(tool, hosts)
        if warm:
            first = B.measure(argv, self.cg_tool, self.cg_hosts, self.cg_wire, env=env,
                              timeout=900, keep=True)
            if first.rc != 0:
                self.say("%s N=%d warm-up run: exit %d" % (tool, n, first.rc))
        marks = self.lab.log_marks(hosts) if count_sessions else None
        m = B.measure(argv, self.cg_tool, self.cg_hosts, self.cg_wire, env=env, timeout=900)
        ok, note = self.check(tool, m, n)
        row = dict(tool=tool, n=n, rtt_ms=self.rtt, wall_s=round(m.wall_s, 4),
                   cpu_s=_r(m.cpu_s), remote_cpu_s=_r(m.remote_cpu_s), wire_cpu_s=_r(m.wire_cpu_s),
                   ok=ok, note=note)
        if warm:
            row["mode"] = "warm"
        if marks is not None:
            per = self.lab.sessions_since(hosts, marks)
            conns = sorted(c for c, _ in per.values())
            execs = sorted(e for _, e in per.values())
            row["conns_per_host"] = [conns[0], conns[-1]]
            row["execs_per_host"] = [execs[0], execs[-1]]
            self.sessions.setdefault(tool + (" warm" if warm else ""), {})[n] = row
        self.runs.append(row)
        self.say("%-8s N=%-3d RTT=%-3g %s wall %6.2fs cpu %5.2fs remote %5.2fs %s%s" % (
            tool, n, self.rtt, "warm" if warm else "cold", m.wall_s, m.cpu_s or -1,
            m.remote_cpu_s or -1, "ok" if ok else "FAILED ", "" if ok else note))
        return row

    def real_host(self) -> None:
        """Every tool, N=1, on the real host and on a lab host, both on loopback (no delay line):
        the lab's cost model (wall, controller CPU, host-side CPU) against the real one."""
        real = self.a.real
        assert real is not None
        real_cg = B.Cgroup("real", path=self.a.real_host_cgroup) if self.a.real_host_cgroup else None
        self.cg_hosts.enter_self()
        try:
            local = self.lab.lab.add_host(
                "local000", gpus=self.a.gpus, gpu_name="NVIDIA H200", total_mib=143771,
                reserved_mib=616, sshd_extra="LogLevel VERBOSE")
            local.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
        finally:
            B.Cgroup.leave_self()
        tools = list(self.a.tools) + (["ansible_pl"] if "ansible" in self.a.tools else [])
        for r in range(self.a.real_runs):
            order = tools[r % len(tools):] + tools[:r % len(tools)]
            for tool in order:
                for where, host, cg in (("lab", local, self.cg_hosts), ("real", real, real_cg)):
                    if self.late("real-host %s %s run %d" % (tool, where, r)):
                        return
                    argv, env = self.argv_env(tool, [host], real if where == "real" else None)
                    m = B.measure(argv, self.cg_tool, cg, None, env=env, timeout=120)
                    ok, note = self.check(tool, m, 1)
                    self.real_rows.append(dict(tool=tool, where=where, run=r, wall_s=round(m.wall_s, 4),
                                               cpu_s=_r(m.cpu_s), remote_cpu_s=_r(m.remote_cpu_s),
                                               ok=ok, note=note))
                    self.say("real-host %-10s %-4s wall %6.2fs cpu %5.3fs host %5.3fs %s" % (
                        tool, where, m.wall_s, m.cpu_s or -1, m.remote_cpu_s or -1,
                        "ok" if ok else "FAILED " + note))
                    time.sleep(0.2)
        self.lab.lab.remove_host(local)

    def scale(self) -> None:
        """gpufleet and parallel-ssh at N=1 and the largest N with --scale-forks F, alternated
        with the same tools at --forks: wall(N)/wall(1) when every host runs at once."""
        self.set_rtt(self.a.rtts[0])
        top = max(self.a.ns)
        tools = [t for t in ("gpufleet", "pssh") if t in self.a.tools]
        for tool in tools:  # a warm-up run each (not kept): the first after a pause is slower
            self.runs.remove(self.run_tool(tool, 1, False))
        for r in range(self.a.scale_runs):
            for n in (1, top):
                for forks in (self.a.scale_forks, self.a.forks):
                    for tool in tools:
                        if self.late("scale %s N=%d forks %d run %d" % (tool, n, forks, r)):
                            return
                        self.forks = forks
                        try:
                            row = self.run_tool(tool, n, False)
                        finally:
                            self.forks = 0
                        self.runs.remove(row)  # not a sweep cell: its own table
                        self.scale_rows.append(dict(row, forks=forks, run=r))

    # the sweep --------------------------------------------------------------------------------

    def sweep(self) -> None:
        for i, rtt in enumerate(self.a.rtts):
            self.set_rtt(rtt)
            ns = self.a.ns if i == 0 else self.a.ns_far
            for n in ns:
                cap = self.a.seq_max_n if i > 0 else getattr(self.a, "seq_max_n_first", 128)
                tools = [t for t in self.a.tools if not (t == "ssh" and n > cap)]
                if i == 0 and n in self.a.pipelining_ns and "ansible" in tools:
                    tools.append("ansible_pl")
                slow: dict[str, float] = {}
                for r in range(self.a.runs):
                    order = tools[r % len(tools):] + tools[:r % len(tools)]  # alternate
                    for tool in order:
                        if r >= self.a.slow_runs and slow.get(tool, 0) > self.a.slow_s:
                            continue
                        if self.late("status %s N=%d RTT=%g run %d" % (tool, n, rtt, r)):
                            continue
                        row = self.run_tool(tool, n, count_sessions=(r == 0))
                        slow[tool] = max(slow.get(tool, 0), row["wall_s"])
                        time.sleep(0.3)
                        if self.a.warm and tool in KEEPS and not self.late(
                                "warm status %s N=%d RTT=%g run %d" % (tool, n, rtt, r)):
                            self.run_tool(tool, n, count_sessions=(r == 0), warm=True)
                            time.sleep(0.3)

    def failures(self) -> None:
        """k dead (refused) + k blackholed (dropped) among N hosts: how long status takes."""
        self.set_rtt(self.a.rtts[0])
        n = self.a.fail_n
        cases = [(n - 2 * k, k) for k in self.a.fail_k if n - 2 * k >= 1]
        if self.a.fail_over:
            cases.append((n, self.a.fail_over))  # N > forks: failing hosts wait for a free slot
        for healthy, k in cases:
            if self.late("failures healthy=%d k=%d" % (healthy, k)):
                continue
            good = self.lab.hosts[:healthy]
            dead, holes = self.lab.dead(k), self.lab.blackholed(k)
            bad = [x for pair in zip(dead, holes) for x in pair]
            mixed = _interleave(good, bad)
            t = self.a.fail_timeout
            walls = []
            for r in range(2):
                self.seq += 1
                inv = self.lab.gpufleet_inventory(mixed, self.work / ("fail%04d.yaml" % self.seq), t)
                argv = [B.tool_path("gpufleet"), "-i", str(inv), "--forks", str(self.a.forks),
                        "status", "--all", "--json"]
                m = B.measure(argv, self.cg_tool, self.cg_hosts, self.cg_wire)
                doc = json.loads(m.stdout.decode())
                hosts = {h["host"]: h for h in doc["hosts"]}
                good_ok = sum(1 for g in good if hosts[g.name]["ok"])
                bad_s = [hosts[b.name]["seconds"] for b in bad]
                errors = sorted({(hosts[b.name]["error"] or "")[:60] for b in bad})
                walls.append(m.wall_s)
                self.say("fail N=%d k=%d run %d: wall %.2fs (connect_timeout %gs) healthy ok %d/%d %s" % (
                    len(mixed), k, r, m.wall_s, t, good_ok, len(good), errors[:2]))
            self.fail_rows.append(dict(n=len(mixed), healthy=len(good), k=k, connect_timeout_s=t,
                                       forks=self.a.forks, walls=[round(w, 3) for w in walls],
                                       good_ok=good_ok, rc=m.rc, errors=errors,
                                       failing_host_seconds=[round(min(bad_s), 3), round(max(bad_s), 3)]
                                       if bad_s else None))

    def clean(self) -> None:
        """Time from `gpufleet clean` start to verified free, minus the simulated release delay."""
        for rtt in self.a.clean_rtts if self.a.clean_rtts is not None else self.a.rtts[:1]:
            self.set_rtt(rtt)
            self.clean_at(rtt)

    def clean_at(self, rtt: float) -> None:
        delay = self.a.release_delay
        for n in self.a.clean_ns:
            if self.late("clean N=%d RTT=%g" % (n, rtt)):
                continue
            hosts = self.lab.hosts[:n]
            for h in hosts:
                h.set_config(release_delay_s=delay)
            for r in range(self.a.clean_runs):
                for h in hosts:  # the start-up holder is gone after the first clean
                    if not h.records():
                        self.cg_hosts.enter_self()
                        try:
                            h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
                        finally:
                            B.Cgroup.leave_self()
                self.seq += 1
                inv = self.lab.gpufleet_inventory(hosts, self.work / ("clean%04d.yaml" % self.seq),
                                                  self.a.connect_timeout)
                argv = [B.tool_path("gpufleet"), "-i", str(inv), "--forks", str(self.a.forks), "clean",
                        "--all", "--gpus", "all", "--yes", "--json", "--grace", "5", "--timeout", "30"]
                marks = self.lab.log_marks(hosts)
                m = B.measure(argv, self.cg_tool, self.cg_hosts, self.cg_wire)
                per = self.lab.sessions_since(hosts, marks)
                try:
                    doc = json.loads(m.stdout.decode())
                except ValueError:
                    doc = {"hosts": []}
                clean = sum(1 for h in doc["hosts"] if h.get("verdict") == "clean")
                # valid only if every host signalled its holder (then waited for the fake's delay)
                signalled = sum(1 for h in doc["hosts"]
                                if any(s.get("outcome") == "sent" for s in h.get("signals") or ()))
                waits = [h["memory_wait"]["seconds"] for h in doc["hosts"] if h.get("memory_wait")]
                row = dict(n=n, run=r, rtt_ms=rtt, wall_s=round(m.wall_s, 3), latency_s=round(m.wall_s - delay, 3),
                           release_delay_s=delay, clean=clean, signalled=signalled, rc=m.rc,
                           cpu_s=_r(m.cpu_s),
                           memory_wait_s=[round(min(waits), 3), round(max(waits), 3)] if waits else None,
                           conns_per_host=[min(c for c, _ in per.values()), max(c for c, _ in per.values())],
                           execs_per_host=[min(e for _, e in per.values()), max(e for _, e in per.values())])
                self.clean_rows.append(row)
                self.say("clean RTT=%g N=%d run %d: wall %.2fs latency %.2fs clean %d/%d execs/host %s conns/host %s" % (
                    rtt, n, r, m.wall_s, m.wall_s - delay, clean, n, row["execs_per_host"], row["conns_per_host"]))
                time.sleep(0.3)


def _interleave(good: list, bad: list) -> list:
    """Failing hosts spread evenly through the inventory order (not all first or last)."""
    if not bad:
        return list(good)
    out: list = []
    step = len(good) / (len(bad) + 1)
    gi = 0
    for j, b in enumerate(bad, 1):
        upto = int(round(step * j))
        out += good[gi:upto]
        gi = upto
        out.append(b)
    return out + good[gi:]


def _r(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)


# ------------------------------------------------------------------------------- report


def machine() -> dict:
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) // 1024
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mib": mem, "kernel": platform.release(),
            "python": platform.python_version()}


def versions() -> dict:
    from importlib import metadata
    out = {}
    for pkg in ("gpufleet", "paramiko", "fabric", "parallel-ssh", "ssh2-python", "ansible-core"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    out["OpenSSH"] = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    try:
        rev = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "gpufleet"],
                               capture_output=True, text=True).stdout.strip()
        out["git"] = rev + (" (gpufleet/ has uncommitted changes)" if dirty else "")
    except OSError:
        pass
    out["gpufleet tree"] = tree_hash()
    return out


def tree_hash(root: Path = HERE.parent / "gpufleet") -> str:
    """BLAKE2b of gpufleet/'s .py files (path and content): names the code a report measured
    where ``git`` cannot (the GPU machine's copy of the tree carries a stale .git). The same
    on any machine: ``python3 -c 'import sys; sys.path.insert(0, "bench"); import run;
    print(run.tree_hash())'``."""
    import hashlib
    h = hashlib.blake2b(digest_size=8)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def summarize(runs: list[dict]) -> dict:
    """(rtt, n, tool) -> {wall: [med, min, max], cpu, remote, k}"""
    cells: dict = {}
    for r in runs:
        if not r["ok"]:
            continue
        tool = r["tool"] + (" warm" if r.get("mode") == "warm" else "")
        cells.setdefault((r["rtt_ms"], r["n"], tool), []).append(r)
    out = {}
    for key, rows in cells.items():
        def stat(field: str, rows: list = rows) -> Optional[list]:
            vals = [x[field] for x in rows if x.get(field) is not None]
            if not vals:
                return None
            return [statistics.median(vals), min(vals), max(vals)]
        out[key] = {"wall": stat("wall_s"), "cpu": stat("cpu_s"), "remote": stat("remote_cpu_s"),
                    "wire": stat("wire_cpu_s"), "k": len(rows)}
    return out


def fmt_stat(s: Optional[list], digits: int = 2) -> str:
    if not s:
        return "-"
    med, lo, hi = s
    return "%.*f (%.*f–%.*f)" % (digits, med, digits, lo, digits, hi) if hi - lo > 0 else "%.*f" % (digits, med)


def write_report(bench: Any, args: argparse.Namespace, command: str, started: str, seconds: float,
                 mach: Optional[dict] = None, ver: Optional[dict] = None) -> str:
    summ = summarize(bench.runs)
    mach = mach or machine()
    ver = ver or versions()
    tools = [t for t in TOOLS if t in args.tools]
    L: list[str] = []
    label = getattr(args, "machine_label", "")
    L.append("# gpufleet benchmark results" + (" — %s" % label if label else ""))
    L.append("")
    L.append("Generated by `%s` on %s (took %.0f s). How and why: [README.md](README.md)." % (command, started, seconds))
    L.append("")
    L.append("- Machine: %s, %d cores, %d MiB RAM, Linux %s, Python %s" % (
        mach["cpu"], mach["cores"], mach["mem_mib"], mach["kernel"], mach["python"]))
    L.append("- Versions: " + ", ".join("%s %s" % kv for kv in ver.items()))
    L.append("- Hosts: test-lab hosts (real OpenSSH sshd each, %d fake H200 GPUs, one holder) in one "
             "network namespace behind a userspace delay line (this kernel has no netem); measured "
             "TCP connect RTT: %s." % (args.gpus, ", ".join("%g ms -> %.1f ms" % kv for kv in bench.measured_rtt.items())))
    L.append("- Every tool at parallelism min(N, %d); %d runs per cell, tools alternating (the order "
             "rotates each round); a tool whose first run took > %g s ran %d time(s) in that cell (marked *). "
             "Values: median (min–max)." % (args.forks, args.runs, args.slow_s, args.slow_runs))
    L.append("- CPU: controller = the tool's process tree (a cgroup: v1 cpuacct.usage or v2 cpu.stat usage_usec); hosts = all lab hosts "
             "(sshd, shell/agent, fake nvidia-smi), which share this machine's %d cores; CPU floor = "
             "(controller + hosts CPU) / cores: no tool can finish faster on this machine." % mach["cores"])
    L.append("")
    L.append("## status: wall time and controller CPU")
    L.append("")
    head = "| RTT | N | " + " | ".join("%s wall s" % LABEL[t] for t in tools) + \
        " | gpufleet / pssh | ansible / gpufleet | " + " | ".join("%s CPU s" % t for t in tools) + \
        " | hosts CPU s (gpufleet run) | gpufleet CPU floor s |"
    L.append(head)
    L.append("|" + "---|" * (head.count("|") - 1))
    keys = sorted({(k[0], k[1]) for k in summ})
    for rtt, n in keys:
        cells = {t: summ.get((rtt, n, t)) for t in tools}
        star = "*" if any(c and c["k"] < args.runs for c in cells.values()) else ""
        row = ["%g ms" % rtt, "%d%s" % (n, star)]
        row += [fmt_stat(c["wall"]) if c else "-" for c in cells.values()]
        g, p, a = cells.get("gpufleet"), cells.get("pssh"), cells.get("ansible")
        row.append("%.2f" % (g["wall"][0] / p["wall"][0]) if g and p else "-")
        row.append("%.1f" % (a["wall"][0] / g["wall"][0]) if g and a else "-")
        row += [("%.2f" % c["cpu"][0]) if c and c["cpu"] else "-" for c in cells.values()]
        row.append(("%.2f" % g["remote"][0]) if g and g["remote"] else "-")
        row.append(("%.2f" % ((g["cpu"][0] + g["remote"][0]) / (os.cpu_count() or 1)))
                   if g and g["remote"] and g["cpu"] else "-")
        L.append("| " + " | ".join(row) + " |")
    failed = [r for r in bench.runs if not r["ok"]]
    if failed:
        L.append("")
        L.append("Failed runs (left out above): " + "; ".join(
            "%s N=%d RTT=%g: %s" % (r["tool"], r["n"], r["rtt_ms"], r["note"]) for r in failed[:8]))
    L += warm_table(summ, tools)
    L += cpu_per_host_table(summ, tools)
    L += real_host_table(getattr(bench, "real_rows", []), tools)
    pl = sorted(k for k in summ if k[2] == "ansible_pl")
    if pl:
        L.append("")
        L.append("Ansible with `ANSIBLE_PIPELINING=True` (fewer execs per host; not the default):")
        L.append("")
        L.append("| RTT | N | ansible default wall s | ansible pipelining wall s | pipelining / gpufleet | CPU s |")
        L.append("|---|---|---|---|---|---|")
        for rtt, n, _ in pl:
            a, b, g = summ.get((rtt, n, "ansible")), summ[(rtt, n, "ansible_pl")], summ.get((rtt, n, "gpufleet"))
            L.append("| %g ms | %d | %s | %s | %s | %s |" % (
                rtt, n, fmt_stat(a["wall"]) if a else "-", fmt_stat(b["wall"]),
                "%.1f" % (b["wall"][0] / g["wall"][0]) if g else "-", "%.2f" % b["cpu"][0] if b["cpu"] else "-"))
    L.append("")
    L.append("## SSH connections and execs per host (sshd VERBOSE logs, first run of each cell)")
    L.append("")
    L.append("| tool | connections/host | execs/host |")
    L.append("|---|---|---|")
    names = tools + (["ansible_pl"] if "ansible_pl" in bench.sessions else [])
    for t in names + [t + " warm" for t in names if t + " warm" in bench.sessions]:
        rows = bench.sessions.get(t, {})
        if rows:
            c = {tuple(r["conns_per_host"]) for r in rows.values()}
            e = {tuple(r["execs_per_host"]) for r in rows.values()}
            name = LABEL[t[:-5]] + ", warm (through the kept masters)" if t.endswith(" warm") \
                else LABEL[t]
            L.append("| %s | %s | %s |" % (name, _rng(c), _rng(e)))
    if bench.fail_rows:
        L.append("")
        L.append("## status with k dead (refused) and k blackholed (dropped) hosts")
        L.append("")
        L.append("| N (forks %d) | healthy | k dead + k blackholed | connect_timeout s | wall s (2 runs) | "
                 "failing hosts' own s | healthy ok | wall ≤ timeout + 2 s |" % args.forks)
        L.append("|---|---|---|---|---|---|---|---|")
        for f in bench.fail_rows:
            bound = f["connect_timeout_s"] + 2
            fs = f["failing_host_seconds"]
            L.append("| %d | %d | %d + %d | %g | %s | %s | %d/%d | %s |" % (
                f["n"], f["healthy"], f["k"], f["k"], f["connect_timeout_s"],
                ", ".join("%.2f" % w for w in f["walls"]), ("%.2f–%.2f" % tuple(fs)) if fs else "-",
                f["good_ok"], f["healthy"], "yes" if max(f["walls"]) <= bound else "**no**"))
    if bench.clean_rows:
        L.append("")
        L.append("## clean: start to verified free, minus the simulated release delay")
        L.append("")
        L.append("| RTT | N | release delay s | wall s | latency s (wall − delay) | agent memory wait s | clean | hosts that signalled | execs/host | connections/host |")
        L.append("|---|---|---|---|---|---|---|---|---|---|")
        for rtt, n in sorted({(r.get("rtt_ms", args.rtts[0]), r["n"]) for r in bench.clean_rows}):
            rows = [r for r in bench.clean_rows if r["n"] == n and r.get("rtt_ms", args.rtts[0]) == rtt]
            walls = [r["wall_s"] for r in rows]
            lat = [r["latency_s"] for r in rows]
            mw = [x for r in rows if r["memory_wait_s"] for x in r["memory_wait_s"]]
            L.append("| %g ms | %d | %g | %s | %s | %s | %s | %s | %s | %s |" % (
                rtt, n, rows[0]["release_delay_s"], fmt_stat(_st(walls)), fmt_stat(_st(lat)),
                ("%.2f–%.2f" % (min(mw), max(mw))) if mw else "-",
                ", ".join("%d/%d" % (r["clean"], n) for r in rows),
                ", ".join("%s/%d" % (r.get("signalled", "?"), n) for r in rows),
                _rng({tuple(r["execs_per_host"]) for r in rows}),
                _rng({tuple(r["conns_per_host"]) for r in rows})))
    L += scale_table(getattr(bench, "scale_rows", []))
    L.append("")
    L.append("## Targets")
    L.append("")
    L += targets(bench, summ, args)
    skipped = getattr(bench, "skipped", [])
    if skipped:
        L.append("")
        L.append("Skipped by `--deadline-s %g` (%d runs/cases): %s" % (
            args.deadline_s, len(skipped), "; ".join(skipped[:12]) + (" ..." if len(skipped) > 12 else "")))
    L.append("")
    raw_name, plot_name = Path(str(args.raw)).name, Path(str(args.plot)).name
    L.append("Raw data: [%s](%s); plot: [%s](%s)." % (raw_name, raw_name, plot_name, plot_name))
    return "\n".join(L) + "\n"


def warm_table(summ: dict, tools: list) -> list[str]:
    """--warm: each tool cold (a fresh connection per host) next to warm (its timed run right
    after an untimed one, through the masters that one kept: gpufleet's ssh_persist, Ansible's
    ControlPersist=60s, both their defaults). parallel-ssh and the ssh loop keep nothing."""
    keys = sorted({(k[0], k[1]) for k in summ if k[2].endswith(" warm")})
    if not keys:
        return []
    keeping = [t for t in tools if t in KEEPS]
    others = [t for t in tools if t not in KEEPS]
    L = ["", "## status: cold and warm (`--warm`)", "",
         "Cold: every host connected afresh (whatever a run kept is ended after it). Warm: the "
         "timed run follows an untimed run of the same command within its keep window, so it "
         "goes through the masters that one kept: gpufleet's `ssh_persist` (60 s) and "
         "Ansible's `ControlPersist=60s` (both defaults). " + " and ".join(LABEL[t] for t in others)
         + " keep no connection: " + ("its" if len(others) == 1 else "their")
         + " warm run is " + ("its" if len(others) == 1 else "their") + " cold one (shown cold). "
         "Wall s, median (min–max); controller CPU s.", ""]
    head = "| RTT | N | " + " | ".join("%s cold | %s warm | warm/cold" % (LABEL[t], LABEL[t])
                                       for t in keeping)
    head += "".join(" | %s (no keep: cold)" % LABEL[t] for t in others)
    if "gpufleet" in keeping and "ansible" in keeping:
        head += " | ansible / gpufleet, warm"
    head += "".join(" | %s CPU cold / warm" % t for t in keeping) + " |"
    L.append(head)
    L.append("|" + "---|" * (head.count("|") - 1))
    for rtt, n in keys:
        row = ["%g ms" % rtt, str(n)]
        for t in keeping:
            c, w = summ.get((rtt, n, t)), summ.get((rtt, n, t + " warm"))
            row += [fmt_stat(c["wall"]) if c else "-", fmt_stat(w["wall"]) if w else "-",
                    "%.2f" % (w["wall"][0] / c["wall"][0]) if c and w else "-"]
        for t in others:
            c = summ.get((rtt, n, t))
            row.append(fmt_stat(c["wall"]) if c else "-")
        if "gpufleet" in keeping and "ansible" in keeping:
            g, a = summ.get((rtt, n, "gpufleet warm")), summ.get((rtt, n, "ansible warm"))
            row.append("%.1f" % (a["wall"][0] / g["wall"][0]) if g and a else "-")
        for t in keeping:
            c, w = summ.get((rtt, n, t)), summ.get((rtt, n, t + " warm"))
            row.append("%s / %s" % ("%.2f" % c["cpu"][0] if c and c["cpu"] else "-",
                                    "%.2f" % w["cpu"][0] if w and w["cpu"] else "-"))
        L.append("| " + " | ".join(row) + " |")
    return L


def _ms_per_host(stat: Optional[list], n: int) -> str:
    return "%.1f" % (stat[0] * 1000.0 / n) if stat else "-"


def cpu_per_host_table(summ: dict, tools: list) -> list[str]:
    """Controller CPU and host-side CPU per host, per tool: the figures that do not depend on
    how many cores the machine has (the walls do, when the hosts share them)."""
    keys = sorted({(k[0], k[1]) for k in summ})
    if not keys:
        return []
    names = tools + (["ansible_pl"] if any(k[2] == "ansible_pl" for k in summ) else [])
    L = ["", "## status: CPU per host, ms (machine-independent)", "",
         "Controller = the tool's process tree / N; hosts = every lab host's CPU during the run "
         "(sshd, the shell or agent, the fake nvidia-smi) / N. Medians over the cell's runs.", ""]
    head = "| RTT | N | " + " | ".join("%s controller" % LABEL[t] for t in names) + " | " + \
        " | ".join("%s hosts" % LABEL[t] for t in names) + " |"
    L.append(head)
    L.append("|" + "---|" * (head.count("|") - 1))
    for rtt, n in keys:
        cells = [summ.get((rtt, n, t)) for t in names]
        row = ["%g ms" % rtt, str(n)]
        row += [_ms_per_host(c["cpu"], n) if c else "-" for c in cells]
        row += [_ms_per_host(c["remote"], n) if c else "-" for c in cells]
        L.append("| " + " | ".join(row) + " |")
    return L


def real_host_table(rows: list, tools: list) -> list[str]:
    """--real-host: each tool on the real machine and on a loopback lab host, N=1."""
    if not rows:
        return []
    names = [t for t in tools + ["ansible_pl"] if any(r["tool"] == t for r in rows)]
    L = ["", "## The real host next to a lab host (N=1, loopback, no delay line)", "",
         "The real host: this machine over its own sshd (tests/gpu/ossh.sh), the real driver "
         "(nvidia-smi, NVML); its host-side CPU is its sshd's cgroup (sessions included). The lab "
         "host: a test-lab host (fake nvidia-smi and NVML) on 127.0.0.1. Medians (min–max).", "",
         "| tool | lab wall s | real wall s | lab controller CPU ms | real controller CPU ms | "
         "lab host CPU ms | real host CPU ms | ok runs lab/real |",
         "|---|---|---|---|---|---|---|---|"]
    for t in names:
        cells = []
        for where in ("lab", "real"):
            ok = [r for r in rows if r["tool"] == t and r["where"] == where and r["ok"]]
            cells.append((ok, len([r for r in rows if r["tool"] == t and r["where"] == where])))

        def col(field: str, scale: float, i: int, digits: int, cells: list = cells) -> str:
            vals = [r[field] * scale for r in cells[i][0] if r.get(field) is not None]
            return fmt_stat(_st(vals), digits) if vals else "-"
        L.append("| %s | %s | %s | %s | %s | %s | %s | %d/%d, %d/%d |" % (
            LABEL[t], col("wall_s", 1, 0, 2), col("wall_s", 1, 1, 2), col("cpu_s", 1000, 0, 0),
            col("cpu_s", 1000, 1, 0), col("remote_cpu_s", 1000, 0, 0), col("remote_cpu_s", 1000, 1, 0),
            len(cells[0][0]), cells[0][1], len(cells[1][0]), cells[1][1]))
    failed = [r for r in rows if not r["ok"]]
    if failed:
        L.append("")
        L.append("Failed: " + "; ".join("%s %s: %s" % (r["tool"], r["where"], r["note"]) for r in failed[:6]))
    return L


def _st(vals: list) -> Optional[list]:
    return [statistics.median(vals), min(vals), max(vals)] if vals else None


def _rng(pairs: set) -> str:
    lo = min(p[0] for p in pairs)
    hi = max(p[1] for p in pairs)
    return str(lo) if lo == hi else "%d–%d" % (lo, hi)


def targets(bench: Bench, summ: dict, args: argparse.Namespace) -> list[str]:
    out = []

    def verdict(ok: Optional[bool]) -> str:
        return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")

    g32, p32, a32 = (summ.get((20.0, 32, t)) for t in ("gpufleet", "pssh", "ansible"))
    if g32 and p32:
        r = g32["wall"][0] / p32["wall"][0]
        out.append("- status N=32, 20 ms: gpufleet / parallel-ssh wall = %.2f (target ≤ 0.5: under half of parallel-ssh): %s" % (r, verdict(r <= 0.5)))
    if g32 and a32:
        r = a32["wall"][0] / g32["wall"][0]
        out.append("- status N=32, 20 ms: ansible / gpufleet wall = %.1f (target ≥ 5): %s" % (r, verdict(r >= 5)))
    for rtt in args.rtts:
        g1, g128 = summ.get((rtt, 1, "gpufleet")), summ.get((rtt, 128, "gpufleet"))
        if g1 and g128:
            r = g128["wall"][0] / g1["wall"][0]
            floor = None
            if g128["cpu"] and g128["remote"]:
                floor = (g128["cpu"][0] + g128["remote"][0]) / (os.cpu_count() or 1)
            extra = (" — CPU floor of this machine at N=128: (controller %.1f + hosts %.1f CPU s) / %d cores = %.1f s"
                     % (g128["cpu"][0], g128["remote"][0], os.cpu_count(), floor)) if floor else ""
            out.append("- status wall(N=128)/wall(N=1) at %g ms = %.1f (target ≤ 2): %s%s" % (
                rtt, r, verdict(r <= 2), extra))
            scaled = [x for x in getattr(bench, "scale_rows", []) if x["tool"] == "gpufleet" and x["ok"]
                      and x["forks"] != args.forks and rtt == args.rtts[0]]
            one = [x["wall_s"] for x in scaled if x["n"] == 1]
            big = [x["wall_s"] for x in scaled if x["n"] == 128]
            if one and big:
                r = statistics.median(big) / statistics.median(one)
                out.append("- the same with --forks %d (every host at once, same run): %.2f (target ≤ 2): %s"
                           % (scaled[0]["forks"], r, verdict(r <= 2)))
            if g128["cpu"]:
                ms = g128["cpu"][0] * 1000.0 / 128
                out.append("- status controller CPU per host at N=128, %g ms = %.1f ms (target ≤ 5): %s" % (
                    rtt, ms, verdict(ms <= 5)))
    st = bench.sessions.get("gpufleet", {})
    if st:
        mx = max(r["execs_per_host"][1] for r in st.values())
        mn = min(r["execs_per_host"][0] for r in st.values())
        out.append("- status SSH execs per host = %s (target 1): %s" % (mn if mn == mx else "%d–%d" % (mn, mx), verdict(mx == 1 and mn == 1)))
    for rtt in sorted({r.get("rtt_ms", args.rtts[0]) for r in bench.clean_rows}):
        at = [r for r in bench.clean_rows if r["n"] == 32 and r.get("rtt_ms", args.rtts[0]) == rtt]
        invalid = [r for r in at if r.get("signalled", 32) < 32]
        if at and invalid:
            out.append("- clean N=32, %g ms: **not valid**: in %d of %d runs not every host signalled "
                       "a holder (the fake driver's holders were not seen)" % (rtt, len(invalid), len(at)))
        elif at:
            med = statistics.median(r["latency_s"] for r in at)
            out.append("- clean N=32, %g ms RTT: latency beyond the release delay = %.2f s median "
                       "(target ≤ 0.3 s): %s" % (rtt, med, verdict(med <= 0.3)))
    if bench.clean_rows:
        mx = max(r["execs_per_host"][1] for r in bench.clean_rows)
        out.append("- clean SSH execs per host ≤ %d (target ≤ 2): %s" % (mx, verdict(mx <= 2)))
    within = [f for f in bench.fail_rows if f["k"] and f["n"] <= f["forks"]]
    over = [f for f in bench.fail_rows if f["k"] and f["n"] > f["forks"]]
    if within:
        worst = max(max(f["walls"]) - f["connect_timeout_s"] for f in within)
        out.append("- dead/blackholed hosts, N ≤ forks: worst wall − connect_timeout = %.2f s, whatever k "
                   "(target ≤ 2 s): %s" % (worst, verdict(worst <= 2)))
    if over:
        worst = max(max(f["walls"]) - f["connect_timeout_s"] for f in over)
        out.append("- dead/blackholed hosts, N > forks (%s): worst wall − connect_timeout = %.2f s "
                   "(target ≤ 2 s): %s%s" % (", ".join("N=%d" % f["n"] for f in over), worst,
                                             verdict(worst <= 2), "" if worst <= 2 else
                                             " — a failing host queued behind a full pool starts its "
                                             "connect timeout only when a slot frees"))
    return out


def plot(bench: Bench, args: argparse.Namespace, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = summarize(bench.runs)
    rtts = sorted({k[0] for k in summ})
    if not rtts:  # a partial run (e.g. failure cases only) has no sweep to plot
        print("plot: no status sweep in this run; %s left as it was" % path)
        return
    fig, axes = plt.subplots(1, len(rtts), figsize=(5.2 * len(rtts), 3.8), squeeze=False)
    for ax, rtt in zip(axes[0], rtts):
        for tool in TOOLS:
            pts = sorted((k[1], v["wall"]) for k, v in summ.items() if k[0] == rtt and k[2] == tool)
            if not pts:
                continue
            ns = [p[0] for p in pts]
            med = [p[1][0] for p in pts]
            err = [[p[1][0] - p[1][1] for p in pts], [p[1][2] - p[1][0] for p in pts]]
            ax.errorbar(ns, med, yerr=err, marker="o", capsize=3, label=LABEL[tool])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter
        ns_here = sorted({k[1] for k in summ if k[0] == rtt})
        ax.xaxis.set_major_locator(FixedLocator(ns_here))
        ax.yaxis.set_major_locator(FixedLocator([0.5, 1, 2, 5, 10, 20, 50, 100, 200]))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("hosts (N)")
        ax.set_ylabel("wall time, s (median, min–max)")
        ax.set_title("status-equivalent, RTT %g ms" % rtt)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("gpufleet vs parallel-ssh vs ansible vs ssh loop (test lab, %d cores)" % os.cpu_count(), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


T0 = time.monotonic()


class Recorded:
    """What write_report() and plot() need, read back from a results.json."""

    def __init__(self, raw: dict):
        self.runs = raw["runs"]
        self.fail_rows = raw["failures"]
        self.clean_rows = raw["clean"]
        self.scale_rows = raw.get("scale", [])
        self.real_rows = raw.get("real", [])
        self.skipped = raw.get("skipped", [])
        self.measured_rtt = {float(k): v for k, v in raw["measured_rtt_ms"].items()}
        self.sessions: dict = {}
        for r in self.runs:
            if "conns_per_host" in r:
                tool = r["tool"] + (" warm" if r.get("mode") == "warm" else "")
                self.sessions.setdefault(tool, {})[r["n"]] = r


def replot(args: argparse.Namespace) -> int:
    raw = json.loads(args.from_json.read_text())
    saved = argparse.Namespace(**raw["args"])
    saved.out, saved.plot = args.out, args.plot
    rec = Recorded(raw)
    args.out.write_text(write_report(rec, saved, raw["command"], raw["date"], raw["seconds"],
                                     raw.get("machine"), raw.get("versions")))
    try:
        plot(rec, saved, args.plot)
    except ImportError:
        print("bench: matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    print("rewrote %s, %s from %s" % (args.out, args.plot, args.from_json))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return replot(args)
    if os.geteuid() != 0:
        print("bench: needs root (network namespace, TUN, cgroups, the test lab)", file=sys.stderr)
        return 2
    command = "python3 bench/run.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    work = Path(tempfile.mkdtemp(prefix="gfbench-"))
    os.chmod(work, 0o755)
    # gpufleet keeps its connections (ssh_persist, default 60 s): their sockets in the work dir,
    # never the user's (every run's environment inherits this)
    (work / "xdg").mkdir(mode=0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(work / "xdg")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        bench = Bench(args, work)  # closes what it made if it fails half-way
    except BaseException:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
        raise
    done = False
    try:
        bench.say("work dir %s, netns %s" % (work, bench.net.netns))
        n_max = max(args.ns + args.ns_far + [args.fail_n] + args.clean_ns)
        bench.start_hosts(n_max)
        if args.real:
            bench.real_host()
        bench.sweep()
        if args.clean_ns:
            bench.clean()
        if args.scale_forks:
            bench.scale()
        if args.fail_k:
            bench.failures()
        done = True
    finally:
        bench.close()
        if not args.keep:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
        if not done:  # interrupted (SIGTERM, an error): keep what was measured
            bench.skipped.append("everything after the interruption")
        if bench.runs or bench.real_rows or bench.fail_rows or bench.clean_rows:
            write_outputs(bench, args, command, started)
    return 0


def scale_table(rows: list[dict]) -> list[str]:
    """--scale-forks: wall at N=1 and the largest N per parallelism, runs alternated."""
    if not rows:
        return []
    top = max(r["n"] for r in rows)
    L = ["", "## status: how the wall scales with every host at once (`--scale-forks`, same run)", "",
         "| tool | --forks | wall N=1 s | wall N=%d s | wall(%d)/wall(1) | controller CPU per host at N=%d, ms |" % (top, top, top),
         "|---|---|---|---|---|---|"]
    for tool in sorted({r["tool"] for r in rows}):
        for forks in sorted({r["forks"] for r in rows}, reverse=True):
            one = [r["wall_s"] for r in rows if r["tool"] == tool and r["forks"] == forks and r["n"] == 1 and r["ok"]]
            big = [r for r in rows if r["tool"] == tool and r["forks"] == forks and r["n"] == top and r["ok"]]
            if not one or not big:
                continue
            w1, wn = statistics.median(one), statistics.median(r["wall_s"] for r in big)
            cpu = [r["cpu_s"] for r in big if r.get("cpu_s") is not None]
            L.append("| %s | %d | %s | %s | %.2f | %s |" % (
                tool, forks, fmt_stat(_st(one)), fmt_stat(_st([r["wall_s"] for r in big])), wn / w1,
                "%.1f" % (statistics.median(cpu) * 1000 / top) if cpu else "-"))
    return L


def write_outputs(bench: "Bench", args: argparse.Namespace, command: str, started: str) -> None:
    """results.json, the report (RESULTS-run.md) and the plot, from what the bench measured."""
    seconds = time.monotonic() - T0
    saved = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "real"}
    raw = {"command": command, "date": started, "seconds": round(seconds, 1), "args": saved,
           "machine": machine(), "versions": versions(),
           "measured_rtt_ms": {str(k): v for k, v in bench.measured_rtt.items()}, "runs": bench.runs,
           "failures": bench.fail_rows, "clean": bench.clean_rows, "real": bench.real_rows,
           "scale": bench.scale_rows, "skipped": bench.skipped}
    for p in (args.raw, args.out, args.plot):
        p.parent.mkdir(parents=True, exist_ok=True)
    args.raw.write_text(json.dumps(raw, indent=1) + "\n")
    args.out.write_text(write_report(bench, args, command, started, seconds, raw["machine"], raw["versions"]))
    try:
        plot(bench, args, args.plot)
    except ImportError:
        print("bench: matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
    print("wrote %s (%.0f s)" % (", ".join(str(p) for p in (args.out, args.plot, args.raw) if p.exists()), seconds))


if __name__ == "__main__":
    sys.exit(main())
