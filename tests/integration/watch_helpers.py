"""A running `gpufleet status --watch` (the real CLI, as a subprocess) and the agents it keeps
on lab hosts. Every process is ended by the PID this module started."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from cli_helpers import _SCRUB, GPUFLEET, REPO_ROOT

AGENT_MARK = "gpufleet-agent"  # in the bootstrap's -c text: how an agent looks in a process list


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


class Watch:
    """`gpufleet -i INV status --watch SECONDS --json ...`; NDJSON lines read one by one."""

    def __init__(self, home: Path, inventory: Path, seconds: float = 1.0, *args: str):
        self.proc = subprocess.Popen(
            GPUFLEET + ["-i", str(inventory), "status", "--watch", str(seconds), "--json", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env=cli_env(home), cwd=str(home))
        self._buf = b""

    def doc(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next NDJSON document (fails the test if none comes in time)."""
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                raise AssertionError("no document within %ss; stderr: %s"
                                     % (timeout, self.stderr_now()))
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                raise AssertionError("status --watch ended (rc %s): %s"
                                     % (self.proc.wait(), self.stderr_now()))
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def until(self, cond: Any, timeout: float = 30.0, what: str = "a document") -> dict:
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            last = self.doc(timeout=max(0.1, end - time.monotonic()))
            if cond(last):
                return last
        raise AssertionError("no document with %s in %ss; last: %s" % (what, timeout, last))

    def stderr_now(self) -> str:
        if self.proc.poll() is None or self.proc.stderr is None:
            return "(running)"
        return self.proc.stderr.read().decode(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)  # the CLI this object started

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait(timeout=30)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe:
                pipe.close()
        return rc


def host_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    hosts = [h for h in doc["hosts"] if h["host"] == name]
    assert len(hosts) == 1, doc
    return hosts[0]


def agents_on(host: Any) -> list[int]:
    """In-host pids of live gpufleet agents on a lab host (found by the bootstrap's text)."""
    out = []
    for entry in host.path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if AGENT_MARK in " ".join(host.cmdline(pid)) and host.alive(pid):
                out.append(pid)
        except OSError:
            continue
    return sorted(out)


def ppid_of(host: Any, pid: int) -> int:
    stat = host.path("/proc/%d/stat" % pid).read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def wait_gone(host: Any, pid: int, timeout: float) -> bool:
    """True once ``pid`` is not alive on the host (a zombie is not alive)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not host.alive(pid):
            return True
        time.sleep(0.05)
    return not host.alive(pid)


def stop_sshd_and_sessions(host: Any, agent_pid: int) -> list[int]:
    """SIGKILL the host's listening sshd and the sshd processes above the agent (recorded
    from the agent's ancestry and the PidFile): the host's sshd is killed."""
    from cli_helpers import sshd_pid

    pids = [sshd_pid(host)]
    pid = ppid_of(host, agent_pid)
    while pid > 1 and host.comm(pid).startswith("sshd") and pid not in pids:
        pids.append(pid)
        pid = ppid_of(host, pid)
    for pid in pids:
        host.kill(pid, signal.SIGKILL)
    return pids


def start_sshd(host: Any) -> None:
    """The host's sshd again, same config (it daemonizes; the host's init reaps it)."""
    res = host.exec(["/usr/sbin/sshd", "-f", "/run/gflab/sshd_config", "-E", "/run/gflab/sshd2.log"])
    assert res.returncode == 0, res.stderr
