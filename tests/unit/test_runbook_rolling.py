"""Rolling runs, pure: the batches against Ansible's own function, the stop rule at its
boundaries, the runbook keys and flags, the roll loop with a stand-in fan-out, the retry file.

The whole-run comparison with ansible-playbook on real hosts is
tests/integration/test_rolling_ansible_lab.py; the lab runs are
tests/integration/test_runbooks_rolling_lab.py.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.config.inventory import Host
from gpufleet.errors import StepFailed, UsageError
from gpufleet.runbook.kinds import describe
from gpufleet.runbook.batches import batch_size, over_budget, split_batches, stop_reason
from gpufleet.runbook.load import load_runbook, parse_runbook
from gpufleet.runbook.retry import read_retry, retry_path, write_retry
from gpufleet.runbook.roll import roll, roll_document
from gpufleet.runbook.run import HostRun, StepResult
from gpufleet.runbook.values import v_percentage, v_serial

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"


def _parse(text: str, **extra: str):
    return parse_runbook(textwrap.dedent(text), source="rb.yaml", extra_vars=extra)


def _error(text: str, **extra: str) -> str:
    with pytest.raises(UsageError) as info:
        _parse(text, **extra)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    return message


def _fail(message: str):
    raise UsageError(message)


# ----------------------------------------------------------------- batches: Ansible's own function


@pytest.fixture(scope="module")
def executor(prerequisite: Any) -> Any:
    """ansible-core's PlaybookExecutor (a test dependency: skipped loudly without it, failed in CI)."""
    try:
        from ansible.executor.playbook_executor import PlaybookExecutor
    except ImportError as exc:
        prerequisite("ansible-core", f"{exc} (pip install -e '.[test]')")
    return PlaybookExecutor


def _ansible_batches(executor: Any, n: int, serial: list) -> list[list[int]]:
    """ansible-core's PlaybookExecutor._get_serialized_batches, called on stand-ins for the
    play and the inventory (it only reads play.serial/hosts/order and inventory.get_hosts)."""

    class Inventory:
        def get_hosts(self, pattern: Any, order: Any = None) -> list[int]:
            return list(range(n))

    class Play:
        hosts, order = "all", None

    play = Play()
    play.serial = list(serial)  # type: ignore[attr-defined]
    me = type("Executor", (), {"_inventory": Inventory()})()
    return executor._get_serialized_batches(me, play)


serial_items = st.one_of(st.integers(min_value=0, max_value=12),
                         st.integers(min_value=1, max_value=100).map(lambda p: f"{p}%"))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(min_value=0, max_value=40), serial=st.lists(serial_items, min_size=0, max_size=5))
def test_batches_are_ansibles(executor: Any, n: int, serial: list) -> None:
    assert split_batches(list(range(n)), serial) == _ansible_batches(executor, n, serial)


def test_batches_examples() -> None:
    hosts = [f"h{i}" for i in range(8)]
    assert [len(b) for b in split_batches(hosts, [1, 2, "25%"])] == [1, 2, 2, 2, 1]
    assert [len(b) for b in split_batches(hosts, ["30%"])] == [2, 2, 2, 2]  # int(2.4)
    assert [len(b) for b in split_batches(hosts, ["10%"])] == [1] * 8  # int(0.8) -> at least 1
    assert [len(b) for b in split_batches(hosts, [1, 0])] == [1, 7]  # 0: all the rest
    assert split_batches(hosts, []) == [hosts]
    assert sum(split_batches(hosts, [3]), []) == hosts  # order kept, nothing twice
    assert batch_size("50%", 7) == 3


# ----------------------------------------------------------------- the stop rule


def test_budget_is_strictly_greater_than() -> None:
    assert not over_budget(1, 4, 25)  # 25% is not more than 25%
    assert over_budget(2, 4, 25)
    assert over_budget(1, 8, 0) and not over_budget(0, 8, 0)  # 0: any failure stops
    assert not over_budget(2, 4, 50) and over_budget(3, 4, 50)
    assert not over_budget(1, 8, 12.5) and over_budget(2, 8, 12.5)
    assert not over_budget(4, 4, None)  # no budget


def test_a_batch_that_failed_whole_stops_even_without_budget() -> None:
    assert stop_reason(2, 2, None) == "every host of the batch failed (2 of 2)"
    assert stop_reason(4, 4, 100) is not None  # Ansible's PlaybookExecutor does the same
    assert stop_reason(1, 2, None) is None
    assert stop_reason(1, 2, 25) == "1 of 2 host(s) failed (50% > max_fail_percentage 25%)"


# ----------------------------------------------------------------- values and runbook keys


@pytest.mark.parametrize("value, expected", [
    (1, (1,)), ("25%", ("25%",)), ([1, 2, "25%"], (1, 2, "25%")), ("1,2, 25%", (1, 2, "25%")),
    ("3", (3,)), (0, (0,)), (" 50 % ", ("50%",)),
])
def test_serial_values(value: Any, expected: tuple) -> None:
    assert v_serial(value, _fail) == expected


@pytest.mark.parametrize("value, fragment", [
    (-1, "host count"), (1.5, "host count"), (True, "host count"), ("x", "host count"),
    ("0%", "1%-100%"), ("101%", "1%-100%"), ("12.5%", "1%-100%"), ([], "list of"),
    ({"a": 1}, "host count"),
])
def test_bad_serial_values(value: Any, fragment: str) -> None:
    with pytest.raises(UsageError, match=fragment):
        v_serial(value, _fail)


def test_percentages() -> None:
    assert v_percentage(25, _fail) == 25.0 and v_percentage("12.5%", _fail) == 12.5
    for bad in (-1, 101, "x%", True, None):
        with pytest.raises(UsageError, match="percentage 0-100"):
            v_percentage(bad, _fail)


def test_rolling_keys_load() -> None:
    rb = _parse("""\
        serial: [1, "{{ N }}", "25%"]
        max_fail_percentage: 25%
        pause_s: 2
        gate:
          - {name: sound, kind: health}
          - {kind: wait_http, url: "{{ URL }}", timeout: 30}
        steps:
          - {kind: report}
        """, N="2", URL="http://127.0.0.1:8000/health")
    r = rb.rolling
    assert r.serial == (1, 2, "25%") and r.max_fail_percentage == 25.0 and r.pause_s == 2.0
    assert [s.kind for s in r.gate] == ["health", "wait_http"] and r.gate[1].timeout == 30
    assert r.gate[1].params["url"] == "http://127.0.0.1:8000/health"
    assert r.given and not _parse("steps:\n  - {kind: report}\n").rolling.given


@pytest.mark.parametrize("text, fragment", [
    ("serial: [1, -2]\nsteps: [{kind: report}]\n", "rb.yaml:1: serial: expected a host count"),
    ("serail: 1\nsteps: [{kind: report}]\n", "did you mean 'serial'"),
    ("max_fail_percentage: 120\nsteps: [{kind: report}]\n", "rb.yaml:1: max_fail_percentage"),
    ("pause_s: -1\nsteps: [{kind: report}]\n", "pause_s"),
    ("gate: []\nsteps: [{kind: report}]\n", "gate: expected a list of health or wait_http"),
    ("gate:\n  - {kind: shell, argv: [rm, x]}\nsteps: [{kind: report}]\n",
     "rb.yaml:2: gate: step 1 'shell' (shell): a gate only looks"),
    ("gate:\n  - {kind: health, fail_of: warn}\nsteps: [{kind: report}]\n", "gate: step 1 'health' (health): unknown key"),
    ("serial: '{{ NOPE }}'\nsteps: [{kind: report}]\n", "serial: undefined variable 'NOPE'"),
])
def test_bad_rolling_keys(text: str, fragment: str) -> None:
    assert fragment in _error(text)


def test_a_variable_only_used_by_serial_may_be_given() -> None:
    assert _parse("serial: '{{ S }}'\nsteps: [{kind: report}]\n", S="1,25%").rolling.serial == (1, "25%")


def test_the_shipped_rolling_swap_loads() -> None:
    rb = load_runbook(PLAYBOOKS / "model-swap-rolling.yaml",
                      {"OLD_UNIT": "vllm-minimax", "NEW_UNIT": "vllm-kimi", "LB_URL": "http://127.0.0.1:9000"})
    assert rb.rolling.serial == (1, 2, "25%") and rb.rolling.max_fail_percentage == 0
    assert [s.kind for s in rb.rolling.gate] == ["health", "wait_http"]
    kinds = [s.kind for s in rb.steps]
    assert kinds[0] == "local_http" and kinds[-1] == "local_http"
    assert kinds[1:-1] == [s.kind for s in load_runbook(
        PLAYBOOKS / "model-swap.yaml", {"OLD_UNIT": "a", "NEW_UNIT": "b"}).steps]
    drain = rb.steps[0].for_host({"HOST": "node-3", "HOST_ADDRESS": "10.0.0.3"})
    assert drain.params["url"] == "http://127.0.0.1:9000/backends/node-3/drain"


# ----------------------------------------------------------------- the roll loop, with a stand-in fan-out


def _hosts(n: int) -> list[Host]:
    return [Host(name=f"h{i}", connection="local") for i in range(n)]


class FakeFleet:
    """run_hosts for roll(): records each call; the hosts in ``bad`` fail their steps, those
    in ``bad_gate`` their gate."""

    def __init__(self, bad: Sequence[str] = (), bad_gate: Sequence[str] = ()) -> None:
        self.bad, self.bad_gate = set(bad), set(bad_gate)
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, book: Any, hosts: Sequence[Host], label: str) -> list[HostRun]:
        self.calls.append((label, [h.name for h in hosts]))
        gate = label.endswith("gate")
        out = []
        for h in hosts:
            ok = h.name not in (self.bad_gate if gate else self.bad)
            steps = [StepResult(s.name, s.kind, "ok" if ok else "failed") for s in book.steps]
            out.append(HostRun(host=h.name, ok=ok, error=None if ok else "step 1 failed", steps=steps,
                               error_kind=None if ok else "command"))
        return out


def _book(text: str = "serial: [1, 2]\nmax_fail_percentage: 0\nsteps: [{kind: report}]\n"):
    return _parse(text)


def test_roll_stops_at_the_batch_over_budget_and_never_starts_the_rest() -> None:
    fleet = FakeFleet(bad=["h2"])
    seen = []
    result = roll(_book(), _hosts(7), fleet, on_batch=lambda b: seen.append(b.index))
    assert fleet.calls == [("batch 1/4", ["h0"]), ("batch 2/4", ["h1", "h2"])]
    assert seen == [1, 2]
    assert result.not_run == ["h3", "h4", "h5", "h6"]
    assert result.stopped == "stopped after batch 2: 1 of 2 host(s) failed (50% > max_fail_percentage 0%)"
    assert result.retry_hosts == ["h2", "h3", "h4", "h5", "h6"]
    assert not result.ok
    doc = roll_document(_book(), result, "/x/rb.hosts")
    assert [b["hosts"] for b in doc["batches"]] == [["h0"], ["h1", "h2"]]
    assert doc["batches"][1]["failed"] == ["h2"] and doc["batches"][1]["failed_percent"] == 50.0
    assert doc["not_run"] == ["h3", "h4", "h5", "h6"] and doc["exit_code"] == 1
    assert [h["host"] for h in doc["hosts"]] == ["h0", "h1", "h2"]


def test_roll_within_budget_runs_every_batch() -> None:
    book = _book("serial: 4\nmax_fail_percentage: 25\nsteps: [{kind: report}]\n")
    result = roll(book, _hosts(8), FakeFleet(bad=["h1"]))
    assert [len(b.runs) for b in result.batches] == [4, 4] and result.not_run == []
    assert result.stopped is None and not result.ok  # a host failed: still exit 1
    assert result.retry_hosts == ["h1"]


def test_a_failed_gate_fails_its_host_and_counts() -> None:
    book = _book("serial: 2\nmax_fail_percentage: 0\ngate: [{kind: health}]\nsteps: [{kind: report}]\n")
    fleet = FakeFleet(bad=["h0"], bad_gate=["h1"])
    result = roll(book, _hosts(6), fleet)
    # the gate ran only on the host whose steps passed, after the whole batch
    assert fleet.calls == [("batch 1/3", ["h0", "h1"]), ("batch 1/3 gate", ["h1"])]
    h1 = result.batches[0].runs[1]
    assert not h1.ok and h1.error.startswith("gate: ")
    assert [s.name for s in h1.steps] == ["report", "gate: health"]
    assert result.not_run == ["h2", "h3", "h4", "h5"]


def test_pause_only_between_batches_and_ctrl_c_in_it_stops() -> None:
    book = _book("serial: 1\npause_s: 5\nsteps: [{kind: report}]\n")
    slept: list[float] = []
    result = roll(book, _hosts(3), FakeFleet(), sleep=slept.append)
    assert slept == [5.0, 5.0] and result.ok

    def interrupted(_s: float) -> None:
        raise KeyboardInterrupt

    result = roll(book, _hosts(3), FakeFleet(), sleep=interrupted)
    assert result.interrupted and result.not_run == ["h1", "h2"]
    assert result.stopped == "stopped after batch 1: interrupted during the pause"


# ----------------------------------------------------------------- the retry file


def test_retry_file_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = retry_path("playbooks/model-swap-rolling.yaml")
    assert path == tmp_path / ".local/state/gpufleet/retry/model-swap-rolling.hosts"
    assert write_retry(path, ["h2", "h3"], "/abs/rb.yaml") is None
    assert read_retry(path) == ["h2", "h3"]
    assert path.read_text().startswith("# gpufleet run /abs/rb.yaml")
    assert write_retry(path, [], "/abs/rb.yaml") is None  # all ok: nothing left to retry
    assert not path.exists()
    with pytest.raises(UsageError, match="no retry file"):
        read_retry(path)
    path.write_text("h1\n$(reboot)\n")
    with pytest.raises(UsageError, match=r"\.hosts:2: not a host name"):
        read_retry(path)
    path.write_text("# nothing\n\n")
    with pytest.raises(UsageError, match="names no host"):
        read_retry(path)


def test_an_unwritable_retry_file_is_a_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    warning = write_retry(blocker / "retry" / "x.hosts", ["h1"], "rb.yaml")
    assert warning is not None and "not written" in warning


yaml_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
              st.text(max_size=12), st.sampled_from(["25%", "0%", "1,2", "{{ HOST }}", "-1", "100%"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(["serial", "max_fail_percentage", "pause_s", "gate"]), value=yaml_values,
       field=st.sampled_from(["url", "method", "json", "headers", "status", "interval"]), other=yaml_values)
def test_any_value_of_the_new_keys_is_valid_or_one_line(key: str, value: Any, field: str, other: Any) -> None:
    """Whatever YAML gives the rolling keys or a local_http field: a runbook, or ONE line (exit 2)."""
    import yaml

    doc = {key: value, "steps": [{"kind": "local_http", "url": "http://127.0.0.1/{{ HOST }}", field: other}]}
    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        rb = parse_runbook(text, source="rb.yaml")
    except UsageError as exc:
        assert "\n" not in str(exc) and exc.exit_code == 2
        return
    step = rb.steps[0]
    describe(step)
    split_batches(list(range(9)), rb.rolling.serial)
    try:
        step.for_host({"HOST": "node-1", "HOST_ADDRESS": "10.0.0.1"})
    except StepFailed as exc:
        assert "\n" not in str(exc)
