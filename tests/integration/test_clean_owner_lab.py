"""A clean that says `clean` means the GPU stays free: owners that start a target again.

The lab's owner is the one operators meet most: a shell loop, ``sh -c 'while :; do trainer;
sleep 1; done'``, whose trainer holds GPU memory. Killing the trainer frees the memory for a
second; the clean must name the loop as the trainer's owner, say ``retaken`` (exit 1) once the
loop starts a new trainer, well before its timeout, and stop the loop only when the operator
names it with ``--owner``.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from cli_helpers import run_gpufleet

pytestmark = pytest.mark.lab

FAST = ("--grace", "1", "--timeout", "30")


class ShellLoop:
    """``sh -c 'while :; do HOLDER; sleep 1; done'`` on a lab host, started detached; its PID
    is the one it writes itself, and the test ends exactly that process and its trainer."""

    def __init__(self, host: Any, gpu: int, mib: int) -> None:
        self.host = host
        self.pidfile = "/tmp/loop-%s.pid" % uuid.uuid4().hex[:8]
        holder = "%s /run/gflab/fakecuda.py --gpus %d --mib %d --title trainer" % (
            host.holder_python(), gpu, mib)
        # Written then renamed: the test must never read the file half-written.
        self.script = "echo $$ > %s.tmp && mv %s.tmp %s; while :; do %s; sleep 1; done" % (
            self.pidfile, self.pidfile, self.pidfile, holder)
        res = host.exec(["sh", "-c", 'setsid -f sh -c "$0" </dev/null >/dev/null 2>&1',
                         self.script])
        assert res.returncode == 0, res.stderr
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not host.path(self.pidfile).exists():
            time.sleep(0.05)
        self.pid = int(host.path(self.pidfile).read_text())

    def trainer(self, timeout: float = 30) -> int:
        """The loop's trainer once it holds its memory."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = self.children()
            if kids and self.host.gpu_used()[0] > 0:
                return kids[0]
            time.sleep(0.05)
        raise AssertionError("the loop started no trainer")

    def children(self) -> list[int]:
        path = self.host.path("/proc/%d/task/%d/children" % (self.pid, self.pid))
        try:
            return [int(c) for c in path.read_text().split()]
        except OSError:
            return []

    def stop(self) -> None:
        kids = self.children()
        self.host.kill(self.pid)
        for kid in kids:
            self.host.kill(kid)


@pytest.fixture
def looped(make_host: Any) -> Iterator[tuple[Any, ShellLoop]]:
    host = make_host("loop-node", gpus=2)
    loop = ShellLoop(host, gpu=0, mib=3000)
    try:
        yield host, loop
    finally:
        loop.stop()


def test_the_plan_names_the_loop_as_the_trainers_owner(lab: Any, looped: Any,
                                                       tmp_path: Path) -> None:
    host, loop = looped
    trainer = loop.trainer()
    inv = lab.inventory_yaml([host])
    plan = run_gpufleet(tmp_path, inv, "clean", "--host", "loop-node", "--gpus", "0",
                        "--dry-run", *FAST)
    assert plan.rc == 0, str(plan)
    row = next(line for line in plan.stdout.splitlines() if line.split()[:1] == [str(trainer)])
    assert "PID %d sh (restarts)" % loop.pid in row, plan.stdout
    assert "PID %d sh restarts PID %d trainer" % (loop.pid, trainer) in plan.stdout
    assert "--owner %d" % loop.pid in plan.stdout
    assert "watch for 5 s" in plan.stdout
    assert host.alive(loop.pid) and host.alive(trainer)


def test_a_restarted_trainer_is_retaken_at_once_not_clean(lab: Any, looped: Any,
                                                          tmp_path: Path) -> None:
    host, loop = looped
    trainer = loop.trainer()
    inv = lab.inventory_yaml([host])
    started = time.monotonic()
    run = run_gpufleet(tmp_path, inv, "clean", "--host", "loop-node", "--gpus", "0", "--yes",
                       "--json", *FAST)
    took = time.monotonic() - started
    assert run.rc == 1, str(run)
    doc = run.host("loop-node")
    assert doc["verdict"] == "retaken", json.dumps(doc)[:3000]
    assert [t["pid"] for t in doc["targets"]] == [trainer]
    assert host.alive(loop.pid) and not host.alive(trainer)  # the owner is never signalled
    new = loop.trainer()
    assert new != trainer
    assert "PID %d" % new in doc["reason"] and "PID %d sh" % loop.pid in doc["reason"]
    assert "--owner %d" % loop.pid in doc["reason"]
    assert took < 20, took  # the retake is seen when the loop restarts, not at the timeout


def test_naming_the_owner_stops_it_first_and_the_gpu_stays_free(lab: Any, looped: Any,
                                                                tmp_path: Path) -> None:
    host, loop = looped
    trainer = loop.trainer()
    inv = lab.inventory_yaml([host])
    run = run_gpufleet(tmp_path, inv, "clean", "--host", "loop-node", "--gpus", "0",
                       "--owner", str(loop.pid), "--yes", "--json", *FAST)
    assert run.rc == 0, str(run)
    doc = run.host("loop-node")
    assert doc["verdict"] == "clean", json.dumps(doc)[:3000]
    waves = {t["pid"]: (t["wave"], t["evidence"]) for t in doc["targets"]}
    assert waves == {loop.pid: (0, "owner"), trainer: (1, "nvidia-smi")}, waves
    assert not host.alive(loop.pid) and not host.alive(trainer)
    time.sleep(2.0)  # longer than the loop's sleep: nothing starts again
    assert host.gpu_used()[0] == 0 and loop.children() == []


def test_an_owner_that_owns_no_target_is_refused_and_nothing_else_changes(
        lab: Any, looped: Any, tmp_path: Path) -> None:
    host, loop = looped
    trainer = loop.trainer()
    inv = lab.inventory_yaml([host])
    plan = run_gpufleet(tmp_path, inv, "clean", "--host", "loop-node", "--gpus", "0",
                        "--owner", "1", "--dry-run", *FAST)
    assert "--owner: owns no target of this plan" in plan.stdout, plan.stdout
    assert host.alive(loop.pid) and host.alive(trainer)
