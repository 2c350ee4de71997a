#!/usr/bin/env python3
"""Where a clean's time goes beyond the release delay, phase by phase (the lab target: <= 1 s beyond the delay).

    sudo python3 bench/clean_phases.py                     # 32 lab hosts, delay 2 s, 3 runs
    sudo python3 bench/clean_phases.py --hosts 32 --runs 5 --delay 2
    sudo python3 bench/clean_phases.py --hosts 32 --runs 5 --floor 0 --persist default

`gpufleet clean --all --gpus all --yes --json` over N lab hosts (8 fake H200s and one holder
each, as bench/fast_agent.py), run by a small driver that timestamps, inside the CLI process,
the calls of gpufleet.ops.clean it passes through (nothing else changes): the plan round's
start, each host's plan (its conversation's first answer), each host's act (the clean request
to its verdict), and the process's exit as the bench sees it. Printed per run and as medians:

* start: the interpreter's start to the plan round (imports, inventory, ssh_config);
* plan: the plan round's start to the last host's plan (every handshake, agent, snapshot);
* confirm: the last plan to the first clean request (the fleet-wide plan check, --yes);
* act - delay: the first clean request to the last verdict, less the release delay;
* exit: the last verdict to the process's end (the document, the audit log);
* beyond: the whole wall less the delay (bench/fast_agent.py's number).

It also prints the CPU of the CLI and its children (ssh) and of the hosts over the run, and
(``--floor``) the floor under the plan round: the same hosts reached all at once by bare
``ssh`` processes (gpufleet's key exchange, curve25519), each running ``python3 -S -E -s -c
pass``, then each running the agent's snapshot from its cache (the bootstrap and the request
without the agent, as the plan's first request is sent): the handshakes and agents alone,
nothing of the controller.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import Lab  # noqa: E402

#: Runs the CLI with the calls below timestamped into the file named by $GF_PHASES.
DRIVER = r"""
import os, sys, time, runpy
T0 = time.monotonic()
out = open(os.environ["GF_PHASES"], "w", buffering=1)
import gpufleet.ops.clean as oc
def timed(name):
    f = getattr(oc, name)
    def wrap(*a, **k):
        t = time.monotonic()
        try:
            return f(*a, **k)
        finally:
            out.write("%s %.6f %.6f\n" % (name, t - T0, time.monotonic() - T0))
    setattr(oc, name, wrap)
for name in ("_plan_all", "plan_conversation", "execute_conversation"):
    timed(name)
out.write("t0 %.6f %.6f\n" % (T0, 0.0))
sys.argv = ["gpufleet"] + sys.argv[1:]
runpy.run_module("gpufleet", run_name="__main__")
"""
CLK = os.sysconf("SC_CLK_TCK")


def host_cpu_s(hosts: list[Any]) -> float:
    """CPU used so far by every process of the hosts: each live process's own and its reaped
    children's (utime, stime, cutime, cstime), so a process that ended counts once, in its
    reaper's. A live connection's sshd and what it ran (a kept connection's sessions) count
    too: only the listener's reaped children did before, which left out every session of a
    connection that outlived the run."""
    total = 0
    for h in hosts:
        for entry in h.path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                f = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in f[11:15])
    return total / CLK


def one_run(lab_hosts: list[Any], inv: Path, env: dict, delay: float, work: Path) -> dict:
    for h in lab_hosts:
        h.set_config(release_delay_s=delay)
        if not h.records():
            h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
    time.sleep(1.0)  # the last run's sessions have ended on the hosts
    phases = work / "phases.txt"
    hc0, ru0 = host_cpu_s(lab_hosts), resource.getrusage(resource.RUSAGE_CHILDREN)
    t_spawn = time.monotonic()
    r = subprocess.run([sys.executable, "-c", DRIVER, "-i", str(inv), "clean", "--all", "--gpus",
                        "all", "--yes", "--json", "--grace", "5", "--timeout", "30"],
                       capture_output=True, text=True, env=dict(env, GF_PHASES=str(phases)),
                       timeout=600)
    t_end = time.monotonic()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    time.sleep(0.3)
    hc1 = host_cpu_s(lab_hosts)
    if r.returncode != 0:
        raise SystemExit("clean failed (exit %d): %s" % (r.returncode, r.stderr[-400:]))
    doc = json.loads(r.stdout)
    signalled = sum(1 for h in doc["hosts"] if any(s.get("outcome") == "sent"
                                                   for s in h.get("signals") or ()))
    ev: dict[str, list[tuple[float, float]]] = {}
    t0 = 0.0
    for line in phases.read_text().splitlines():
        name, a, b = line.split()
        if name == "t0":
            t0 = float(a)
        else:
            ev.setdefault(name, []).append((float(a), float(b)))
    offset = t0 - t_spawn  # the driver's T0 on the bench's clock
    plan_start = ev["_plan_all"][0][0] + offset
    plans_done = max(b for _, b in ev["plan_conversation"]) + offset
    acts = ev["execute_conversation"]
    act_start = min(a for a, _ in acts) + offset
    act_end = max(b for _, b in acts) + offset
    wall = t_end - t_spawn
    return {
        "hosts_signalled": signalled,
        "start_s": plan_start, "plan_s": plans_done - plan_start, "confirm_s": act_start - plans_done,
        "act_minus_delay_s": act_end - act_start - delay, "exit_s": wall - act_end,
        "beyond_s": wall - delay, "wall_s": wall,
        "cli_cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "hosts_cpu_s": hc1 - hc0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=32)
    ap.add_argument("--delay", type=float, default=2.0, help="the fake driver's release delay (s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--persist", default="0", metavar="SECONDS|default",
                    help="also runs over connections kept between commands (the inventory's "
                         "ssh_persist; default: the key left unset, gpufleet's default of "
                         "60 s), alternated with fresh ones (ssh_persist: 0): a table each")
    ap.add_argument("--floor", type=int, default=3, metavar="ROUNDS",
                    help="rounds of the bare-ssh floor (0: none)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gfbench-phases-"))
    (work / "home").mkdir()
    env = dict(os.environ, HOME=str(work / "home"), PYTHONPATH=str(REPO))
    lab = Lab(work / "lab")
    try:
        hosts = [lab.add_host("node%03d" % i, gpus=8, gpu_name="NVIDIA H200", total_mib=143771,
                              reserved_mib=616) for i in range(a.hosts)]
        invs = {"fresh connections (ssh_persist: 0)": lab.inventory_yaml(
            hosts, path=work / "fleet.yaml", command_timeout=60, ssh_persist=0)}
        if a.persist == "default":  # the inventory says nothing: gpufleet's default
            invs["kept connections (default)"] = lab.inventory_yaml(
                hosts, path=work / "fleet-kept.yaml", command_timeout=60)
        elif float(a.persist):
            invs["kept connections (ssh_persist: %s)" % a.persist] = lab.inventory_yaml(
                hosts, path=work / "fleet-kept.yaml", command_timeout=60,
                ssh_persist=float(a.persist))
        for inv in invs.values():  # warm: the hosts' agent caches, the page cache, the masters
            one_run(hosts, inv, env, a.delay, work)
        rows: dict[str, list] = {k: [] for k in invs}
        for _ in range(a.runs):
            for mode, inv in invs.items():  # alternated: the same minutes for both
                rows[mode].append(one_run(hosts, inv, env, a.delay, work))
        if len(invs) > 1:
            subprocess.run([sys.executable, "-m", "gpufleet", "disconnect"], env=env,
                           capture_output=True, timeout=60)
        floors = floor_rounds(hosts, a.floor)
    finally:
        lab.close()
    print(json.dumps({"hosts": a.hosts, "delay_s": a.delay, "runs": rows}))
    for mode, got in rows.items():
        print_table("%d hosts, delay %g s, %s" % (a.hosts, a.delay, mode), got)
    for name, walls in floors.items():
        print("floor, %d hosts at once, bare ssh running %s: %s s, median **%.3f** s" % (
            a.hosts, name, ", ".join("%.3f" % w for w in walls), statistics.median(walls)))
    return 0


def print_table(title: str, rows: list[dict]) -> None:
    keys = ["start_s", "plan_s", "confirm_s", "act_minus_delay_s", "exit_s", "beyond_s",
            "cli_cpu_s", "hosts_cpu_s"]
    print("| %s | %s |" % (title, " | ".join("run %d" % (i + 1) for i in range(len(rows))))
          + " median |")
    print("|---|" + "---|" * (len(rows) + 1))
    for k in keys:
        vals = [r[k] for r in rows]
        print("| %s | %s | **%.3f** |" % (k, " | ".join("%.3f" % v for v in vals),
                                          statistics.median(vals)))
    print("| hosts signalled | %s | |" % " | ".join(str(r["hosts_signalled"]) for r in rows))


def floor_rounds(hosts: list[Any], rounds: int) -> dict[str, list[float]]:
    """Wall of ``rounds`` rounds of one bare ssh per host at once, per remote command."""
    if rounds <= 0:
        return {}
    import shlex

    sys.path.insert(0, str(REPO))
    from gpufleet.remote import bootstrap_command, encode_request

    request = {"mode": "snapshot", "deadline_s": 50, "smi_timeout_s": 10, "cuda_version": False}
    work = {"python3 -S -E -s -c pass": ("python3 -S -E -s -c pass", b""),
            "the agent's snapshot (cached)": (shlex.join(bootstrap_command()),
                                              encode_request(request, agent=False))}
    out: dict[str, list[float]] = {k: [] for k in work}
    for _ in range(rounds):
        for name, (command, stdin) in work.items():
            argv = [h.ssh_argv()[:1] + ["-o", "KexAlgorithms=curve25519-sha256"]
                    + h.ssh_argv()[1:] + ["--", command] for h in hosts]
            t0 = time.monotonic()
            procs = [subprocess.Popen(v, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL) for v in argv]
            for p in procs:  # every request written at once (~12 KB: within a pipe's buffer),
                assert p.stdin is not None  # not one host's after another's answer
                p.stdin.write(stdin)
                p.stdin.close()
                p.stdin = None  # communicate() below only reads
            outs = [p.communicate(timeout=120)[0] for p in procs]
            out[name].append(time.monotonic() - t0)
            if stdin and not all(b'"facts"' in o for o in outs):
                raise SystemExit("floor: an agent did not answer with a snapshot")
    return out


if __name__ == "__main__":
    sys.exit(main())
