"""What the GPU machine's bench run (bench/device/run.sh) relies on, checked here for real.

* The lab runs the sshd named by GFLAB_SSHD (there: Debian's sshd unpacked from a .deb, behind a
  wrapper that gives it its libraries): a host started with it serves SSH through that program.
* bench/benchlab.py's Cgroup counts CPU on cgroup2 (cpu.stat usage_usec), the GPU machine's only
  hierarchy: a child that burns CPU is counted in a cgroup made on a real cgroup2 mount.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cli_helpers import REPO_ROOT

LAB_DIR = REPO_ROOT / "tests" / "lab"
BENCH_DIR = REPO_ROOT / "bench"


def _lab_problem() -> str | None:
    sys.path.insert(0, str(LAB_DIR))
    import lab

    return lab.check()


def test_lab_hosts_run_the_sshd_named_by_gflab_sshd(prerequisite, tmp_path):
    problem = _lab_problem()
    if problem:
        prerequisite("the test lab", problem)
    # outside /tmp and /root (private in every host), as run.sh's /var/tmp/gfdevice
    shared = Path(tempfile.mkdtemp(prefix="gflab-sshd-", dir="/var/tmp"))
    try:
        marker = shared / "used"
        wrapper = shared / "sshd"
        wrapper.write_text('#!/bin/sh\necho "$$ $*" >> %s\nexec /usr/sbin/sshd "$@"\n' % marker)
        wrapper.chmod(0o755)
        script = (
            "import sys; sys.path.insert(0, %r)\n"
            "import lab\n"
            "with lab.Lab(%r) as L:\n"
            "    h = L.add_host('viawrap')\n"
            "    r = h.ssh(['hostname'])\n"
            "    print(r.returncode, r.stdout.strip())\n" % (str(LAB_DIR), str(tmp_path / "lab"))
        )
        env = dict(os.environ, GFLAB_SSHD=str(wrapper))
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.split() == ["0", "viawrap"], res.stdout
        lines = marker.read_text().splitlines()
        assert len(lines) == 1 and "-f /run/gflab/sshd_config" in lines[0], lines
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_bench_cgroup_counts_cpu_on_cgroup2(prerequisite, tmp_path):
    if os.geteuid() != 0:
        prerequisite("cgroup2", "mounting a cgroup2 hierarchy needs root")
    mnt = tmp_path / "cg2"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "cgroup2", "none", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        prerequisite("cgroup2", "mount -t cgroup2: %s" % res.stderr.strip())
    try:
        probe = (
            "import sys; sys.path.insert(0, %r)\n"
            "import benchlab as B\n"
            "c = B.Cgroup('gfbench-test%%d' %% __import__('os').getpid())\n"
            "assert c.v2 and c.available, (c.path, c.v2, c.available)\n"
            "m = B.measure([sys.executable, '-c', 'sum(range(2 * 10 ** 7))'], c)\n"
            "c.remove()\n"
            "print(m.rc, m.cpu_s, m.wall_s, c.path.exists())\n" % str(BENCH_DIR)
        )
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env=dict(os.environ, GFBENCH_CGROUP2=str(mnt)), timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        rc, cpu, wall, exists = out.stdout.split()
        assert rc == "0" and exists == "False"
        # the burner's CPU was counted (a tenth of a second at least), and no more than it could use
        assert 0.1 < float(cpu) <= float(wall) * 1.5 + 0.05, out.stdout
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
