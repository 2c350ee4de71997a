"""`gpufleet export` and `gpufleet serve` against the lab and the real Prometheus parts.

Real parts, started here on loopback ports and stopped by their recorded PIDs: Debian's
`prometheus` (scrapes `gpufleet serve`; queried through its HTTP API), `promtool` (lints the
exposition and the shipped alert rules) and `prometheus-node-exporter` (its textfile collector
serves what `export --textfile` wrote). Lab hosts: a train node with a known holder and
unattributed memory, a WSL2 workstation with 1680 MiB expected unattributed memory, a host
whose "agent" prints garbage, and a dead port.
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest

from cli_helpers import (GPUFLEET, REPO_ROOT, _SCRUB, assert_one_line_error, home,  # noqa: F401
                         run_gpufleet, sshd_pid, wait_for)

MIB = 1 << 20
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
RULES = REPO_ROOT / "docs" / "prometheus" / "gpufleet-rules.yml"
DASHBOARD = REPO_ROOT / "docs" / "prometheus" / "gpufleet-dashboard.json"


def dashboard_queries() -> list[str]:
    """Every PromQL query of the shipped dashboard's panels."""
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def need(binary: Optional[str], package: str) -> str:
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{package} is not installed (.ci/run installs it)")
        pytest.skip(f"!!! {package} is not installed: apt-get install {package}")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy


def get(url: str, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with _DIRECT.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def child_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update(HOME=str(home), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p))
    return env


class Started:
    """A process this test started: stopped by its recorded PID (TERM, then KILL)."""

    def __init__(self, argv: list[str], **kw: Any):
        self.proc = subprocess.Popen(argv, **kw)
        self.pid = self.proc.pid

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        return self.proc.returncode


@pytest.fixture
def fleet(lab: Any, make_host: Any, home: Path) -> dict[str, Any]:
    train = make_host("train-node", gpus=2, ghost_mib={1: 300})
    worker = train.spawn_holder(gpus=[0], mib=716, title="VLLM::Worker")
    wsl = make_host("bigmama", gpus=1, wsl2=True, gpu_name="NVIDIA GeForce RTX 5090",
                    total_mib=32607, reserved_mib=0, ghost_mib=1680)
    garbled = make_host("garbled", gpus=1)
    dead = lab.dead_host("old-node")
    inv = lab.inventory_yaml([train, wsl, garbled, dead], connect_timeout=2,
                             bigmama={"unattributed_mib": 1680},
                             garbled={"python": "/bin/echo"})  # the "agent" prints its argv
    return {"inv": inv, "train": train, "worker": worker, "wsl": wsl, "home": home}


def start_serve(home: Path, inv: Path, *args: str) -> tuple[Started, str]:
    """`gpufleet serve --listen 127.0.0.1:0 ARGS`; returns it and its base URL (from stderr)."""
    serve = Started(GPUFLEET + ["-i", str(inv), "serve", "--listen", "127.0.0.1:0", *args],
                    env=child_env(home), cwd=str(home), stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert serve.proc.stderr is not None
    line = serve.proc.stderr.readline()
    m = re.match(r"gpufleet: serving (http://127\.0\.0\.1:\d+)/metrics for \d+ hosts", line)
    if m is None:
        serve.stop()
        raise AssertionError(f"serve said {line!r}; stderr: {serve.proc.stderr.read()}")
    return serve, m.group(1)


def metric_lines(text: str, name: str) -> dict[str, float]:
    """{labels text: value} of one metric's samples in an exposition."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def refreshes(base: str) -> float:
    code, body = get(base + "/metrics")
    if code != 200:
        return 0
    return sum(metric_lines(body.decode(), "gpufleet_refreshes_total").values())


def logins(host: Any) -> int:
    return (host.dir / "sshd.log").read_text().count("Accepted publickey")


def connection_sshds(host: Any) -> list[int]:
    """The per-connection sshd processes of the host (children of its listening sshd)."""
    parent, out = sshd_pid(host), []
    for entry in host.path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(entry.name))
    return out


def promql(base: str, query: str) -> list[dict[str, Any]]:
    code, body = get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    assert code == 200, body
    doc = json.loads(body)
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def test_prometheus_scrapes_serve_and_promql_returns_the_labs_numbers(fleet: dict, tmp_path: Path
                                                                    ) -> None:
    prometheus = need(PROMETHEUS, "prometheus")
    train, worker = fleet["train"], fleet["worker"]
    # a clean of GPU 1 (300 MiB nobody holds: it stays, the verdict says so) for the last-clean
    # series; GPU 0's worker is outside the scope and untouched
    t0 = time.time()
    cleaned = run_gpufleet(fleet["home"], fleet["inv"], "clean", "--host", "train-node", "--gpus",
                           "1", "--yes", "--json", "--timeout", "1", "--grace", "1")
    t1 = time.time()
    verdict = cleaned.host("train-node")["verdict"]
    assert verdict not in ("clean", "planned") and train.alive(worker), str(cleaned)
    before = {h: logins(fleet[h]) for h in ("train", "wsl")}  # spawn_holder, clean log in too
    serve, base = start_serve(fleet["home"], fleet["inv"], "--max-age", "2", "--per-process")
    prom: Optional[Started] = None
    try:
        wait_for(lambda: get(base + "/healthz")[0] == 200, 60, "serve's first refresh")
        health = json.loads(get(base + "/healthz")[1])
        assert (health["ok"], health["hosts"], health["hosts_up"]) == (True, 4, 2), health
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                          f"rule_files: ['{RULES}']\n"
                          "scrape_configs:\n  - job_name: gpufleet\n"
                          f"    static_configs: [{{targets: ['{base[len('http://'):]}']}}]\n")
        prom = Started([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}"], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        papi = f"http://127.0.0.1:{port}"
        wait_for(lambda: promql(papi, 'up{job="gpufleet"} == 1') if _ok(papi + "/-/ready")
                 else None, 60, "prometheus scraping serve")

        def value(query: str) -> dict[str, float]:
            return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
                    for r in promql(papi, query)}

        wsl = value('gpufleet_gpu_expected_unattributed_memory_bytes{host="bigmama"}')
        assert list(wsl.values()) == [1680 * MIB], wsl
        assert list(value('gpufleet_gpu_unattributed_memory_bytes{host="bigmama"}').values()) == [1680 * MIB]
        listed = value('sum by (gpu) (gpufleet_gpu_holders{host="train-node",source="listed"})')
        assert {json.loads(k)["gpu"]: v for k, v in listed.items()} == {"0": 1, "1": 0}
        used = train.gpu_used()
        unattr = value('gpufleet_gpu_unattributed_memory_bytes{host="train-node"}')
        assert {json.loads(k)["gpu"]: v for k, v in unattr.items()} == {
            "0": (used[0] - 716) * MIB, "1": 300 * MIB}
        proc = promql(papi, f'gpufleet_process_memory_used_bytes{{host="train-node",pid="{int(worker)}"}}')
        assert [(r["metric"]["name"], r["metric"]["gpu"], float(r["value"][1])) for r in proc] == [
            ("VLLM::Worker", "0", 716 * MIB)]
        assert proc[0]["metric"]["UUID"].startswith("GPU-") and proc[0]["metric"]["Hostname"] == "train-node"
        up = {r["metric"]["host"]: (float(r["value"][1]), r["metric"].get("reason", ""))
              for r in promql(papi, "gpufleet_up")}
        assert up == {"train-node": (1, ""), "bigmama": (1, ""), "garbled": (0, "agent"),
                      "old-node": (0, "refused")}, up
        # the shipped rule fires for the dead host and the garbled one (for: 0s in the test? no:
        # the rules say 5m, so the alert is pending, and pending is what Prometheus shows)
        wait_for(lambda: {a["labels"]["host"] for a in json.loads(get(papi + "/api/v1/alerts")[1])
                          ["data"]["alerts"] if a["labels"]["alertname"] == "GpufleetHostDown"}
                 == {"garbled", "old-node"}, 30, "GpufleetHostDown pending for the two failed hosts")

        last = promql(papi, 'gpufleet_last_clean_verdict{host="train-node"}')
        assert [(r["metric"]["verdict"], float(r["value"][1])) for r in last] == [(verdict, 1)]
        when = value('gpufleet_last_clean_timestamp_seconds{host="train-node"}')
        assert len(when) == 1 and t0 <= list(when.values())[0] <= t1, (t0, when, t1)
        # every query of the shipped dashboard runs, and finds series over the lab
        for expr in dashboard_queries():
            assert promql(papi, expr.replace("$host", ".*")), expr

        # persistent sessions: many refreshes, at most one login per reachable host: none on
        # train-node, whose connection the clean above kept (ssh_persist, on by default)
        at = refreshes(base)
        wait_for(lambda: refreshes(base) >= at + 3, 60, "three more refreshes")
        assert {h: logins(fleet[h]) - before[h] for h in before} == {"train": 0, "wsl": 1}
        # a dropped connection is reconnected on the next refresh
        for pid in connection_sshds(train):
            train.kill(pid, signal.SIGKILL)
        wait_for(lambda: logins(train) == before["train"] + 1, 60, "the reconnect")
        wait_for(lambda: value('gpufleet_up{host="train-node"}') and
                 list(value('gpufleet_up{host="train-node"}').values()) == [1], 30, "train-node up again")
        # a host that goes down keeps its Hostname label (serve's last known), reason = its kind
        fleet["wsl"].stop()

        def wsl_up() -> dict[str, float]:
            return {k: v for k, v in metric_lines(get(base + "/metrics")[1].decode(),
                                                  "gpufleet_up").items() if 'host="bigmama"' in k}
        wait_for(lambda: list(wsl_up().values()) == [0], 60, "bigmama down")
        (labels,) = wsl_up()
        assert 'Hostname="bigmama"' in labels and 'reason="' in labels and 'reason=""' not in labels
        # read-only: nothing but GET/HEAD, nothing but the documented paths
        assert get(base + "/metrics", method="POST")[0] == 405
        assert get(base + "/nothing-here")[0] == 404
    finally:
        if prom is not None:
            prom.stop()
        assert serve.stop() == 0  # SIGTERM: a clean exit


def test_promtool_accepts_the_exposition_and_the_rules(fleet: dict) -> None:
    promtool = need(PROMTOOL, "prometheus")
    run = run_gpufleet(fleet["home"], fleet["inv"], "export", "--per-process")  # the defaults
    assert run.rc == 0, str(run)
    assert 'gpufleet_up{Hostname="",host="old-node",reason="refused"} 0.0' in run.stdout
    lint = subprocess.run([promtool, "check", "metrics"], input=run.stdout, capture_output=True,
                          text=True, timeout=60)
    assert (lint.returncode, lint.stdout, lint.stderr) == (0, "", ""), lint
    # dcgm-exporter's own modelName (--model-label) is camelCase: promtool says so, and nothing else
    dcgm = run_gpufleet(fleet["home"], fleet["inv"], "export", "--model-label", "modelName")
    assert 'modelName="' in dcgm.stdout and 'model_name="' not in dcgm.stdout
    lint = subprocess.run([promtool, "check", "metrics"], input=dcgm.stdout,
                          capture_output=True, text=True, timeout=60)
    complaints = {line.split(" ", 1)[1] for line in (lint.stdout + lint.stderr).splitlines() if line}
    assert complaints == {"label names should be written in 'snake_case' not 'camelCase'"}, lint
    rules = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60)
    assert rules.returncode == 0 and "SUCCESS" in rules.stdout, rules


def test_node_exporter_serves_the_textfile(fleet: dict, tmp_path: Path) -> None:
    exporter = need(NODE_EXPORTER, "prometheus-node-exporter")
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    run = run_gpufleet(fleet["home"], fleet["inv"], "export", "--textfile", str(textdir))
    assert run.rc == 0 and run.stdout == "", str(run)
    assert sorted(p.name for p in textdir.iterdir()) == ["gpufleet.prom"]
    assert oct((textdir / "gpufleet.prom").stat().st_mode & 0o777) == "0o644"
    port = free_port()
    node = Started([exporter, f"--web.listen-address=127.0.0.1:{port}",
                    f"--collector.textfile.directory={textdir}", "--collector.disable-defaults",
                    "--collector.textfile"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _ok(f"http://127.0.0.1:{port}/metrics"), 30, "node_exporter")
        text = get(f"http://127.0.0.1:{port}/metrics")[1].decode()
    finally:
        node.stop()
    expected = metric_lines(text, "gpufleet_gpu_expected_unattributed_memory_bytes")
    assert [v for k, v in expected.items() if 'host="bigmama"' in k] == [1680 * MIB], text
    assert [k for k, v in metric_lines(text, "gpufleet_up").items() if v == 0] == [
        k for k in metric_lines(text, "gpufleet_up") if 'host="garbled"' in k or 'host="old-node"' in k]
    assert metric_lines(text, "node_textfile_scrape_error") == {"": 0.0}


def _ok(url: str) -> bool:
    try:
        return get(url, timeout=2)[0] == 200
    except OSError:
        return False


def test_a_failed_write_leaves_the_old_file_and_no_temporary(fleet: dict, tmp_path: Path) -> None:
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    first = run_gpufleet(fleet["home"], fleet["inv"], "export", "--textfile", str(textdir))
    assert first.rc == 0, str(first)
    before = (textdir / "gpufleet.prom").read_bytes()
    assert len(before) > 4096

    def small_files() -> None:  # any file the CLI writes may be at most 4 KiB: the write fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    argv = GPUFLEET + ["-i", str(fleet["inv"]), "export", "--textfile", str(textdir)]
    res = subprocess.run(argv, env=child_env(fleet["home"]), cwd=str(fleet["home"]),
                         capture_output=True, text=True, timeout=180, preexec_fn=small_files)
    assert res.returncode == 1, res
    assert res.stderr.splitlines() == [
        f"gpufleet: error: cannot write {textdir / 'gpufleet.prom'}: File too large"], res
    assert sorted(p.name for p in textdir.iterdir()) == ["gpufleet.prom"]
    assert (textdir / "gpufleet.prom").read_bytes() == before


def test_bad_input_is_one_line_and_exit_2_before_any_host_is_contacted(fleet: dict, tmp_path: Path
                                                                      ) -> None:
    home, inv, train = fleet["home"], fleet["inv"], fleet["train"]
    seen = logins(train)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    cases = [
        (["export", "--textfile", str(tmp_path / "missing")], "no such directory"),
        (["export", "--textfile", str(not_a_dir)], "not a directory"),
        (["export", "--model-label", "Model"], "--model-label 'Model'"),
        (["export", "--per-process", "--process-labels", "pid,cmdline"], "--process-labels"),
        (["export", "--max-processes", "0"], "--max-processes '0'"),
        (["serve", "--listen", "127.0.0.1"], "expected HOST:PORT"),
        (["serve", "--listen", "127.0.0.1:99999"], "expected HOST:PORT"),
        (["serve", "--listen", "no such host.invalid:9835"], "--listen"),
        (["serve", "--max-age", "0"], "positive"),
        (["serve", "--max-age", "soon"], "not a number"),
    ]
    for args, fragment in cases:
        assert_one_line_error(run_gpufleet(home, inv, *args, timeout=60), fragment)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert_one_line_error(run_gpufleet(home, inv, "serve", "--listen", f"127.0.0.1:{port}",
                                           timeout=60), "Address already in use")
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "gflab-ro", str(readonly)],
                   check=True)
    try:
        assert_one_line_error(run_gpufleet(home, inv, "export", "--textfile", str(readonly)),
                              "not writable")
    finally:
        subprocess.run(["umount", str(readonly)], check=True)
    assert logins(train) == seen  # nothing was contacted


def test_serve_over_only_failing_hosts_answers_metrics_and_healthz_says_so(lab: Any, home: Path
                                                                          ) -> None:
    """No host answers: /metrics is still 200 (each host `up 0` with its reason, never a
    500), and /healthz is 503 saying why."""
    inv = lab.inventory_yaml([lab.dead_host("gone-a"), lab.dead_host("gone-b")], connect_timeout=2)
    serve, base = start_serve(home, inv, "--max-age", "1")
    try:
        wait_for(lambda: get(base + "/metrics")[0] == 200, 60, "the first refresh")
        code, body = get(base + "/metrics")
        up = metric_lines(body.decode(), "gpufleet_up")
        assert up == {'{Hostname="",host="gone-a",reason="refused"}': 0.0,
                      '{Hostname="",host="gone-b",reason="refused"}': 0.0}, body
        code, body = get(base + "/healthz")
        health = json.loads(body)
        assert code == 503 and (health["ok"], health["error"], health["hosts_up"]) == (
            False, "no host answered", 0), health
        assert get(base + "/healthz", method="HEAD")[0] == 503
    finally:
        assert serve.stop() == 0
