"""The lab itself: real sshd hosts in namespaces, fake driver, fakecuda holders.

These are the guarantees other tests build on; each would fail if the lab cheated (e.g. a holder
not really detached, a namespace not really private, a device file not really opened).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import HolderPid, LabError


def wait_for(cond, timeout: float = 10.0, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not reached in %.0fs" % timeout)


# --- sessions ----------------------------------------------------------------------------------


def test_ssh_session_runs_python3_and_nvidia_smi(lab_host):
    res = lab_host.ssh("hostname; command -v python3 nvidia-smi; python3 -c 'import sys; print(sys.version_info[0])'; nvidia-smi -L")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == lab_host.name
    assert lines[1:3] == ["/usr/bin/python3", "/usr/bin/nvidia-smi"]
    assert lines[3] == "3"
    assert [re.sub(r"\(UUID: GPU-[0-9a-f-]{36}\)", "(UUID)", x) for x in lines[4:]] == [
        "GPU 0: NVIDIA RTX 6000 Ada Generation (UUID)",
        "GPU 1: NVIDIA RTX 6000 Ada Generation (UUID)",
    ]


def test_non_root_user_logs_in(lab, lab_host):
    res = lab_host.ssh("id -un; echo $HOME; nvidia-smi --query-gpu=index --format=csv,noheader", user=lab.user)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [lab.user, "/home/" + lab.user, "0", "1"]


def test_agent_style_command_reads_stdin(lab_host):
    # The agent is sent on stdin to a constant `python3 -c ...` command (docs/DESIGN.md).
    code = 'import sys;d=sys.stdin.buffer.read();n=d.index(b"\\n");k=int(d[:n]);exec(compile(d[n+1:n+1+k],"a","exec"),{"REQUEST":d[n+1+k:]})'
    src = "import json,os;print(json.dumps({'pid':os.getpid(),'req':REQUEST.decode()}))"
    res = lab_host.ssh(["python3", "-c", code], input="%d\n%s{\"mode\":1}" % (len(src), src))
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["req"] == '{"mode":1}' and doc["pid"] < 1000


def test_host_key_is_checked(lab, lab_host, tmp_path):
    known = lab.known_hosts_path.read_text().splitlines()
    assert lab_host.host_key_line in known
    assert lab_host.host_key_line.startswith("[127.0.0.1]:%d ssh-ed25519 " % lab_host.port)
    wrong = tmp_path / "known_hosts"
    wrong.write_text(lab.wrong_host_key_line(lab_host) + "\n")
    argv = [a if not a.startswith("UserKnownHostsFile=") else "UserKnownHostsFile=%s" % wrong for a in lab_host.ssh_argv()]
    res = subprocess.run(argv + ["true"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in res.stderr


def test_paramiko_connects_with_lab_files(lab, lab_host):
    paramiko = pytest.importorskip("paramiko")
    client = paramiko.SSHClient()
    client.load_host_keys(str(lab.known_hosts_path))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(lab_host.address, port=lab_host.port, username="root", key_filename=str(lab.client_key),
                   look_for_keys=False, allow_agent=False, timeout=10)
    try:
        _, out, _ = client.exec_command("nvidia-smi --query-gpu=count --format=csv,noheader")
        assert out.read().decode().split() == ["2", "2"]
    finally:
        client.close()


def test_nvidia_smi_off_path(make_host):
    host = make_host(nvidia_smi="/usr/local/nvidia/bin/nvidia-smi")
    res = host.ssh("command -v nvidia-smi; echo rc=$?; /usr/local/nvidia/bin/nvidia-smi --query-gpu=index --format=csv,noheader; ls /usr/local/bin >/dev/null && echo usr-local-intact")
    assert res.stdout.split() == ["rc=1", "0", "1", "usr-local-intact"]
    assert not os.path.exists("/usr/local/nvidia")  # nothing written to the real disk


def test_no_nvidia_smi(make_host):
    host = make_host(nvidia_smi=None)
    res = host.ssh("command -v nvidia-smi; ls /usr/bin/nvidia-smi /usr/local/nvidia/bin/nvidia-smi /usr/lib/wsl/lib/nvidia-smi")
    assert res.stdout == ""
    assert res.returncode != 0


def test_host_without_python3(make_host):
    host = make_host(python3=False)
    res = host.ssh(["python3", "-c", "print(1)"])
    assert res.returncode == 127
    assert "python3" in res.stderr and "not found" in res.stderr
    assert host.ssh("nvidia-smi --query-gpu=index --format=csv,noheader; ls /proc/1/stat").stdout.split() == ["0", "1", "/proc/1/stat"]


def test_wsl2_host(make_host):
    host = make_host(wsl2=True, gpus=1, ghost_mib=1680)
    res = host.ssh("ls /dev | grep -E 'nvidia|dxg'; command -v nvidia-smi; echo rc=$?; /usr/lib/wsl/lib/nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits")
    assert res.stdout.split() == ["dxg", "rc=1", "1680"]
    pid = host.spawn_holder(gpus=[0], mib=716)
    assert set(host.fds(pid)) >= {"/dev/dxg"}
    assert not any(f.startswith("/dev/nvidia") for f in host.fds(pid))
    apps = host.ssh("/usr/lib/wsl/lib/nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits").stdout
    assert apps.strip() == "%d, [N/A]" % pid
    assert host.gpu_used() == [1680 + 716]


@pytest.mark.parametrize("mode", ["fail", "hang", "garbage"])
def test_broken_drivers(make_host, mode):
    host = make_host(driver=mode, gpus=1)
    res = host.ssh("timeout 2 nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits; echo rc=$?")
    if mode == "fail":
        assert "couldn't communicate with the NVIDIA driver" in res.stdout and res.stdout.endswith("rc=9\n")
    elif mode == "hang":
        assert res.stdout == "rc=124\n"
    else:
        first = res.stdout.splitlines()[0]
        assert not re.fullmatch(r"\d+, \d+", first) and res.stdout.endswith("rc=0\n")


def test_set_config_changes_the_driver(lab_host):
    lab_host.set_config(fail=True)
    assert lab_host.ssh("nvidia-smi").returncode == 9
    lab_host.set_config(fail=False, ghost_mib=4)
    assert lab_host.gpu_used() == [4, 4]


# --- holders -----------------------------------------------------------------------------------


def test_holder_is_renamed_in_comm_and_cmdline(lab_host):
    pid = lab_host.spawn_holder(gpus=[1], mib=716, title="VLLM::Worker")
    assert isinstance(pid, HolderPid) and pid.starttime
    assert lab_host.comm(pid) == "VLLM::Worker"
    assert lab_host.cmdline(pid)[0] == "VLLM::Worker"
    ps = lab_host.ssh(["ps", "-o", "comm=,args=", "-p", str(pid)]).stdout.split()
    assert ps == ["VLLM::Worker", "VLLM::Worker"]


def test_non_root_holder_is_renamed_too(lab, lab_host):
    pid = lab_host.spawn_holder(gpus=[0], mib=100, title="VLLM::Worker", user=lab.user)
    assert (lab_host.comm(pid), lab_host.cmdline(pid)[0]) == ("VLLM::Worker", "VLLM::Worker")
    uid = lab_host.ssh(["stat", "-c", "%U", "/proc/%d" % pid]).stdout.strip()
    assert uid == lab.user


def test_untitled_holder_is_listed_by_argv0(lab, lab_host):
    # Recorded: nvidia-smi's process_name is argv[0] as the process was started.
    pid = lab_host.spawn_holder(gpus=[0], mib=300)
    other = lab_host.spawn_holder(gpus=[1], mib=300, user=lab.user)
    names = lab_host.smi("--query-compute-apps=pid,process_name", "--format=csv,noheader").stdout.splitlines()
    assert names == ["%d, %s" % (pid, lab_host.cmdline(pid)[0]), "%d, python3" % other]


def test_holder_opens_every_device_file(make_host):
    host = make_host(gpus=4)
    pid = host.spawn_holder(gpus=[2], mib=716)
    fds = host.fds(pid)
    for dev in ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert dev in fds
    assert fds.count("/dev/nvidia2") > fds.count("/dev/nvidia0")  # more fds on the GPU it uses
    assert host.gpu_used() == [0, 0, 716, 0]


def test_cuda_visible_devices_maps_to_physical_gpu(make_host):
    # Recorded: with CUDA_VISIBLE_DEVICES=1 the process still holds fds on /dev/nvidia0 too,
    # while its memory is on GPU 1.
    host = make_host(gpus=2)
    pid = host.spawn_holder(gpus=[0], mib=4614, cuda_visible="1")
    assert "/dev/nvidia0" in host.fds(pid) and "/dev/nvidia1" in host.fds(pid)
    assert host.gpu_used() == [0, 4614]
    uuid1 = host.smi("-i", "1", "--query-gpu=uuid", "--format=csv,noheader").stdout.strip()
    apps = host.smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader").stdout.strip()
    assert apps == "%d, %s" % (pid, uuid1)


def test_minor_numbers_name_the_device_files(make_host):
    host = make_host(gpus=2, minors=[1, 0])
    res = host.ssh("ls /dev | grep -E '^nvidia[0-9]'; nvidia-smi -q | grep 'Minor Number'")
    assert res.stdout.split()[:2] == ["nvidia0", "nvidia1"]
    assert [line.split(":")[1].strip() for line in res.stdout.splitlines()[2:]] == ["1", "0"]
    pid = host.spawn_holder(gpus=[0], mib=10)
    fds = host.fds(pid)
    assert fds.count("/dev/nvidia1") > fds.count("/dev/nvidia0")  # index 0 is minor 1


def test_holder_outlives_its_ssh_session_and_is_in_the_host_pid_namespace(make_host):
    host = make_host()
    pid = host.spawn_holder(gpus=[0], mib=716)
    outer = host.outer_pid(pid)
    assert outer is not None and outer != pid
    assert host.alive(pid)
    ps = host.ssh(["ps", "-o", "pid=,ppid=,sid=", "-p", str(pid)]).stdout.split()
    assert ps == [str(pid), "1", str(pid)]  # reparented to the host's init, own session
    assert "lab_init.py" in host.ssh("tr '\\0' ' ' < /proc/1/cmdline").stdout  # PID 1 is the lab's init


def test_hosts_are_isolated(make_host):
    a = make_host()
    b = make_host()
    pa = a.spawn_holder(gpus=[0], mib=1000)
    assert a.gpu_used() == [1000, 0]
    assert b.gpu_used() == [0, 0]
    a.ssh("echo hello > /tmp/mark; echo x > /dev/shm/mark", check=True)
    assert b.ssh("ls /tmp/mark /dev/shm/mark").returncode != 0
    assert not os.path.exists("/tmp/mark")
    assert b.ssh("pgrep -c -f fakecuda").stdout.strip() == "0"
    assert a.ssh(["ps", "-p", str(pa), "-o", "pid="]).stdout.strip() == str(pa)


def test_vllm_family(lab_host):
    api = lab_host.spawn_vllm(gpus=[0, 1], mib=2000)
    engine = api.children[0]
    workers = engine.children
    assert [lab_host.cmdline(w)[0] for w in workers] == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    assert [lab_host.comm(w) for w in workers] == ["VLLM::Worker_TP", "VLLM::Worker_TP"]  # 15 bytes
    assert lab_host.comm(engine) == "VLLM::EngineCor"  # comm is 15 bytes
    assert lab_host.cmdline(engine)[0] == "VLLM::EngineCore_DP0"
    ppids = lab_host.ssh(["ps", "-o", "pid=,ppid=", "-p", ",".join(str(p) for p in api.family())]).stdout
    parent = {int(a): int(b) for a, b in (line.split() for line in ppids.splitlines())}
    assert parent[engine] == api and parent[workers[0]] == engine and parent[workers[1]] == engine
    assert not any(f.startswith("/dev/nvidia") for f in lab_host.fds(api))
    assert "/dev/nvidia0" in lab_host.fds(engine)
    assert lab_host.gpu_used() == [2000, 2000]


# --- memory accounting -------------------------------------------------------------------------


def test_memory_released_when_holder_killed(lab_host):
    pid = lab_host.spawn_holder(gpus=[0, 1], mib=[716, 20998])
    assert lab_host.gpu_used() == [716, 20998]
    assert lab_host.kill(pid)
    assert lab_host.wait_gone(pid)
    assert lab_host.gpu_used() == [0, 0]
    assert pid not in lab_host.records()


def test_memory_released_after_delay(make_host):
    delay = 1.5
    host = make_host(release_delay_s=delay, gpus=1)
    pid = host.spawn_holder(gpus=[0], mib=40000, term_delay=0.5)
    host.kill(pid, signal.SIGTERM)
    assert host.alive(pid)  # the handler takes 0.5 s: memory stays meanwhile
    assert host.gpu_used() == [40000]
    assert host.wait_gone(pid)
    t0 = time.monotonic()
    assert host.gpu_used() == [40000]  # dead, but the driver has not released it yet
    wait_for(lambda: host.gpu_used() == [0], timeout=delay + 10)
    assert time.monotonic() - t0 >= delay - 0.3


def test_allocation_beyond_free_memory_fails(make_host):
    host = make_host(gpus=1, total_mib=24576, reserved_mib=0, ghost_mib=4096)
    host.spawn_holder(gpus=[0], mib=16384)
    with pytest.raises(LabError, match="CUDA out of memory"):
        host.spawn_holder(gpus=[0], mib=8192)
    assert host.gpu_used() == [4096 + 16384]


def test_zombie_holds_no_memory(lab_host):
    pid = lab_host.spawn_holder(gpus=[1], mib=100, zombie_child=6144)
    assert pid.zombie and lab_host.proc_state(pid.zombie) == "Z"
    assert not lab_host.alive(pid.zombie)
    assert lab_host.gpu_used() == [0, 100]


def test_leader_exit_holder_is_a_zombie_leader_that_still_holds(lab_host):
    """As recorded on the H200 (probe-1.log part D): the main thread is gone (Z, empty fd table
    and maps), a live thread holds the device files and maps; nvidia-smi lists the PID with its
    memory; SIGKILL of the PID ends every thread and frees it."""
    pid = lab_host.spawn_holder(gpus=[1], mib=700, title="zleader", leader_exit=True)
    assert lab_host.proc_state(pid) == "Z" and lab_host.threads(pid) >= 2
    assert lab_host.alive(pid)
    assert lab_host.fds(pid) == []
    thread = pid.thread
    assert pid.thread != pid and lab_host.task_states(pid)[thread][0] == "S"
    fds = {os.readlink(lab_host.path("/proc/%d/task/%d/fd/%s" % (pid, thread, fd)))
           for fd in os.listdir(lab_host.path("/proc/%d/task/%d/fd" % (pid, thread)))}
    assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= fds
    maps = lab_host.path("/proc/%d/task/%d/maps" % (pid, thread)).read_text()
    assert "/dev/nvidia-uvm" in maps and "/dev/nvidia1" in maps
    assert lab_host.path("/proc/%d/maps" % pid).read_text() == ""
    assert lab_host.gpu_used() == [0, 700]
    apps = lab_host.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    assert apps.stdout.split() == ["%d," % pid, "700"], apps.stdout
    lab_host.kill(pid)
    assert lab_host.wait_gone(pid) and lab_host.proc_state(pid) is None
    assert lab_host.gpu_used() == [0, 0]


def test_stuck_holder_has_a_thread_in_d_state(lab_host):
    """``stuck``: the holding thread sleeps uninterruptibly (D) in the kernel, as a killed
    process's threads stuck in the driver show; signals other than SIGKILL leave it there."""
    pid = lab_host.spawn_holder(gpus=[0], mib=500, leader_exit=True, stuck=True)
    states = lab_host.task_states(pid)
    assert states[pid][0] == "Z" and states[pid.thread] == ("D", "handle_userfault"), states
    assert lab_host.alive(pid) and lab_host.gpu_used() == [500, 0]
    lab_host.kill(pid, signal.SIGSTOP)
    time.sleep(0.2)
    assert lab_host.task_states(pid)[pid.thread][0] == "D"
    lab_host.kill(pid, signal.SIGKILL)
    assert lab_host.wait_gone(pid)
    assert lab_host.gpu_used() == [0, 0]


def test_ignore_term_survives_sigterm(lab_host):
    pid = lab_host.spawn_holder(gpus=[0], mib=500, ignore_term=True)
    lab_host.kill(pid, signal.SIGTERM)
    time.sleep(0.3)
    assert lab_host.alive(pid) and lab_host.gpu_used()[0] == 500
    lab_host.kill(pid, signal.SIGKILL)
    assert lab_host.wait_gone(pid)
    assert lab_host.gpu_used()[0] == 0


def test_killed_worker_of_live_parent_is_a_zombie_and_releases(lab_host):
    api = lab_host.spawn_vllm(gpus=[0, 1], mib=1000)
    worker = api.children[0].children[1]
    lab_host.kill(worker)
    wait_for(lambda: lab_host.proc_state(worker) == "Z")
    assert lab_host.gpu_used() == [1000, 0]


def test_gpu_reset_over_ssh(lab, make_host):
    host = make_host(gpus=2, ghost_mib={1: 1680})
    pid = host.spawn_holder(gpus=[0], mib=716)
    busy = host.ssh("nvidia-smi --gpu-reset -i 1")
    # CUDA opens every /dev/nvidiaN: the holder on GPU 0 keeps GPU 1 "in use" too.
    assert busy.returncode == 255 and "In use by another client" in busy.stdout
    host.kill(pid)
    host.wait_gone(pid)
    assert host.ssh("nvidia-smi --gpu-reset -i 1", user=lab.user).returncode == 4
    ok = host.ssh("nvidia-smi --gpu-reset -i 1")
    assert ok.returncode == 0 and ok.stdout.endswith("All done.\n")
    assert [r["index"] for r in host.resets()] == [1]
    assert host.gpu_used() == [0, 0]


# --- unreachable hosts, inventory, teardown -------------------------------------------------------


def _connect(port: int, timeout: float) -> str:
    s = socket.socket()
    s.settimeout(timeout)
    try:
        s.connect(("127.0.0.1", port))
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except (socket.timeout, TimeoutError):
        return "timeout"
    finally:
        s.close()


def test_dead_host_refuses(lab):
    dead = lab.dead_host()
    assert _connect(dead.port, 5) == "refused"
    argv = ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", str(dead.port), "127.0.0.1", "true"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 255 and "Connection refused" in res.stderr


def test_blackholed_host_times_out(lab):
    hole = lab.blackholed_host()
    t0 = time.monotonic()
    assert _connect(hole.port, 1.0) == "timeout"
    assert time.monotonic() - t0 >= 0.9
    argv = ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=1", "-p", str(hole.port), "127.0.0.1", "true"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert res.returncode == 255 and "timed out" in res.stderr


def test_mute_host_connects_but_never_speaks(lab):
    mute = lab.mute_host()
    s = socket.create_connection(("127.0.0.1", mute.port), timeout=5)
    s.settimeout(0.5)
    with pytest.raises((socket.timeout, TimeoutError)):
        s.recv(100)
    s.close()


def test_inventory_yaml(lab, lab_host, tmp_path):
    yaml = pytest.importorskip("yaml")
    dead = lab.dead_host("gone")
    path = lab.inventory_yaml(
        [lab_host, dead], path=tmp_path / "fleet.yaml", connect_timeout=2,
        groups={"all-lab": [lab_host, dead]}, **{lab_host.name: {"user": lab.user, "protect": ["*train*"]}},
    )
    doc = yaml.safe_load(path.read_text())
    entry = doc["hosts"][lab_host.name]
    assert entry == {
        "address": "127.0.0.1", "port": lab_host.port, "user": lab.user,
        "identity_file": str(lab.client_key), "known_hosts_file": str(lab.known_hosts_path),
        "host_key_policy": "strict", "connect_timeout": 2, "protect": ["*train*"],
    }
    assert doc["hosts"]["gone"]["port"] == dead.port and doc["hosts"]["gone"]["user"] == "root"
    assert doc["groups"] == {"all-lab": [lab_host.name, "gone"]}
    try:
        from gpufleet.config.inventory import load_inventory
    except ImportError:
        return
    inv = load_inventory(path)
    assert inv is not None


def test_stop_ends_every_process_of_the_host(make_host):
    host = make_host()
    pid = host.spawn_holder(gpus=[0], mib=10, ignore_term=True)
    outer = host.outer_pid(pid)
    init = host.root_pid
    host.stop()
    assert not host.running
    wait_for(lambda: not os.path.exists("/proc/%d" % outer) and not os.path.exists("/proc/%d" % init))
    assert host.host_key_line not in host.lab.known_hosts_path.read_text()


def test_bad_options_are_refused(lab):
    with pytest.raises(ValueError):
        lab.add_host("bad-smi", nvidia_smi="relative/path")
    with pytest.raises(ValueError):
        lab.add_host("bad-driver", driver="flaky")
    assert "bad-smi" not in lab.hosts


def test_failed_start_is_reported_with_the_reason(lab):
    # A host whose sshd cannot start (an sshd_config error) fails loudly, leaving nothing behind.
    before = set(lab.hosts)
    with pytest.raises(LabError, match="did not start"):
        lab.add_host("bad-sshd", sshd_extra="NoSuchOption yes")
    assert set(lab.hosts) == before


def test_hosts_die_with_the_process_that_started_them(lab, tmp_path):
    # A crashed test run must not leave sshds and holders behind: each host's init exits when the
    # lifeline pipe from its Lab's process closes.
    script = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from lab import Lab\n"
        "lab = Lab(%r)\n"
        "h = lab.add_host('orphan')\n"
        "pid = h.spawn_holder(gpus=[0], mib=10, ignore_term=True)\n"
        "print(h.root_pid, h.outer_pid(pid), flush=True)\n"
        "time.sleep(300)\n"
    ) % (os.path.dirname(os.path.abspath(__file__)), str(tmp_path / "lab"))
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        init, holder = (int(x) for x in owner.stdout.readline().split())
    finally:
        owner.kill()
        owner.wait()
    wait_for(lambda: not os.path.exists("/proc/%d" % init) and not os.path.exists("/proc/%d" % holder))


def test_proc_driver_information_gives_minors(make_host):
    host = make_host(gpus=2, minors=[1, 0], gpu_name="NVIDIA H200")
    res = host.ssh("ls /proc/driver/nvidia/gpus; cat -A /proc/driver/nvidia/gpus/0000:00:06.0/information")
    lines = res.stdout.splitlines()
    assert lines[:2] == ["0000:00:06.0", "0000:00:07.0"]
    uuid0 = host.smi("-i", "0", "--query-gpu=uuid", "--format=csv,noheader").stdout.strip()
    probe = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "proc_information_catA.txt"
    ours = lines[2:]
    assert "GPU UUID: ^I %s$" % uuid0 in ours and "Device Minor: ^I 1$" in ours
    shape = [re.sub(r"(GPU-[0-9a-f-]+|\d+:\d+:\d+\.\d|Minor: \^I \d+)", "X", x) for x in ours]
    if probe.exists():  # the probe's recording of a real H200 (cat -A), when present
        assert shape == [re.sub(r"(GPU-[0-9a-f-]+|\d+:\d+:\d+\.\d|Minor: \^I \d+)", "X", x) for x in probe.read_text().splitlines()]
    assert host.ssh("touch /proc/driver/nvidia/x").returncode != 0


# --- the fake libnvidia-ml.so.1 ------------------------------------------------------------------

# What an NVML client does on a real host: dlopen by name (or a known path), init, then per GPU
# UUID, memory (nvmlMemory_v2_t) and compute processes (nvmlProcessInfo_t); nvml.h layouts.
NVML_PROBE = r"""
import ctypes as C, json, sys
try:
    lib = C.CDLL(sys.argv[1])
except OSError as e:
    print(json.dumps({"load": str(e)})); sys.exit(0)
rc = lib.nvmlInit_v2()
if rc:
    lib.nvmlErrorString.restype = C.c_char_p
    print(json.dumps({"init": rc, "error": lib.nvmlErrorString(rc).decode()})); sys.exit(0)
class Mem(C.Structure):
    _fields_ = [("version", C.c_uint)] + [(f, C.c_ulonglong) for f in ("total", "reserved", "free", "used")]
class Proc(C.Structure):
    _fields_ = [("pid", C.c_uint), ("used", C.c_ulonglong), ("gi", C.c_uint), ("ci", C.c_uint)]
n = C.c_uint(); lib.nvmlDeviceGetCount_v2(C.byref(n)); gpus = []
for i in range(n.value):
    d = C.c_void_p(); lib.nvmlDeviceGetHandleByIndex_v2(i, C.byref(d))
    u = C.create_string_buffer(96); lib.nvmlDeviceGetUUID(d, u, 96)
    m = Mem(version=C.sizeof(Mem) | 2 << 24); assert lib.nvmlDeviceGetMemoryInfo_v2(d, C.byref(m)) == 0
    k = C.c_uint(0); procs = (Proc * 64)(); k.value = 64
    assert lib.nvmlDeviceGetComputeRunningProcesses_v3(d, C.byref(k), procs) == 0
    gpus.append({"uuid": u.value.decode(), "used": m.used >> 20, "total": m.total >> 20,
                 "reserved": m.reserved >> 20, "procs": [[p.pid, p.used] for p in procs[:k.value]]})
lib.nvmlShutdown()
print(json.dumps({"gpus": gpus}))
"""


def nvml_probe(host, target="libnvidia-ml.so.1", user="root"):
    res = host.ssh(["python3", "-c", NVML_PROBE, target], user=user)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_nvml_resolves_by_name_and_reads_the_hosts_gpus(lab, make_host):
    host = make_host(gpus=2, ghost_mib={1: 100})
    pid = host.spawn_holder(gpus=[1], mib=716)
    for user in ("root", lab.user):
        got = nvml_probe(host, user=user)
        smi = host.smi("--query-gpu=uuid,memory.used,memory.total,memory.reserved", "--format=csv,noheader,nounits").stdout
        want = [dict(zip(("uuid", "used", "total", "reserved"), [v.strip() for v in line.split(",")]))
                for line in smi.splitlines()]
        assert [{k: str(g[k]) for k in want[0]} for g in got["gpus"]] == want
        assert [g["procs"] for g in got["gpus"]] == [[], [[pid, 716 << 20]]]
    assert got["gpus"][1]["used"] == 816
    # Installed as the driver package does, in the host only.
    listing = host.ssh("ls -l /usr/lib/*-linux-gnu/libnvidia-ml.so.1").stdout
    assert "libnvidia-ml.so.1 -> libnvidia-ml.so.580.159.04" in listing
    assert host.nvml and not os.path.exists(host.nvml)
    host.kill(pid)
    assert host.wait_gone(pid, 10)
    assert [g["used"] for g in nvml_probe(host)["gpus"]] == [0, 100]


def test_host_without_nvml_and_with_a_broken_one(make_host):
    bare = make_host(gpus=1, nvml=False)
    assert bare.nvml is None
    assert "libnvidia-ml.so.1" in nvml_probe(bare)["load"]
    assert bare.ssh("ls /usr/lib/*-linux-gnu/ | grep -c nvidia-ml").stdout.strip() == "0"
    assert bare.gpu_used() == [0]  # nvidia-smi still works
    broken = make_host(gpus=1, nvml="broken")
    assert nvml_probe(broken) == {"init": 18, "error": "Driver/library version mismatch"}
    assert broken.gpu_used() == [0]
    failed = make_host(gpus=1, driver="fail")  # the driver itself: NVML and nvidia-smi both fail
    assert nvml_probe(failed)["init"] == 9
    assert failed.smi().returncode == 9


def test_nvml_on_wsl2_and_off_the_search_path(make_host):
    wsl = make_host(wsl2=True, gpus=1)
    assert wsl.nvml == "/usr/lib/wsl/lib/libnvidia-ml.so.1"
    pid = wsl.spawn_holder(gpus=[0], mib=716)
    got = nvml_probe(wsl, "/usr/lib/wsl/lib/libnvidia-ml.so.1")
    assert got["gpus"][0]["procs"] == [[pid, 2**64 - 1]]  # NVML_VALUE_NOT_AVAILABLE under WDDM
    assert got["gpus"][0]["used"] == 716
    odd = make_host(gpus=1, nvml="/usr/local/nvidia/lib64/libnvidia-ml.so.1")
    assert "cannot open" in nvml_probe(odd)["load"]
    assert len(nvml_probe(odd, "/usr/local/nvidia/lib64/libnvidia-ml.so.1")["gpus"]) == 1
    with pytest.raises(ValueError):
        odd.lab.add_host("bad-nvml", nvml="relative.so")
