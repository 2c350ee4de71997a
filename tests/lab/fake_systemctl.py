"""A stand-in systemctl for lab hosts (they run no systemd), shared by runbook tests and the demo.

The fake keeps a unit's processes in /root/units (the host's private /root): ``start``
launches a fakecuda holder (memory on the unit's GPUs, as a vLLM would) and, when the unit has
a health port, a small HTTP server answering /health after a delay; ``stop`` ends exactly the
process groups it started (recorded PIDs, never names).
"""
from __future__ import annotations

import json
from typing import Any

FAKE_SYSTEMCTL = r'''
import json, os, signal, subprocess, sys, time

PY = sys.executable
UNITS = "/root/units"
HEALTH = """
import http.server, sys, time
port, delay = int(sys.argv[1]), float(sys.argv[2])
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def state(unit):
    try:
        with open(os.path.join(UNITS, unit + ".state")) as f:
            return json.load(f)
    except OSError:
        return None


def spec(unit):
    try:
        with open(os.path.join(UNITS, unit + ".json")) as f:
            return json.load(f)
    except OSError:
        return None


def active(unit):
    st = state(unit)
    return bool(st) and all(alive(p) for p in st["pids"])


def start(unit):
    sp = spec(unit)
    if sp is None:
        sys.stderr.write("Failed to start %s: Unit %s not found.\n" % (unit, unit))
        return 5
    if active(unit):
        return 0
    gpus = ",".join(str(g) for g in sp["gpus"])
    out = subprocess.run([PY, "/run/gflab/fakecuda.py", "--detach", "--log", "/tmp/%s.log" % unit,
                          "--gpus", gpus, "--mib", str(sp["mib"]), "--title", sp.get("title", "VLLM::Worker")],
                         stdout=subprocess.PIPE, check=True).stdout
    pids = [json.loads(out.decode().strip().splitlines()[-1])["pid"]]
    if sp.get("health_port"):
        srv = subprocess.Popen([PY, "-c", HEALTH, str(sp["health_port"]), str(sp.get("health_delay", 0))],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        pids.append(srv.pid)
    with open(os.path.join(UNITS, unit + ".state"), "w") as f:
        json.dump({"pids": pids}, f)
    return 0


def stop(unit):
    if spec(unit) is None:
        sys.stderr.write("Failed to stop %s: Unit %s not loaded.\n" % (unit, unit))
        return 5
    st = state(unit)
    if not st:
        return 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in st["pids"]:  # each is the leader of its own session and process group
            try:
                os.killpg(pid, sig)
            except OSError:
                pass
        end = time.time() + 10
        while time.time() < end and any(alive(p) for p in st["pids"]):
            time.sleep(0.05)
        if not any(alive(p) for p in st["pids"]):
            break
    os.unlink(os.path.join(UNITS, unit + ".state"))
    with open(os.path.join(UNITS, "calls.log"), "a") as f:
        f.write("stopped %s\n" % unit)
    return 0


def show(units):
    """systemd's answer on which cgroup a unit owns: the spec's "cgroup" (the path as
    /proc/PID/cgroup shows it), empty for a unit it does not run, as systemd prints them."""
    blocks = []
    for u in units:
        sp = spec(u) or {}
        blocks.append("Id=%s\nControlGroup=%s\n" % (u, sp.get("cgroup", "") if active(u) or
                                                      sp.get("cgroup_always") else ""))
    sys.stdout.write("\n".join(blocks))
    return 0


def main(argv):
    words = [a for a in argv if a not in ("--no-ask-password", "--user", "--")
             and not a.startswith("--property=")]
    verb, units = words[0], words[1:]
    with open(os.path.join(UNITS, "calls.log"), "a") as f:
        f.write(" ".join(argv) + "\n")
    if verb == "show":
        return show(units)
    if verb == "is-active":
        states = ["active" if active(u) else "inactive" for u in units]
        print("\n".join(states))
        return 0 if all(s == "active" for s in states) else 3
    if verb in ("start", "stop"):
        rc = 0
        for u in units:
            rc = rc or (start(u) if verb == "start" else stop(u))
        return rc
    if verb in ("enable", "disable"):
        return 0
    sys.stderr.write("fake systemctl: unknown verb %s\n" % verb)
    return 1


sys.exit(main(sys.argv[1:]))
'''


def install_systemctl(host: Any, units: dict[str, dict]) -> str:
    """The fake systemctl and its unit specs, in the host's private /root; returns its path.
    A spec's "cgroup" is the unit's ControlGroup as ``systemctl show`` gives it (while the
    unit runs, or always with "cgroup_always": a unit whose processes the test started)."""
    units_dir = host.path("/root/units")
    units_dir.mkdir(parents=True, exist_ok=True)
    for name, sp in units.items():
        (units_dir / f"{name}.service.json").write_text(json.dumps(sp))
    host.path("/root/gflab-systemctl.py").write_text(FAKE_SYSTEMCTL)
    bindir = host.path("/root/bin")
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / "systemctl"
    wrapper.write_text(f'#!/bin/sh\nexec {host.holder_python()} /root/gflab-systemctl.py "$@"\n')
    wrapper.chmod(0o755)
    return "/root/bin/systemctl"


def unit_pids(host: Any, unit: str) -> list[int]:
    try:
        return json.loads(host.path(f"/root/units/{unit}.service.state").read_text())["pids"]
    except FileNotFoundError:
        return []
