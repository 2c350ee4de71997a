"""The controller's memory of which hosts hold this agent's compiled code
(gpufleet/transport/knownagents.py): learnt from documents, per way of reaching a host, never
for a host whose inventory turns the cache off, and a memory only (no directory: no error)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.config.inventory import Host
from gpufleet.transport import knownagents

KEY = "0123456789abcdef0123456789abcdef"


def doc(state: str | None) -> dict:
    return {"mode": "snapshot", "facts": {"agent_cache": state}}


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "gpufleet" / "agents"


def test_a_hit_or_a_written_miss_is_remembered_and_anything_else_forgets(cache_home):
    host = Host("gpu1", address="10.0.0.1")
    assert not knownagents.holds(host, KEY)
    knownagents.note(host, KEY, doc("miss"), known=False)
    assert knownagents.holds(host, KEY)
    assert not knownagents.holds(host, KEY[::-1])  # another agent version
    assert len(os.listdir(cache_home)) == 1
    knownagents.note(host, KEY, doc("hit"), known=True)
    assert knownagents.holds(host, KEY)
    for state in ("unusable", "off"):
        knownagents.note(host, KEY, doc("miss"), known=False)
        knownagents.note(host, KEY, doc(state), known=True)
        assert not knownagents.holds(host, KEY)
    assert os.listdir(cache_home) == []


def test_a_document_without_cache_facts_teaches_nothing():
    host = Host("gpu1")
    knownagents.note(host, KEY, doc("hit"), known=False)
    for nothing in (None, {}, {"facts": None}, {"agent_needed": KEY, "reason": "absent"}):
        knownagents.note(host, KEY, nothing, known=True)
        assert knownagents.holds(host, KEY)
    knownagents.forget(host)
    assert not knownagents.holds(host, KEY)


def test_each_way_of_reaching_a_host_is_its_own_memory():
    base = Host("gpu1", address="10.0.0.1", port=22, user="root")
    others = [Host("gpu2", address="10.0.0.1", port=22, user="root"),
              Host("gpu1", address="10.0.0.2", port=22, user="root"),
              Host("gpu1", address="10.0.0.1", port=2222, user="root"),
              Host("gpu1", address="10.0.0.1", port=22, user="ops"),
              Host("gpu1", address="10.0.0.1", port=22, user="root", sudo=True),
              Host("gpu1", address="10.0.0.1", port=22, user="root", python="/opt/py/bin/python3")]
    knownagents.note(base, KEY, doc("hit"), known=False)
    assert knownagents.holds(base, KEY)
    assert not any(knownagents.holds(h, KEY) for h in others)


def test_a_local_host_is_never_remembered_and_no_file_is_written_for_it(cache_home):
    """connection: local gets the agent through a pipe: nothing to save by leaving it out."""
    host = Host("ws", connection="local")
    knownagents.note(host, KEY, doc("hit"), known=False)
    assert not knownagents.holds(host, KEY)
    assert not cache_home.exists()


def test_a_host_with_the_cache_off_is_never_sent_a_request_without_the_agent():
    host = Host("gpu1", agent_cache=False)
    knownagents.note(host, KEY, doc("hit"), known=False)
    assert not knownagents.holds(host, KEY)
    on = Host("gpu1")
    knownagents.note(on, KEY, doc("hit"), known=False)
    assert knownagents.holds(on, KEY) and not knownagents.holds(host, KEY)


def test_an_unwritable_cache_directory_is_no_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    host = Host("gpu1")
    knownagents.note(host, KEY, doc("hit"), known=False)
    assert not knownagents.holds(host, KEY)
    knownagents.forget(host)
