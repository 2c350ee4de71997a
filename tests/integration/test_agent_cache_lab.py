"""The agent's compiled code cached on a real host over real SSH (gpufleet/remote/loader.py).

A lab host (real sshd, root) gets a fresh tmpfs on its /var/cache (its own mount namespace:
nothing of the machine changes), so what the root agent writes to /var/cache/gpufleet is seen
from outside. The real CLI's first `status` misses and stores the entry, the second loads it
(facts.agent_cache in `--json`); with the inventory's `agent_cache: false` nothing is written,
and an entry that another user could write is refused and replaced.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import home, run_gpufleet  # noqa: F401  (fixture)
from gpufleet.remote import agent_key

CACHE = "/var/cache/gpufleet"


@pytest.fixture
def host(make_host: Any) -> Any:
    h = make_host()
    res = h.exec(["mount", "-t", "tmpfs", "-o", "mode=755", "gfcache", "/var/cache"])
    assert res.returncode == 0, res.stderr
    h.holder = h.spawn_holder(gpus=[0], mib=700, title="VLLM::Worker")
    return h


def cache_of(run: Any, name: str) -> tuple[str, Any]:
    assert run.rc == 0, str(run)
    facts = run.host(name)["facts"]
    return facts["agent_cache"], facts["agent_cache_reason"]


def test_status_misses_then_hits_over_ssh(host: Any, lab: Any, home: Path) -> None:
    fleet = lab.inventory_yaml([host], path=home / "fleet.yaml")
    assert not host.path(CACHE).exists()
    first = run_gpufleet(home, fleet, "status", "--json")
    assert cache_of(first, host.name) == ("miss", "absent")
    where = host.path(CACHE)
    st = os.lstat(where)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    entries = os.listdir(where)
    assert len(entries) == 1 and entries[0].startswith("agent-%s-cpython-" % agent_key())
    second = run_gpufleet(home, fleet, "status", "--json")
    assert cache_of(second, host.name) == ("hit", None)
    assert [p["pid"] for p in second.host(host.name)["gpus"][0]["processes"]] == [host.holder]
    assert os.listdir(where) == entries


def test_agent_cache_false_writes_nothing_on_the_host(host: Any, lab: Any, home: Path) -> None:
    fleet = lab.inventory_yaml([host], path=home / "fleet.yaml",
                               **{host.name: {"agent_cache": False}})
    for _ in range(2):
        run = run_gpufleet(home, fleet, "status", "--json")
        assert cache_of(run, host.name) == ("off", "inventory")
    clean = run_gpufleet(home, fleet, "clean", "--all", "--gpus", "0", "--yes", "--json")
    assert clean.rc == 0, str(clean)
    assert not host.alive(host.holder)
    assert os.listdir(host.path("/var/cache")) == []  # not even the directory


def test_an_entry_others_could_write_is_refused_over_ssh(host: Any, lab: Any, home: Path) -> None:
    fleet = lab.inventory_yaml([host], path=home / "fleet.yaml")
    assert cache_of(run_gpufleet(home, fleet, "status", "--json"), host.name)[0] == "miss"
    (entry,) = os.listdir(host.path(CACHE))
    os.chmod(host.path(CACHE + "/" + entry), 0o666)
    assert cache_of(run_gpufleet(home, fleet, "status", "--json"), host.name) == \
        ("miss", "file-mode")
    assert stat.S_IMODE(os.stat(host.path(CACHE + "/" + entry)).st_mode) == 0o600
    os.chmod(host.path(CACHE), 0o777)
    assert cache_of(run_gpufleet(home, fleet, "status", "--json"), host.name) == \
        ("unusable", "dir-mode")


# ---- the agent left out for a host the controller saw cache it (transport/knownagents.py)

def _sessions_since(host: Any, mark: int) -> tuple[int, int]:
    """(connections, execs) the host's sshd logged since ``mark`` (LogLevel VERBOSE)."""
    with open(host.dir / "sshd.log", "rb") as f:
        f.seek(mark)
        text = f.read().decode(errors="replace")
    return text.count("Accepted publickey"), text.count("Starting session: command")


@pytest.fixture
def verbose_host(make_host: Any) -> Any:
    h = make_host(sshd_extra="LogLevel VERBOSE")
    res = h.exec(["mount", "-t", "tmpfs", "-o", "mode=755", "gfcache", "/var/cache"])
    assert res.returncode == 0, res.stderr
    h.holder = h.spawn_holder(gpus=[0], mib=700, title="VLLM::Worker")
    return h


def _sent(run: Any, name: str) -> tuple[str, Any, Any]:
    assert run.rc == 0, str(run)
    facts = run.host(name)["facts"]
    return facts["agent_cache"], facts["agent_cache_reason"], facts["agent_sent"]


def test_a_host_seen_caching_the_agent_is_sent_requests_without_it(
        verbose_host: Any, lab: Any, home: Path) -> None:
    """status and clean (a conversation) leave the source out once the host cached it; a
    host whose cache was lost since answers without running anything and gets the whole
    agent in one more exec, and the clean acts exactly once. Execs are what counts here: the
    first status keeps its connection (``ssh_persist``, on by default), so every later command
    runs over it and makes no new connection: (0, execs)."""
    host = verbose_host
    fleet = lab.inventory_yaml([host], path=home / "fleet.yaml")
    size = lambda: (host.dir / "sshd.log").stat().st_size  # noqa: E731
    assert _sent(run_gpufleet(home, fleet, "status", "--json"), host.name) == \
        ("miss", "absent", True)
    mark = size()
    assert _sent(run_gpufleet(home, fleet, "status", "--json"), host.name) == \
        ("hit", None, False)
    assert _sessions_since(host, mark) == (0, 1)
    for entry in os.listdir(host.path(CACHE)):  # the host lost its cache (a reinstall, rm)
        os.unlink(host.path(CACHE + "/" + entry))
    mark = size()
    lost = run_gpufleet(home, fleet, "status", "--json")
    assert _sent(lost, host.name) == ("miss", "absent", True)
    assert [p["pid"] for p in lost.host(host.name)["gpus"][0]["processes"]] == [host.holder]
    assert _sessions_since(host, mark) == (0, 2)
    for entry in os.listdir(host.path(CACHE)):
        os.unlink(host.path(CACHE + "/" + entry))
    mark = size()
    clean = run_gpufleet(home, fleet, "clean", "--all", "--gpus", "0", "--yes", "--json")
    assert clean.rc == 0, str(clean)
    assert not host.alive(host.holder)
    assert _sessions_since(host, mark) == (0, 2)
    assert len(os.listdir(host.path(CACHE))) == 1
    mark = size()
    assert _sent(run_gpufleet(home, fleet, "status", "--json"), host.name) == \
        ("hit", None, False)
    assert _sessions_since(host, mark) == (0, 1)
