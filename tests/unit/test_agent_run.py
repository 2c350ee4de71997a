"""Run the real agent the way the controller does: the DESIGN.md bootstrap via ``python -c``,
source and request on stdin, against real child processes of this test and a small stub
nvidia-smi (written here) that prints RECORDED lines (tests/fixtures/recorded/).

The stub is deliberately tiny; the faithful fake for the lab is tests/lab/fake_nvidia_smi.py.
Each child started here is killed at teardown by its own PID.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from gpufleet.core.model import parse_snapshot
from gpufleet.remote import AGENT_PIECES, agent_source, bootstrap_command, encode_request

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "recorded"


def find_python36():
    """A real Python 3.6 to run the agent under, where this machine has one ($GPUFLEET_PY36,
    python3.6 on PATH, a pyenv build); None elsewhere, and then only the ast checks of
    tests/unit/test_layers.py guard the agent's 3.6 grammar."""
    candidates = [os.environ.get("GPUFLEET_PY36"), shutil.which("python3.6")]
    candidates += [str(p) for p in sorted(Path.home().glob(".pyenv/versions/3.6*/bin/python3"))]
    for cand in candidates:
        if not cand or not os.access(cand, os.X_OK):
            continue
        try:
            out = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2])"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if out.strip() == b"(3, 6)":
            return cand
    return None


PY36 = find_python36()
PYTHONS = [sys.executable] + ([PY36] if PY36 else [])

GPU0_UUID = "GPU-b6867955-3f5c-7ad9-b674-7a2248eb9a7f"  # h200-single-gpu.log
GPU1_UUID = "GPU-b226c03d-98d5-aaff-f57c-8cd874d83c3e"  # h200-two-gpus.log
EXIT9 = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
         "Make sure that the latest NVIDIA driver is installed and running.")


def recorded(name: str) -> str:
    return (FIXTURES / name).read_text()


def recorded_app_line(pid: Optional[int], line_no: int = 1) -> str:
    """h200-single-gpu.log line 76 ("425, python3, 20998, GPU-b686...") for another PID, as
    the agent's query prints it: without the process_name column (the agent does not ask for
    it; probe/h200-names-probe4.log recorded that query's rows on the same driver)."""
    pid0, _name, rest = recorded("compute_apps.csv").splitlines()[line_no].split(", ", 2)
    return "%d, %s" % (int(pid0) if pid is None else pid, rest)


STUB = r'''#!{python}
import json, os, sys, time
HERE = os.path.dirname(os.path.abspath(__file__))
cfg = json.load(open(os.path.join(HERE, "stub.json")))
with open(os.path.join(HERE, "calls.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")

def alive(pid):
    try:
        s = open("/proc/%d/stat" % pid).read()
    except OSError:
        return False
    return s.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

mode = cfg.get("mode", "ok")
if mode == "exit9":
    print(cfg["exit9"])
    sys.exit(9)
if mode == "hang":
    import subprocess
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    open(os.path.join(HERE, "hang.pids"), "w").write("%d %d" % (os.getpid(), g.pid))
    time.sleep(3600)
args = sys.argv[1:]
apps = [a for a in cfg["apps"] if not a.get("dynamic") or alive(a["pid"])]
if not args:
    sys.stdout.write(cfg["bare"])
elif args[0] == "-q":
    sys.stdout.write(cfg["q"])
elif args[0] == "--gpu-reset":
    print("stub: reset " + " ".join(args[1:]))
elif args[0].startswith("--query-gpu="):
    fields = args[0].split("=", 1)[1].split(",")
    for f in fields:
        if f in cfg.get("reject", []):
            print('Field "%s" is not a valid field to query.' % f)
            print()
            sys.exit(2)
    if mode == "garbage":
        sys.stdout.write(cfg["garbage"])
        sys.exit(0)
    for g in cfg["gpus"]:
        vals = dict(g)
        used = sum(a["used"] for a in apps if a["uuid"] == g["uuid"])
        vals["memory.used"] = str(used)
        if "memory.reserved" in g:
            vals["memory.free"] = str(int(g["memory.total"]) - used - int(g["memory.reserved"]))
        print(", ".join(vals.get(f, "[N/A]") for f in fields))
elif args[0].startswith("--query-compute-apps="):
    for a in apps:
        print(a["line"])
else:
    print("stub: unknown arguments %r" % (args,))
    sys.exit(2)
'''

# Values from the recorded logs: GPU 1 of h200-two-gpus.log is printed FIRST, so a join by
# position instead of UUID shows up; GPU 0 is the single GPU of h200-single-gpu.log.
GPUS = [
    {"index": "1", "uuid": GPU1_UUID, "name": "NVIDIA H200", "pci.bus_id": "00000000:00:07.0",
     "memory.total": "143771", "memory.reserved": "616", "utilization.gpu": "0",
     "driver_version": "580.159.04"},
    {"index": "0", "uuid": GPU0_UUID, "name": "NVIDIA H200", "pci.bus_id": "00000000:00:06.0",
     "memory.total": "143771", "utilization.gpu": "0", "driver_version": "580.159.04"},
]


class Stub:
    def __init__(self, directory: Path, **cfg):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.path = directory / "nvidia-smi"
        self.path.write_text(STUB.replace("{python}", sys.executable))
        self.path.chmod(0o755)
        self.cfg = {"mode": "ok", "gpus": GPUS, "apps": [], "bare": recorded("bare_table.txt"),
                    "q": recorded("q_minor_bus.txt"), "exit9": EXIT9, "reject": []}
        self.update(**cfg)

    def update(self, **cfg):
        self.cfg.update(cfg)
        (self.dir / "stub.json").write_text(json.dumps(self.cfg))

    def calls(self):
        f = self.dir / "calls.jsonl"
        return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


HOLDER = r'''
import ctypes, signal, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
files = [open(p, "rb") for p in sys.argv[2:] if p.startswith("/")]
print("ready", flush=True)
time.sleep(600)
'''


# The leader thread exits while another thread runs on: /proc/PID/stat says "Z" with 2
# threads and /proc/PID/fd is empty, as for a CUDA process tearing down after SIGTERM.
ZOMBIE_LEADER = r'''
import ctypes, threading, time, sys
files = [open(p, "rb") for p in sys.argv[1:] if p.startswith("/")]
threading.Thread(target=time.sleep, args=(600,)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
'''


def wait_state(pid: int, state: str) -> None:
    end = time.monotonic() + 5
    while proc_state(pid) != state and time.monotonic() < end:
        time.sleep(0.02)
    assert proc_state(pid) == state


def starttime(pid: int) -> int:
    return int(Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[19])


def proc_state(pid: int):
    try:
        return Path("/proc/%d/stat" % pid).read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.fixture
def children():
    """Start real processes; kill each by its own PID at teardown."""
    started = []

    def start(argv, wait_ready=True, **kw):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, **kw)
        started.append(p)
        if wait_ready:
            assert p.stdout.readline().strip() == b"ready"
        return p

    def holder(name="gf) w(x", *extra, **kw):
        return start([sys.executable, "-c", HOLDER, name, "gpufleet-test-holder"] + list(extra),
                     **kw)

    start.holder = holder
    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()
        if p.stdout:
            p.stdout.close()


def start_resident(started, request, python=sys.executable, env=None):
    """The agent as a host runs it for a resident run (watch, stay): the bootstrap, its request
    written, stdin left open; recorded in ``started`` for end_resident."""
    p = subprocess.Popen(bootstrap_command(python), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    started.append(p)
    p.stdin.write(encode_request(request))
    p.stdin.flush()
    return p


def end_resident(started):
    """Kill what start_resident started and is still running (by its own PID), reap all."""
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def run_agent(request, python=sys.executable, env=None, argv=None, timeout=60.0, **popen_kw):
    """The controller's way: constant argv, `<len>\\n<source><json>` on stdin, no shell."""
    p = subprocess.Popen(argv or bootstrap_command(python), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **popen_kw)
    out, err = p.communicate(encode_request(request), timeout=timeout)
    assert p.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert len(lines) == 1, out  # exactly one JSON document
    return json.loads(lines[0])


def snap_request(stub, **kw):
    req = {"mode": "snapshot", "deadline_s": 30.0, "nvidia_smi": str(stub.path),
           "smi_timeout_s": 10.0}
    req.update(kw)
    return req


# ------------------------------------------------------------------- snapshot


@pytest.mark.parametrize("python", PYTHONS)
def test_snapshot_real_processes(tmp_path, children, python):
    holder = children.holder("gf) w(x", __file__)
    apart = children.holder("apart", start_new_session=True)
    stub = Stub(tmp_path / "stub", apps=[
        {"pid": holder.pid, "used": 20998, "uuid": GPU0_UUID, "dynamic": True,
         "line": recorded_app_line(holder.pid)},
        {"pid": 426, "used": 5638, "uuid": GPU0_UUID,  # recorded (line 75), no name column
         "line": recorded_app_line(None, 0)},
    ])
    stub.update(apps=stub.cfg["apps"] + [
        {"pid": apart.pid, "used": 100, "uuid": GPU1_UUID, "dynamic": True,
         "line": "%d, 100, %s" % (apart.pid, GPU1_UUID)}])
    doc = run_agent(snap_request(stub), python=python)

    assert doc["agent_version"] == 1 and doc["mode"] == "snapshot"
    assert doc["nvidia_smi"]["ok"] is True, doc["nvidia_smi"]
    assert doc["nvidia_smi"]["error"] is None
    gpus = {g["index"]: g for g in doc["gpus"]}
    assert set(gpus) == {0, 1}
    assert gpus[0]["uuid"] == GPU0_UUID and gpus[0]["pci_bus_id"] == "00000000:00:06.0"
    assert gpus[0]["memory_used_mib"] == 20998 + 5638
    assert gpus[0]["memory_reserved_mib"] is None and gpus[0]["memory_free_mib"] is None
    assert gpus[1]["memory_reserved_mib"] == 616
    assert gpus[1]["memory_free_mib"] == 143771 - 100 - 616
    assert gpus[0]["minor"] is None  # no /proc/driver/nvidia and no /dev/nvidiaN here
    apps = {a["pid"]: a for a in doc["compute_apps"]}
    assert apps[holder.pid]["gpu_index"] == 0  # joined by UUID, not by row position
    assert apps[holder.pid]["used_mib"] == 20998
    assert apps[apart.pid]["gpu_index"] == 1
    facts = doc["facts"]
    assert facts["driver_version"] == "580.159.04" and facts["cuda_version"] == "13.0"
    assert facts["nvidia_smi"] == str(stub.path)
    assert facts["is_root"] == (os.geteuid() == 0) and facts["uid"] == os.geteuid()
    assert facts["python"] == subprocess.check_output(
        [python, "-c", "import platform; print(platform.python_version())"]).decode().strip()

    procs = doc["processes"]
    h = procs[str(holder.pid)]
    assert h["comm"] == "gf) w(x"  # prctl name with ') ' read back through stat and comm
    assert "gpufleet-test-holder" in h["cmdline"] and h["cmdline"].startswith(sys.executable)
    assert h["starttime"] == starttime(holder.pid)
    assert h["ppid"] == os.getpid() and h["state"] == "S"
    assert h["uid"] == os.geteuid() and h["user"]
    assert h["relation"] == "session"  # same session as the agent (both children of pytest)
    assert h["kernel_thread"] is False
    assert procs[str(apart.pid)]["relation"] is None  # its own session
    me = procs[str(facts["agent_pid"])]
    assert me["relation"] == "self" and me["starttime"] == facts["agent_starttime"]
    assert procs[str(os.getpid())]["relation"] == "ancestor"
    assert procs["1"]["relation"] == "ancestor" if os.getpid() != 1 else True
    if not os.path.exists("/proc/426"):
        assert "426" not in procs
        assert any("426" in w for w in doc["warnings"])
    snap = parse_snapshot(doc)  # the controller's contract
    assert snap.gpu_indices_of_app(holder.pid) == (0,)
    assert snap.processes[holder.pid].name == "gf) w(x"
    # nvidia-smi children of the agent are neither holders nor listed processes
    stub_pids = [p for p, e in procs.items() if "nvidia-smi" in e["cmdline"]]
    assert stub_pids == []


def test_snapshot_names_come_from_proc_and_bad_rows_are_rejected(tmp_path, children):
    """The compute-apps query asks for no process name (nvidia-smi prints anyone's argv[0]
    into its CSV); the name is argv[0] read from /proc, as the NVML path reads it. A row that
    is not exactly pid, used_memory, gpu_uuid is rejected with a warning, never joined with
    its neighbour, and the other rows still count."""
    holder = children.holder("job")
    stub = Stub(tmp_path / "stub", apps=[
        {"pid": holder.pid, "used": 700, "uuid": GPU0_UUID, "dynamic": True,
         "line": "%d, x" % holder.pid},
        {"pid": holder.pid, "used": 0, "uuid": GPU0_UUID, "dynamic": True,
         "line": "%d, 700, %s" % (holder.pid, GPU0_UUID)}])
    doc = run_agent(snap_request(stub))
    queries = [c[0] for c in stub.calls() if c and c[0].startswith("--query-compute-apps=")]
    assert queries == ["--query-compute-apps=pid,used_memory,gpu_uuid"]
    assert doc["nvidia_smi"]["ok"] is True, doc["nvidia_smi"]
    assert [(a["pid"], a["process_name"], a["used_mib"]) for a in doc["compute_apps"]] == [
        (holder.pid, sys.executable, 700)]
    rejected = [w for w in doc["warnings"] if "rejected" in w]
    assert rejected == ["1 nvidia-smi --query-compute-apps row(s) rejected (not pid, "
                        "used_memory, gpu_uuid): %r" % ("%d, x" % holder.pid)], doc["warnings"]


def test_snapshot_holders_in_own_mount_namespace(tmp_path, children):
    """A process that opened /dev/nvidia0 in another mount namespace (as in a container or
    the lab) shows up as a holder through readlink of /proc/PID/fd."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    script = ("mount -t tmpfs tmpfs /dev && touch /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl "
              "/dev/nvidia-uvm && exec \"$0\" -c \"$1\" gfholder /dev/nvidia1 /dev/nvidiactl "
              "/dev/nvidia-uvm")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"])
    if probe.returncode != 0:
        pytest.skip("unshare -m not permitted here")
    h = children(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                  sys.executable, HOLDER])
    z = children(["unshare", "-m", "--propagation", "private", "sh", "-c",
                  script.replace("/dev/nvidia1 /dev/nvidiactl /dev/nvidia-uvm", "/dev/nvidia0"),
                  sys.executable, ZOMBIE_LEADER])
    wait_state(z.pid, "Z")
    stub = Stub(tmp_path / "stub")
    doc = run_agent(snap_request(stub))
    holders = {x["pid"]: x["devices"] for x in doc["holders"]}
    assert holders[h.pid] == ["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidiactl"]
    assert holders[z.pid] == ["/dev/nvidia0"]  # found through its live thread's fd table
    assert doc["processes"][str(z.pid)]["state"] == "Z"
    assert doc["processes"][str(z.pid)]["threads"] == 2
    assert doc["processes"][str(h.pid)]["comm"] == "gfholder"
    snap = parse_snapshot(doc)
    (mine,) = [x for x in snap.holders if x.pid == h.pid]
    assert snap.holder_gpu_indices(mine) == (1,)  # no minor numbers here: /dev/nvidia1 -> GPU 1


def test_snapshot_exit9(tmp_path):
    stub = Stub(tmp_path / "stub", mode="exit9")
    doc = run_agent(snap_request(stub))
    assert doc["nvidia_smi"]["ok"] is False
    assert doc["nvidia_smi"]["exit_code"] == 9
    assert doc["nvidia_smi"]["error"] == EXIT9
    assert doc["gpus"] == [] and doc["facts"]["agent_pid"] > 0
    assert parse_snapshot(doc).nvidia_smi_ok is False


def test_snapshot_hanging_nvidia_smi_is_bounded(tmp_path):
    stub = Stub(tmp_path / "stub", mode="hang")
    t0 = time.monotonic()
    doc = run_agent(snap_request(stub, smi_timeout_s=1.0, deadline_s=30.0), timeout=20)
    elapsed = time.monotonic() - t0
    assert elapsed < 8, elapsed
    assert doc["nvidia_smi"]["ok"] is False
    assert doc["nvidia_smi"]["error"] == "nvidia-smi timed out after 1s (driver hung?)"
    # the stub and what it forked were killed (own session), not left running
    pids = [int(x) for x in (tmp_path / "stub" / "hang.pids").read_text().split()]
    end = time.monotonic() + 5
    while time.monotonic() < end and any(proc_state(p) not in (None, "Z") for p in pids):
        time.sleep(0.05)
    assert all(proc_state(p) in (None, "Z") for p in pids)


def test_snapshot_deadline_bounds_nvidia_smi(tmp_path):
    stub = Stub(tmp_path / "stub", mode="hang")
    t0 = time.monotonic()
    doc = run_agent(snap_request(stub, smi_timeout_s=30.0, deadline_s=1.5), timeout=20)
    assert time.monotonic() - t0 < 8
    assert "timed out after 1.5s" in doc["nvidia_smi"]["error"]


def test_snapshot_missing_nvidia_smi(tmp_path):
    doc = run_agent({"mode": "snapshot", "nvidia_smi": str(tmp_path / "nope" / "nvidia-smi")})
    assert doc["nvidia_smi"]["ok"] is False
    assert doc["nvidia_smi"]["error"].startswith("nvidia-smi not found")
    assert doc["facts"]["nvidia_smi"] is None
    fallbacks = ["/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi",
                 "/usr/lib/wsl/lib/nvidia-smi"]
    if not any(os.path.exists(p) for p in fallbacks):
        env = dict(os.environ, PATH=str(tmp_path))
        doc = run_agent({"mode": "snapshot"}, env=env)
        assert doc["nvidia_smi"]["error"] == "nvidia-smi not found"


def test_snapshot_rejected_optional_field_degrades_to_null(tmp_path):
    stub = Stub(tmp_path / "stub", reject=["memory.reserved"])
    doc = run_agent(snap_request(stub))
    assert doc["nvidia_smi"]["ok"] is True
    assert {g["index"]: g["memory_reserved_mib"] for g in doc["gpus"]} == {0: None, 1: None}
    queries = [c[0] for c in stub.calls() if c and c[0].startswith("--query-gpu=")]
    assert "memory.reserved" in queries[0] and "memory.reserved" not in queries[1]


@pytest.mark.parametrize("garbage", [
    "garbage\n", recorded("query_gpu_7fields.csv")[:40] + "\n", "\x00\x01\x02\n",
])
def test_snapshot_garbage_output(tmp_path, garbage):
    stub = Stub(tmp_path / "stub", mode="garbage", garbage=garbage)
    doc = run_agent(snap_request(stub))
    assert doc["nvidia_smi"]["ok"] is False
    assert doc["nvidia_smi"]["error"].startswith("unparsable nvidia-smi")
    assert doc["gpus"] == [] and "traceback" not in doc


def test_bad_request_is_a_document():
    doc = run_agent({"mode": "reboot"})
    assert doc["error"].startswith("bad request")


def test_shell_metacharacters_in_paths_are_data(tmp_path):
    odd = tmp_path / "a b;$(touch PWNED)`touch PWNED2`'\"|&"
    stub = Stub(odd)
    doc = run_agent(snap_request(stub))
    assert doc["nvidia_smi"]["ok"] is True
    assert doc["facts"]["nvidia_smi"] == str(stub.path)
    assert not list(tmp_path.rglob("PWNED*")) and not Path("PWNED").exists()


# ------------------------------------------------------------------- clean


def clean_request(tmp_path, stub, targets, **kw):
    req = {"mode": "clean", "deadline_s": 30, "nvidia_smi": str(stub.path), "smi_timeout_s": 5,
           "scope": [0], "targets": targets, "units": [], "grace_s": 5.0, "timeout_s": 10.0,
           "poll_s": 0.05, "threshold_mib": {"0": 64, "1": 64}, "shm": False, "reset": False,
           "lock_path": str(tmp_path / "clean.lock"), "operator": "tester@laptop"}
    req.update(kw)
    return req


def agent_env(tmp_path):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return dict(os.environ, HOME=str(home))


def audit_lines(tmp_path):
    f = tmp_path / "home" / ".local" / "state" / "gpufleet" / "agent-audit.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def gpu_app(p, used=20998, uuid=GPU0_UUID):
    return {"pid": p.pid, "used": used, "uuid": uuid, "dynamic": True,
            "line": recorded_app_line(p.pid).replace(GPU0_UUID, uuid).replace(
                "20998", str(used))}


@pytest.mark.parametrize("python", PYTHONS)
def test_clean_exit_wait_polls_when_pidfd_is_disabled(tmp_path, children, python):
    """The request's "pidfd": false forces the polling fallback (a kernel without pidfds)."""
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    req = clean_request(tmp_path, stub, [{"pid": h.pid, "starttime": starttime(h.pid),
                                          "wave": 0}], pidfd=False, grace_s=0.5)
    doc = run_agent(req, python=python, env=agent_env(tmp_path))
    assert [(s["signal"], s["outcome"]) for s in doc["signals"]] == [("TERM", "sent"),
                                                                     ("KILL", "sent")]
    assert doc["signals"][1]["t"] - doc["signals"][0]["t"] >= 0.5
    assert h.wait(timeout=5) == -signal.SIGKILL
    assert doc["exit_wait"]["pidfd"] == 0 and doc["exit_wait"]["polled"] >= 1
    assert doc["exit_wait"]["reason"] == "pidfd disabled by the request"
    assert doc["memory_wait"]["ok"] is True


@pytest.mark.parametrize("python", PYTHONS)
def test_clean_term_honoured_and_memory_verdict(tmp_path, children, python):
    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    st = starttime(h.pid)
    doc = run_agent(clean_request(tmp_path, stub, [{"pid": h.pid, "starttime": st, "wave": 0}]),
                    python=python, env=agent_env(tmp_path))
    assert doc["lock"] == "acquired" and "error" not in doc, doc.get("traceback")
    assert [(s["pid"], s["signal"], s["outcome"]) for s in doc["signals"]] == \
        [(h.pid, "TERM", "sent")]
    assert h.wait(timeout=5) == -signal.SIGTERM
    # a pidfd, or gone before the wait began (it exits on TERM at once): never polled
    assert doc["exit_wait"]["polled"] == 0 and doc["exit_wait"]["reason"] is None
    assert doc["memory_wait"]["ok"] is True and doc["memory_wait"]["polls"] >= 1
    # exited, but this test (its parent) has not reaped it yet: reported as such, by parent
    assert [(x["pid"], x["state"], x["ppid"]) for x in doc["survivors"]] == \
        [(h.pid, "Z", os.getpid())]
    assert "zombie" in doc["survivors"][0]["reason"]
    after = parse_snapshot(doc["after"])
    assert {g.index: g.memory_used_mib for g in after.gpus}[0] == 0
    assert h.pid not in after.listed_pids()
    (line,) = audit_lines(tmp_path)
    assert (line["pid"], line["starttime"], line["signal"], line["outcome"], line["operator"]) \
        == (h.pid, st, "TERM", "sent", "tester@laptop")
    assert "gpufleet-test-holder" in line["cmdline"]


@pytest.mark.parametrize("python", PYTHONS)
def test_clean_term_ignored_gets_kill_after_grace(tmp_path, children, python):
    h = children.holder("stubborn", "--ignore-term")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    doc = run_agent(clean_request(tmp_path, stub,
                                  [{"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}],
                                  grace_s=0.5), python=python, env=agent_env(tmp_path))
    sig = [(s["signal"], s["outcome"]) for s in doc["signals"]]
    assert sig == [("TERM", "sent"), ("KILL", "sent")]
    assert doc["signals"][1]["t"] - doc["signals"][0]["t"] >= 0.5
    assert h.wait(timeout=5) == -signal.SIGKILL
    # the grace was waited on the pidfd (Python 3.6: pidfd_open through ctypes' syscall)
    assert doc["exit_wait"]["pidfd"] >= 1 and doc["exit_wait"]["polled"] == 0
    assert doc["memory_wait"]["ok"] is True
    assert [x["signal"] for x in audit_lines(tmp_path)] == ["TERM", "KILL"]


def test_clean_waves_in_order(tmp_path, children):
    root = children.holder("root")
    worker = children.holder("worker", "--ignore-term")
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": worker.pid, "starttime": starttime(worker.pid), "wave": 1},
        {"pid": root.pid, "starttime": starttime(root.pid), "wave": 0},
    ], grace_s=0.3, scope=[]), env=agent_env(tmp_path))
    assert [(s["pid"], s["signal"], s["outcome"]) for s in doc["signals"]] == [
        (root.pid, "TERM", "sent"), (worker.pid, "TERM", "sent"), (worker.pid, "KILL", "sent")]
    assert root.wait(timeout=5) == -signal.SIGTERM and worker.wait(timeout=5) == -signal.SIGKILL


def test_clean_pid_reused_is_not_signalled(tmp_path, children):
    h = children.holder()
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid) + 1, "wave": 0}], scope=[]),
        env=agent_env(tmp_path))
    assert [(s["signal"], s["outcome"]) for s in doc["signals"]] == [("TERM", "pid reused")]
    time.sleep(0.2)
    assert h.poll() is None  # still alive
    assert doc["survivors"] == []  # the process we meant is gone; this one is someone else
    assert doc["memory_wait"] == {"ok": True, "seconds": 0.0, "polls": 0, "used_mib": {},
                                  "error": None}


def test_clean_gone_target(tmp_path, children):
    h = children.holder()
    st = starttime(h.pid)
    h.kill()
    h.wait()
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [{"pid": h.pid, "starttime": st, "wave": 0}],
                                  scope=[]), env=agent_env(tmp_path))
    assert [s["outcome"] for s in doc["signals"]] == ["gone"]


def test_clean_lock_busy_when_second_clean_runs(tmp_path, children):
    h = children.holder("slow", "--ignore-term")
    stub = Stub(tmp_path / "stub")
    first_req = clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}], grace_s=3.0, scope=[])
    first = subprocess.Popen(bootstrap_command(sys.executable), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=agent_env(tmp_path))
    first.stdin.write(encode_request(first_req))
    first.stdin.close()
    try:
        lock = str(tmp_path / "clean.lock")
        end = time.monotonic() + 10
        held = False
        while time.monotonic() < end and not held:  # until the first clean holds the lock
            if os.path.exists(lock):
                with open(lock) as f:
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        fcntl.flock(f, fcntl.LOCK_UN)
                    except OSError:
                        held = True
            time.sleep(0.02)
        assert held
        other = children.holder("bystander")
        second = run_agent(clean_request(tmp_path, stub, [
            {"pid": other.pid, "starttime": starttime(other.pid), "wave": 0}],
            lock_wait_s=0.3, units=[{"unit": "x.service"}]), env=agent_env(tmp_path))
        assert second["lock"] == "busy"
        assert second["signals"] == [] and second["units_stopped"] == []
        assert other.poll() is None
        out = json.loads(first.stdout.read())
        assert out["lock"] == "acquired"
        assert [s["signal"] for s in out["signals"]] == ["TERM", "KILL"]
    finally:
        first.wait(timeout=30)
        first.stdout.close()


def test_clean_refuses_own_ancestor(tmp_path):
    """The agent never signals its ancestors, whatever the controller asked."""
    wrapper = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys; sys.exit(subprocess.call(sys.argv[1:]))"]
        + bootstrap_command(sys.executable),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=agent_env(tmp_path))
    stub = Stub(tmp_path / "stub")
    time.sleep(0.1)
    req = clean_request(tmp_path, stub, [
        {"pid": wrapper.pid, "starttime": starttime(wrapper.pid), "wave": 0},
        {"pid": 1, "starttime": starttime(1), "wave": 0}], scope=[], grace_s=0.2)
    out, _ = wrapper.communicate(encode_request(req), timeout=30)
    assert wrapper.returncode == 0  # not killed
    doc = json.loads(out)
    assert [s["outcome"] for s in doc["signals"]] == ["refused: own session",
                                                      "refused: pid <= 1"]
    reasons = {s["pid"]: s["reason"] for s in doc["survivors"]}
    assert reasons[wrapper.pid] == "refused: own session"


ZOMBIE_PARENT = r'''
import os, time
pid = os.fork()
if pid == 0:
    os._exit(0)
print(pid, flush=True)
time.sleep(600)
'''


def test_clean_zombie_target_names_parent(tmp_path, children):
    parent = children([sys.executable, "-c", ZOMBIE_PARENT], wait_ready=False)
    zpid = int(parent.stdout.readline())
    end = time.monotonic() + 5
    while proc_state(zpid) != "Z" and time.monotonic() < end:
        time.sleep(0.02)
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": zpid, "starttime": starttime(zpid), "wave": 0}], scope=[]),
        env=agent_env(tmp_path))
    assert [s["outcome"] for s in doc["signals"]] == ["gone"]
    (surv,) = doc["survivors"]
    assert surv["pid"] == zpid and surv["state"] == "Z"
    assert str(parent.pid) in surv["reason"] and "zombie" in surv["reason"]


def test_clean_zombie_leader_with_live_threads_is_signalled(tmp_path, children):
    p = children([sys.executable, "-c", ZOMBIE_LEADER])
    wait_state(p.pid, "Z")
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": p.pid, "starttime": starttime(p.pid), "wave": 0}], scope=[], grace_s=2.0),
        env=agent_env(tmp_path))
    assert [(s["signal"], s["outcome"]) for s in doc["signals"]] == [("TERM", "sent")]
    assert p.wait(timeout=5) == -signal.SIGTERM


def test_clean_memory_verdict_waits_for_memory(tmp_path, children):
    target = children.holder("target")
    other = children.holder("keeps-memory")  # not a target: its memory stays
    stub = Stub(tmp_path / "stub", apps=[gpu_app(target, 1000), gpu_app(other, 500)])
    t0 = time.monotonic()
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": target.pid, "starttime": starttime(target.pid), "wave": 0}], timeout_s=2.0),
        env=agent_env(tmp_path))
    assert time.monotonic() - t0 < 12
    mw = doc["memory_wait"]  # (the wait may end a poll before its timeout)
    assert mw["ok"] is False and mw["polls"] > 2 and 1.0 <= mw["seconds"] <= 6
    assert mw["used_mib"] == {"0": 500} and "GPU 0" in mw["error"]
    assert target.wait(timeout=5) == -signal.SIGTERM and other.poll() is None


def test_clean_memory_nothing_signalled_can_free_ends_the_wait_after_the_release_time(
        tmp_path, children):
    """release_floor_mib: memory no signalled process can free (the controller's
    release_floors). Past release_wait_s -- a driver releasing a process already gone -- the
    wait stops instead of running out its timeout; memory beyond that floor is waited for."""
    other = children.holder("not-signalled")
    stub = Stub(tmp_path / "stub", apps=[gpu_app(other, 500)])
    t0 = time.monotonic()
    doc = run_agent(clean_request(tmp_path, stub, [], timeout_s=8.0, release_wait_s=0.3,
                                  release_floor_mib={"0": 500}), env=agent_env(tmp_path))
    mw = doc["memory_wait"]
    assert time.monotonic() - t0 < 5
    assert mw["ok"] is False and mw["held_by_others"] is True and 0.3 <= mw["seconds"] < 2
    assert mw["error"] == "GPU 0 still above threshold: nothing signalled can free it"
    # more memory than the floor explains: that can still come back, so it is waited for
    # (waited well past the release window; the wait may end a poll before its timeout)
    doc = run_agent(clean_request(tmp_path, stub, [], timeout_s=2.0, release_wait_s=0.3,
                                  release_floor_mib={"0": 100}), env=agent_env(tmp_path))
    assert doc["memory_wait"]["seconds"] >= 1.0 and "held_by_others" not in doc["memory_wait"]
    assert other.poll() is None


def test_clean_units_are_argv_data(tmp_path):
    systemctl = tmp_path / "systemctl"
    log = tmp_path / "systemctl.log"
    systemctl.write_text("#!%s\nimport json, sys\nopen(%r, 'a').write(json.dumps(sys.argv[1:]) "
                         "+ '\\n')\n" % (sys.executable, str(log)))
    systemctl.chmod(0o755)
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [], scope=[], systemctl=str(systemctl), units=[
        {"unit": "vllm-minimax.service", "disable": True},
        {"unit": "x.service; reboot", "disable": False},
        {"unit": "-H.service"},
    ]), env=agent_env(tmp_path))
    assert [(u["unit"], u["ok"]) for u in doc["units_stopped"]] == [
        ("vllm-minimax.service", True), ("x.service; reboot", False), ("-H.service", False)]
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert [c[-2:] for c in calls] == [["stop", "vllm-minimax.service"],
                                       ["disable", "vllm-minimax.service"]]


def test_clean_unit_failure_reported(tmp_path):
    systemctl = tmp_path / "systemctl"
    systemctl.write_text("#!/bin/sh\necho 'Failed to stop x.service: Unit x.service not loaded.' "
                         ">&2\nexit 5\n")
    systemctl.chmod(0o755)
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [], scope=[], systemctl=str(systemctl),
                                  units=[{"unit": "x.service"}]), env=agent_env(tmp_path))
    (u,) = doc["units_stopped"]
    assert u["ok"] is False and "not loaded" in u["error"]


def test_clean_shm_leftovers(tmp_path, children):
    shm = tmp_path / "shm"
    shm.mkdir()
    names = ["nccl-unused", "torch_123_abc", "nccl-open", "psm_mapped", "vllm-recent",
             "other-file"]
    for n in names:
        (shm / n).write_bytes(b"\0" * 4096)
    old = time.time() - 3600
    for n in names:
        if n != "vllm-recent":
            os.utime(str(shm / n), (old, old))
    opener = children.holder("shm-open", str(shm / "nccl-open"))
    mapper = children([sys.executable, "-c",
                       "import mmap,sys,time\nf=open(sys.argv[1],'r+b')\n"
                       "m=mmap.mmap(f.fileno(),4096)\nf.close()\nprint('ready',flush=True)\n"
                       "time.sleep(600)", str(shm / "psm_mapped")])
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [], scope=[], shm=True, shm_dir=str(shm),
                                  shm_min_age_s=60), env=agent_env(tmp_path))
    assert sorted(doc["shm_removed"]) == [str(shm / "nccl-unused"), str(shm / "torch_123_abc")]
    assert sorted(p.name for p in shm.iterdir()) == ["nccl-open", "other-file", "psm_mapped",
                                                     "vllm-recent"]
    assert opener.poll() is None and mapper.poll() is None


def test_clean_reset_is_guarded(tmp_path):
    stub = Stub(tmp_path / "stub")
    doc = run_agent(clean_request(tmp_path, stub, [], scope=[0, 7], reset=True),
                    env=agent_env(tmp_path))
    assert doc["memory_wait"]["ok"] is False and doc["memory_wait"]["polls"] == 1
    assert doc["memory_wait"]["error"] == "no GPU with index 7"
    resets = {r["index"]: r for r in doc["reset"]}
    assert resets[7]["ok"] is False and "no GPU" in resets[7]["message"]
    facts = doc["after"]["facts"]
    calls = [c for c in stub.calls() if c and c[0] == "--gpu-reset"]
    if facts["is_root"] and not facts["in_container"] and not facts["wsl2"]:
        assert resets[0]["ok"] is True and calls == [["--gpu-reset", "-i", "0"]]
    else:
        assert resets[0]["ok"] is False and resets[0]["message"].startswith("not reset:")
        assert calls == []


def test_clean_deadline_bounds_everything(tmp_path, children):
    h = children.holder("stubborn2", "--ignore-term")
    stub = Stub(tmp_path / "stub", mode="hang")
    t0 = time.monotonic()
    doc = run_agent(clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}],
        deadline_s=3, grace_s=1.0, timeout_s=60, smi_timeout_s=30), env=agent_env(tmp_path),
        timeout=30)
    assert time.monotonic() - t0 < 10
    assert [s["signal"] for s in doc["signals"]] == ["TERM", "KILL"]
    assert doc["memory_wait"]["ok"] is False
    assert h.wait(timeout=5) == -signal.SIGKILL


def test_clean_survives_sighup_and_a_dropped_session(tmp_path, children):
    """A dropped SSH session (SIGHUP, stdout gone) must not cut the sequence half-way."""
    h = children.holder("hup-target", "--ignore-term")
    stub = Stub(tmp_path / "stub")
    req = clean_request(tmp_path, stub, [
        {"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}], scope=[], grace_s=1.0)
    p = subprocess.Popen(bootstrap_command(sys.executable), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env=agent_env(tmp_path))
    p.stdin.write(encode_request(req))
    p.stdin.close()
    end = time.monotonic() + 10
    while not audit_lines(tmp_path) and time.monotonic() < end:  # TERM sent: inside clean
        time.sleep(0.02)
    p.stdout.close()  # the reader is gone
    p.send_signal(signal.SIGHUP)
    assert p.wait(timeout=30) == 0
    assert h.wait(timeout=5) == -signal.SIGKILL  # KILL after grace still happened
    assert [(x["signal"], x["outcome"]) for x in audit_lines(tmp_path)] == \
        [("TERM", "sent"), ("KILL", "sent")]


STUCK = r"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("gfagent", sys.argv[1])
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)
def stuck(*args, **kw):
    if sys.argv[2] == "stubborn":  # swallows the first alarm, like a blocked system call
        while True:
            try:
                time.sleep(100)
            except BaseException:
                pass
    time.sleep(100)
agent.snapshot = stuck
agent.main(b'{"mode": "snapshot", "deadline_s": 1}')
"""


@pytest.mark.parametrize("how", ["unwinds", "stubborn"])
def test_alarm_is_the_last_resort_bound(how, tmp_path):
    agent_path = tmp_path / "agent.py"  # the joined payload, as a host gets it
    agent_path.write_bytes(agent_source())
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", STUCK, str(agent_path), how],
                         stdout=subprocess.PIPE, timeout=30).stdout
    assert time.monotonic() - t0 < 10
    doc = json.loads(out)
    assert doc["error"].startswith("agent deadline exceeded")
    assert doc["nvidia_smi"]["ok"] is False
    parse_snapshot(doc)


COMPILE_ALL = """
import sys
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        compile(f.read(), path, "exec")
"""


def test_pieces_and_payload_compile_under_a_real_python36(tmp_path):
    """What ast.parse(feature_version=(3, 6)) cannot promise (it misses some newer syntax on
    newer Pythons), a real 3.6 compiler can: every piece, the loader, wait_http and the joined
    payload."""
    if PY36 is None:
        pytest.skip("no Python 3.6 here: only the ast checks of test_layers.py guard 3.6")
    remote = REPO / "gpufleet" / "remote"
    payload = tmp_path / "agent.py"
    payload.write_bytes(agent_source())
    files = [str(remote / (name + ".py")) for name in AGENT_PIECES + ("loader", "wait_http")]
    r = subprocess.run([PY36, "-c", COMPILE_ALL] + files + [str(payload)],
                       stderr=subprocess.PIPE, timeout=60)
    assert r.returncode == 0, r.stderr.decode()


def test_clean_as_other_user_reports_permission_denied(tmp_path, children):
    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(system_python, os.X_OK):
        pytest.skip("needs root (to run the agent as nobody) and /usr/bin/python3")
    h = children.holder("roots-own")
    lock_dir = tempfile.mkdtemp(prefix="gpufleet-test-")  # 0700; nobody's own, as a lock's must be
    os.chown(lock_dir, 65534, 65534)
    lock = lock_dir + "/clean.lock"
    try:
        req = {"mode": "clean", "deadline_s": 20, "scope": [], "grace_s": 0.3,
               "timeout_s": 5, "poll_s": 0.05, "lock_path": lock, "operator": "t",
               "nvidia_smi": "/nonexistent/nvidia-smi",
               "targets": [{"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}]}
        doc = run_agent(req, python=system_python, user=65534, group=65534, extra_groups=[],
                        cwd="/tmp", env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    finally:
        shutil.rmtree(lock_dir)
    assert doc["lock"] == "acquired", doc.get("error")
    assert [(s["signal"], s["outcome"]) for s in doc["signals"]] == \
        [("TERM", "permission denied")]
    assert h.poll() is None
    (surv,) = doc["survivors"]
    assert "EPERM" in surv["reason"]
    assert doc["after"]["facts"]["can_read_all_fds"] is False
    assert any("would be hidden" in w for w in doc["after"]["warnings"])
    assert any("audit file" in w for w in doc["warnings"])  # best effort, and said so


def test_minor_numbers_from_q_when_proc_lacks_them(tmp_path, monkeypatch):
    from gpufleet.remote import agent
    stub = Stub(tmp_path / "stub")  # -q prints the recorded Minor Number / Bus Id lines
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    monkeypatch.setattr(agent, "DEV", str(dev))
    # index and minor differ on purpose: matched by bus id, never by position
    gpus = [{"index": 0, "pci_bus_id": "00000000:00:07.0"},
            {"index": 1, "pci_bus_id": "00000000:00:06.0"}]
    smi_doc, warnings = {"seconds": 0.0}, []
    agent.attach_minors(gpus, str(stub.path), {"smi_timeout_s": 5}, agent.Deadline(10),
                        smi_doc, warnings, proc=str(tmp_path / "noproc"))
    assert [g["minor"] for g in gpus] == [1, 0]
    assert stub.calls() == [["-q"]] and warnings == []

    info = tmp_path / "proc" / "driver" / "nvidia" / "gpus" / "0000:00:07.0"
    info.mkdir(parents=True)
    (info / "information").write_text("Bus Location: \t 0000:00:07.0\nDevice Minor: \t 5\n")
    gpus = [{"index": 0, "pci_bus_id": "00000000:00:07.0"}]
    agent.attach_minors(gpus, str(stub.path), {"smi_timeout_s": 5}, agent.Deadline(10),
                        smi_doc, warnings, proc=str(tmp_path / "proc"))
    assert gpus[0]["minor"] == 5 and len(stub.calls()) == 1  # /proc/driver first, no -q


# ----------------------------- clients and holders: maps, vanished holders, unreadable-fd reasons

MAPPER = r'''
import ctypes, mmap, sys, time
ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)
files = [open(p, "rb") for p in sys.argv[2].split(",") if p]
mfiles = [open(p, "rb") for p in sys.argv[3].split(",") if p]
maps = [mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ) for f in mfiles]
for f in mfiles:
    f.close()  # the mapping stays; the fd does not (CUDA keeps both, the fd list is argv 2)
print("ready", flush=True)
time.sleep(600)
'''


def test_snapshot_reports_which_device_files_each_holder_maps(tmp_path, children):
    """Recorded on the H200: every process opens the same device files; a CUDA process maps
    nvidia-uvm, its GPU's /dev/nvidiaN and nvidiactl, an NVML client maps none, a running
    nvidia-smi only nvidiactl. The agent reports holders[].mapped."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"]).returncode != 0:
        pytest.skip("unshare -m not permitted here")
    devs = "/dev/nvidia0,/dev/nvidia1,/dev/nvidiactl,/dev/nvidia-uvm"
    setup = ("mount -t tmpfs tmpfs /dev && for f in nvidia0 nvidia1 nvidiactl nvidia-uvm; do "
             "printf x > /dev/$f; done && exec \"$0\" -c \"$1\" \"$2\" \"$3\" \"$4\"")

    def start(name, mapped):
        return children(["unshare", "-m", "--propagation", "private", "sh", "-c", setup,
                         sys.executable, MAPPER, name, devs, mapped])

    cuda = start("cudaish", "/dev/nvidia-uvm,/dev/nvidia1,/dev/nvidiactl")
    client = start("nvmlish", "")
    smi = start("smiish", "/dev/nvidiactl")
    doc = run_agent(snap_request(Stub(tmp_path / "stub")))
    mapped = {x["pid"]: x["mapped"] for x in doc["holders"]}
    assert mapped[cuda.pid] == ["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidiactl"]
    assert mapped[client.pid] == []
    assert mapped[smi.pid] == ["/dev/nvidiactl"]
    snap = parse_snapshot(doc)
    from gpufleet.core import policy
    roles = policy.holder_roles(snap, 64)
    assert roles[client.pid].role == roles[smi.pid].role == policy.ROLE_CLIENT
    assert doc["holders_vanished"] == []


def test_parse_maps_devices_reads_the_pathname_column():
    from gpufleet.remote import agent
    text = ("7f00-7f01 rw-s 00000000 00:05 12 /dev/nvidiactl\n"
            "7f01-7f02 rw-s 00000000 00:05 13 /dev/nvidia0 (deleted)\n"
            "7f02-7f03 r--p 00000000 08:01 99 /usr/lib/libcuda.so.1\n"
            "7f03-7f04 rw-s 00000000 00:05 14 /dev/nvidia-uvm\n"
            "7f04-7f05 rw-s 00000000 00:05 15 /dev/shm/nccl-x\n"
            "7f05-7f06 rw-p 00000000 00:00 0 \n")
    assert agent.parse_maps_devices(text) == ["/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl"]


# The H200 probe's part D (tests/fixtures/real-h200/clean-cases/probe-1.log): the device files
# are opened and mapped, then the main thread calls pthread_exit while another runs on (or,
# with "stuck", sits in uninterruptible sleep: tests/lab/fakecuda.py's sleep_in_kernel).
ZOMBIE_LEADER_MAPPED = r'''
import ctypes, mmap, sys, threading, time
sys.path.insert(0, sys.argv[1])
import fakecuda
held = [(f, mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ))
        for f in [open(p, "rb") for p in sys.argv[3:]]]
_, tid = fakecuda.hold_in_thread(lambda: None, sys.argv[2] == "stuck")
print("ready", flush=True)
print(tid, flush=True)
ctypes.CDLL(None).pthread_exit(None)
'''


def zombie_leader_mapping(children, how):
    """A zombie leader whose live thread keeps /dev/nvidia0 and /dev/nvidia-uvm (one-byte files
    on a private /dev) open and mapped; returns (process, the live thread's tid)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"]).returncode != 0:
        pytest.skip("unshare -m not permitted here")
    script = ("mount -t tmpfs tmpfs /dev && for f in nvidia0 nvidia-uvm; do printf x > /dev/$f; "
              "done && exec \"$0\" -c \"$1\" \"$2\" \"$3\" /dev/nvidia0 /dev/nvidia-uvm")
    z = children(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                  sys.executable, ZOMBIE_LEADER_MAPPED, str(REPO / "tests" / "lab"), how])
    tid = int(z.stdout.readline())
    wait_state(z.pid, "Z")
    return z, tid


def test_maps_of_a_zombie_leader_are_its_live_threads(tmp_path, children):
    """Recorded on the H200: the leader's maps are empty, its live threads' show the devices.
    Read through a live thread, the holder is a CUDA context again (policy.holder_role)."""
    from gpufleet.remote import agent
    z, tid = zombie_leader_mapping(children, "hold")
    assert Path("/proc/%d/maps" % z.pid).read_text() == ""
    assert agent.mapped_devices(z.pid) == ["/dev/nvidia-uvm", "/dev/nvidia0"]
    assert agent.mapped_devices(os.getpid()) is not None
    doc = run_agent(snap_request(Stub(tmp_path / "stub")))
    (held,) = [h for h in doc["holders"] if h["pid"] == z.pid]
    assert held["mapped"] == ["/dev/nvidia-uvm", "/dev/nvidia0"]
    entry = doc["processes"][str(z.pid)]
    assert (entry["state"], entry["threads"], entry["live_threads"], entry["stuck_threads"]) == (
        "Z", 2, 1, [])
    snap = parse_snapshot(doc)
    assert snap.processes[z.pid].threads == 2 and snap.processes[z.pid].stuck_threads == ()


def test_a_zombie_leaders_thread_in_d_state_is_reported_with_its_wchan(tmp_path, children):
    """A killed process's threads stuck in the driver: the zombie leader's live threads all
    in D. The agent reports each with its wchan (here the kernel's handle_userfault)."""
    z, tid = zombie_leader_mapping(children, "stuck")
    doc = run_agent(snap_request(Stub(tmp_path / "stub")))
    entry = doc["processes"][str(z.pid)]
    assert entry["live_threads"] == 1
    assert entry["stuck_threads"] == [{"tid": tid, "wchan": "handle_userfault"}]
    (held,) = [h for h in doc["holders"] if h["pid"] == z.pid]
    assert held["mapped"] == ["/dev/nvidia-uvm", "/dev/nvidia0"]
    (stuck,) = parse_snapshot(doc).processes[z.pid].stuck_threads
    assert (stuck.tid, stuck.wchan) == (tid, "handle_userfault")


def test_holder_gone_before_its_details_are_read_is_not_a_holder(tmp_path, children,
                                                                  monkeypatch):
    """Concurrent scans: a concurrent nvidia-smi run is caught by the fd scan and is gone (or
    its PID reused) when its details are read: it used to show as `? 695 (fd: GPUs 0)`."""
    from gpufleet.remote import agent
    gone = children.holder("goner", "/dev/null")
    reused = children.holder("reused", "/dev/null")
    real_entry = agent.process_entry

    def entry(pid, ctx, proc=agent.PROC):
        if pid == gone.pid:
            return None  # exited between the fd scan and this read
        doc = real_entry(pid, ctx, proc)
        if doc is not None and pid == reused.pid:
            doc["starttime"] += 1  # a new process under the same PID
        return doc

    monkeypatch.setattr(agent, "process_entry", entry)
    monkeypatch.setattr(agent, "device_target", lambda t: t if t == "/dev/null" else None)
    stub = Stub(tmp_path / "stub")
    doc = agent.snapshot(snap_request(stub), agent.Deadline(30))
    held = {h["pid"] for h in doc["holders"]}
    assert gone.pid not in held and reused.pid not in held
    assert {gone.pid, reused.pid} <= set(doc["holders_vanished"])
    assert str(gone.pid) not in doc["processes"]


def test_unreadable_fds_say_the_true_reason(tmp_path):
    from gpufleet.remote import agent
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "comm").write_text("process_api\n")
    (tmp_path / "1" / "status").write_text("Name:\tprocess_api\nUid:\t0\t0\t0\t0\n")
    (reason,) = agent.denied_reasons([1], proc=str(tmp_path))
    assert reason["pid"] == 1 and reason["comm"] == "process_api"
    if os.geteuid() == 0:
        assert reason["reason"].startswith("permission denied although the agent is root")
    else:
        assert "(not root)" in reason["reason"]



def test_the_controllers_clean_requests_skip_the_cuda_version(tmp_path, children, monkeypatch):
    """ops.clean's two requests (the plan's snapshot; the clean and its after-snapshot) ask for
    no CUDA version, and the real agent then runs no bare `nvidia-smi` (110 ms on an H200,
    time a clean's caller waits) between "the memory is back" and the verdict. Only the test's own holder is
    ever a target: this machine's /proc is shared (the plan's other candidates are dropped)."""
    from gpufleet.config.inventory import Host
    from gpufleet.core.model import parse_snapshot
    from gpufleet.core.plan import make_plan
    from gpufleet.ops.clean import CleanOptions, clean_request, plan_host
    from gpufleet.transport import AgentReply, Session

    class Recorder(Session):
        """Records what the controller asks the agent; answers with a failure."""

        def __init__(self, host):
            super().__init__(host)
            self.requests = []

        def run_agent(self, request, timeout=None):
            self.requests.append(dict(request))
            return AgentReply(False, error="recorded", error_kind="agent")

    h = children.holder()
    stub = Stub(tmp_path / "stub", apps=[gpu_app(h)])
    host = Host(name="here", connection="local", python=sys.executable, nvidia_smi=str(stub.path))
    opts = CleanOptions(gpus="0", grace_s=5.0, timeout_s=10.0, operator="t",
                        lock_path=str(tmp_path / "lock"))
    recorder = Recorder(host)
    assert not plan_host(host, recorder, opts).ok
    (plan_request,) = recorder.requests
    assert plan_request["mode"] == "snapshot" and plan_request["cuda_version"] is False
    before = run_agent(plan_request, env=agent_env(tmp_path))
    assert before["facts"]["cuda_version"] is None
    snap = parse_snapshot(before)
    request = clean_request(host, make_plan(snap, [0], host="here"), opts, snap)
    assert request["cuda_version"] is False
    request["targets"] = [{"pid": h.pid, "starttime": starttime(h.pid), "wave": 0}]
    (tmp_path / "stub" / "calls.jsonl").unlink()
    doc = run_agent(request, env=agent_env(tmp_path))
    assert [(s["pid"], s["outcome"]) for s in doc["signals"]] == [(h.pid, "sent")]
    assert h.wait(timeout=5) == -signal.SIGTERM
    assert doc["memory_wait"]["ok"] is True and doc["after"]["gpus"]
    calls = stub.calls()
    assert [c for c in calls if c == []] == []  # no bare nvidia-smi in the clean, after included
    assert any(c and c[0].startswith("--query-compute-apps=") for c in calls)  # the after-snapshot
    status = run_agent(snap_request(stub), env=agent_env(tmp_path))  # asked (status): still read
    assert status["facts"]["cuda_version"] == "13.0" and [] in stub.calls()
