"""`gpufleet top`'s screen without a terminal: render.top.layout / on_key / clean_scope from
snapshot fixtures (tests/fixtures/status, tests/fixtures/scenarios: built from recorded
output) and LiveHost values."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from gpufleet.core.live import LiveHost
from gpufleet.core.model import HostResult, parse_snapshot
from gpufleet.core.results import Failure
from gpufleet.render.top import (
    MIN_HEIGHT,
    MIN_WIDTH,
    HostInfo,
    TopState,
    clean_scope,
    layout,
    on_key,
)

FIX = Path(__file__).resolve().parent.parent / "fixtures"
NOW = 1000.0


def live(name: str, fixture: str, age: float = 0.5, failure=None) -> LiveHost:
    snap = parse_snapshot(json.loads((FIX / fixture).read_text()))
    return LiveHost(name, HostResult(host=name, ok=True, snapshot=snap), NOW - age, failure,
                    stale_after_s=3.0)


def fleet() -> list[LiveHost]:
    return [live("node-b", "scenarios/vllm-tp4.json"),
            live("node-a", "status/basic.json"),
            LiveHost("node-dead", failure=Failure("refused", "connection refused"))]


INFO = {"node-a": HostInfo(("inference",)), "node-b": HostInfo(("training",))}


def texts(screen) -> list[str]:
    return [line.text for line in screen.lines]


def host_rows(screen) -> list[str]:
    return [line.text for line in screen.lines if line.key and line.key[0] == "host"]


def test_summary_and_one_row_per_host_with_the_numbers() -> None:
    screen = layout(fleet(), INFO, TopState(), 160, 40, NOW)
    title = screen.lines[0].text
    assert "hosts 3: 2 up, 1 down, 0 stale" in title
    assert "GPUs 9 busy, 0 free" in title  # 8 on node-b, 1 on node-a
    rows = host_rows(screen)
    assert [r.split()[1] for r in rows] == ["node-a", "node-b", "node-dead"]  # sort: name
    a = rows[0].split()
    assert a[2:4] == ["1", "1/0"] and "26651MiB" not in rows[0] and "26.0 / 140.4GiB" in rows[0]
    assert "connection refused" in rows[2] and screen.lines[0].role == "title"
    assert [ln.role for ln in screen.lines if ln.key == ("host", "node-dead")] == ["down"]


def test_the_summary_counts_health_and_a_hosts_own_finding_is_shown() -> None:
    """node-a's inventory expects 2 GPUs and it has 1; node-b's snapshot has no readings: the
    title counts both, and the expanded host says what is wrong with it."""
    info = dict(INFO, **{"node-a": HostInfo(("inference",), expected_gpus=2)})
    state = TopState(expanded=frozenset({("host", "node-a")}))
    screen = layout(fleet(), info, state, 200, 40, NOW)
    assert "| health: 1 OK, 8 UNKNOWN; host findings: 1 CRITICAL |" in screen.lines[0].text
    found = [ln for ln in screen.lines if ln.text.startswith("    host: ")]
    assert [(ln.text.strip(), ln.role) for ln in found] == [
        ("host: CRITICAL gpu_count: 1 GPU(s) found, the inventory expects 2", "warn")]


def test_host_rows_have_their_utilisation_and_one_unit_per_memory_pair() -> None:
    """UTIL: the mean of the host's GPUs; used and total in one unit (never 7000MiB /
    48.0GiB), per-process and unattributed memory in MiB."""
    views = fleet()
    snap = views[0].result.snapshot
    utils = [g.utilization_pct for g in snap.gpus]
    state = TopState(expanded=frozenset({("host", "node-b")}))
    screen = layout(views, INFO, state, 200, 60, NOW)
    assert "  UTIL  " in screen.lines[1].text
    row = [r for r in host_rows(screen) if r.split()[1] == "node-b"][0]
    assert f" {round(sum(utils) / len(utils))}% " in row and " 68% " in row, row
    gpu0 = [t for t in texts(screen) if t.strip().startswith("[ ] GPU 0")][0]
    assert " 43.1 / 48.0GiB " in gpu0 and "MiB / " not in gpu0, gpu0
    assert "| memory 350.9 / 524.3GiB | unattributed 127MiB" in screen.lines[0].text


def test_enter_expands_a_host_into_gpus_and_holders() -> None:
    state = TopState()
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    state, action = on_key(state, "ENTER", screen)  # cursor on the first row: node-a
    assert action is None and ("host", "node-a") in state.expanded
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    body = "\n".join(texts(screen))
    assert "GPU 0  NVIDIA H200" in body
    assert any("VLLM::Worker" in t and "pid 425" in t and "20998MiB" in t and "nvidia-smi" in t
               for t in texts(screen))
    assert any("trainer" in t and "pid 426" in t and "root" in t for t in texts(screen))
    state, _ = on_key(state, "ENTER", screen)
    assert "GPU 0  NVIDIA H200" not in "\n".join(texts(layout(fleet(), INFO, state, 160, 40, NOW)))


def test_device_file_holders_units_and_clients_on_an_expanded_host() -> None:
    state = TopState(expanded=frozenset({("host", "node-b")}))
    body = texts(layout(fleet(), INFO, state, 200, 60, NOW))
    engine = [t for t in body if "VLLM::EngineCore_DP0" in t]
    assert engine and "pid 4340" in engine[0] and "fd" in engine[0]
    assert any("unit session-4.scope" in t for t in body if "pid 4360" in t)


def test_sort_by_memory_and_unattributed_and_filter_by_tag_and_holder() -> None:
    state = TopState()
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    state, _ = on_key(state, "s", screen)
    assert state.sort == "memory"
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    rows = host_rows(screen)
    assert [r.split()[1] for r in rows] == ["node-b", "node-a", "node-dead"]
    assert screen.lines[-1].text.endswith("every 2s, sort memory")
    for typed, shown in (("training", ["node-b"]), ("trainer", ["node-a"]),
                         ("node-", ["node-a", "node-b", "node-dead"])):
        s = TopState()
        s, _ = on_key(s, "/", screen)
        for ch in typed:
            s, _ = on_key(s, ch, screen)
        s, _ = on_key(s, "ENTER", screen)
        assert (s.filter, s.editing) == (typed, False)
        assert layout(fleet(), INFO, s, 160, 40, NOW).shown == tuple(shown)
    s = replace(TopState(), filter="nomatch")
    assert any("no host matches the filter 'nomatch'" in t
               for t in texts(layout(fleet(), INFO, s, 160, 40, NOW)))


def test_the_filter_finds_what_a_holder_runs_not_only_its_comm() -> None:
    """node-a's holders are `python3 /tmp/hold.py ...` (comm renamed): the script is what an
    operator types; an expanded host shows it on each holder's line."""
    def shown(typed: str) -> tuple[str, ...]:
        return layout(fleet(), INFO, replace(TopState(), filter=typed), 160, 40, NOW).shown

    assert shown("hold.py") == ("node-a",)
    assert shown("hold.py trainer") == ("node-a",)
    state = TopState(expanded=frozenset({("host", "node-a")}))
    body = texts(layout(fleet(), INFO, state, 160, 40, NOW))
    assert any("hold.py trainer 5" in t and "pid 426" in t and "root" in t for t in body)


def test_a_stale_host_shows_its_age_and_why() -> None:
    views = [live("node-a", "status/basic.json", age=12.0,
                  failure=Failure("closed", "connection lost: the server closed the connection"))]
    screen = layout(views, INFO, TopState(), 160, 20, NOW)
    row = host_rows(screen)[0]
    assert "stale 12s" in row and "connection lost" in row
    assert "0 up, 0 down, 1 stale" in screen.lines[0].text


def test_too_small_says_so_and_waits() -> None:
    screen = layout(fleet(), INFO, TopState(), MIN_WIDTH - 1, 30, NOW)
    assert screen.too_small and "terminal too small" in screen.lines[0].text
    assert not layout(fleet(), INFO, TopState(), MIN_WIDTH, MIN_HEIGHT, NOW).too_small


def test_every_line_fits_the_width_and_the_screen_fits_the_height() -> None:
    state = TopState(expanded=frozenset({("host", "node-a"), ("host", "node-b")}))
    for width, height in ((60, 8), (80, 24), (200, 60)):
        screen = layout(fleet(), INFO, state, width, height, NOW)
        assert len(screen.lines) == height
        assert all(len(t) <= width for t in texts(screen))


def test_the_cursor_scrolls_the_list() -> None:
    state = TopState(expanded=frozenset({("host", "node-b")}))
    screen = layout(fleet(), INFO, state, 120, 10, NOW)
    for _ in range(12):
        state, _ = on_key(state, "DOWN", screen)
        screen = layout(fleet(), INFO, replace(state), 120, 10, NOW)
        state = replace(state, top=screen.top)
        cursor_lines = [ln for ln in screen.lines if ln.role == "cursor"]
        assert len(cursor_lines) == 1 and cursor_lines[0].key == state.cursor


def test_marks_give_the_clean_scope_of_one_host() -> None:
    state = TopState(expanded=frozenset({("host", "node-b")}), cursor=("gpu", "node-b", 2))
    screen = layout(fleet(), INFO, state, 160, 60, NOW)
    state, _ = on_key(state, " ", screen)
    assert clean_scope(state, fleet()) == ("node-b", [2], "")
    # a holder brings its GPUs: a trainer worker on GPU 5
    state = replace(state, cursor=("app", "node-b", 5, 4521))
    state, _ = on_key(state, " ", screen)
    assert clean_scope(state, fleet()) == ("node-b", [2, 5], "")
    state, action = on_key(state, "c", screen)
    assert action == "clean"
    assert "[x]" in "\n".join(texts(layout(fleet(), INFO, state, 160, 60, NOW)))
    both = replace(state, marks=state.marks | {("gpu", "node-a", 0)})
    assert clean_scope(both, fleet())[0] is None and "2 hosts" in clean_scope(both, fleet())[2]
    assert clean_scope(TopState(), fleet())[2].startswith("nothing marked")


def test_readonly_has_no_marks_and_no_clean() -> None:
    state = TopState(readonly=True, expanded=frozenset({("host", "node-a")}),
                     cursor=("gpu", "node-a", 0))
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    assert "[ ]" not in "\n".join(texts(screen)) and "read-only" in screen.lines[0].text
    state, _ = on_key(state, " ", screen)
    assert state.marks == frozenset() and "read-only" in state.message
    state, action = on_key(state, "c", screen)
    assert action is None and "read-only" in state.message


def test_without_a_selection_marks_and_clean_say_how_to_select_hosts() -> None:
    how = "clean changes hosts: start top with --host NAME, -g GROUP, --tag TAG or --all"
    state = TopState(actions_refused=how, expanded=frozenset({("host", "node-a")}),
                     cursor=("gpu", "node-a", 0))
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    text = "\n".join(texts(screen))
    assert "[ ]" not in text and "watch only" in screen.lines[0].text
    assert "space mark" not in text and "c clean" not in text
    state, action = on_key(state, " ", screen)
    assert (state.marks, state.message, action) == (frozenset(), how, None)
    state, action = on_key(state, "c", screen)
    assert (action, state.message) == (None, how)
    assert how in texts(layout(fleet(), INFO, state, 160, 40, NOW))[-1]


def test_help_and_quit() -> None:
    state, action = on_key(TopState(), "?", layout(fleet(), INFO, TopState(), 160, 40, NOW))
    screen = layout(fleet(), INFO, state, 160, 40, NOW)
    assert any("sort: name, memory, unattributed" in t for t in texts(screen))
    assert on_key(TopState(), "q", screen)[1] == "quit"


def test_a_hostile_process_title_cannot_reach_the_terminal() -> None:
    doc = json.loads((FIX / "status/basic.json").read_text())
    for proc in doc["processes"].values():
        proc["comm"] = "evil\x1b[2J"
        proc["cmdline"] = "evil\x1b[2J"
    snap = parse_snapshot(doc)
    view = LiveHost("node-a", HostResult(host="node-a", ok=True, snapshot=snap), NOW)
    state = TopState(expanded=frozenset({("host", "node-a")}))
    body = "\n".join(texts(layout([view], INFO, state, 160, 40, NOW)))
    assert "\x1b" not in body and "evil\\x1b[2J" in body


def test_a_long_plan_line_is_wrapped_not_cut() -> None:
    from gpufleet.render.top import Overlay

    reason = "  refused 9 VLLM::Worker_TP0: its family also uses GPU 1, outside the scope: " + \
        "ending part of it can end the whole family; pass --include-spanning"
    state = TopState(overlay=Overlay("clean node-b GPUs 0: the plan", (reason,), "y/n", "confirm"))
    screen = layout(fleet(), INFO, state, 60, 20, NOW)
    body = texts(screen)
    assert all(len(t) <= 60 for t in body)
    assert "--include-spanning" in "".join(body) and body[-1] == "y/n"
