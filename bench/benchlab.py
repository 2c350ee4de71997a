"""The bench's lab: N test-lab hosts behind a delayed link, and how a tool run is measured.

Network: one network namespace (``gfbench<pid>``, the "far side") holds every host's sshd,
listening on 10.250.0.2:<port>; the controller reaches it over a link with a fixed one-way
delay (bench/delayline.py; this kernel has no netem). Dead hosts are closed ports on
10.250.0.2 (the far kernel answers RST after one RTT); blackholed hosts are addresses in
10.250.1.0/24, whose packets the link drops. Only addresses of namespaces made here are used.

Measuring: each tool runs as its own process in a fresh cpuacct cgroup, so controller CPU
counts every process it started (Ansible's forks and ssh ControlPersist masters too); wall
time is from spawn to exit. SSH execs per host are counted from each sshd's VERBOSE log
("Starting session: command ..."), connections from "Accepted publickey".
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "lab"))

from lab import DEFAULT_PATH, Lab, LabHost  # noqa: E402

FAR_ADDR = "10.250.0.2"
BLACKHOLE_NET = "10.250.1.0/24"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
BIN = Path(sys.executable).parent  # console scripts of this interpreter (no pyenv shim)


def remote_python() -> str:
    """The hosts' python3 for Ansible (no interpreter discovery): the one on their session PATH
    (/usr/bin/python3 here; bench/device/run.sh links one into /usr/local/bin where it is missing)."""
    found = shutil.which("python3", path=DEFAULT_PATH)
    return found or "/usr/bin/python3"


def tool_path(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else name


CGROUP2 = Path(os.environ.get("GFBENCH_CGROUP2") or "/sys/fs/cgroup")  # cgroup2 mount point


def _v2_home() -> Optional[Path]:
    """This process's cgroup2 directory, when /sys/fs/cgroup (or GFBENCH_CGROUP2) is cgroup2 and
    there is no v1 cpuacct: the bench's cgroups are made under it (a container's own cgroup)."""
    if CPUACCT.is_dir() and not os.environ.get("GFBENCH_CGROUP2"):
        return None
    if not (CGROUP2 / "cgroup.controllers").exists():
        return None
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::")), None)
    except OSError:
        return None
    if rel is None:
        return None
    home = CGROUP2 / rel.lstrip("/")
    return home if home.is_dir() else CGROUP2


V2_HOME = _v2_home()  # read once, before the bench moves itself between its cgroups


class Cgroup:
    """A cgroup for one tool run: CPU of the process and every descendant. cgroup v1
    (cpuacct.usage, ns) or v2 (cpu.stat usage_usec, present without any controller enabled)."""

    def __init__(self, name: str, path: Optional[Path] = None):
        """``name``: a new cgroup made here; ``path``: an existing one, only read (a real
        host's sshd, started in it by bench/device/run.sh)."""
        self.made = path is None
        if path is not None:
            self.path = Path(path)
        else:
            self.path = (V2_HOME if V2_HOME is not None else CPUACCT) / name
        self.v2 = (self.path.parent / "cgroup.controllers").exists() or \
            (self.path / "cgroup.controllers").exists()
        self.available = self.path.parent.is_dir()
        if self.available and self.made:
            try:
                self.path.mkdir(exist_ok=True)
            except OSError:
                self.available = False
        self.available = self.available and self.path.is_dir()

    def usage_s(self) -> Optional[float]:
        if not self.available:
            return None
        if self.v2:
            for line in (self.path / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return None
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def enter_fn(self):
        procs = str(self.path / "cgroup.procs")
        if not self.available:
            return None

        def enter() -> None:
            with open(procs, "w") as f:
                f.write("0")
        return enter

    def enter_self(self) -> None:
        """Move this process into the cgroup (what it starts from now on inherits it)."""
        if self.available:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    @staticmethod
    def leave_self() -> None:
        home = V2_HOME if V2_HOME is not None else (CPUACCT if CPUACCT.is_dir() else None)
        if home is not None:
            (home / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        if not self.available:
            return []
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def end_leftovers(self, timeout: float = 5.0) -> int:
        """SIGTERM what the tool left running in its cgroup (ssh ControlPersist masters);
        every pid here was started by the measured run."""
        left = self.pids()
        for pid in left:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(left)

    def remove(self) -> None:
        if self.available and self.made:
            for _ in range(50):
                try:
                    self.path.rmdir()
                    return
                except FileNotFoundError:
                    return
                except OSError:
                    self.end_leftovers(1.0)
                    time.sleep(0.1)


@dataclass
class Measured:
    wall_s: float
    cpu_s: Optional[float]  # the tool and everything it started (controller side)
    remote_cpu_s: Optional[float]  # every lab host (sshd, agent, nvidia-smi) meanwhile
    wire_cpu_s: Optional[float]  # the delay line meanwhile
    rc: int
    stdout: bytes
    stderr: bytes


def measure(argv: Sequence[str], cg: Cgroup, hosts_cg: Optional[Cgroup] = None,
            wire_cg: Optional[Cgroup] = None, timeout: float = 600,
            env: Optional[dict] = None, keep: bool = False) -> Measured:
    """Run one tool to its end; wall time and the CPU of each side. What it left running in
    its cgroup (ssh ControlPersist masters) is ended, unless ``keep``: a warm-up run whose
    masters the next, timed, run of the same command uses (that one ends them)."""
    others = [c.usage_s() if c else None for c in (hosts_cg, wire_cg)]
    before = cg.usage_s()
    t0 = time.monotonic()
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, preexec_fn=cg.enter_fn())
    try:
        so, se = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        so, se = proc.communicate()
    wall = time.monotonic() - t0
    if not keep:
        cg.end_leftovers()
    after = cg.usage_s()
    cpu = (after - before) if before is not None and after is not None else None
    diffs = []
    for c, b in zip((hosts_cg, wire_cg), others):
        a = c.usage_s() if c else None
        diffs.append(a - b if a is not None and b is not None else None)
    return Measured(wall, cpu, diffs[0], diffs[1], proc.returncode, so or b"", se or b"")


class Net:
    """The far-side namespace and the delayed link to it; removed on close (and at exit)."""

    def __init__(self, one_way_ms: float, cgroup: Optional[Cgroup] = None):
        tag = str(os.getpid())
        self.netns = "gfbench" + tag
        self.near, self.far = "gfbn" + tag, "gfbf" + tag
        self.one_way_ms = one_way_ms
        self.proc: Optional[subprocess.Popen] = None
        self._closed = False
        routes = subprocess.run(["ip", "route", "show", "10.250.0.0/16"], capture_output=True, text=True)
        if routes.stdout.strip():  # the addresses are fixed: one bench at a time
            self._closed = True
            raise RuntimeError("10.250.x.x is already routed here (another bench run?): %s"
                               % routes.stdout.strip().splitlines()[0])
        subprocess.run(["ip", "netns", "add", self.netns], check=True, capture_output=True)
        atexit.register(self.close)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "delayline.py"), self.near, self.far, self.netns,
             str(one_way_ms), BLACKHOLE_NET],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=cgroup.enter_fn() if cgroup else None)
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError("delay line did not start: %r" % line)

    def set_rtt(self, rtt_ms: float) -> None:
        self.one_way_ms = rtt_ms / 2.0
        self.proc.stdin.write("%g\n" % self.one_way_ms)
        self.proc.stdin.flush()
        time.sleep(0.2)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.near], capture_output=True)


def measured_rtt_ms(port: int, tries: int = 5) -> float:
    """Median TCP connect time to a far-side sshd: the RTT the tools really see."""
    import socket
    times = []
    for _ in range(tries):
        s = socket.socket()
        t = time.monotonic()
        s.connect((FAR_ADDR, port))
        times.append((time.monotonic() - t) * 1000)
        s.close()
        time.sleep(0.02)
    times.sort()
    return times[len(times) // 2]


@dataclass
class Far:
    """A non-host endpoint on the far side (dead: refused; blackholed: dropped)."""

    name: str
    address: str
    port: int
    host_key_line: Optional[str] = None


REAL_NAME_PREFIX = "real-gpu"  # the real host's inventory name (its GPUs are real ones)


@dataclass
class RealHost:
    """A real machine's own sshd (bench/run.py --real-host), with its own key and known_hosts;
    its CPU is read from the cgroup its sshd was started in (sessions inherit it)."""

    name: str
    address: str
    port: int
    key: Path
    known_hosts: Path
    host_key_line: Optional[str] = None

    @classmethod
    def parse(cls, spec: str, name: str = REAL_NAME_PREFIX) -> "RealHost":
        """ADDR:PORT:KEY:KNOWN_HOSTS -> RealHost; ValueError (one line) when malformed."""
        parts = spec.split(":")
        if len(parts) != 4 or not parts[1].isdigit():
            raise ValueError("--real-host wants ADDR:PORT:KEY:KNOWN_HOSTS, got %r" % spec)
        key, known = Path(parts[2]), Path(parts[3])
        for p in (key, known):
            if not p.is_file():
                raise ValueError("--real-host: %s is not a file" % p)
        return cls(name, parts[0], int(parts[1]), key.resolve(), known.resolve())


class BenchLab:
    """Lab hosts on the far side, with inventories for every tool."""

    def __init__(self, workdir: Path, net: Net):
        self.workdir = workdir
        self.net = net
        self.lab = Lab(workdir / "lab")
        self.hosts: list[LabHost] = []

    def start_hosts(self, n: int, gpus: int = 8, progress=None) -> None:
        while len(self.hosts) < n:
            i = len(self.hosts)
            h = self.lab.add_host(
                "node%03d" % i, gpus=gpus, gpu_name="NVIDIA H200", total_mib=143771,
                reserved_mib=616, netns=self.net.netns, listen=FAR_ADDR,
                sshd_extra="LogLevel VERBOSE\nMaxStartups 1000\nMaxSessions 1000")
            # one vLLM-like worker per host: the /proc scan and compute apps find something
            h.spawn_holder(gpus=[0], mib=71680, title="VLLM::Worker_TP0", via="exec")
            self.hosts.append(h)
            if len({x.port for x in self.hosts}) != len(self.hosts):
                raise RuntimeError("two lab hosts share a port: %s" % h)
            if progress:
                progress(len(self.hosts))

    def dead(self, k: int) -> list[Far]:
        """Ports on the far side that nothing listens on: connect is refused after one RTT."""
        used = {h.port for h in self.hosts}
        free = [p for p in range(40999, 30000, -1) if p not in used]
        return [Far("dead%02d" % i, FAR_ADDR, free[i]) for i in range(k)]

    @staticmethod
    def blackholed(k: int) -> list[Far]:
        return [Far("hole%02d" % i, "10.250.1.%d" % (10 + i), 22) for i in range(k)]

    # --- inventories --------------------------------------------------------------------------

    def gpufleet_inventory(self, hosts: Sequence, path: Path, connect_timeout: float = 5,
                           key: Optional[Path] = None, known_hosts: Optional[Path] = None,
                           **more: Any) -> Path:
        """``more``: further keys for every host (``ssh_persist=0``: fresh connections)."""
        extra: dict[str, Any] = dict(more)
        if key is not None:
            extra.update(identity_file=str(key), known_hosts_file=str(known_hosts))
        return self.lab.inventory_yaml(list(hosts), path=path, connect_timeout=connect_timeout,
                                       command_timeout=60, **extra)

    def ansible_inventory(self, hosts: Sequence, path: Path, key: Optional[Path] = None,
                          known_hosts: Optional[Path] = None) -> Path:
        """``key``/``known_hosts``: another host's (the real one), else the lab's."""
        key = key or self.lab.client_key
        known_hosts = known_hosts or self.lab.known_hosts_path
        lines = ["[gpu]"]
        for h in hosts:
            lines.append("%s ansible_host=%s ansible_port=%d" % (h.name, h.address, h.port))
        lines += [
            "", "[gpu:vars]", "ansible_user=root",
            "ansible_ssh_private_key_file=%s" % key,
            "ansible_python_interpreter=%s" % remote_python(),
            "ansible_ssh_common_args='-o UserKnownHostsFile=%s -o GlobalKnownHostsFile=/dev/null "
            "-o StrictHostKeyChecking=yes -o IdentitiesOnly=yes'" % known_hosts,
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    def hosts_json(self, hosts: Sequence, path: Path, key: Optional[Path] = None,
                   known_hosts: Optional[Path] = None) -> Path:
        doc = {"key": str(key or self.lab.client_key),
               "known_hosts": str(known_hosts or self.lab.known_hosts_path),
               "hosts": [{"name": h.name, "address": h.address, "port": h.port} for h in hosts]}
        path.write_text(json.dumps(doc))
        return path

    # --- SSH accounting ---------------------------------------------------------------------------

    def log_marks(self, hosts: Sequence[LabHost]) -> dict:
        return {h.name: _size(h.dir / "sshd.log") for h in hosts}

    def sessions_since(self, hosts: Sequence[LabHost], marks: dict) -> dict:
        """host -> (connections, execs) logged by its sshd since ``marks``."""
        time.sleep(0.3)  # sshd writes "Close session" lines after the client is gone
        out = {}
        for h in hosts:
            with open(h.dir / "sshd.log", "rb") as f:
                f.seek(marks.get(h.name, 0))
                text = f.read().decode(errors="replace")
            conns = text.count("Accepted publickey")
            execs = text.count("Starting session: command")
            out[h.name] = (conns, execs)
        return out

    def close(self) -> None:
        self.lab.close()


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0
