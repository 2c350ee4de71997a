"""PID 1 of one lab host: builds the host's private view of the machine, runs its sshd, reaps.

Started by lab.py as ``unshare -m -p -f -u --mount-proc --kill-child python3 lab_init.py SPEC``
(root), so it runs in fresh mount, PID and UTS namespaces. Why each piece:

* a tmpfs on /run: per-host /run/fakegpu (the fake driver's state), /run/sshd (privsep dir)
  and /run/gflab (scripts, keys, sshd_config, copied in: the lab's own temp dir may be hidden),
  and the lab user's runtime directory /run/user/<uid> (0700, its own: logind makes one on a
  real host; a non-root agent keeps its clean lock there);
* a tmpfs on /dev with bind mounts of null, zero, full, random, urandom, tty, a new devpts,
  a fresh /dev/shm and REGULAR files standing in for /dev/nvidiaN, nvidiactl, nvidia-uvm (or
  /dev/dxg on a WSL2 host): holders open them, gpufleet finds them in /proc/PID/fd;
* private /tmp and /root (tmpfs; /root gets /etc/skel, so the machine's own dotfiles do not
  change the session PATH) and copy-on-write /home (overlayfs): lock files, audit logs and
  ready files of one host are not seen by another, and nothing leaks onto the real machine;
  the lab's Python (spec "keep") stays visible at its path when it lives under /root or /tmp;
* the fake nvidia-smi placed at the chosen path through an overlay of its nearest existing
  directory (so /usr/local/nvidia/bin/nvidia-smi works without touching the real disk);
* the fake libnvidia-ml.so.1 (tests/lab/fakenvml) at the chosen path the same way, as the
  driver package installs it (libnvidia-ml.so.<driver> and the libnvidia-ml.so.1 link; a plain
  file on WSL2), so dlopen("libnvidia-ml.so.1") finds it through ld.so's default directories;
* /proc/driver/nvidia/gpus/<bus>/information files (tmpfs over /proc/driver) that give each
  GPU's minor number, as the real driver does;
* a host without python3 on PATH gets PATH = a directory of symlinks to /usr/bin and /usr/sbin
  minus python* (the real interpreter stays at its absolute path for the fake nvidia-smi).

It reports "ok" (or "error: ...") on the status fd once sshd listens, then reaps orphans and
exits when SIGTERM arrives or the lifeline pipe from the lab closes (the lab process died):
the death of a PID namespace's init kills every process in it.
"""
import ctypes
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_BIND = 4096
MS_REC = 16384
MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, fstype=None, flags=0, data=None):
    res = _libc.mount(
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if res != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mount %s on %s (%s): %s" % (source, target, fstype, os.strerror(err)))


def umount(target):
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "umount %s: %s" % (target, os.strerror(err)))


def write(path, data, mode=0o644):
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    os.chmod(path, mode)


def build_dev(spec):
    """A private /dev: the few real character devices sessions need, plus fake GPU files."""
    os.mkdir("/run/gflab/olddev")
    mount("/dev", "/run/gflab/olddev", None, MS_BIND | MS_REC)
    mount("gflab-dev", "/dev", "tmpfs", MS_NOSUID, "mode=755,size=4m")
    for name in ("null", "zero", "full", "random", "urandom", "tty"):
        write("/dev/" + name, b"", 0o666)
        mount("/run/gflab/olddev/" + name, "/dev/" + name, None, MS_BIND)
    os.mkdir("/dev/pts")
    try:
        mount("devpts", "/dev/pts", "devpts", MS_NOSUID, "newinstance,ptmxmode=0666,mode=620")
        os.symlink("pts/ptmx", "/dev/ptmx")
    except OSError:
        mount("/run/gflab/olddev/pts", "/dev/pts", None, MS_BIND)
        write("/dev/ptmx", b"", 0o666)
        mount("/run/gflab/olddev/ptmx", "/dev/ptmx", None, MS_BIND)
    os.mkdir("/dev/shm")
    mount("gflab-shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for link, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, "/dev/" + link)
    umount("/run/gflab/olddev")
    os.rmdir("/run/gflab/olddev")
    # one byte each: regular files cannot be mmap'ed when empty, and holders map them as
    # CUDA maps the real devices (a CUDA context maps nvidiactl, nvidia-uvm, its GPUs' nvidiaN)
    if spec["wsl2"]:
        write("/dev/dxg", b"\0", 0o666)
    else:
        for minor in spec["minors"]:
            write("/dev/nvidia%d" % minor, b"\0", 0o666)
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            write("/dev/" + name, b"\0", 0o666)
    # the kernel log: a regular file in /dev/kmsg's record format (crw-r--r-- root: 0644)
    if spec.get("kmsg") is not None:
        write("/dev/kmsg", spec["kmsg"].encode("utf-8"), 0o644)


def overlay(target, upper_files, tag):
    """Overlay ``target`` (an existing dir) with files written into a tmpfs upper layer."""
    base = "/run/gflab/ov/" + tag
    os.makedirs(base + "/u")
    os.makedirs(base + "/w")
    for rel, (data, mode) in upper_files.items():
        path = os.path.join(base + "/u", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path, data, mode)
    mount(
        "gflab-ov",
        target,
        "overlay",
        0,
        "lowerdir=%s,upperdir=%s/u,workdir=%s/w" % (target, base, base),
    )


def place_smi(path, wrapper):
    """Put the fake nvidia-smi at ``path`` without writing to the real disk."""
    parent = os.path.dirname(path)
    anchor = parent
    while not os.path.isdir(anchor) and anchor not in ("", "/"):
        anchor = os.path.dirname(anchor)
    rel = os.path.relpath(path, anchor)
    overlay(anchor, {rel: (wrapper, 0o755)}, "smi")


def place_nvml(path, data, driver, wsl2):
    """Put the fake libnvidia-ml.so.1 at ``path`` (an overlay, like the fake nvidia-smi)."""
    anchor = os.path.dirname(path)
    while not os.path.isdir(anchor) and anchor not in ("", "/"):
        anchor = os.path.dirname(anchor)
    rel = os.path.relpath(path, anchor)
    if wsl2 or not path.endswith(".so.1"):
        overlay(anchor, {rel: (data, 0o755)}, "nvml")
        return
    real = path[: -len(".1")] + "." + driver  # libnvidia-ml.so.580.159.04
    overlay(anchor, {os.path.relpath(real, anchor): (data, 0o755)}, "nvml")
    os.symlink(os.path.basename(real), path)


# Where a machine's real driver keeps what the agent looks for (remote/nvml.py
# LIBRARY_FALLBACKS, remote/jobs.py SMI_FALLBACKS): a lab host on a machine with a real GPU
# (the GPU machine's bench) must see only its fake driver, never the real one.
REAL_NVML_PLACES = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
    "/usr/local/nvidia/lib64", "/usr/lib/wsl/lib",
)
REAL_SMI_PLACES = ("/usr/bin/nvidia-smi", "/usr/local/nvidia/bin/nvidia-smi",
                   "/usr/lib/wsl/lib/nvidia-smi")


def _ldconfig_nvml():
    """The libnvidia-ml paths ld.so's cache names (dlopen by name looks there first)."""
    for tool in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([tool, "-p"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 timeout=10).stdout.decode("utf-8", "replace")
        except (OSError, subprocess.SubprocessError):
            continue
        return [line.rsplit("=>", 1)[1].strip() for line in out.splitlines()
                if "libnvidia-ml.so" in line and "=>" in line]
    return []


def real_driver_files(spec):
    """The machine's own libnvidia-ml and nvidia-smi files that are not this host's fakes."""
    mine = set()
    for placed in (spec.get("nvml"), spec.get("nvidia_smi")):
        if isinstance(placed, str) and os.path.lexists(placed):
            mine.add(os.path.realpath(placed))
            mine.add(placed)
    found = set(_ldconfig_nvml()) | set(REAL_SMI_PLACES)
    for d in REAL_NVML_PLACES:
        try:
            found.update(os.path.join(d, n) for n in os.listdir(d) if n.startswith("libnvidia-ml.so"))
        except OSError:
            pass
    return sorted(p for p in found
                  if os.path.lexists(p) and p not in mine and os.path.realpath(p) not in mine)


def hide_real_driver(spec, nvml_data, smi_data):
    """Bind-mount this host's fakes (or, where it has none, an empty file that neither loads nor
    runs) over the machine's real driver files, so the agent on a lab host finds the fakes or
    nothing, as on a host with only the fake driver installed. File over file: no directory's
    other mounts are hidden. A no-op on machines without a GPU driver."""
    stand_in = {}
    for kind, data in (("nvml", nvml_data), ("smi", smi_data)):
        path = "/run/gflab/hide-" + kind
        write(path, data if data is not None else b"", 0o755 if data is not None else 0)
        stand_in[kind] = path
    done = set()
    for path in real_driver_files(spec):
        real = os.path.realpath(path)
        if real in done or not os.path.isfile(real):
            continue
        done.add(real)
        kind = "smi" if os.path.basename(path) == "nvidia-smi" else "nvml"
        mount(stand_in[kind], real, None, MS_BIND)


def nopython_path():
    """PATH dir with every /usr/bin and /usr/sbin command except python*: python3 'not found'."""
    farm = "/run/gflab/nopy-bin"
    os.mkdir(farm)
    for d in ("/usr/sbin", "/usr/bin"):
        for name in os.listdir(d):
            if name.startswith("python"):
                continue
            try:
                os.symlink(os.path.join(d, name), os.path.join(farm, name))
            except FileExistsError:
                pass
    return farm


def build_proc_driver(spec):
    """/proc/driver/nvidia/gpus/<bus>/information, as recorded by the probe (cat -A):
    where a real host tells the /dev/nvidiaN minor of each GPU. Not on WSL2 hosts."""
    if spec["wsl2"] or not os.path.isdir("/proc/driver"):
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fake_nvidia_smi

    cfg = dict(fake_nvidia_smi.DEFAULTS)
    cfg.update(spec["config"])
    mount("gflab-driver", "/proc/driver", "tmpfs", MS_NOSUID | MS_NODEV, "mode=555")
    for g in fake_nvidia_smi.gpus_of(cfg):
        bus = g["bus_id"][4:].lower()  # 00000000:00:06.0 -> 0000:00:06.0
        d = "/proc/driver/nvidia/gpus/" + bus
        os.makedirs(d)
        text = (
            "Model: \t\t %s\nIRQ:   \t\t 41\nGPU UUID: \t %s\nVideo BIOS: \t 96.00.a5.00.1a\n"
            "Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\n"
            "Bus Location: \t %s\nDevice Minor: \t %d\nGPU Firmware: \t %s\nGPU Excluded:\t No\n"
            % (g["name"], g["uuid"], bus, g["minor"], cfg["driver"])
        )
        write(d + "/information", text, 0o444)
    mount("", "/proc/driver", None, 32 | MS_RDONLY)  # MS_REMOUNT: read-only like procfs


def wait_listening(port, proc, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            return "sshd exited with status %s" % proc.returncode
        s = socket.socket()
        try:
            s.settimeout(0.2)
            s.connect(("127.0.0.1", port))
            return None
        except OSError:
            time.sleep(0.005)
        finally:
            s.close()
    return "sshd not listening after %.0fs" % timeout


def setup(spec, files):
    socket.sethostname(spec["name"])
    mount("gflab-run", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    for d in ("/run/gflab", "/run/sshd", "/run/fakegpu", "/run/lock"):
        os.mkdir(d, 0o755)
    os.mkdir("/run/fakegpu/procs")
    os.chmod("/run/fakegpu/procs", 0o777)
    os.chmod("/run/lock", 0o1777)
    if spec.get("runtime_ids"):  # the lab user's runtime directory, as logind makes it
        uid, gid = spec["runtime_ids"]
        os.mkdir("/run/user", 0o755)
        os.mkdir("/run/user/%d" % uid, 0o700)
        os.chown("/run/user/%d" % uid, uid, gid)
    write("/run/fakegpu/config.json", json.dumps(spec["config"], indent=1), 0o666)
    for name, data in files.items():
        write("/run/gflab/" + name, data, 0o600 if name.endswith("_key") else 0o644)
    os.chmod("/run/gflab/fake_nvidia_smi.py", 0o755)
    os.chmod("/run/gflab/fakecuda.py", 0o755)
    wrapper = '#!/bin/sh\nexec %s -S -E /run/gflab/fake_nvidia_smi.py "$@"\n' % spec["smi_python"]
    write("/run/gflab/nvidia-smi", wrapper, 0o755)
    # Directories that must stay visible under the private /root and /tmp (the lab's Python).
    keep = [k for k in spec.get("keep", []) if os.path.isdir(k)]
    for n, k in enumerate(keep):
        os.makedirs("/run/gflab/stage/%d" % n)
        mount(k, "/run/gflab/stage/%d" % n, None, MS_BIND | MS_REC)
    build_dev(spec)
    build_proc_driver(spec)
    mount("gflab-tmp", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    mount("gflab-root", "/root", "tmpfs", MS_NOSUID | MS_NODEV, "mode=700")
    for name in os.listdir("/etc/skel"):
        src = os.path.join("/etc/skel", name)
        if os.path.isfile(src):
            with open(src, "rb") as f:
                write(os.path.join("/root", name), f.read(), 0o644)
    if os.path.isdir("/home"):
        overlay("/home", {}, "home")
    for n, k in enumerate(keep):
        os.makedirs(k, exist_ok=True)
        mount("/run/gflab/stage/%d" % n, k, None, MS_BIND | MS_REC)
        umount("/run/gflab/stage/%d" % n)
    if spec["nvidia_smi"]:
        place_smi(spec["nvidia_smi"], wrapper)
    if spec.get("nvml"):
        place_nvml(spec["nvml"], files["libnvidia-ml.so.1"], spec["config"]["driver"], spec["wsl2"])
    hide_real_driver(spec, files["libnvidia-ml.so.1"] if spec.get("nvml") else None,
                     wrapper if spec["nvidia_smi"] else None)
    path = spec["path"]
    if not spec["python3"]:
        path = nopython_path()
    sshd_config = spec["sshd_config"].replace("@PATH@", path)
    write("/run/gflab/sshd_config", sshd_config, 0o644)


def main():
    spec_path, status_fd, lifeline_fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with open(spec_path) as f:
        spec = json.load(f)
    files = {}
    for name, path in spec["files"].items():
        with open(path, "rb") as f:
            files[name] = f.read()
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def report(text):
        try:
            os.write(status_fd, (text.replace("\n", " ") + "\n").encode())
            os.close(status_fd)
        except OSError:
            pass

    try:
        setup(spec, files)
        os.chdir("/")
        sshd = subprocess.Popen(
            [spec.get("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", "/run/gflab/sshd_config"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        problem = wait_listening(spec["port"], sshd, 10.0)
    except Exception as exc:  # report any setup failure to the lab, then die
        report("error: %s: %s" % (type(exc).__name__, exc))
        return 1
    if problem:
        report("error: %s" % problem)
        return 1
    report("ok")

    def on_chld(signum, frame):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def on_term(signum, frame):
        os._exit(0)

    signal.signal(signal.SIGCHLD, on_chld)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    on_chld(0, None)
    while True:
        try:
            if not os.read(lifeline_fd, 1):
                return 0
        except OSError as exc:
            if exc.errno != errno.EINTR:
                return 0


if __name__ == "__main__":
    sys.exit(main())
