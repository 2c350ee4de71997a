"""gpufleet as Slurm's Prolog and Epilog, against REAL Slurm (Debian's slurmctld, slurmd and
munged, 22.05): a one-node cluster on loopback whose slurmd runs inside a lab host's
namespaces (tests/integration/slurm_lab.py), so the shipped contrib/slurm/{prolog,epilog}
scripts run `gpufleet slurm ...` where the fake GPUs and the job's leftovers are. Jobs are
submitted with real sbatch as the lab's non-root user; node states are read with real
`scontrol show node` and `sinfo -R`.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_helpers import REPO_ROOT
from slurm_lab import SlurmCluster, missing_tools

pytestmark = pytest.mark.lab

NODE = "slurm-node1"
CONTRIB = REPO_ROOT / "contrib" / "slurm"


def _require_slurm(require: Any) -> None:
    missing = missing_tools()
    if missing:
        require("Slurm", "missing %s (apt-get install slurmctld slurmd slurm-client munge)"
                % ", ".join(missing))


class Cluster:
    """The cluster, its lab host, and the settings file the shipped scripts read."""

    def __init__(self, lab: Any, root: Path):
        self.lab, self.root = lab, root
        self.audit = root / "audit.jsonl"
        self.node_log = root / "node.log"
        self.host = lab.add_host(NODE, gpus=4, total_mib=49140, keep=[str(root)])
        wrappers = {}
        for kind in ("prolog", "epilog"):
            w = root / ("run-" + kind)
            # the shipped script, verbatim; only where its settings file is differs
            w.write_text("#!/bin/sh\nGPUFLEET_SLURM_DEFAULTS=%s exec %s\n"
                         % (shlex.quote(str(root / "gpufleet-slurm")), shlex.quote(str(CONTRIB / kind))))
            os.chmod(w, 0o755)
            wrappers[kind] = str(w)
        self.settings()
        self.slurm = SlurmCluster(root, NODE, gpus=4, prolog=wrappers["prolog"],
                                  epilog=wrappers["epilog"])

    def settings(self, epilog: str = "", prolog: str = "") -> None:
        """/etc/default/gpufleet-slurm of the node: this checkout's CLI and the test's logs."""
        common = "--log-file %s --no-syslog" % self.node_log
        text = (
            "GPUFLEET=%s\nPYTHONPATH=%s\nexport PYTHONPATH\n"
            'GPUFLEET_EPILOG_ARGS="%s --audit-log %s --budget 8 --grace 1 %s"\n'
            'GPUFLEET_PROLOG_ARGS="%s --budget 8 %s"\n'
            % (shlex.quote("%s -m gpufleet" % sys.executable), shlex.quote(str(REPO_ROOT)),
               common, self.audit, epilog, common, prolog))
        (self.root / "gpufleet-slurm").write_text(text)

    def log_lines(self) -> list[str]:
        return self.node_log.read_text().splitlines() if self.node_log.exists() else []

    def audit_records(self) -> list[dict]:
        if not self.audit.exists():
            return []
        return [json.loads(line) for line in self.audit.read_text().splitlines() if line.strip()]

    def wait_log(self, needle: str, timeout: float = 30) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            hits = [line for line in self.log_lines() if needle in line]
            if hits:
                return hits[-1]
            time.sleep(0.2)
        raise AssertionError("no %r in the node log:\n%s\n%s" % (needle, "\n".join(self.log_lines()),
                                                                 self.slurm.logs()))


@pytest.fixture(scope="module")
def cluster(lab: Any, prerequisite: Any) -> Iterator[Cluster]:
    """Its own directory under /tmp, not pytest's (that one is 0700, and the job's user must
    reach the munge socket and the job scripts); removed afterwards."""
    import shutil
    import tempfile

    _require_slurm(prerequisite)
    root = Path(tempfile.mkdtemp(prefix="gflab-slurm-"))
    os.chmod(root, 0o711)
    c = Cluster(lab, root)
    try:
        c.slurm.start(c.host)
        yield c
    finally:
        c.slurm.stop()
        lab.remove_host(c.host)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def clean_node(cluster: Cluster) -> Iterator[Cluster]:
    """Each test starts with an idle node, no drain, default settings, its own logs."""
    cluster.settings()
    for f in (cluster.audit, cluster.node_log):
        if f.exists():
            f.unlink()
    cluster.slurm.wait_node_state(("IDLE", "IDLE+DRAIN"), timeout=60, exact=True)
    if "DRAIN" in cluster.slurm.node_state():
        cluster.slurm.resume()
    cluster.slurm.wait_node_state(("IDLE",), timeout=30, exact=True)
    yield cluster


def _detached(spec: dict) -> str:
    """Shell line that starts a fakecuda family from inside a job, detached (setsid): it
    outlives the job as vLLM's workers do; GPU indices are CUDA's (CUDA_VISIBLE_DEVICES)."""
    from lab import _holder_args

    argv = ["python3", "/run/gflab/fakecuda.py", "--detach", "--log", "/dev/null"] + _holder_args(spec)
    return shlex.join(argv)


def _vllm_spec(workers: int, mib: int, **kw: Any) -> dict:
    engine = dict(gpus=[], mib=0, title="VLLM::EngineCore_DP0", children=[
        dict(gpus=[n], mib=mib, title="VLLM::Worker_TP%d" % n, **kw) for n in range(workers)])
    return dict(gpus=[], mib=0, no_devices=True, title="vllm serve", children=[engine], **kw)


def _job(*lines: str) -> str:
    return "#!/bin/sh\n" + "\n".join(lines) + "\n"


def _gpu_pids(host: Any) -> dict[int, list[int]]:
    """pid -> GPUs it holds memory on, from the host's fake nvidia-smi."""
    out = host.smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader").stdout
    uuids = host.smi("--query-gpu=index,uuid", "--format=csv,noheader").stdout
    index = {u.strip(): int(i) for i, u in (line.split(",") for line in uuids.splitlines() if line.strip())}
    pids: dict[int, list[int]] = {}
    for line in out.splitlines():
        if line.strip():
            pid, uuid = line.split(",")
            pids.setdefault(int(pid), []).append(index[uuid.strip()])
    return pids


def test_epilog_frees_the_jobs_leftovers_and_the_node_stays_idle(clean_node: Cluster) -> None:
    c, host, user = clean_node, clean_node.host, clean_node.lab.user
    monitor = host.spawn_monitor(title="nvitop", via="exec")  # root's, every GPU open
    try:
        # job B (GPUs 2-3 while A runs) keeps a holder alive while A ends
        b = c.slurm.sbatch(_job("sleep 1", _detached(dict(gpus=[0, 1], mib=900, title="trainer")),
                                "sleep 120"), user=user, gres="gpu:2")
        c.slurm.wait_job(b, ("RUNNING",))
        b_gpus = c.slurm.job(b)
        deadline = time.time() + 20
        while time.time() < deadline and not _gpu_pids(host):
            time.sleep(0.2)
        trainer = dict(_gpu_pids(host))
        assert trainer and all(g in (0, 1) for gs in trainer.values() for g in gs) or \
            all(g in (2, 3) for gs in trainer.values() for g in gs), (trainer, b_gpus)
        # job A: renamed vLLM-like workers setsid away and survive the job
        a = c.slurm.sbatch(_job(_detached(_vllm_spec(2, 716))), user=user, gres="gpu:2")
        c.slurm.wait_job(a, ("COMPLETED",), timeout=60)
        line = c.wait_log("job %d:" % a)
        assert "free" in line and "process(es) signalled" in line, line
        a_gpus = sorted(set(range(4)) - {g for gs in trainer.values() for g in gs})
        used = host.gpu_used()
        assert all(used[g] == 0 for g in a_gpus), used
        assert all(host.alive(p) for p in trainer), "job B's holder was touched"
        assert host.alive(monitor), "root's monitor was touched"
        every = c.audit_records()
        records = [r for r in every if r.get("event") != "verdict"]  # the signals' lines
        assert records and {r["job_id"] for r in every} == {str(a)}
        assert {r["job_user"] for r in every} == {user}
        assert [r["verdict"] for r in every if r.get("event") == "verdict"] == ["clean"]
        assert not {r["pid"] for r in records} & (set(trainer) | {monitor})
        state = c.slurm.wait_node_state(("IDLE", "MIXED", "ALLOCATED"))
        assert "DRAIN" not in state, (state, c.slurm.node())
    finally:
        host.kill(monitor)
        for pid in _gpu_pids(host):
            host.kill(pid)
            host.wait_gone(pid, 10)
        if "b" in locals():
            c.slurm.run(["scancel", str(b)], check=False)
    assert c.slurm.wait_node_state(("IDLE", "IDLE+DRAIN"), timeout=60, exact=True) == "IDLE"


def test_memory_that_cannot_be_freed_drains_the_node_with_the_reason(clean_node: Cluster) -> None:
    c, host = clean_node, clean_node.host
    c.settings(epilog="--drain-reason")
    host.set_config(release_delay_s=600.0)  # the driver keeps a dead process's memory
    try:
        a = c.slurm.sbatch(_job(_detached(dict(gpus=[0], mib=716, title="VLLM::Worker"))),
                           user=c.lab.user, gres="gpu:1")
        c.slurm.wait_job(a, ("COMPLETED",), timeout=60)
        line = c.wait_log("gpufleet: GPU")
        assert "716 MiB used, no process holds it" in line, line
        c.slurm.wait_node_state(("DRAIN",), timeout=30)
        node = c.slurm.node()
        assert node["Reason"].startswith("gpufleet: GPU 0: 716 MiB used"), node
        sinfo = c.slurm.run(["sinfo", "-R", "-h", "-o", "%n|%E"]).stdout
        assert "%s|gpufleet: GPU 0: 716 MiB" % NODE in sinfo, sinfo
    finally:
        host.set_config(release_delay_s=0.0)
    host.gpu_used()  # the fake releases the memory on its next look
    c.slurm.resume()


def test_prolog_refuses_a_job_on_a_held_gpu_then_undrain(clean_node: Cluster, tmp_path: Path,
                                                         monkeypatch: Any) -> None:
    c, host = clean_node, clean_node.host
    monkeypatch.setenv("SLURM_CONF", str(c.slurm.conf))
    c.settings(prolog="--drain-reason")
    squatter = host.spawn_holder(gpus=[0], mib=2000, title="squatter", user="root", via="exec")
    job = c.slurm.sbatch(_job("echo ran"), user=c.lab.user, gres="gpu:1")
    line = c.wait_log("before job %d" % job)
    assert "GPU 0: 2000 MiB held by pid %d squatter (uid 0)" % squatter in line, line
    c.slurm.wait_node_state(("DRAIN",), timeout=30)
    assert c.slurm.node()["Reason"].startswith("gpufleet: GPU 0: 2000 MiB held by pid"), c.slurm.node()
    info = c.slurm.wait_job(job, ("PENDING",), timeout=30)  # requeued, held: it never ran
    assert "held" in info.get("Reason", "").lower() or info.get("Priority") == "0", info
    assert not (c.root / "jobs" / ("%d.out" % job)).exists() or \
        "ran" not in (c.root / "jobs" / ("%d.out" % job)).read_text()
    c.slurm.run(["scancel", str(job)], check=False)

    inventory = c.lab.inventory_yaml([host], path=tmp_path / "fleet.yaml")
    still = _undrain(c, inventory, tmp_path)
    assert still.rc == 1 and "left drained" in still.stdout and "squatter" in still.stdout, still
    assert "DRAIN" in c.slurm.node_state()
    host.kill(squatter)
    host.wait_gone(squatter, 10)
    dry = _undrain(c, inventory, tmp_path, "--dry-run")
    assert dry.rc == 0 and "would resume" in dry.stdout, dry
    assert "DRAIN" in c.slurm.node_state()
    done = _undrain(c, inventory, tmp_path)
    assert done.rc == 0 and "resumed" in done.stdout, done
    state = c.slurm.wait_node_state(("IDLE",), timeout=30)
    assert "DRAIN" not in state


def _undrain(c: Cluster, inventory: Path, home: Path, *extra: str) -> Any:
    from cli_helpers import run_gpufleet

    return run_gpufleet(home, inventory, "slurm", "undrain", "--host", c.host.name, *extra)


def test_epilog_signals_nothing_for_a_broken_configuration(clean_node: Cluster) -> None:
    """gres.conf names a GPU the node does not have: the epilog signals nothing, says the
    configuration is at fault, and Slurm drains the node."""
    c, host = clean_node, clean_node.host
    holder = host.spawn_holder(gpus=[0], mib=500, title="leftover", user=c.lab.user, via="exec")
    env = dict(SLURM_JOB_ID="999", SLURM_JOB_UID=str(_uid(c.lab.user)), SLURM_JOB_GPUS="0,7",
               SLURMD_NODENAME=NODE, SLURM_SCRIPT_CONTEXT="epilog_slurmd")
    res = host.exec(["env"] + ["%s=%s" % kv for kv in env.items()] + [str(c.root / "run-epilog")])
    assert res.returncode == 2, res
    assert "GPU 7 does not exist" in res.stderr and "configuration is at fault" in res.stderr, res
    assert host.alive(holder)
    assert "GPU 7 does not exist" in c.wait_log("error:")
    assert c.audit_records() == []
    host.kill(holder, signal.SIGKILL)


def _uid(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid
