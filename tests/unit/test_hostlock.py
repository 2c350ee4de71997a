"""The controller's one line for a clean its host lock stopped (gpufleet/core/hostlock.py): who
holds it, on one line whatever the holder's command line holds, or why it was refused."""
from __future__ import annotations

from gpufleet.core.hostlock import lock_failure


AGENT_CMDLINE = ('python3 -S -E -s -c import sys;b=sys.stdin.buffer;h=b.readline().split();'
                 'exec(compile(b.read(int(h[0])),"gpufleet-agent-loader","exec"),{})')


def test_the_busy_line_names_pid_user_and_command() -> None:
    doc = {"lock": "busy", "lock_holder": {"pid": 4242, "uid": 0, "user": "root",
                                           "cmdline": "flock /run/gpufleet/clean.lock sleep 9",
                                           "open": True}}
    assert lock_failure(doc) == (
        'another process holds this host\'s lock: PID 4242, user root, command '
        '"flock /run/gpufleet/clean.lock sleep 9"; nothing was signalled')
    agent_doc = {"lock": "busy", "lock_holder": dict(doc["lock_holder"], cmdline=AGENT_CMDLINE)}
    line = lock_failure(agent_doc, "nothing removed")
    assert line.startswith("another gpufleet clean holds this host's lock: PID 4242, user root")
    assert line.endswith('…"; nothing removed') and len(line) < 200


def test_the_busy_line_is_one_line_whatever_the_command_holds() -> None:
    hostile = "evil\n\x1b[2J\tx" + "y" * 500
    line = lock_failure({"lock": "busy", "lock_holder": {"pid": 9, "uid": 1000, "user": None,
                                                          "cmdline": hostile, "open": False}})
    assert "\n" not in line and "\x1b" not in line and "\\x1b[2J" in line
    assert "user 1000" in line and "no longer has the lock file open" in line


def test_unknown_holders_and_refusals_have_their_own_lines() -> None:
    assert lock_failure({"lock": "busy"}) == \
        "another gpufleet clean holds this host's lock; nothing was signalled"
    assert lock_failure({"lock": "busy", "lock_holder": {"pid": 0}}).startswith(
        "a process outside the agent's PID namespace holds this host's clean lock")
    refused = {"lock": "refused", "lock_refused": {
        "kind": "unsafe_dir", "path": "/run/gpufleet/clean.lock",
        "reason": "/run/gpufleet is owned by uid 65534, not by the agent's uid 0"}}
    assert lock_failure(refused) == ("no safe clean lock: /run/gpufleet is owned by uid 65534, "
                                     "not by the agent's uid 0; nothing was signalled")
    assert lock_failure({"lock": "acquired"}) is None and lock_failure({}) is None

