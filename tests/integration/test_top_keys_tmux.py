"""`top` offers what its plan asks for, and says a changed host key as `status` does.

A vLLM family on GPUs 0 and 1, GPU 0 marked: the plan refuses the family ("pass
--include-spanning", a flag top never had); `s` on the plan plans again with it, as `clean
--include-spanning`, and `y` frees both GPUs. A host whose key changed shows HOST KEY CHANGED
with both fingerprints, not ssh's bare "Host key verification failed.".
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli_helpers import GPUFLEET, home, read_jsonl, sha256_fingerprint  # noqa: F401  (home)
from test_top_tmux import Tmux, wait_no_agents

pytestmark = pytest.mark.lab


@pytest.fixture
def tmux_sessions() -> Any:
    started: list[Tmux] = []
    yield started
    for t in started:
        t.kill_server()


def test_s_on_the_plan_includes_the_spanning_family(lab: Any, make_host: Any, home: Path,
                                                    tmux_sessions: list) -> None:
    host = make_host("span-a", gpus=2)
    api = host.spawn_vllm(gpus=[0, 1], mib=700)  # API server (no devices) -> EngineCore -> workers
    family = [p for p in api.family() if p != api]  # the GPU family: EngineCore and its workers
    inv = lab.inventory_yaml([host])
    t = Tmux(home, GPUFLEET + ["-i", str(inv), "top", "-n", "1", "--all"], width=220)
    tmux_sessions.append(t)
    t.wait("hosts 1: 1 up")
    t.keys("Enter")
    t.wait("GPU 1")
    t.keys("Down", "Space")  # GPU 0 only
    t.wait(lambda s: any("[x] GPU 0" in ln for ln in s.splitlines()))
    t.keys("c")
    screen = t.wait("clean --include-spanning")
    assert "s = plan again with the processes that also use GPUs outside the marks" in screen
    t.keys("s")
    screen = t.wait(lambda s: "Signal the processes above?" in s and "include_spanning" in s,
                    timeout=60)
    assert "clean --include-spanning" not in screen  # offered once: this plan has them
    t.keys("y")
    t.wait(lambda s: "outcome" in s and "clean" in s.split("outcome", 1)[1], timeout=90)
    for pid in family:
        assert host.wait_gone(pid, 15), pid
    assert host.gpu_used() == [0, 0]
    audit = read_jsonl(home / ".local" / "state" / "gpufleet" / "audit.jsonl")
    assert {r["pid"] for r in audit if r.get("event") != "verdict"} == set(family)
    t.keys("x")
    t.keys("q")
    t.wait("TOP-EXIT=0")
    wait_no_agents(host)


def test_a_changed_host_key_shows_both_fingerprints(lab: Any, make_host: Any, home: Path,
                                                    tmux_sessions: list) -> None:
    host = make_host("rekeyed-top", gpus=1)
    wrong = home / "wrong_known_hosts"
    wrong_line = lab.wrong_host_key_line(host)
    wrong.write_text(wrong_line + "\n")
    inv = lab.inventory_yaml([host], known_hosts_file=str(wrong))
    t = Tmux(home, GPUFLEET + ["-i", str(inv), "top", "-n", "1"], width=400)
    tmux_sessions.append(t)
    screen = t.wait("HOST KEY CHANGED", timeout=60)
    line = next(ln for ln in screen.splitlines() if "HOST KEY CHANGED" in ln)
    assert sha256_fingerprint(host.host_key_line) in line, line  # what it presents now
    assert sha256_fingerprint(wrong_line) in line, line  # what the file has
    assert "Host key verification failed" not in screen
    t.keys("q")
    t.wait("TOP-EXIT=0")


def test_verbose_top_needs_stderr_off_the_screen(lab: Any, make_host: Any, home: Path,
                                                 tmux_sessions: list) -> None:
    """-v's lines on the terminal would be drawn over the screen: refused there (one line,
    exit 2); with stderr sent to a file, top runs and the file says how each host is reached."""
    import shlex

    host = make_host("verbose-top", gpus=1)
    inv = lab.inventory_yaml([host])
    t = Tmux(home, GPUFLEET + ["-i", str(inv), "top", "-v"], width=200)
    tmux_sessions.append(t)
    screen = t.wait("TOP-EXIT=2")
    assert "gpufleet: error: -v writes on stderr, the terminal top draws on" in screen
    log = home / "top.log"
    line = " ".join(shlex.quote(a) for a in GPUFLEET + ["-i", str(inv), "top", "-v"])
    t2 = Tmux(home, ["sh", "-c", f"{line} 2>{shlex.quote(str(log))}"], width=200)
    tmux_sessions.append(t2)
    t2.wait("hosts 1: 1 up")
    t2.keys("q")
    t2.wait("TOP-EXIT=0")
    text = log.read_text()
    assert f"gpufleet: {host.name}: ssh to 127.0.0.1:{host.port} " in text, text
    assert f"gpufleet: {host.name}: resident run with an ssh process" in text, text
