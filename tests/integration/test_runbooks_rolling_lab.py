"""Rolling runs (`serial`, `max_fail_percentage`, gate, pause, --retry) by the real CLI over
real SSH against 8 lab hosts, and the shipped model-swap-rolling.yaml behind a fake load
balancer.

Evidence is read from the hosts, not from gpufleet's report: each host's marker step writes
its start and end time into the host's private /tmp (all lab hosts share this machine's clock),
so batch order is checked as "every host of batch k ended before any host of batch k+1
started"; a host of a batch that never started has no marker and no new SSH login in its
sshd's log (it was never contacted). A host fails its step when the test put /tmp/roll-fail
on it.
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from fake_systemctl import install_systemctl, unit_pids  # tests/lab, on sys.path via conftest

REPO = Path(__file__).resolve().parents[2]
HOME = Path(tempfile.mkdtemp(prefix="gf-rolling-home-"))  # the runs' retry files live here
RETRY_DIR = HOME / ".local/state/gpufleet/retry"
NAMES = [f"roll-{i}" for i in range(8)]

MARK = ("date +%s.%N > /tmp/roll-start; sleep 0.3; date +%s.%N > /tmp/roll-end; "
        "test ! -e /tmp/roll-fail")


def gpufleet(inventory: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "from gpufleet.cli import main; main()", "-i", str(inventory), *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(REPO),
        env=dict(os.environ, HOME=str(HOME)))


def ssh_logins(host: Any) -> int:
    return (host.dir / "sshd.log").read_text().count("Accepted publickey")


@pytest.fixture(scope="module")
def fleet(lab: Any) -> Iterator[tuple[list[Any], Path]]:
    hosts = [lab.add_host(name, gpus=1) for name in NAMES]
    inventory = lab.inventory_yaml(hosts, path=Path(tempfile.mkdtemp(prefix="gf-rolling-")) / "fleet.yaml")
    try:
        yield hosts, inventory
    finally:
        for host in hosts:
            lab.remove_host(host)
        shutil.rmtree(inventory.parent, ignore_errors=True)
        shutil.rmtree(HOME, ignore_errors=True)


@pytest.fixture
def marks(fleet: tuple[list[Any], Path]) -> Iterator[list[Any]]:
    """The fleet with no markers and no failure switch left from another test."""
    hosts, _ = fleet
    for host in hosts:
        host.exec(["rm", "-f", "/tmp/roll-start", "/tmp/roll-end", "/tmp/roll-fail"])
    yield hosts


def _runbook(tmp_path: Path, head: str, name: str = "roll") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(head + "steps:\n"
                    "  - name: controller log\n    kind: local_command\n"
                    "    argv: [sh, -c, 'echo \"$GPUFLEET_HOST\" >> \"$0\"', '{{ LOG }}']\n"
                    f"  - name: mark\n    kind: shell\n    command: '{MARK}'\n")
    return path


def _times(host: Any) -> tuple[float, float] | None:
    start, end = host.path("/tmp/roll-start"), host.path("/tmp/roll-end")
    if not start.exists():
        return None
    return float(start.read_text()), float(end.read_text())


def test_batches_run_in_order_and_a_failure_stops_every_later_batch(fleet: Any, marks: list[Any],
                                                                     tmp_path: Path) -> None:
    hosts, inventory = fleet
    hosts[4].path("/tmp/roll-fail").write_text("")
    log = tmp_path / "controller.log"
    book = _runbook(tmp_path, 'serial: [1, 2, "25%"]\nmax_fail_percentage: 0\n')
    logins = [ssh_logins(h) for h in hosts]

    started = time.monotonic()
    res = gpufleet(inventory, "run", str(book), "--host", "roll-*", "-e", f"LOG={log}", "--yes", "--json")
    took = time.monotonic() - started

    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert [b["hosts"] for b in doc["batches"]] == [NAMES[:1], NAMES[1:3], NAMES[3:5]]
    assert doc["batches"][2]["failed"] == ["roll-4"] and doc["batches"][2]["failed_percent"] == 50.0
    assert doc["not_run"] == NAMES[5:]
    assert doc["stopped"] == "stopped after batch 3: 1 of 2 host(s) failed (50% > max_fail_percentage 0%)"
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert doc["rolling"]["serial"] == [1, 2, "25%"] and doc["rolling"]["max_fail_percentage"] == 0
    # What the hosts say: batch k ended everywhere before batch k+1 began anywhere.
    times = [_times(h) for h in hosts]
    batches = [[0], [1, 2], [3, 4]]
    for earlier, later in zip(batches, batches[1:]):
        assert max(times[i][1] for i in earlier) < min(times[i][0] for i in later), times
    # The canary finished before anything else began.
    assert times[0][1] < min(t[0] for t in times[1:5])
    # Later hosts were never touched: no marker, no SSH login, no controller step for them.
    assert times[5:] == [None, None, None]
    assert [ssh_logins(h) - n for h, n in zip(hosts, logins)] == [1] * 5 + [0] * 3
    logged = log.read_text().split()  # the controller's own steps, in the order they ran
    assert logged[0] == "roll-0" and sorted(logged[1:3]) == NAMES[1:3] and sorted(logged[3:]) == NAMES[3:5]
    retry = (RETRY_DIR / "roll.hosts").read_text().splitlines()
    assert retry[1:] == ["roll-4", "roll-5", "roll-6", "roll-7"]
    print(f"\nrolling run over 8 lab hosts, 3 batches run: {took:.1f}s")


def test_text_report_then_retry_runs_only_what_failed_or_did_not_run(fleet: Any, marks: list[Any],
                                                                     tmp_path: Path) -> None:
    hosts, inventory = fleet
    hosts[3].path("/tmp/roll-fail").write_text("")
    log = tmp_path / "controller.log"
    book = _runbook(tmp_path, "serial: 2\nmax_fail_percentage: 25\n", name="roll-retry")
    args = ["run", str(book), "--host", "roll-*", "-e", f"LOG={log}", "--yes"]

    res = gpufleet(inventory, *args)

    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout
    assert "batch 1/4 (2 hosts): roll-0, roll-1" in out and "batch 2/4 (2 hosts): roll-2, roll-3" in out
    assert "batch 3/4" not in out
    assert "batch 2 stops the run: 1 of 2 host(s) failed (50% > max_fail_percentage 25%)" in out
    assert out.rstrip().splitlines()[-3:] == [
        "rolled 2 of 4 batch(es) (serial 2; max_fail_percentage 25%): 3/8 host(s) ok, 1 failed (roll-3), 4 not run",
        "stopped after batch 2: 1 of 2 host(s) failed (50% > max_fail_percentage 25%)",
        "not run (nothing done there, never contacted): roll-4, roll-5, roll-6, roll-7"]
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("roll-")]
    assert [r[0] for r in rows if "failed" in r] == ["roll-3"] and len(rows) == 8  # 4 hosts x 2 steps
    assert f"--retry (hosts in {RETRY_DIR / 'roll-retry.hosts'})" in res.stderr
    first = [_times(h) for h in hosts[:3]]

    hosts[3].path("/tmp/roll-fail").unlink()
    again = gpufleet(inventory, *args, "--retry")

    assert again.returncode == 0, again.stdout + again.stderr
    assert "batch 1/3 (2 hosts): roll-3, roll-4" in again.stdout
    assert "batch 3/3 (1 host): roll-7" in again.stdout
    assert again.stdout.rstrip().splitlines()[-1] == \
        "rolled 3 of 3 batch(es) (serial 2; max_fail_percentage 25%): 5/5 host(s) ok"
    assert [_times(h) for h in hosts[:3]] == first  # the hosts that were ok were not run again
    assert all(_times(h) is not None for h in hosts[3:])
    assert log.read_text().split().count("roll-3") == 2 and log.read_text().split().count("roll-0") == 1
    assert not (RETRY_DIR / "roll-retry.hosts").exists()  # nothing left to retry
    nothing = gpufleet(inventory, *args, "--retry")
    assert nothing.returncode == 2 and nothing.stderr.count("\n") == 1
    assert "--retry: no retry file" in nothing.stderr


def test_bad_serial_flag_is_one_line_and_touches_nothing(fleet: Any, marks: list[Any], tmp_path: Path) -> None:
    hosts, inventory = fleet
    book = _runbook(tmp_path, "")
    logins = [ssh_logins(h) for h in hosts]
    for flag, value, fragment in (("--serial", "1,0%", "--serial: expected a whole percentage 1%-100%"),
                                  ("--max-fail-percentage", "-5", "--max-fail-percentage: expected a percentage")):
        res = gpufleet(inventory, "run", str(book), "--host", "roll-*", "-e", "LOG=/dev/null", "--yes", flag, value)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and fragment in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    assert [ssh_logins(h) for h in hosts] == logins
    assert all(_times(h) is None for h in hosts)


# ----------------------------------------------------------------------------- the shipped playbook


class LoadBalancer:
    """A fake load balancer's API on 127.0.0.1: POST /backends/NAME/{drain,enable}, recorded
    with the time each call arrived."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, str, dict]] = []
        calls = self.calls

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                parts = self.path.strip("/").split("/")
                ok = len(parts) == 3 and parts[0] == "backends" and parts[2] in ("drain", "enable")
                if ok:
                    calls.append((time.time(), parts[2], parts[1], body))
                self.send_response(200 if ok else 404)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def out_at_once(self) -> int:
        """The most hosts out of rotation at the same time."""
        out: set[str] = set()
        most = 0
        for _, verb, name, _ in sorted(self.calls):
            (out.add if verb == "drain" else out.discard)(name)
            most = max(most, len(out))
        return most

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_shipped_rolling_swap_drains_swaps_gates_and_stops(lab: Any, make_host: Any, tmp_path: Path) -> None:
    """model-swap-rolling.yaml over 7 hosts: the canary swaps and passes the gate, batch 2 has a
    host whose old unit is not there (its stop fails): the roll stops; the other 4 hosts keep
    the old model and were never drained. Lab hosts share one loopback, so the new model's
    /health is one server run here (the unit starts are still each host's)."""
    hosts, systemctl = [], ""
    for i in range(7):
        host = make_host(f"swap-{i}", gpus=2)
        units = {"vllm-minimax": {"gpus": [0, 1], "mib": 40000, "title": "VLLM::Worker"},
                 "vllm-kimi": {"gpus": [0, 1], "mib": 30000, "title": "VLLM::Worker"}}
        if i == 2:
            units.pop("vllm-minimax")  # this host's stop step fails: "not loaded"
        systemctl = install_systemctl(host, units)
        if i != 2:
            assert host.exec([systemctl, "start", "vllm-minimax.service"]).returncode == 0
        hosts.append(host)
    old = {h.name: unit_pids(h, "vllm-minimax") for h in hosts}
    health = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    lb = LoadBalancer()
    inventory = lab.inventory_yaml(hosts)
    logins = [ssh_logins(h) for h in hosts]
    try:
        res = gpufleet(inventory, "run", str(REPO / "playbooks" / "model-swap-rolling.yaml"), "--host", "swap-*",
                       "-e", "OLD_UNIT=vllm-minimax", "-e", "NEW_UNIT=vllm-kimi", "-e", f"SYSTEMCTL={systemctl}",
                       "-e", f"LB_URL={lb.url}", "-e", f"HEALTH_URL=http://127.0.0.1:{health.server_address[1]}/health",
                       "-e", "NEW_PARAMS=7B", "-e", "NEW_DTYPE=bf16", "-e", "NEW_TP=2", "-e", "HEALTH_INTERVAL=0.25",
                       "-e", "PAUSE_S=1", "--yes", "--json")
    finally:
        lb.close()
        health.shutdown()
        health.server_close()

    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert [b["hosts"] for b in doc["batches"]] == [["swap-0"], ["swap-1", "swap-2"]]
    assert doc["not_run"] == ["swap-3", "swap-4", "swap-5", "swap-6"]
    by_host = {h["host"]: h for h in doc["hosts"]}
    for name in ("swap-0", "swap-1"):
        steps = by_host[name]["steps"]
        assert [s["outcome"] for s in steps] == ["ok"] * 12, steps
        assert [s["name"] for s in steps][-2:] == ["gate: GPUs sound after", "gate: new model serving"]
    bad = by_host["swap-2"]["steps"]
    assert [s["outcome"] for s in bad] == ["ok", "ok", "failed"] + ["skipped"] * 7  # no gate on it
    # The balancer: each swapped host out, then back in; the failed one stays out; the rest never left.
    seen = [(verb, name) for _, verb, name, _ in sorted(lb.calls)]
    assert seen[:2] == [("drain", "swap-0"), ("enable", "swap-0")]
    assert sorted(seen[2:]) == [("drain", "swap-1"), ("drain", "swap-2"), ("enable", "swap-1")]
    assert lb.out_at_once() == 2
    assert all(body == {"backend": name, "address": "127.0.0.1"} for _, _, name, body in lb.calls)
    enable_0 = next(t for t, verb, name, _ in lb.calls if (verb, name) == ("enable", "swap-0"))
    assert min(t for t, verb, name, _ in lb.calls if name in ("swap-1", "swap-2")) - enable_0 >= 1.0  # gate + pause
    # The hosts: swapped where it ran; the old model untouched where nothing ran.
    for host in hosts[:2]:
        assert unit_pids(host, "vllm-kimi") and host.gpu_used() == [30000] * 2
    for host in hosts[3:]:
        assert all(host.alive(p) for p in old[host.name]) and host.gpu_used() == [40000] * 2
        assert unit_pids(host, "vllm-kimi") == []
    assert [ssh_logins(h) - n for h, n in zip(hosts, logins)][3:] == [0, 0, 0, 0]
