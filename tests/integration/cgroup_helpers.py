"""Real cgroups for lab tests, named the way systemd names them, and systemd's answer for them.

The lab runs no systemd: the test makes the cgroup tree itself (a writable cgroup2 or v1
name=systemd hierarchy, as on a real host), moves processes into it by writing their PIDs to
cgroup.procs, and tells the lab's systemctl (tests/lab/fake_systemctl.py, systemd's stand-in)
which ControlGroup each unit owns.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest


def _writable_cgroup_root() -> tuple[Optional[str], str]:
    """A cgroup hierarchy where the lab can make a systemd-like path: cgroup2 first, else v1
    name=systemd (what parse_cgroup reads). (path, why not) -- path None when impossible."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError as exc:
        return None, str(exc)
    v2 = [m.split()[1] for m in mounts if m.split()[2] == "cgroup2"]
    v1 = [m.split()[1] for m in mounts if m.split()[2] == "cgroup" and "name=systemd" in m.split()[3]]
    why = "no cgroup2 or name=systemd hierarchy mounted"
    for root in v2 + v1:
        probe = os.path.join(root, "gpufleet-probe-%s" % uuid.uuid4().hex[:8])
        try:
            os.mkdir(probe)
            os.rmdir(probe)
            return root, ""
        except OSError as exc:
            why = "mkdir under %s: %s" % (root, exc.strerror)
    return None, why


class CgroupTree:
    """Real cgroups made by the test under one base directory of a writable hierarchy, named
    the way systemd names them (system.slice/X.service, user.slice/.../user@UID.service/...);
    removed, innermost first, after the test (its hosts are stopped by then)."""

    def __init__(self) -> None:
        root, why = _writable_cgroup_root()
        if root is None:
            pytest.skip("cannot create a cgroup here (%s): a unit-owned holder needs a real "
                        "cgroup path; the systemd cgroup path is simulated in unit tests only"
                        % why)
        self.root = root
        self.base = os.path.join(root, "gpufleet-test-%s" % uuid.uuid4().hex[:8])
        self.made: list[str] = []

    def make(self, rel: str, owner: Optional[int] = None) -> str:
        """mkdir -p base/rel (the last part chowned to ``owner``: a delegated subtree)."""
        path = self.base
        for part in [""] + rel.split("/"):
            path = os.path.join(path, part) if part else path
            if not os.path.isdir(path):
                os.mkdir(path)
                self.made.append(path)
        if owner is not None:
            for name in ("", "cgroup.procs"):
                os.chown(os.path.join(path, name), owner, owner)
        return path

    def control_group(self, path: str) -> str:
        """The path as /proc/PID/cgroup and systemd's ControlGroup show it."""
        return "/" + os.path.relpath(path, self.root)

    def remove(self) -> None:
        for d in sorted(self.made + self._below(), key=len, reverse=True):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)

    def _below(self) -> list[str]:
        """Directories someone else made inside the tree (the attacker's own cgroups)."""
        out = []
        for top, dirs, _ in os.walk(self.base):
            out.extend(os.path.join(top, d) for d in dirs)
        return out


def systemd_knows(host: Any, unit: str, control_group: str, **spec: Any) -> None:
    """The lab's systemctl (systemd's stand-in) runs ``unit`` with that ControlGroup."""
    from fake_systemctl import install_systemctl

    install_systemctl(host, {unit: dict(spec, cgroup=control_group, cgroup_always=True)})



@pytest.fixture
def cgroups() -> Iterator[CgroupTree]:
    tree = CgroupTree()
    yield tree
    tree.remove()
