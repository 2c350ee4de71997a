"""The lab's fake CUDA MPS on a lab host (tests/lab/fakemps/fakemps.c): install, start, ask, quit.

Why a C program: the agent asks a verified MPS daemon through the daemon's OWN binary
(/proc/PID/exe, root's nvidia-cuda-mps-control), feeding commands on stdin exactly as an
operator would; a copied Python interpreter named nvidia-cuda-mps-control would read those
commands as a Python program. One small binary, installed root's and 0755 under both real
names, is the daemon, the server and the control client (its docstring says what each does
and what was recorded on the H200).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE / "fakenvml") not in sys.path:
    sys.path.insert(0, str(HERE / "fakenvml"))
import fakenvml_build  # noqa: E402

SOURCE = HERE / "fakemps" / "fakemps.c"
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror"]
BIN_DIR = "/run/gflab/mps"  # in the host's own /run (tmpfs): root's, 0755
PIPE_DIR = "/tmp/nvidia-mps"  # the default CUDA_MPS_PIPE_DIRECTORY
CONTROL = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"


def build() -> Path:
    """The fake MPS binary, compiled once per source like the fake NVML."""
    return fakenvml_build.build_c(SOURCE, "fakemps", CFLAGS)


@dataclass
class Mps:
    """A fake MPS running on a lab host: its daemon's and server's in-host PIDs, where its
    pipe directory and binaries are."""

    host: Any
    daemon: int
    server: int
    pipe_dir: str
    bin_dir: str
    env: dict

    @property
    def control(self) -> str:
        return self.bin_dir + "/" + CONTROL

    def ask(self, *commands: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """The control client, commands on stdin (`echo get_server_list | ...`), run in the
        host with the daemon's pipe directory."""
        return self.host.exec(["env", "CUDA_MPS_PIPE_DIRECTORY=" + self.pipe_dir, self.control],
                              input="".join(c + "\n" for c in commands), timeout=timeout)

    def quit(self, timeout: float = 30) -> subprocess.CompletedProcess:
        """`echo quit | nvidia-cuda-mps-control`: waits while any client lives (recorded)."""
        return self.ask("quit", timeout=timeout)


def install(host: Any, bin_dir: str = BIN_DIR) -> None:
    """Put the binary in the host under both names, root's and 0755, in a root 0755 dir."""
    binary = build()
    outer = host.path(bin_dir)
    outer.mkdir(parents=True, exist_ok=True)
    os.chmod(outer, 0o755)
    for name in (CONTROL, SERVER):
        target = outer / name
        if not target.exists():
            tmp = outer / ("." + name + ".tmp")
            shutil.copyfile(binary, tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, target)


def start(host: Any, gpus: Sequence[int] = (0,), server_mib: int = 66,
          pipe_dir: str = PIPE_DIR, bin_dir: str = BIN_DIR, user: str = "root") -> Mps:
    """`nvidia-cuda-mps-control -d` in the host (nsenter, as ``user``): the daemon maps the
    GPUs' /dev/nvidiaN and nvidiactl, its server holds ``server_mib`` on each GPU (listed by
    the fake nvidia-smi and NVML). Returns once both run."""
    install(host, bin_dir)
    minors = host.config().get("minors") or list(range(host.gpus))
    mapped = ",".join(str(minors[g]) for g in gpus)
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "FAKEGPU_ROOT": "/run/fakegpu",
           "FAKEMPS_DAEMON_MAP": mapped, "FAKEMPS_SERVER_MAP": mapped,
           "FAKEMPS_SERVER_ALLOC": ",".join("%d:%d" % (g, server_mib) for g in gpus)}
    argv = ["env"] + ["%s=%s" % kv for kv in sorted(env.items())] + [bin_dir + "/" + CONTROL, "-d"]
    res = host.exec(argv, user=user, timeout=30)
    if res.returncode != 0:
        raise RuntimeError("fake MPS did not start on %s (exit %d): %s"
                           % (host.name, res.returncode, res.stderr.strip()))
    daemon, server, _ = host.path(pipe_dir + "/fakemps.state").read_text().split()
    return Mps(host, int(daemon), int(server), pipe_dir, bin_dir, env)
