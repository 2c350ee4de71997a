"""The test lab: simulated GPU hosts, each a real OpenSSH sshd in its own namespaces.

Why: gpufleet's promise is about real SSH sessions, real processes, real /proc; a mocked SSH
client would test nothing of that. A lab host costs ~0.1 s to start: ``unshare`` gives it mount,
PID and UTS namespaces, tests/lab/lab_init.py (its PID 1) builds its /dev, /run, /tmp and runs
``/usr/sbin/sshd -D -e`` on 127.0.0.1:<free port>. See tests/lab/README.md for the API.

Needs root, /usr/sbin/sshd, ssh, ssh-keygen and unshare (util-linux); ``check()`` says
what is missing. Only processes the lab started are ever signalled (each host's namespace init,
by recorded PID: killing it ends every process of that PID namespace).
"""
from __future__ import annotations

import json
import os
import pwd
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

HERE = Path(__file__).resolve().parent
if str(HERE / "fakenvml") not in sys.path:
    sys.path.insert(0, str(HERE / "fakenvml"))
import fakenvml_build  # noqa: E402  (tests/lab/fakenvml/fakenvml_build.py)
# The sshd every host runs: the system's, or GFLAB_SSHD (an absolute path, outside /tmp and /root,
# which a host makes private), e.g. one unpacked from Debian's .debs on a machine without
# OpenSSH (bench/device/run.sh; its libraries come through LD_LIBRARY_PATH).
SSHD = os.environ.get("GFLAB_SSHD") or "/usr/sbin/sshd"
LAB_USER = "gflabuser"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SMI = "/usr/bin/nvidia-smi"
WSL2_SMI = "/usr/lib/wsl/lib/nvidia-smi"
# Where the driver package puts libnvidia-ml.so.1: the multiarch library dir, one of ld.so's
# default search dirs (so dlopen("libnvidia-ml.so.1") finds it); on WSL2 /usr/lib/wsl/lib.
DEFAULT_NVML = "/usr/lib/%s/libnvidia-ml.so.1" % (sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu")
WSL2_NVML = "/usr/lib/wsl/lib/libnvidia-ml.so.1"
# nvml="broken": the library loads, nvmlInit fails (NVML_ERROR_LIB_RM_VERSION_MISMATCH, nvml.h:
# "RM detects a driver/library version mismatch", the usual failure after a driver upgrade).
BROKEN_NVML_ERROR = 18
START_TIMEOUT_S = 15.0


class LabError(RuntimeError):
    """The lab could not do what was asked (a host did not start, a command failed)."""


def _run(argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, **kw)


def check() -> Optional[str]:
    """None when the lab can run here, else why not (one line)."""
    if os.geteuid() != 0:
        return "the lab needs root (namespaces, sshd, useradd)"
    for tool in (SSHD, "ssh", "ssh-keygen", "unshare", "nsenter"):
        if not (os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool)):
            return "%s not found (install openssh-server, openssh-client, util-linux)" % tool
    if fakenvml_build.compiler() is None:
        return "no C compiler for the fake libnvidia-ml.so.1 (install gcc, libc6-dev)"
    probe = _run(["unshare", "-m", "-p", "-f", "-u", "--mount-proc", "true"], timeout=20)
    if probe.returncode != 0:
        why = probe.stderr.strip() or probe.returncode
        return "unshare -m -p -f -u --mount-proc failed: %s" % why
    return None


def kmsg_record(message: str, seq: int = 1, seconds: float = 100.0, facility: int = 0,
                level: int = 4, raw: bool = False) -> str:
    """One /dev/kmsg record as the kernel formats it (Documentation/ABI/testing/dev-kmsg):
    ``prefix;message``: priority (facility << 3 | level), sequence number, microseconds since
    boot, flags; a driver's printk is facility 0 (kernel), a process writing to /dev/kmsg
    gets 1 (user). Non-printable bytes are escaped ``\\xNN`` by the kernel: so here (``raw``:
    not, to test that a reader does not rely on it)."""
    text = message if raw else "".join(c if " " <= c < "\x7f" or c > "\x9f" else "\\x%02x" % ord(c) for c in message)
    return "%d,%d,%d,-;%s\n" % (facility << 3 | level, seq, int(seconds * 1e6), text)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _sshd_version() -> tuple[int, int]:
    out = _run(["ssh", "-V"]).stderr
    m = re.search(r"OpenSSH_(\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _ensure_user(name: str) -> pwd.struct_passwd:
    """The non-root test user; created once on the machine (root's tests, CI runner)."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        res = _run(["useradd", "-m", "-s", "/bin/bash", name])
        if res.returncode not in (0, 9):  # 9: already exists (a parallel lab won the race)
            raise LabError("useradd %s failed: %s" % (name, res.stderr.strip())) from None
        pw = pwd.getpwnam(name)
    # useradd leaves the password "!" (locked): without PAM, sshd refuses a locked account
    # even for key logins. "*" means "no password" and is not locked.
    try:
        with open("/etc/shadow") as f:
            locked = any(line.startswith(name + ":!") for line in f)
    except OSError:
        locked = False
    if locked:
        res = _run(["usermod", "-p", "*", name])
        if res.returncode != 0:
            raise LabError("usermod -p '*' %s failed: %s" % (name, res.stderr.strip()))
    if not os.path.isdir(pw.pw_dir):
        os.makedirs(pw.pw_dir, mode=0o755)
        os.chown(pw.pw_dir, pw.pw_uid, pw.pw_gid)
    return pw


def _keep_dirs() -> list[str]:
    """This interpreter's directories, and the checkout gpufleet is imported from (an editable
    install: CI may clone under /tmp), that a host's private /root or /tmp would hide."""
    out = []
    for p in (sys.base_prefix, sys.prefix, str(Path(__file__).resolve().parents[2])):
        p = os.path.realpath(p)
        if p.startswith(("/root/", "/tmp/")) and p not in out:
            out.append(p)
    return out


def _run_text(argv: Sequence[str], what: str, timeout: float, input: Optional[str], check: bool,
              env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a command into a host (ssh or nsenter) with text I/O; ``check`` raises LabError."""
    res = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout,
                         env=env, stdin=None if input is not None else subprocess.DEVNULL)
    if check and res.returncode != 0:
        raise LabError("%s: exit %d: %s" % (what, res.returncode, res.stderr.strip()))
    return res


def _holder_args(spec: Mapping[str, Any]) -> list[str]:
    """fakecuda.py arguments for one holder spec (see LabHost.spawn_holder)."""
    args = ["--gpus", ",".join(str(g) for g in spec.get("gpus", [0]))]
    mib = spec.get("mib", 500)
    args += ["--mib", ",".join(str(m) for m in mib) if isinstance(mib, (list, tuple)) else str(mib)]
    if spec.get("title"):
        args += ["--title", str(spec["title"])]
    if spec.get("argv"):
        args += ["--argv", json.dumps([str(a) for a in spec["argv"]])]
    if spec.get("ignore_term"):
        args.append("--ignore-term")
    if spec.get("term_delay") is not None:
        args += ["--term-delay", str(spec["term_delay"])]
    if spec.get("cuda_visible") is not None:
        cv = spec["cuda_visible"]
        cv = ",".join(str(c) for c in cv) if isinstance(cv, (list, tuple)) else str(cv)
        args += ["--cuda-visible", cv]
    if spec.get("no_devices"):
        args.append("--no-devices")
    if spec.get("monitor"):
        args.append("--monitor")
    if spec.get("zombie_child") is not None:
        args += ["--zombie-child", str(spec["zombie_child"])]
    if spec.get("exit_after") is not None:
        args += ["--exit-after", str(spec["exit_after"])]
    if spec.get("leader_exit") or spec.get("stuck"):
        args.append("--leader-exit")
    if spec.get("stuck"):
        args.append("--stuck")
    if spec.get("mps_pipe"):
        args += ["--mps-pipe", str(spec["mps_pipe"])]
    for child in spec.get("children") or ():
        args += ["--spawn-child", shlex.join(_holder_args(child))]
    return args


class HolderPid(int):
    """A holder's pid inside its host (an int), with its starttime and its children's pids."""

    starttime: Optional[int]
    children: list["HolderPid"]
    zombie: Optional[int]
    thread: Optional[int]
    doc: dict

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> "HolderPid":
        obj = cls(int(doc["pid"]))
        obj.starttime = doc.get("starttime")
        obj.children = [cls.from_doc(c) for c in doc.get("children") or ()]
        obj.zombie = doc.get("zombie")
        obj.thread = doc.get("thread")
        obj.doc = dict(doc)
        return obj

    def family(self) -> list["HolderPid"]:
        """This pid and all its descendants, parents first."""
        out = [self]
        for c in self.children:
            out += c.family()
        return out


class Endpoint:
    """An address that is not a lab host: a dead or blackholed port (no host key)."""

    def __init__(self, name: str, port: int, sockets: list[socket.socket], kind: str):
        self.name = name
        self.address = "127.0.0.1"
        self.port = port
        self.kind = kind
        self.host_key_line: Optional[str] = None
        self._sockets = sockets

    def close(self) -> None:
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
        self._sockets = []

    def __repr__(self) -> str:
        return "<Endpoint %s %s 127.0.0.1:%d>" % (self.kind, self.name, self.port)


class LabHost:
    """One simulated GPU host. Pids given and returned are as seen inside the host."""

    def __init__(self, lab: "Lab", name: str, port: int, hostdir: Path, options: dict):
        self.lab = lab
        self.name = name
        self.address = options.get("listen") or "127.0.0.1"
        self.port = port
        self.dir = hostdir
        self.options = options
        self.nvidia_smi: Optional[str] = options["nvidia_smi"]
        self.nvml: Optional[str] = options.get("nvml")  # the library's path in the host, or None
        self.gpus: int = options["config"]["gpus"]
        self.wsl2: bool = options["wsl2"]
        pub = (hostdir / "ssh_host_ed25519_key.pub").read_text().split()
        self.host_key_line = "[%s]:%d %s %s" % (self.address, port, pub[0], pub[1])
        self.root_pid: Optional[int] = None  # the namespace's init, as seen from outside
        self._unshare: Optional[subprocess.Popen] = None
        self._lifeline: Optional[int] = None

    # --- lifecycle ---------------------------------------------------------------------------

    def _start(self, spec_path: Path) -> None:
        status_r, status_w = os.pipe()
        life_r, life_w = os.pipe()
        argv = [
            "unshare", "-m", "-p", "-f", "-u", "--mount-proc", "--propagation", "private",
            "--kill-child", sys.executable, "-I", str(HERE / "lab_init.py"), str(spec_path),
            str(status_w), str(life_r),
        ]
        if self.options.get("netns"):  # nsenter execs unshare: same pid, no fork
            argv = ["nsenter", "--net=/run/netns/%s" % self.options["netns"]] + argv
        try:
            self._unshare = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=open(self.dir / "init.log", "ab"),
                stderr=subprocess.STDOUT,
                pass_fds=(status_w, life_r),
                start_new_session=True,
            )
        finally:
            os.close(status_w)
            os.close(life_r)
        self._lifeline = life_w
        status = b""
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not status.endswith(b"\n"):
                left = deadline - time.monotonic()
                ready, _, _ = select.select([status_r], [], [], max(0.0, left))
                if not ready:
                    break
                chunk = os.read(status_r, 4096)
                if not chunk:
                    break
                status += chunk
        finally:
            os.close(status_r)
        self.root_pid = self._find_init()
        text = status.decode(errors="replace").strip()
        if text != "ok":
            log = ""
            for name in ("init.log", "sshd.log"):
                try:
                    log += " | %s: %s" % (name, (self.dir / name).read_text()[-800:].strip())
                except OSError:
                    pass
            self.stop()
            raise LabError(
                "lab host %s did not start: %s%s" % (self.name, text or "no status", log)
            )

    def _find_init(self) -> Optional[int]:
        assert self._unshare is not None
        pid = self._unshare.pid
        for _ in range(200):
            try:
                kids = Path("/proc/%d/task/%d/children" % (pid, pid)).read_text().split()
            except OSError:
                return None
            if kids:
                return int(kids[0])
            time.sleep(0.005)
        return None

    @property
    def running(self) -> bool:
        return self._unshare is not None and self._unshare.poll() is None

    def stop(self) -> None:
        """End the host: SIGKILL its namespace init (every process in it dies with it)."""
        if self.root_pid is not None and self._unshare is not None and self._unshare.poll() is None:
            try:
                os.kill(self.root_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._unshare is not None:
            try:
                self._unshare.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._unshare.kill()  # unshare --kill-child takes the init with it
                self._unshare.wait(timeout=10)
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        self.lab._forget(self)

    # --- running things in the host ------------------------------------------------------------

    def ssh_argv(self, user: str = "root", connect_timeout: float = 10) -> list[str]:
        """The ssh client command line that reaches this host (append the remote command)."""
        return [
            "ssh", "-F", "/dev/null", "-i", str(self.lab.client_key),
            "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", "UserKnownHostsFile=%s" % self.lab.known_hosts_path,
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
            "-o", "ConnectTimeout=%s" % connect_timeout, "-o", "LogLevel=ERROR",
            "-p", str(self.port), "-l", user, self.address,
        ]

    def ssh(
        self,
        cmd: Union[str, Sequence[str]],
        user: str = "root",
        timeout: float = 60,
        input: Optional[str] = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` (shell text, or an argv that is quoted here) over real SSH."""
        text = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return _run_text(self.ssh_argv(user) + ["--", text], "ssh %s %r" % (self.name, text),
                         timeout, input, check)

    def exec(
        self,
        argv: Sequence[str],
        user: str = "root",
        timeout: float = 60,
        input: Optional[str] = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run argv inside the host's namespaces without SSH (nsenter): quick, for test set-up."""
        prefix = ["nsenter", "-t", str(self.root_pid), "-m", "-u", "-p", "-w"]
        if user != "root":
            pw = pwd.getpwnam(user)
            prefix += ["setpriv", "--reuid=%d" % pw.pw_uid, "--regid=%d" % pw.pw_gid]
            prefix += ["--init-groups"]
            prefix = prefix + ["env", "HOME=%s" % pw.pw_dir, "USER=%s" % user, "LOGNAME=%s" % user]
        env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
        return _run_text(prefix + ["--"] + list(argv) if user == "root" else prefix + list(argv),
                         "exec on %s %r" % (self.name, argv), timeout, input, check, env=env)

    def holder_python(self, user: str = "root") -> str:
        """Interpreter for holders: this one (it has setproctitle) when the user can run it."""
        if user == "root":
            try:
                import setproctitle  # noqa: F401

                return sys.executable
            except ImportError:
                pass
        return "python3" if self.options["python3"] else self.options["smi_python"]

    def spawn_holder(
        self,
        gpus: Iterable[int] = (0,),
        mib: Union[int, Sequence[int]] = 716,
        title: Optional[str] = None,
        ignore_term: bool = False,
        term_delay: Optional[float] = None,
        children: Optional[Sequence[Mapping[str, Any]]] = None,
        user: str = "root",
        cuda_visible: Optional[Union[str, Sequence[int]]] = None,
        no_devices: bool = False,
        zombie_child: Optional[int] = None,
        exit_after: Optional[float] = None,
        python: Optional[str] = None,
        via: str = "ssh",
        monitor: bool = False,
        leader_exit: bool = False,
        stuck: bool = False,
        mps: Optional[Any] = None,
        argv: Optional[Sequence[str]] = None,
    ) -> HolderPid:
        """Start a fakecuda holder (and its children) fully detached; returns its pid.

        ``children`` are dicts with the same keys (gpus, mib, title, ignore_term, term_delay,
        children, ...). ``via="exec"`` starts it through nsenter instead of SSH (faster).
        ``leader_exit``: the holding is done by a second thread and the main thread then calls
        pthread_exit (a zombie leader that still holds, as on the H200); ``stuck`` (root) also
        puts that thread in uninterruptible sleep (D). Returns once the leader is a zombie.
        ``mps``: a client of that fake MPS (``spawn_mps``'s value): its daemon lists it.
        ``argv``: the command line it shows (rewritten in place, comm kept: ``python3``), as a
        script its interpreter started, e.g. ``["python3", "/data/alice/train.py", "--lr", "1"]``.
        """
        spec = dict(
            gpus=list(gpus), mib=mib, title=title, ignore_term=ignore_term, term_delay=term_delay,
            children=children, cuda_visible=cuda_visible, no_devices=no_devices,
            zombie_child=zombie_child, exit_after=exit_after, monitor=monitor, argv=argv,
            leader_exit=leader_exit, stuck=stuck,
            mps_pipe=mps.pipe_dir if mps is not None else None,
        )
        py = python or self.holder_python(user)
        log = "/tmp/fakecuda-%d.log" % time.time_ns()
        argv = [py, "/run/gflab/fakecuda.py", "--detach", "--log", log]
        argv += _holder_args(spec)
        if via == "ssh":
            res = self.ssh(argv, user=user, timeout=90)
        else:
            res = self.exec(argv, user=user, timeout=90)
        if res.returncode != 0:
            raise LabError(
                "spawn_holder on %s failed (exit %d): %s %s"
                % (self.name, res.returncode, res.stdout.strip(), res.stderr.strip())
            )
        try:
            doc = json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise LabError(
                "spawn_holder on %s: unreadable answer %r %r" % (self.name, res.stdout, res.stderr)
            ) from None
        holder = HolderPid.from_doc(doc)
        if (leader_exit or stuck) and not self._wait_state(holder, "Z", 10.0):
            raise LabError("spawn_holder on %s: leader %d not a zombie after 10 s (state %s)"
                           % (self.name, holder, self.proc_state(holder)))
        return holder

    def spawn_monitor(self, title: Optional[str] = None, user: str = "root",
                      via: str = "ssh") -> HolderPid:
        """An NVML client like nvtop, nvitop, gpustat or dcgm-exporter: /dev/nvidiactl,
        /dev/nvidia-uvm and every /dev/nvidiaN open, nothing mapped, no GPU memory, not in
        nvidia-smi's compute-apps (recorded on the H200: a pynvml poller)."""
        return self.spawn_holder(gpus=[], mib=0, title=title, user=user, via=via, monitor=True)

    def spawn_mps(self, gpus: Sequence[int] = (0,), server_mib: int = 66,
                  pipe_dir: str = "/tmp/nvidia-mps", user: str = "root") -> Any:
        """A CUDA MPS control daemon and its server, real processes running root's binaries
        named nvidia-cuda-mps-control / nvidia-cuda-mps-server (tests/lab/labmps.py, the
        fake tests/lab/fakemps/fakemps.c); returns an ``Mps`` (``.daemon``, ``.server``,
        ``.pipe_dir``, ``.ask(*commands)``, ``.quit()``). Clients: ``spawn_holder(mps=...)``."""
        import labmps

        return labmps.start(self, gpus, server_mib, pipe_dir, user=user)

    def spawn_smi_loop(self, interval_s: float = 0.05, user: str = "root") -> int:
        """A `watch nvidia-smi`-like loop (sh running the host's nvidia-smi every interval),
        fully detached; returns the in-host pid of the loop's shell (kill it to stop)."""
        script = ('i="$1"; while :; do nvidia-smi >/dev/null 2>&1; sleep "$i"; done '
                  '</dev/null >/dev/null 2>&1 & echo $!')
        res = self.exec(["setsid", "sh", "-c", script, "smi-loop", str(interval_s)],
                        user=user, check=True)
        return int(res.stdout.strip().splitlines()[-1])

    def spawn_vllm(
        self,
        gpus: Sequence[int] = (0, 1),
        mib: int = 716,
        user: str = "root",
        ignore_term: bool = False,
        term_delay: Optional[float] = None,
        via: str = "ssh",
    ) -> HolderPid:
        """A vLLM-like family: API server -> VLLM::EngineCore_DP0 -> one VLLM::Worker per GPU.

        The API server holds no GPU memory and no device files; the engine core initialises CUDA
        (opens the devices) without memory; each worker holds ``mib`` on its GPU. Returns the
        API server's pid; ``.children[0]`` is the engine core, ``.children[0].children`` the
        workers.
        """
        workers = [
            dict(gpus=[g], mib=mib, title="VLLM::Worker_TP%d" % n, ignore_term=ignore_term,
                 term_delay=term_delay)
            for n, g in enumerate(gpus)
        ]
        engine = dict(gpus=[], mib=0, title="VLLM::EngineCore_DP0", children=workers,
                      ignore_term=ignore_term, term_delay=term_delay)
        return self.spawn_holder(gpus=[], mib=0, no_devices=True, children=[engine], user=user,
                                 ignore_term=ignore_term, term_delay=term_delay, via=via)

    # --- looking inside ----------------------------------------------------------------------

    def append_kmsg(self, *records: str) -> None:
        """Append records (``kmsg_record(...)``) to the host's fake /dev/kmsg."""
        with open(self.path("/dev/kmsg"), "a") as f:
            f.write("".join(records))

    def path(self, inner: str) -> Path:
        """Path, seen from outside, of a file inside the host (through /proc/PID/root)."""
        return Path("/proc/%d/root" % self.root_pid) / inner.lstrip("/")

    @property
    def state_dir(self) -> Path:
        return self.path("/run/fakegpu")

    def proc_state(self, pid: int) -> Optional[str]:
        """The process state letter (R, S, Z, ...) of a pid inside the host, None if gone."""
        try:
            data = self.path("/proc/%d/stat" % pid).read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        return data[data.rindex(")") + 2 :].split()[0]

    def threads(self, pid: int) -> Optional[int]:
        """The number of threads of a pid inside the host (its leader counted), None if gone."""
        try:
            data = self.path("/proc/%d/stat" % pid).read_text()
        except (FileNotFoundError, ProcessLookupError):
            return None
        return int(data[data.rindex(")") + 2 :].split()[17])

    def task_states(self, pid: int) -> dict[int, tuple[str, str]]:
        """{tid: (state letter, wchan)} of every thread of a pid inside the host."""
        out = {}
        try:
            tids = [int(t) for t in os.listdir(self.path("/proc/%d/task" % pid))]
        except (FileNotFoundError, ProcessLookupError):
            return out
        for tid in tids:
            base = self.path("/proc/%d/task/%d" % (pid, tid))
            try:
                data = (base / "stat").read_text()
                wchan = (base / "wchan").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            out[tid] = (data[data.rindex(")") + 2 :].split()[0], wchan)
        return out

    def alive(self, pid: int) -> bool:
        """True while the pid exists in the host and is not a zombie; a zombie leader whose
        other threads still run is alive (it holds what they hold)."""
        state = self.proc_state(pid)
        if state in ("Z", "X"):
            return (self.threads(pid) or 0) > 1
        return state is not None

    def _wait_state(self, pid: int, state: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc_state(pid) == state:
                return True
            time.sleep(0.01)
        return False

    def comm(self, pid: int) -> str:
        return self.path("/proc/%d/comm" % pid).read_text().rstrip("\n")

    def cmdline(self, pid: int) -> list[str]:
        raw = self.path("/proc/%d/cmdline" % pid).read_bytes()
        return [p.decode(errors="replace") for p in raw.rstrip(b"\0").split(b"\0")]

    def fds(self, pid: int) -> list[str]:
        """Targets of the pid's open fds (e.g. /dev/nvidia0)."""
        fddir = self.path("/proc/%d/fd" % pid)
        out = []
        for fd in sorted(os.listdir(fddir), key=int):
            try:
                out.append(os.readlink(fddir / fd))
            except OSError:
                pass
        return out

    def outer_pid(self, pid: int) -> Optional[int]:
        """The pid as seen from outside the host (for os.kill from the test process)."""
        try:
            ns = os.readlink("/proc/%d/ns/pid" % self.root_pid)
        except OSError:
            return None
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.readlink("/proc/%s/ns/pid" % name) != ns:
                    continue
                with open("/proc/%s/status" % name) as f:
                    for line in f:
                        if line.startswith("NSpid:"):
                            if int(line.split()[-1]) == pid:
                                return int(name)
                            break
            except (OSError, ValueError):
                continue
        return None

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> bool:
        """Signal a process of this host (by its inner pid); False if it is not there."""
        outer = self.outer_pid(pid)
        if outer is None:
            return False
        try:
            os.kill(outer, sig)
        except ProcessLookupError:
            return False
        return True

    def wait_gone(self, pid: int, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive(pid):
                return True
            time.sleep(0.01)
        return False

    # --- the fake GPU state --------------------------------------------------------------------

    def config(self) -> dict:
        return json.loads((self.state_dir / "config.json").read_text())

    def set_config(self, **changes: Any) -> dict:
        """Change the fake driver's config.json (e.g. fail=True, release_delay_s=1.0)."""
        if "ghost_mib" in changes and isinstance(changes["ghost_mib"], int):
            changes["ghost_mib"] = {str(i): changes["ghost_mib"] for i in range(self.gpus)}
        cfg = self.config()
        cfg.update(changes)
        path = self.state_dir / "config.json"
        tmp = self.state_dir / ("config.json.lab%d.tmp" % os.getpid())
        tmp.write_text(json.dumps(cfg, indent=1))
        os.chmod(tmp, 0o666)
        os.rename(tmp, path)
        return cfg

    def smi(
        self, *args: str, user: str = "root", timeout: float = 20
    ) -> subprocess.CompletedProcess:
        """Run the host's nvidia-smi (inside the host, without SSH)."""
        return self.exec(["/run/gflab/nvidia-smi", *args], user=user, timeout=timeout)

    def gpu_used(self) -> list[int]:
        """memory.used per GPU index, through the fake nvidia-smi."""
        res = self.smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
        if res.returncode != 0:
            raise LabError(
                "nvidia-smi on %s: exit %d: %s" % (self.name, res.returncode, res.stdout.strip())
            )
        return [int(line.split(",")[1]) for line in res.stdout.splitlines() if line.strip()]

    def resets(self) -> list[dict]:
        try:
            text = (self.state_dir / "resets.jsonl").read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def records(self) -> dict[int, dict]:
        """The holder records the fake driver holds now (pid -> record)."""
        out = {}
        for p in (self.state_dir / "procs").glob("*.json"):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            out[int(rec["pid"])] = rec
        return out

    def __repr__(self) -> str:
        return "<LabHost %s %s:%d gpus=%d>" % (self.name, self.address, self.port, self.gpus)


class Lab:
    """A set of lab hosts sharing one client key and one known_hosts file. Context manager."""

    def __init__(self, tmpdir: Union[str, Path, None] = None, user: str = LAB_USER):
        problem = check()
        if problem:
            raise LabError("the test lab cannot run here: " + problem)
        self._own_dir = tmpdir is None
        self.dir = Path(tmpdir if tmpdir is not None else tempfile.mkdtemp(prefix="gflab-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        self.user = user
        pw = _ensure_user(user)
        self._runtime_ids = (pw.pw_uid, pw.pw_gid)
        self.client_key = self.dir / "client_ed25519"
        self._keygen(self.client_key, "gflab-client")
        self.client_pub = (self.dir / "client_ed25519.pub").read_text().strip()
        self.known_hosts_path = self.dir / "known_hosts"
        self.known_hosts_path.write_text("")
        self.hosts: dict[str, LabHost] = {}
        self.endpoints: list[Endpoint] = []
        self._lock = threading.Lock()
        self._version = _sshd_version()
        # The fake nvidia-smi's interpreter: one every user can run, by absolute path.
        system_python = shutil.which("python3", path="/usr/bin:/bin")
        self._smi_python = os.path.realpath(system_python or sys.executable)
        # The fake libnvidia-ml.so.1, compiled once per source (tests/lab/fakenvml/fakenvml_build.py).
        try:
            self.nvml_library: Path = fakenvml_build.build()
        except fakenvml_build.BuildError as exc:
            raise LabError("the fake libnvidia-ml.so.1 did not build: %s" % exc) from None
        self._counter = 0

    @staticmethod
    def _keygen(path: Path, comment: str) -> None:
        for p in (path, Path(str(path) + ".pub")):
            if p.exists():
                p.unlink()
        res = _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
        if res.returncode != 0:
            raise LabError("ssh-keygen failed: %s" % res.stderr.strip())

    # --- hosts -------------------------------------------------------------------------------

    def add_host(
        self,
        name: Optional[str] = None,
        gpus: int = 2,
        gpu_name: Union[str, Sequence[str]] = "NVIDIA RTX 6000 Ada Generation",
        total_mib: Union[int, Sequence[int]] = 49140,
        reserved_mib: Union[int, Sequence[int]] = 616,
        ghost_mib: Union[int, Mapping[Any, int]] = 0,
        release_delay_s: float = 0.0,
        hidden_pids: bool = False,
        wsl2: bool = False,
        driver: str = "ok",
        nvidia_smi: Optional[str] = "default",
        python3: bool = True,
        minors: Optional[Sequence[int]] = None,
        sshd_extra: str = "",
        netns: Optional[str] = None,
        listen: Optional[str] = None,
        path_prefix: Optional[str] = None,
        nvml: Union[bool, str, None] = True,
        keep: Sequence[str] = (),
        kmsg: Optional[Sequence[str]] = (),
        **config: Any,
    ) -> LabHost:
        """Start one host. ``driver``: ok | fail | hang | garbage. ``nvidia_smi``: a path inside
        the host, "default" (/usr/bin/nvidia-smi, or /usr/lib/wsl/lib/nvidia-smi on WSL2) or None
        (no nvidia-smi). ``python3=False``: python3 is not on the session PATH. Other keyword
        arguments go into the fake driver's config.json (see fake_nvidia_smi.DEFAULTS).
        ``sshd_extra``: more sshd_config lines (e.g. "MaxStartups 1"). ``netns``: run the host
        in this existing network namespace (/run/netns/NAME, e.g. made by `ip netns add`);
        ``listen``: sshd also listens on this address of it, and the host's ``address`` is it
        (bench/ reaches hosts through a delayed link this way). ``path_prefix``: a
        directory put first on the SSH session's PATH (e.g. "/root/bin", in the host's private
        /root, for a fake systemctl that the agent then finds as `systemctl`). ``nvml``: the
        fake libnvidia-ml.so.1: True (the default place, found by name), an absolute path inside
        the host, "broken" (installed, nvmlInit fails) or False/None (no library).
        ``keep``: outside directories (under /tmp or /root) that stay visible at the same path
        inside the host's private /tmp and /root (a Slurm cluster's directory, tests/integration
        /slurm_lab.py: both sides read the same slurm.conf and munge socket).
        ``kmsg``: the host's kernel log, a REGULAR file at /dev/kmsg (root-readable, 0644,
        like the real one) holding these records in /dev/kmsg's own format
        (``kmsg_record``); None: no /dev/kmsg (the agent falls back to journalctl/dmesg).
        """
        if driver not in ("ok", "fail", "hang", "garbage"):
            raise ValueError("driver must be ok, fail, hang or garbage")
        if nvidia_smi not in (None, "default") and not str(nvidia_smi).startswith("/"):
            raise ValueError("nvidia_smi must be an absolute path, 'default' or None")
        if not (nvml in (True, False, None, "default", "broken") or str(nvml).startswith("/")):
            raise ValueError("nvml must be True, False, None, 'broken' or an absolute path")
        with self._lock:
            self._counter += 1
            name = name or "gpu-%02d" % self._counter
            if name in self.hosts:
                raise ValueError("lab host %r exists" % name)
        if nvidia_smi == "default":
            nvidia_smi = WSL2_SMI if wsl2 else DEFAULT_SMI
        if isinstance(ghost_mib, int):
            ghost = {str(i): ghost_mib for i in range(gpus)} if ghost_mib else {}
        else:
            ghost = {str(k): int(v) for k, v in ghost_mib.items()}
        minors = list(minors) if minors is not None else list(range(gpus))
        cfg = {
            "gpus": gpus, "name": gpu_name if isinstance(gpu_name, str) else list(gpu_name),
            "total_mib": total_mib if isinstance(total_mib, int) else list(total_mib),
            "reserved_mib": reserved_mib if isinstance(reserved_mib, int) else list(reserved_mib),
            "driver": "580.159.04", "cuda": "13.0", "seed": "%s-%s" % (name, os.urandom(4).hex()),
            "ghost_mib": ghost, "release_delay_s": release_delay_s, "hidden_pids": hidden_pids,
            "wsl2": wsl2, "fail": driver == "fail", "hang": driver == "hang",
            "garbage": driver == "garbage", "minors": minors,
        }
        if nvml == "broken":
            cfg["nvml_init_error"] = BROKEN_NVML_ERROR
        cfg.update(config)
        if nvml in (True, "default", "broken"):
            nvml = WSL2_NVML if wsl2 else DEFAULT_NVML
        elif not nvml:
            nvml = None
        hostdir = self.dir / "hosts" / name
        hostdir.mkdir(parents=True, exist_ok=True)
        self._keygen(hostdir / "ssh_host_ed25519_key", name)
        (hostdir / "authorized_keys").write_text(self.client_pub + "\n")
        options = dict(config=cfg, nvidia_smi=nvidia_smi, python3=python3, wsl2=wsl2,
                       smi_python=self._smi_python, netns=netns, listen=listen, nvml=nvml)
        last: Optional[Exception] = None
        for _attempt in range(3):  # a free port can be taken between choosing and binding
            port = _free_port()
            if netns:  # free here says nothing about that namespace: skip its hosts' ports
                with self._lock:
                    taken = {h.port for h in self.hosts.values() if h.options.get("netns") == netns}
                while port in taken:
                    port = _free_port()
            host = LabHost(self, name, port, hostdir, options)
            spec = {
                "name": name, "port": port, "config": cfg, "wsl2": wsl2, "minors": minors,
                "nvidia_smi": nvidia_smi, "python3": python3, "smi_python": self._smi_python,
                "nvml": nvml, "kmsg": None if kmsg is None else "".join(kmsg), "sshd": SSHD,
                "runtime_ids": list(self._runtime_ids),
                "path": (path_prefix + ":" if path_prefix else "") + DEFAULT_PATH, "log": str(hostdir / "sshd.log"), "keep": _keep_dirs() + [os.path.realpath(k) for k in keep],
                "sshd_config": self._sshd_config(port)
                + ("ListenAddress %s\n" % listen if listen else "") + sshd_extra.strip() + "\n",
                "files": {
                    "fake_nvidia_smi.py": str(HERE / "fake_nvidia_smi.py"),
                    "fakecuda.py": str(HERE / "fakecuda.py"),
                    "libnvidia-ml.so.1": str(self.nvml_library),
                    "ssh_host_ed25519_key": str(hostdir / "ssh_host_ed25519_key"),
                    "authorized_keys": str(hostdir / "authorized_keys"),
                },
            }
            spec_path = hostdir / "spec.json"
            spec_path.write_text(json.dumps(spec, indent=1))
            with self._lock:
                self.hosts[name] = host
            try:
                host._start(spec_path)
            except LabError as exc:
                last = exc
                continue
            self._write_known_hosts()
            return host
        raise last if last else LabError("lab host %s did not start" % name)

    def _sshd_config(self, port: int) -> str:
        lines = [
            "Port %d" % port,
            "ListenAddress 127.0.0.1",
            "HostKey /run/gflab/ssh_host_ed25519_key",
            "PidFile /run/gflab/sshd.pid",
            "AuthorizedKeysFile /run/gflab/authorized_keys",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "UseDNS no",
            "StrictModes no",
            "PrintMotd no",
            "PrintLastLog no",
            "MaxStartups 200",
            "MaxSessions 100",
            "LoginGraceTime 30",
            "Subsystem sftp internal-sftp",
            "SetEnv PATH=@PATH@ LANG=C.UTF-8",
        ]
        if self._version >= (9, 8):
            lines.append("PerSourcePenalties no")
        return "\n".join(lines) + "\n"

    def _forget(self, host: LabHost) -> None:
        with self._lock:
            if self.hosts.get(host.name) is host:
                del self.hosts[host.name]
        self._write_known_hosts()

    def _write_known_hosts(self) -> None:
        with self._lock:
            lines = [h.host_key_line for h in self.hosts.values() if h.running]
            tmp = self.known_hosts_path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in lines))
            os.rename(tmp, self.known_hosts_path)

    def host(self, name: str) -> LabHost:
        return self.hosts[name]

    def remove_host(self, host: Union[str, LabHost]) -> None:
        (self.hosts[host] if isinstance(host, str) else host).stop()

    def known_hosts(
        self, hosts: Iterable[Union[LabHost, Endpoint]], path: Union[str, Path]
    ) -> Path:
        """Write a known_hosts file holding only these hosts' keys."""
        path = Path(path)
        path.write_text("".join(h.host_key_line + "\n" for h in hosts if h.host_key_line))
        return path

    def wrong_host_key_line(self, host: LabHost) -> str:
        """A known_hosts line for the host's address with a key that is NOT its key."""
        tmp = self.dir / ("wrong-%d" % time.time_ns())
        self._keygen(tmp, "wrong")
        pub = Path(str(tmp) + ".pub").read_text().split()
        tmp.unlink()
        Path(str(tmp) + ".pub").unlink()
        return "[127.0.0.1]:%d %s %s" % (host.port, pub[0], pub[1])

    # --- unreachable endpoints ---------------------------------------------------------------

    def dead_host(self, name: str = "dead") -> Endpoint:
        """A port with nothing listening: connect() is refused at once.

        The port stays bound (never listened on) so no other process can take it meanwhile."""
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ep = Endpoint(name, s.getsockname()[1], [s], "dead")
        self.endpoints.append(ep)
        return ep

    def blackholed_host(self, name: str = "blackhole") -> Endpoint:
        """A port where connect() never completes (the caller must time out).

        A listening socket with backlog 0 that never accepts, its accept queue filled by the
        lab's own connections: the kernel then drops new SYNs, so a client sits in SYN_SENT
        retrying until its own timeout (measured: connect with timeout 2.5 s -> TimeoutError)."""
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        socks = [s]
        for _ in range(3):
            c = socket.socket()
            c.setblocking(False)
            try:
                c.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            socks.append(c)
        time.sleep(0.05)
        ep = Endpoint(name, port, socks, "blackholed")
        self.endpoints.append(ep)
        return ep

    def mute_host(self, name: str = "mute") -> Endpoint:
        """A port that accepts TCP (kernel backlog) but never sends an SSH banner."""
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(128)
        ep = Endpoint(name, s.getsockname()[1], [s], "mute")
        self.endpoints.append(ep)
        return ep

    # --- inventory -----------------------------------------------------------------------------

    def host_entry(self, host: Union[LabHost, Endpoint], **overrides: Any) -> dict:
        """One host's fleet.yaml entry (None removes a key)."""
        entry: dict[str, Any] = {
            "address": host.address,
            "port": host.port,
            "user": "root",
            "identity_file": str(self.client_key),
            "known_hosts_file": str(self.known_hosts_path),
            "host_key_policy": "strict",
        }
        entry.update(overrides)
        return {k: v for k, v in entry.items() if v is not None}

    def inventory_yaml(
        self,
        hosts: Optional[Iterable[Union[LabHost, Endpoint]]] = None,
        path: Union[str, Path, None] = None,
        defaults: Optional[Mapping[str, Any]] = None,
        groups: Optional[Mapping[str, Sequence[Any]]] = None,
        **per_host_overrides: Any,
    ) -> Path:
        """Write a fleet.yaml for these hosts (default: all running hosts); returns its path.

        Keyword arguments whose value is a dict are per-host overrides keyed by host name
        (``**{"train-node": {"user": "gflabuser"}}``); other keyword arguments apply to every
        host (``connect_timeout=2``). A value of None removes the key."""
        import yaml

        hosts = list(self.hosts.values()) if hosts is None else list(hosts)
        common = {k: v for k, v in per_host_overrides.items() if not isinstance(v, dict)}
        per_host = {k: v for k, v in per_host_overrides.items() if isinstance(v, dict)}
        unknown = set(per_host) - {h.name for h in hosts}
        if unknown:
            raise ValueError("overrides for hosts not in the inventory: %s" % sorted(unknown))
        if defaults is None:
            defaults = {"connect_timeout": 5, "command_timeout": 60}
        doc: dict[str, Any] = {
            "defaults": dict(defaults),
            "hosts": {
                h.name: self.host_entry(h, **{**common, **per_host.get(h.name, {})}) for h in hosts
            },
        }
        if groups:
            doc["groups"] = {
                g: [m if isinstance(m, str) else m.name for m in members]
                for g, members in groups.items()
            }
        if path is None:
            self._counter += 1
            path = self.dir / ("fleet-%d.yaml" % self._counter)
        path = Path(path)
        path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False))
        return path

    # --- end -------------------------------------------------------------------------------------

    def close(self) -> None:
        for host in list(self.hosts.values()):
            host.stop()
        for ep in self.endpoints:
            ep.close()
        self.endpoints = []
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
