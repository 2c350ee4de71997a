"""A real Slurm cluster on loopback for the lab: munged and slurmctld on this machine, slurmd
inside a lab host's namespaces (so its Prolog/Epilog see that host's /proc and fake GPUs).

Everything is started from a temporary directory (slurm.conf, gres.conf, a munge key, state and
logs), and stopped by the PIDs recorded here (slurmd by its in-host pid). The directory is kept
visible inside the lab host at the same path (``add_host(keep=...)``), so the daemons on both
sides read the same slurm.conf and the same munge socket. Nothing is installed or changed
outside that directory. Needs Debian's slurmctld, slurmd, slurm-client and munge (.ci/run).

Why the GPUs are declared the way they are: gres.conf ``File=`` must name character devices
(slurmd refuses regular files), while the lab's /dev/nvidiaN are regular files the fake driver's
holders open. So gres.conf names character devices made with ``mknod NAME c 195 N`` (NVIDIA's
major; there is no NVIDIA driver here, nothing ever opens them) in this directory; Slurm only
needs them to count and index GPUs, and hands the indices to jobs, Prolog and Epilog
(SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES), which name the lab host's GPUs of the same index.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "munged")


def missing_tools() -> list[str]:
    return [t for t in SLURM_TOOLS if shutil.which(t) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """One controller, one node (a lab host). ``env`` is the environment for client commands."""

    def __init__(self, root: Path, node_name: str, gpus: int = 4, prolog: Optional[str] = None,
                 epilog: Optional[str] = None, extra_conf: str = "",
                 prolog_epilog_timeout: int = 60):
        self.root = Path(root)
        self.node_name = node_name
        self.gpus = gpus
        self.prolog = prolog
        self.epilog = epilog
        self.extra_conf = extra_conf
        self.prolog_epilog_timeout = prolog_epilog_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.slurmd_pid: Optional[int] = None  # in the lab host's PID namespace
        self.host: Any = None
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # ---------------------------------------------------------------------------- config

    def write_files(self) -> None:
        r = self.root
        r.mkdir(parents=True, exist_ok=True)  # its parents must let the job's user through
        for d in ("munge", "ctld", "spool/" + self.node_name, "log", "gresdev", "jobs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o755)
        os.chmod(r / "jobs", 0o1777)
        key = r / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        for i in range(self.gpus):
            dev = r / "gresdev" / ("nvidia%d" % i)
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))
        lines = [
            "ClusterName=gflab",
            "SlurmctldHost=%s(127.0.0.1)" % socket.gethostname(),
            "SlurmctldPort=%d" % self.ctld_port,
            "SlurmdPort=%d" % self.slurmd_port,
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            "AuthInfo=socket=%s" % self.munge_socket,
            "StateSaveLocation=%s" % (r / "ctld"),
            "SlurmdSpoolDir=%s" % (r / "spool" / "%n"),
            "SlurmctldPidFile=%s" % (r / "slurmctld.pid"),
            "SlurmdPidFile=%s" % (r / "slurmd-%n.pid"),
            "SlurmctldLogFile=%s" % (r / "log" / "slurmctld.log"),
            "SlurmdLogFile=%s" % (r / "log" / "slurmd-%n.log"),
            "SlurmctldDebug=info", "SlurmdDebug=info", "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "GresTypes=gpu", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2", "KillWait=2", "MinJobAge=300", "InactiveLimit=0",
            "SlurmdTimeout=300", "MessageTimeout=10",
            "PrologEpilogTimeout=%d" % self.prolog_epilog_timeout,
        ]
        if self.prolog:
            lines.append("Prolog=%s" % self.prolog)
        if self.epilog:
            lines.append("Epilog=%s" % self.epilog)
        lines += [self.extra_conf.strip()] if self.extra_conf.strip() else []
        lines += [
            "NodeName=%s NodeAddr=127.0.0.1 CPUs=8 RealMemory=1000 Gres=gpu:%d State=UNKNOWN"
            % (self.node_name, self.gpus),
            "PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text(
            "AutoDetect=off\nNodeName=%s Name=gpu File=%s\n"
            % (self.node_name, r / "gresdev" / ("nvidia[0-%d]" % (self.gpus - 1))))

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # ---------------------------------------------------------------------------- daemons

    def start(self, host: Any) -> "SlurmCluster":
        """munged and slurmctld here, slurmd in ``host`` (a LabHost started with keep=[root])."""
        self.host = host
        self.write_files()
        r = self.root
        munged = subprocess.Popen(
            ["munged", "-F", "--force", "--socket=%s" % self.munge_socket,
             "--key-file=%s" % (r / "munge" / "munge.key"), "--pid-file=%s" % (r / "munge" / "munged.pid"),
             "--log-file=%s" % (r / "log" / "munged.log"), "--seed-file=%s" % (r / "munge" / "seed"),
             "--num-threads=2"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(r / "log" / "munged.err", "ab"))
        self.procs["munged"] = munged
        self._wait(lambda: self.munge_socket.exists(), 10, "munged socket", munged)
        ctld = subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(self.conf)],
                                stdin=subprocess.DEVNULL, stdout=open(r / "log" / "slurmctld.out", "ab"),
                                stderr=subprocess.STDOUT, env=self.env)
        self.procs["slurmctld"] = ctld
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0
                   and "UP" in self.run(["scontrol", "ping"], check=False).stdout, 20,
                   "slurmctld answering", ctld)
        # slurmd inside the host (nsenter, no SSH), detached; it writes its in-host pid first
        host.exec(["sh", "-c", '(setsid sh -c \'echo $$ >"$1"; exec slurmd -D -f "$2" '
                   '>>"$3" 2>&1 </dev/null\' slurmd "$1" "$2" "$3" &)',
                   "starter", str(r / "slurmd.inpid"), str(self.conf), str(r / "log" / "slurmd.out")],
                  check=True)
        self._wait(lambda: (r / "slurmd.inpid").exists() and (r / "slurmd.inpid").read_text().strip(),
                   10, "slurmd pid")
        self.slurmd_pid = int((r / "slurmd.inpid").read_text().strip())
        self.wait_node_state(("IDLE",), timeout=40)
        return self

    def stop(self) -> None:
        if self.host is not None and self.slurmd_pid is not None and self.host.running:
            self.host.kill(self.slurmd_pid, signal.SIGTERM)
            deadline = time.time() + 10
            while time.time() < deadline and self.host.alive(self.slurmd_pid):
                time.sleep(0.05)
            if self.host.alive(self.slurmd_pid):
                self.host.kill(self.slurmd_pid, signal.SIGKILL)
        for name in ("slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    def _wait(self, cond: Any, timeout: float, what: str, proc: Optional[subprocess.Popen] = None) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SlurmError("%s: the daemon exited with %s; logs: %s" % (what, proc.returncode, self.logs()))
            try:
                if cond():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SlurmError("timed out waiting for %s; logs: %s" % (what, self.logs()))

    def logs(self) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            try:
                out.append("== %s ==\n%s" % (f.name, f.read_text(errors="replace")[-3000:]))
            except OSError:
                pass
        return "\n".join(out)

    # ---------------------------------------------------------------------------- clients

    def run(self, argv: Sequence[str], check: bool = True, user: Optional[str] = None,
            timeout: float = 30, env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
        full = list(argv)
        if user is not None:
            full = ["runuser", "-u", user, "--"] + full
        e = self.env
        e.update(env or {})
        res = subprocess.run(full, capture_output=True, text=True, timeout=timeout, env=e,
                             stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise SlurmError("%s: exit %d: %s %s" % (full, res.returncode, res.stdout, res.stderr))
        return res

    def node(self) -> dict[str, str]:
        """`scontrol show node -o NODE` as key=value pairs (Reason may contain spaces: last)."""
        text = self.run(["scontrol", "show", "node", "-o", self.node_name]).stdout.strip()
        out: dict[str, str] = {}
        reason_at = text.find(" Reason=")
        if reason_at >= 0:
            out["Reason"] = text[reason_at + len(" Reason="):].strip()
            text = text[:reason_at]
        for word in text.split():
            if "=" in word:
                k, v = word.split("=", 1)
                out[k] = v
        return out

    def node_state(self) -> str:
        return self.node().get("State", "?")

    def wait_node_state(self, wanted: Sequence[str], timeout: float = 30, exact: bool = False) -> str:
        """Until State (e.g. IDLE+DRAIN) contains one word of ``wanted`` (``exact``: is one of
        them, no flags: IDLE+COMPLETING is not IDLE, an epilog still runs)."""
        deadline = time.time() + timeout
        state = "?"
        while time.time() < deadline:
            state = self.node_state()
            words = set(state.replace("*", "").split("+"))
            if (state in wanted) if exact else any(w in words for w in wanted):
                return state
            time.sleep(0.2)
        raise SlurmError("node state %s, wanted %s; logs: %s" % (state, wanted, self.logs()))

    def sbatch(self, script: str, user: str, gres: str = "gpu:1", extra: Sequence[str] = ()) -> int:
        path = self.root / "jobs" / ("job-%d.sh" % time.time_ns())
        path.write_text(script)
        os.chmod(path, 0o755)
        res = self.run(["sbatch", "--parsable", "--gres=%s" % gres, "-o", str(self.root / "jobs" / "%j.out"),
                        "-D", str(self.root / "jobs")] + list(extra) + [str(path)], user=user)
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        text = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False).stdout.strip()
        out: dict[str, str] = {}
        for word in text.split():
            if "=" in word:
                k, v = word.split("=", 1)
                out.setdefault(k, v)
        return out

    def wait_job(self, job_id: int, states: Sequence[str], timeout: float = 60) -> dict[str, str]:
        deadline = time.time() + timeout
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.2)
        raise SlurmError("job %d: %s, wanted %s; logs: %s" % (job_id, info.get("JobState"), states, self.logs()))

    def resume(self) -> None:
        self.run(["scontrol", "update", "NodeName=%s" % self.node_name, "State=RESUME"])
