#!/usr/bin/env python3
"""A fake CUDA program for the test lab: holds "GPU memory" the way a real CUDA process does.

What real CUDA does that gpufleet depends on (recorded in tests/fixtures/recorded/logs):

* it opens EVERY /dev/nvidiaN (several fds on the GPUs it uses, a few on the others, even with
  CUDA_VISIBLE_DEVICES), plus /dev/nvidiactl and /dev/nvidia-uvm; on WSL2 it opens /dev/dxg;
* it MAPS /dev/nvidiactl, /dev/nvidia-uvm and the /dev/nvidiaN of the GPUs it uses (an NVML
  client such as nvtop or nvitop opens the same files and maps none: ``--monitor``);
  h200-clients-and-timings.log. Maps on WSL2 are unrecorded: nothing is mapped there;
* its memory is attributed to it by nvidia-smi's compute-apps list (by GPU UUID);
* vLLM renames its processes both in comm (prctl) and in the cmdline (setproctitle);
* it keeps its memory until the process is gone (a SIGTERM handler delays the release);
* an allocation larger than the free memory fails (torch.OutOfMemoryError, exit 1).

This program registers its allocation in $FAKEGPU_ROOT/procs/<pid>.json with its starttime; the
fake nvidia-smi and the fake libnvidia-ml.so.1 (fakenvml/) decide liveness themselves (pid +
starttime, not a zombie), so a record never needs to be removed on exit.

Usage (all optional)::

    fakecuda.py --gpus 0,1 --mib 716 [--title VLLM::Worker] [--ignore-term] [--term-delay 1.5]
                [--spawn-child 'ARGS'] ... [--ready-file PATH] [--cuda-visible 1,0]
                [--no-devices] [--zombie-child MIB] [--exit-after S] [--detach] [--monitor]
                [--leader-exit [--stuck]] [--mps-pipe DIR]

``--monitor``: an NVML client (nvtop, nvitop, gpustat, dcgm-exporter): opens /dev/nvidiactl,
/dev/nvidia-uvm and every /dev/nvidiaN, maps none, allocates and registers nothing.

``--leader-exit``: the process of the real H200 probe (tests/gpu/probe_clean_cases.py part D,
tests/fixtures/real-h200/clean-cases/probe-1.log): a second thread opens and maps the devices
and registers the memory, then the main thread calls ``pthread_exit`` through ctypes. The
leader is a zombie (``Z``, its fd table and maps empty) while the process, through its live
thread, still holds everything; SIGKILL of the PID ends it. ``--stuck`` (root): the holding
thread then sleeps uninterruptibly in the kernel (``D``, wchan ``handle_userfault``: it reads,
through process_vm_readv, a userfaultfd page nobody fills), as a killed process's threads
stuck in the driver show. Only what /proc says is simulated: that sleep is TASK_KILLABLE, so
unlike a thread stuck in the NVIDIA driver it ends on SIGKILL.
``--mps-pipe DIR``: a CUDA MPS client of the lab's fake MPS daemon started with that pipe
directory (tests/lab/fakemps/fakemps.c): registered where the daemon's lists see it.

``--mib`` is one number for every GPU or one per GPU (``716,1024``). ``--gpus ''`` allocates
nothing (CUDA initialised, no memory). ``--detach`` daemonises (setsid, stdio to /dev/null or
``--log``) and prints the ready document (JSON: pid, starttime, children, zombie) once the whole
family is set up, so a caller over SSH gets the pids and the session can end at once.
"""
import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.environ.get("FAKEGPU_ROOT") or "/run/fakegpu"
PR_SET_NAME = 15


def parse(argv):
    p = argparse.ArgumentParser(prog="fakecuda")
    p.add_argument("--gpus", default="0", help="comma-separated CUDA device indices ('' = none)")
    p.add_argument("--mib", default="500", help="MiB per GPU: one value or one per GPU")
    p.add_argument("--title", default=None, help="new process name (comm and cmdline)")
    p.add_argument("--argv", default=None, metavar="JSON",
                   help="a command line to show, as a JSON list (argv rewritten in place, comm "
                        "kept): `python3 train.py --epochs 3` as its interpreter started it")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--term-delay", type=float, default=None, help="seconds from SIGTERM to exit")
    p.add_argument("--spawn-child", action="append", default=[], metavar="ARGS")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--cuda-visible", default=None, help="like CUDA_VISIBLE_DEVICES")
    p.add_argument("--no-devices", action="store_true", help="a CPU-only process (API server)")
    p.add_argument("--zombie-child", type=int, default=None, metavar="MIB",
                   help="fork a child that allocates MIB on the first GPU and exits unreaped")
    p.add_argument("--exit-after", type=float, default=None)
    p.add_argument("--detach", action="store_true")
    p.add_argument("--monitor", action="store_true", help="an NVML client: no CUDA context")
    p.add_argument("--leader-exit", action="store_true",
                   help="hold in a second thread, then pthread_exit the main thread")
    p.add_argument("--stuck", action="store_true",
                   help="with --leader-exit: the holding thread then sleeps in D state")
    p.add_argument("--log", default=os.devnull)
    p.add_argument("--mps-pipe", default=None, metavar="DIR",
                   help="a CUDA MPS client of the lab's fake MPS daemon (tests/lab/fakemps)")
    return p.parse_args(argv)


def starttime(pid="self"):
    with open("/proc/%s/stat" % pid, "rb") as f:
        data = f.read().decode("ascii", "replace")
    return int(data[data.rindex(")") + 2 :].split()[19])


def write_json(path, doc):
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.chmod(tmp, 0o666)
    os.rename(tmp, path)


def config():
    try:
        with open(os.path.join(ROOT, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def rename(title):
    """Rename like vLLM: the cmdline (setproctitle) and comm (prctl PR_SET_NAME)."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        _overwrite_argv(title)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)


def _overwrite_argv(title):
    """setproctitle's Linux method without the package: overwrite the argv area in place."""
    import ctypes

    with open("/proc/self/stat", "rb") as f:
        data = f.read().decode("ascii", "replace")
    fields = data[data.rindex(")") + 2 :].split()
    arg_start, arg_end = int(fields[45]), int(fields[46])  # stat fields 48, 49
    size = arg_end - arg_start
    raw = title.encode()[: size - 1]
    buf = raw + b"\0" * (size - len(raw))
    ctypes.memmove(arg_start, buf, size)


def physical(gpus, visible):
    """CUDA device index -> nvidia-smi index through CUDA_VISIBLE_DEVICES (indices only)."""
    if visible is None or visible == "":
        return gpus
    vis = [int(v) for v in visible.split(",") if v.strip() != ""]
    return [vis[g] for g in gpus]


_MAPS = []


def map_device(path):
    """mmap a device file the way a CUDA context maps the real one (kept for the lifetime)."""
    import mmap

    with open(path, "rb") as f:
        _MAPS.append(mmap.mmap(f.fileno(), 1, prot=mmap.PROT_READ))


def open_devices(used_indices, minors, monitor=False):
    """Open every NVIDIA device file like CUDA does; more fds on the GPUs that are used. A
    CUDA context also maps nvidiactl, nvidia-uvm and its GPUs' nvidiaN; a monitor maps none."""
    fds = []
    try:
        names = os.listdir("/dev")
    except OSError:
        names = []
    numbered = sorted((n for n in names if re.match(r"^nvidia\d+$", n)), key=lambda n: int(n[6:]))
    if "dxg" in names and not numbered:
        for _ in range(4):
            fds.append(os.open("/dev/dxg", os.O_RDWR))
        return fds
    if not numbered:
        sys.stderr.write("RuntimeError: No CUDA GPUs are available\n")
        sys.exit(1)
    used_minors = {minors[i] if i < len(minors) else i for i in used_indices}
    for ctl in ("nvidiactl", "nvidia-uvm"):
        if ctl in names:
            fds.append(os.open("/dev/" + ctl, os.O_RDWR))
            if not monitor:
                fds.append(os.open("/dev/" + ctl, os.O_RDWR))
                map_device("/dev/" + ctl)
    for n in numbered:
        used = int(n[6:]) in used_minors and not monitor
        for _ in range(4 if used else 1):
            fds.append(os.open("/dev/" + n, os.O_RDWR))
        if used:
            map_device("/dev/" + n)
    return fds


def check_free(alloc):
    """Refuse what does not fit, as CUDA does (free memory as the fake nvidia-smi counts it)."""
    if not alloc:
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fake_nvidia_smi as smi

    gpus, _ = smi.snapshot(smi.load_config())
    for g in gpus:
        want = alloc.get(str(g["index"]), 0)
        if want > g["free"]:
            sys.stderr.write(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %.2f GiB. GPU %d "
                "has a total capacity of %.2f GiB of which %.2f GiB is free.\n"
                % (want / 1024.0, g["index"], g["total"] / 1024.0, g["free"] / 1024.0)
            )
            sys.exit(1)


def register(alloc, visible=None, mps_server=None):
    if not alloc:
        return
    pdir = os.path.join(ROOT, "procs")
    pid = os.getpid()
    doc = {"pid": pid, "starttime": starttime(), "alloc": alloc}
    if visible is not None:
        doc["visible"] = visible
    if mps_server is not None:
        doc["mps_server"] = mps_server
    write_json(os.path.join(pdir, "%d.json" % pid), doc)


def mps_connect(pipe_dir):
    """Become a client of the fake MPS daemon whose state is in ``pipe_dir``: its server's PID
    (NVML lists this client's memory in that server's row under mps_server_only), and this
    client's entry, which the fake control client answers get_client_list from."""
    with open(os.path.join(pipe_dir, "fakemps.state")) as f:
        server = int(f.read().split()[1])
    path = os.path.join(pipe_dir, "fakemps-clients", str(os.getpid()))
    with open(path, "w") as f:
        f.write("%d\n" % starttime())
    return server


def wait_file(path, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            time.sleep(0.01)
    raise SystemExit("fakecuda: child not ready after %.0fs: %s" % (timeout, path))


def zombie_child(index, mib, minors):
    pid = os.fork()
    if pid == 0:
        try:
            open_devices([index], minors)
            register({str(index): mib})
        finally:
            os._exit(0)
    # Never reaped: the child stays a zombie while this process lives.
    for _ in range(500):
        try:
            with open("/proc/%d/stat" % pid) as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.01)
    return pid


def setup(args, cfg, phys, minors, alloc, visible):
    """Open (and map) the device files and register the memory, as a CUDA context does;
    returns (fds, alloc)."""
    if args.monitor:
        alloc = {}
    fds = [] if args.no_devices else open_devices(phys, minors, args.monitor)
    check_free(alloc)
    ngpus = int(cfg.get("gpus", 1))
    if visible:
        seen = [int(v) for v in visible.split(",") if v.strip() != ""]
    else:
        seen = list(range(ngpus))
    server = mps_connect(args.mps_pipe) if args.mps_pipe else None
    register(alloc, None if args.no_devices or args.monitor else seen, server)
    return fds, alloc


def hold_in_thread(work, stuck):
    """Run ``work`` (the holding) in a second thread, which then stays: asleep, or with
    ``stuck`` in uninterruptible sleep; returns (its result, its thread id) once it holds (and
    is in D state)."""
    import threading

    box = {}
    ready = threading.Event()

    def run():
        try:
            box["result"] = work()
        except BaseException as exc:  # check_free's SystemExit: out of memory
            box["error"] = exc
            ready.set()
            return
        box["tid"] = threading.get_native_id()
        ready.set()
        if stuck:
            sleep_in_kernel()
        while True:
            time.sleep(3600)

    threading.Thread(target=run, daemon=True).start()
    ready.wait()
    if "error" in box:
        raise box["error"]
    if stuck:
        wait_state(box["tid"], "D", 10.0)
    return box["result"], box["tid"]


def wait_state(tid, state, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open("/proc/self/task/%d/stat" % tid, "rb") as f:
            data = f.read().decode("ascii", "replace")
        if data[data.rindex(")") + 2 :].split()[0] == state:
            return
        time.sleep(0.01)
    raise SystemExit("fakecuda: thread %d not in state %s after %.0fs" % (tid, state, timeout))


USERFAULTFD_NR = {"x86_64": 323, "aarch64": 282}  # asm/unistd_64.h, asm-generic/unistd.h
UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api): linux/userfaultfd.h
UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)


def sleep_in_kernel():
    """Sleep in D state for good: read, through process_vm_readv (the kernel's own access,
    TASK_KILLABLE), a page registered with userfaultfd that nobody ever fills. Needs root
    (vm.unprivileged_userfaultfd)."""
    import ctypes
    import fcntl
    import mmap
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    nr = USERFAULTFD_NR.get(os.uname()[4])
    uffd = libc.syscall(ctypes.c_long(nr), ctypes.c_int(os.O_CLOEXEC)) if nr else -1
    if uffd < 0:
        raise OSError(ctypes.get_errno(), "userfaultfd unavailable")
    fcntl.ioctl(uffd, UFFDIO_API, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))
    page = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    fcntl.ioctl(uffd, UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", addr, 4096, 1, 0)))

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    buf = ctypes.create_string_buffer(16)
    libc.process_vm_readv(os.getpid(), ctypes.byref(Iovec(ctypes.addressof(buf), 16)), 1,
                          ctypes.byref(Iovec(addr, 16)), 1, 0)


def detach(args, argv):
    """Daemonise; the parent prints the ready document and exits when the family is set up."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(wfd)
        chunks = []
        while True:
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode()
        if not text:
            detail = ""
            if args.log != os.devnull:
                try:
                    with open(args.log) as f:
                        detail = f.read()[-2000:]
                except OSError:
                    pass
            sys.stderr.write("%sfakecuda: holder failed to start (log: %s)\n" % (detail, args.log))
            os._exit(1)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        os._exit(0)
    os.close(rfd)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    return wfd


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    pipe = detach(args, argv) if args.detach else None

    cfg = config()
    minors = cfg.get("minors") or []
    visible = args.cuda_visible
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [int(g) for g in args.gpus.split(",") if g.strip() != ""]
    phys = physical(gpus, visible)
    mibs = [int(m) for m in args.mib.split(",")] if args.mib else [0]
    alloc = {}
    for n, idx in enumerate(phys):
        mib = mibs[n] if n < len(mibs) else mibs[-1]
        if mib > 0:
            alloc[str(idx)] = alloc.get(str(idx), 0) + mib

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.term_delay is not None:
        delay = args.term_delay

        def on_term(signum, frame):
            time.sleep(delay)
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    if args.title:
        rename(args.title)
    if args.argv:
        _overwrite_argv("\0".join(json.loads(args.argv)))

    def hold():
        return setup(args, cfg, phys, minors, alloc, visible)

    thread = None
    if args.leader_exit:
        (fds, alloc), thread = hold_in_thread(hold, args.stuck)
    else:
        fds, alloc = hold()
    zombie = None
    if args.zombie_child is not None:
        zombie = zombie_child(phys[0] if phys else 0, args.zombie_child, minors)

    children = []
    procs = []
    me = os.getpid()
    for n, child_args in enumerate(args.spawn_child):
        ready = "/tmp/fakecuda-ready-%d-%d.json" % (me, n)
        try:
            os.unlink(ready)
        except OSError:
            pass
        cmd = [sys.executable, os.path.abspath(__file__)] + shlex.split(child_args)
        cmd += ["--ready-file", ready]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True))
        children.append(ready)
    children = [wait_file(path, 60) for path in children]

    doc = {
        "pid": me,
        "starttime": starttime(),
        "title": args.title,
        "alloc": alloc,
        "fds": len(fds),
        "children": children,
        "zombie": zombie,
        "leader_exit": bool(args.leader_exit),
        "thread": thread,
        "stuck": bool(args.stuck),
    }
    if args.ready_file:
        write_json(args.ready_file, doc)
    if pipe is not None:
        os.write(pipe, json.dumps(doc).encode())
        os.close(pipe)
    if args.leader_exit:
        import ctypes

        ctypes.CDLL(None).pthread_exit(None)  # as the H200 probe: the leader becomes a zombie

    deadline = None if args.exit_after is None else time.time() + args.exit_after
    while deadline is None or time.time() < deadline:
        time.sleep(3600 if deadline is None else max(0.0, min(3600, deadline - time.time())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
