"""Raw probe (no gpufleet) of the real-GPU cases a clean must get right, for recorded fixtures.

Run as root on a machine with an NVIDIA GPU, torch and nvidia-ml-py:
``python3 tests/gpu/probe_clean_cases.py OUT_DIR [PARTS]`` (PARTS: letters of the parts to
run, default ``adbc``). Each part prints what the driver, NVML,
nvidia-smi and /proc show, with timings; the log is OUT_DIR/probe-clean-cases.log. Parts:

A. a process whose title holds commas and a newline: what nvidia-smi prints for its name
   (CSV, ``-q -d PIDS``, the table);
B. a supervisor that restarts its torch child 0.3 s after it ends: after SIGKILL of the child,
   when the new child appears in NVML's list, maps nvidia-uvm, and has its memory back;
C. MPS: the control daemon, its server and one client: the process tree, executables, device
   files, NVML's lists, the daemon's own lists, a client killed, then ``quit``;
D. a torch process whose main thread called pthread_exit while another thread holds memory:
   its state, fds and maps (leader and threads), NVML's list; SIGKILL and the memory.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

SMI = "/usr/local/nvidia/bin/nvidia-smi"
MPS = "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
GIB = 1 << 30
LOG: list[str] = []


def say(*parts: object) -> None:
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    LOG.append(line)


def smi(*args: str, env: dict | None = None) -> str:
    res = subprocess.run([SMI, *args], capture_output=True, text=True, timeout=30, env=env)
    return res.stdout + (("[stderr] " + res.stderr) if res.stderr else "")


def nvml_procs() -> list[tuple[int, int]]:
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    return [(p.pid, (p.usedGpuMemory or 0) >> 20) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]


def used_mib() -> int:
    import pynvml

    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used >> 20


def devs(path: str, maps: bool = False) -> list[str]:
    out = set()
    try:
        if maps:
            for line in open(path):
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/dev/nvidia"):
                    out.add(parts[5])
        else:
            for fd in os.listdir(path):
                try:
                    t = os.readlink(os.path.join(path, fd))
                except OSError:
                    continue
                if t.startswith("/dev/nvidia"):
                    out.add(t)
    except OSError as exc:
        return ["<%s>" % exc.strerror]
    return sorted(out)


def describe(pid: int, label: str) -> None:
    def read(name: str) -> str:
        try:
            with open("/proc/%d/%s" % (pid, name), "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError as exc:
            return "<%s>" % exc.strerror
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
        st = os.stat("/proc/%d/exe" % pid)
        exe += " (uid %d mode %o)" % (st.st_uid, st.st_mode & 0o7777)
    except OSError as exc:
        exe = "<%s>" % exc.strerror
    stat = read("stat")
    state = stat.rsplit(")", 1)[1].split()[:2] if ")" in stat else "?"
    say("%s: pid %d state/ppid %s comm %r exe %s" % (label, pid, state, read("comm").strip(), exe))
    say("   cmdline %r" % read("cmdline"))
    say("   fd devices %s; maps devices %s" % (devs("/proc/%d/fd" % pid),
                                              devs("/proc/%d/maps" % pid, True)))


def wait_line(proc: subprocess.Popen, timeout: float = 120) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line:
            return line.strip()
        if proc.poll() is not None:
            return "<exited %s>" % proc.returncode
    return "<timeout>"


HOLD = ("import os,sys,time,torch\n"
        "x=torch.empty(int(float(sys.argv[1])*2**30),dtype=torch.uint8,device='cuda')\n"
        "torch.cuda.synchronize()\nprint('up',os.getpid(),flush=True)\ntime.sleep(600)\n")


#: Rewrites the process's own argv area in place (as setproctitle does), through /proc/self/mem:
#: /proc/PID/cmdline, which nvidia-smi's process_name shows, then reads TITLE.
RETITLE = ("def retitle(title):\n"
           "    f=open('/proc/self/stat').read().rsplit(')',1)[1].split()\n"
           "    start,end=int(f[45]),int(f[46])\n"
           "    data=title.encode()[:end-start-1]\n"
           "    m=open('/proc/self/mem','rb+'); m.seek(start)\n"
           "    m.write(data+b'\\0'*(end-start-len(data))); m.close()\n")


def part_a() -> None:
    say("== A: a title with commas and a newline")
    title = "evil,name,with,commas\n4242, 9999 MiB, GPU-forged"
    code = RETITLE + HOLD.replace("torch.cuda.synchronize()\n",
                                  "torch.cuda.synchronize()\nretitle(sys.argv[2])\n")
    p = subprocess.Popen([sys.executable, "-c", code, "0.5", title, "x" * 300],
                         stdout=subprocess.PIPE, text=True)
    say("holder:", wait_line(p))
    time.sleep(1.0)
    describe(p.pid, "holder")
    for q in ("pid,process_name,used_memory,gpu_uuid", "pid,used_memory,gpu_uuid"):
        say("-- --query-compute-apps=%s --format=csv" % q)
        say(smi("--query-compute-apps=" + q, "--format=csv"))
        say("-- --query-compute-apps=%s --format=csv,noheader,nounits" % q)
        say(repr(smi("--query-compute-apps=" + q, "--format=csv,noheader,nounits")))
    say("-- nvidia-smi -q -d PIDS")
    say(smi("-q", "-d", "PIDS"))
    say("-- nvidia-smi (table)")
    say(smi())
    p.kill()
    p.wait()


SUPERVISOR = ("import subprocess,sys,time\n"
              "while True:\n"
              "    c=subprocess.Popen([sys.executable,'-c',sys.argv[1],sys.argv[2]])\n"
              "    print('child',c.pid,flush=True)\n"
              "    c.wait()\n"
              "    time.sleep(0.3)\n")


def maps_uvm(pid: int) -> bool:
    return "/dev/nvidia-uvm" in devs("/proc/%d/maps" % pid, True)


def part_b(rounds: int = 5) -> None:
    say("== B: a supervisor restarts its torch child (6 GiB) 0.3 s after it ends")
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, HOLD, "6"], stdout=subprocess.PIPE,
                           text=True)
    child = int(wait_line(sup).split()[1])
    results = []
    for r in range(rounds):
        end = time.monotonic() + 120
        while time.monotonic() < end and child not in [p for p, _ in nvml_procs()]:
            time.sleep(0.05)
        while time.monotonic() < end and used_mib() < 6000:
            time.sleep(0.05)
        time.sleep(0.5)
        before = used_mib()
        t0 = time.monotonic()
        os.kill(child, signal.SIGKILL)
        marks: dict[str, float] = {}
        new = None
        end = t0 + 60
        while time.monotonic() < end and len(marks) < 5:
            now = time.monotonic() - t0
            listed = nvml_procs()
            used = used_mib()
            if "old_gone_from_nvml" not in marks and child not in [p for p, _ in listed]:
                marks["old_gone_from_nvml"] = now
            if "memory_freed" not in marks and used < before - 5000:
                marks["memory_freed"] = now
            if new is None:
                kids = subprocess.run(["pgrep", "-P", str(sup.pid)], capture_output=True,
                                      text=True).stdout.split()
                kids = [int(k) for k in kids if int(k) != child]
                if kids:
                    new = kids[0]
                    marks["new_child_started"] = now
            if new is not None:
                if "new_maps_uvm" not in marks and maps_uvm(new):
                    marks["new_maps_uvm"] = now
                if "new_in_nvml" not in marks and new in [p for p, _ in listed]:
                    marks["new_in_nvml"] = now
                if "memory_back" not in marks and "memory_freed" in marks and used >= before - 100:
                    marks["memory_back"] = now
            time.sleep(0.005)
        say("round %d: killed %s, new child %s: %s" % (
            r + 1, child, new, json.dumps({k: round(v, 3) for k, v in sorted(marks.items(),
                                                                            key=lambda kv: kv[1])})))
        results.append(marks)
        child = new if new is not None else child
    for key in ("new_child_started", "new_maps_uvm", "new_in_nvml", "memory_back"):
        vals = sorted(m[key] for m in results if key in m)
        if vals:
            say("B %s: min %.3f median %.3f max %.3f s (n=%d)" % (
                key, vals[0], vals[len(vals) // 2], vals[-1], len(vals)))
    sup.kill()
    sup.wait()
    try:
        os.kill(child, signal.SIGKILL)
    except OSError:
        pass
    time.sleep(1.0)


def mps_env() -> dict:
    env = dict(os.environ)
    env.update(CUDA_MPS_PIPE_DIRECTORY="/tmp/gf-mps-pipe", CUDA_MPS_LOG_DIRECTORY="/tmp/gf-mps-log")
    os.makedirs("/tmp/gf-mps-pipe", exist_ok=True)
    os.makedirs("/tmp/gf-mps-log", exist_ok=True)
    return env


def mps_ask(env: dict, command: str, timeout: float = 10) -> str:
    try:
        res = subprocess.run([MPS], input=command + "\n", capture_output=True, text=True,
                             env=env, timeout=timeout)
        return "rc %d out %r err %r" % (res.returncode, res.stdout, res.stderr)
    except subprocess.TimeoutExpired:
        return "<no answer in %.0f s>" % timeout


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def part_c() -> None:
    say("== C: MPS")
    env = mps_env()
    res = subprocess.run([MPS, "-d"], env=env, capture_output=True, text=True, timeout=30)
    say("start daemon: rc", res.returncode, res.stdout, res.stderr)
    time.sleep(1.0)
    daemons = subprocess.run(["pgrep", "-x", "nvidia-cuda-mps"], capture_output=True,
                             text=True).stdout.split()
    say("pgrep -x nvidia-cuda-mps (probe only, nothing signalled by it):", daemons)
    client = subprocess.Popen([sys.executable, "-c", HOLD, "3"], env=env, stdout=subprocess.PIPE,
                              text=True)
    say("client:", wait_line(client))
    time.sleep(1.0)
    for pid in [int(d) for d in daemons]:
        describe(pid, "mps process")
        for c in children(pid):
            describe(c, "   child of %d" % pid)
    describe(client.pid, "mps client")
    say("-- NVML compute processes", nvml_procs(), "used", used_mib())
    try:
        import pynvml

        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mps = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)
        say("-- NVML MPS compute processes", [(p.pid, (p.usedGpuMemory or 0) >> 20) for p in mps])
    except Exception as exc:  # the probe records what it could not read
        say("-- NVML MPS compute processes: error", exc)
    say("-- nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader")
    say(smi("--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader"))
    say("-- nvidia-smi (table)")
    say(smi())
    say("-- get_server_list:", mps_ask(env, "get_server_list"))
    servers = mps_ask(env, "get_server_list").split("'")[1].split() if "'" in \
        mps_ask(env, "get_server_list") else []
    for s in servers:
        say("-- get_client_list %s:" % s, mps_ask(env, "get_client_list " + s))
    t0 = time.monotonic()
    client.kill()
    client.wait()
    freed = None
    while time.monotonic() - t0 < 10:
        if used_mib() < 1500:
            freed = time.monotonic() - t0
            break
        time.sleep(0.02)
    say("client SIGKILL: memory below 1500 MiB after", freed, "s; used now", used_mib(),
        "NVML", nvml_procs())
    say("-- get_server_list after the client:", mps_ask(env, "get_server_list"))
    t0 = time.monotonic()
    say("-- quit:", mps_ask(env, "quit", 20), "after %.2f s" % (time.monotonic() - t0))
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-x", "nvidia-cuda-mps"], capture_output=True,
                          text=True).stdout.split()
    say("after quit: mps processes", left, "used", used_mib(), "NVML", nvml_procs())


ZOMBIE = ("import ctypes,os,threading,time,torch\n"
          "ready=threading.Event()\n"
          "def hold():\n"
          "    x=torch.empty(5*2**30,dtype=torch.uint8,device='cuda'); torch.cuda.synchronize()\n"
          "    ready.set(); time.sleep(600)\n"
          "t=threading.Thread(target=hold); t.start(); ready.wait()\n"
          "print('up',os.getpid(),flush=True)\n"
          "ctypes.CDLL(None).pthread_exit(None)\n")


def part_d() -> None:
    say("== D: the main thread exits (pthread_exit) while another thread holds 5 GiB")
    p = subprocess.Popen([sys.executable, "-c", ZOMBIE], stdout=subprocess.PIPE, text=True)
    say("holder:", wait_line(p))
    time.sleep(1.5)
    describe(p.pid, "leader")
    for tid in sorted(os.listdir("/proc/%d/task" % p.pid), key=int):
        try:
            state = open("/proc/%d/task/%s/stat" % (p.pid, tid)).read().rsplit(")", 1)[1].split()[0]
            wchan = open("/proc/%d/task/%s/wchan" % (p.pid, tid)).read()
        except OSError as exc:
            state, wchan = "<%s>" % exc.strerror, ""
        say("   task %s state %s wchan %r fd %s maps %s" % (
            tid, state, wchan, devs("/proc/%d/task/%s/fd" % (p.pid, tid)),
            devs("/proc/%d/task/%s/maps" % (p.pid, tid), True)))
    say("-- NVML", nvml_procs(), "used", used_mib())
    say("-- ps", subprocess.run(["ps", "-o", "pid,stat,nlwp,comm", "-p", str(p.pid)],
                                capture_output=True, text=True).stdout)
    before = used_mib()
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    freed = None
    while time.monotonic() - t0 < 15:
        if used_mib() < before - 4000:
            freed = time.monotonic() - t0
            break
        time.sleep(0.01)
    say("SIGKILL of the leader PID: memory freed after", freed, "s; NVML", nvml_procs())
    p.wait()


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    import pynvml

    pynvml.nvmlInit()
    say("driver", pynvml.nvmlSystemGetDriverVersion(), "GPU", pynvml.nvmlDeviceGetName(
        pynvml.nvmlDeviceGetHandleByIndex(0)), "date", time.strftime("%Y-%m-%d %H:%M:%S"))
    parts = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
    chosen = sys.argv[2] if len(sys.argv) > 2 else "adbc"
    for part in (parts[c] for c in chosen):
        try:
            part()
        except Exception as exc:  # record and go on: one part's failure is a finding too
            say("!! %s failed: %r" % (part.__name__, exc))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probe-clean-cases.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
