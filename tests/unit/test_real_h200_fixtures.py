"""The pure core replayed on what a real 2x H200 machine produced (tests/fixtures/real-h200).

Recorded by tests/gpu/gpu_scenario.py (docs/real-gpu.md): a vLLM-like family
(VLLM::EngineCore_DP0 + two VLLM::Worker) and a SIGTERM-ignoring holder on GPU 0, a trainer on
GPU 1 (CUDA_VISIBLE_DEVICES=1), an NVML poller holding every /dev/nvidiaN. Each cli-*.json holds
one `gpufleet` run: its argv, exit code, stdout, and the raw agent exchanges behind it
(request + document). These tests rebuild each output from those documents with the pure core
and check it against what the CLI printed, and the documents against nvidia-smi's own text
captured at the same time; the lab's fake nvidia-smi is checked against the real text too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpufleet.ops.clean import HostClean
from gpufleet.core.fit import fit_report, need_from_options, parse_gpus
from gpufleet.core.ledger import ledger
from gpufleet.core.model import HostResult, parse_snapshot
from gpufleet.core.plan import make_plan, to_request
from gpufleet.remote import agent
from gpufleet.core.hostwarnings import host_warnings
from gpufleet.render.common import fmt_mib
from gpufleet.render.status import status_document, status_table
from gpufleet.render.clean import clean_document
from gpufleet.core.verdict import make_verdict

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "real-h200"
FAKE = REPO / "tests" / "lab" / "fake_nvidia_smi.py"
HOST = "h200"
GPU_FIELDS = ["index", "uuid", "name", "pci.bus_id", "memory.used", "memory.total", "memory.free",
              "utilization.gpu", "driver_version", "memory.reserved"]


def load(name: str) -> Any:
    return json.loads((FIX / name).read_text())


def text(name: str) -> str:
    return (FIX / name).read_text()


def agent_doc(cli: dict, mode: str = "snapshot") -> dict:
    docs = [x["doc"] for x in cli["agent"] if x["request"].get("mode") == mode]
    assert len(docs) == 1, "expected one %s exchange, got %d" % (mode, len(docs))
    return docs[0]


def named_apps(csv: str) -> list[dict]:
    """Rows of ``--query-compute-apps=pid,process_name,used_memory,gpu_uuid`` (what the agent
    asked when these were captured) through the agent's parser of its query now, which has no
    process_name (names come from /proc): the name column is taken out for the parser and put
    back beside its row for the comparisons. No name in these captures holds a comma."""
    rows = [line.split(", ") for line in csv.splitlines() if line.strip()]
    assert all(len(r) == 4 for r in rows), rows
    apps, skipped, rejected = agent.parse_apps_csv(
        "".join("%s, %s, %s\n" % (pid, used, uuid) for pid, _, used, uuid in rows))
    assert (skipped, rejected) == (0, [])
    return [dict(app, process_name=row[1]) for app, row in zip(apps, rows)]


def smi(tag: str) -> tuple[dict[int, dict], list[dict]]:
    """nvidia-smi's own numbers captured at `tag`, through the agent's parsers."""
    gpus = agent.parse_gpu_csv(text("smi-%s-query-gpu.csv" % tag), GPU_FIELDS)
    return {g["index"]: g for g in gpus}, named_apps(text("smi-%s-compute-apps.csv" % tag))


def assert_recorded_in(recorded: Any, rebuilt: Any, path: str = "") -> None:
    """Every value the CLI printed then is what the core makes now from the same agent
    documents. Keys may be added to the JSON contract, never renamed: extra keys in ``rebuilt``
    are fine. "seconds" are timings of that run, not data."""
    rebuilt = json.loads(json.dumps(rebuilt)) if not path else rebuilt
    if isinstance(recorded, dict):
        assert isinstance(rebuilt, dict), path
        for key, value in recorded.items():
            if key == "seconds":
                continue
            assert key in rebuilt, "%s.%s missing" % (path, key)
            assert_recorded_in(value, rebuilt[key], "%s.%s" % (path, key))
    elif isinstance(recorded, list):
        assert isinstance(rebuilt, list) and len(rebuilt) == len(recorded), path
        for n, (a, b) in enumerate(zip(recorded, rebuilt)):
            assert_recorded_in(a, b, "%s[%d]" % (path, n))
    else:
        assert recorded == rebuilt, "%s: recorded %r, rebuilt %r" % (path or "doc", recorded, rebuilt)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return load("manifest.json")


@pytest.fixture(scope="module")
def status_cli() -> dict:
    return load("cli-status-json.json")


@pytest.fixture(scope="module")
def status_snap(status_cli):
    return parse_snapshot(agent_doc(status_cli))


@pytest.fixture(scope="module")
def clean_cli() -> dict:
    return load("cli-clean.json")


def plan_of(clean_cli: dict):
    before = parse_snapshot(agent_doc(clean_cli))
    return before, make_plan(before, (0,), unattributed_mib=0, tolerance_mib=64, host=HOST)


# --- status ------------------------------------------------------------------------------------


def test_status_json_is_the_core_rendering_of_its_agent_document(status_cli, status_snap):
    assert status_cli["exit_code"] == 0
    printed = json.loads(status_cli["stdout"])
    rebuilt = status_document([HostResult(host=HOST, ok=True, snapshot=status_snap)], {HOST: 0})
    # Changed on purpose since the capture: unexpected_unattributed_mib no longer counts the
    # driver's own share for the listed processes (driver_allowance_mib, a key added since).
    for old, new in zip(printed["hosts"][0]["gpus"], rebuilt["hosts"][0]["gpus"]):
        assert old["unexpected_unattributed_mib"] == old["unattributed_mib"] > 0
        old["unexpected_unattributed_mib"] = max(
            0, old["unattributed_mib"] - new["driver_allowance_mib"])
        assert old["unexpected_unattributed_mib"] == 0  # 26 MiB with 4 processes, 9 with 1
    assert_recorded_in(printed, rebuilt)


def test_status_table_is_the_core_rendering_of_its_agent_document():
    cli = load("cli-status-text.json")
    snap = parse_snapshot(agent_doc(cli))
    table = status_table([HostResult(host=HOST, ok=True, snapshot=snap)], {HOST: 0})
    # the layout and the units changed since (MiB throughout; a holder is PID, user, MiB,
    # what runs): the numbers the CLI printed then are all there now, in MiB
    for a in snap.compute_apps:
        name = snap.processes[a.pid].name
        assert f"{name} {a.pid} {fmt_mib(a.used_mib)}" in cli["stdout"], a
        assert f"{a.pid} root {a.used_mib}MiB " in table, a
    for gpu in snap.gpus:
        assert f"{fmt_mib(gpu.memory_used_mib)} / {fmt_mib(gpu.memory_total_mib)}" in cli["stdout"]
        assert f"{gpu.memory_used_mib} / {gpu.memory_total_mib}" in table
    for old, new in (("26MiB", " 26  "), ("9MiB", " 9  ")):  # unattributed, GPU 0 and 1
        assert old in cli["stdout"] and new in table, (old, new)
    assert table.count("VLLM::Worker") == cli["stdout"].count("VLLM::Worker") == 2
    summary = [line for line in table.splitlines() if line.startswith("hosts: ")]
    # hosts/GPUs summary, and the health counts added since (that agent had no readings)
    assert summary == [cli["stdout"].splitlines()[-1] + "; health: 2 UNKNOWN"]
    # the host warning the agent sent is a line of its own (stderr), never in the table
    assert "warning" not in table
    assert host_warnings(HOST, snap) == [f"{HOST}: warning: {w}" for w in snap.warnings]


def test_status_numbers_are_nvidia_smis_own(status_snap):
    """The agent's snapshot was taken between two nvidia-smi captures that agree."""
    before, apps_before = smi("status-before")
    after, apps_after = smi("status-after")
    assert apps_before == apps_after
    assert {i: g["memory_used_mib"] for i, g in before.items()} == \
        {i: g["memory_used_mib"] for i, g in after.items()}
    for gpu in status_snap.gpus:
        row = before[gpu.index]
        assert (gpu.uuid, gpu.memory_used_mib, gpu.memory_total_mib, gpu.memory_reserved_mib) == \
            (row["uuid"], row["memory_used_mib"], row["memory_total_mib"], row["memory_reserved_mib"])
    got = sorted((a.pid, a.process_name, a.used_mib, a.gpu_uuid) for a in status_snap.compute_apps)
    want = sorted((a["pid"], a["process_name"], a["used_mib"], a["gpu_uuid"]) for a in apps_before)
    assert got == want


def test_holders_are_on_their_gpus_with_vllm_names(status_snap, manifest):
    for pid in manifest["gpu0"]:
        assert status_snap.gpu_indices_of_app(pid) == (0,)
    assert status_snap.gpu_indices_of_app(manifest["trainer"]) == (1,)
    procs = status_snap.processes
    engine = procs[manifest["engine"]]
    assert (engine.comm, engine.name) == ("VLLM::EngineCor", "VLLM::EngineCore_DP0")
    assert [procs[w].name for w in manifest["workers"]] == ["VLLM::Worker", "VLLM::Worker"]
    assert all(procs[w].ppid == manifest["engine"] for w in manifest["workers"])


def test_every_cuda_process_holds_every_gpus_device_file(status_snap, manifest):
    """Measured again: CUDA_VISIBLE_DEVICES=1 still opens /dev/nvidia0; NVML does too."""
    holders = {h.pid: h for h in status_snap.holders}
    for pid in manifest["gpu0"] + [manifest["trainer"], manifest["poller"]]:
        assert status_snap.holder_gpu_indices(holders[pid]) == (0, 1)
    assert manifest["poller"] not in status_snap.listed_pids()


def test_ledger_unattributed_is_a_few_mib_per_cuda_process(status_snap):
    """used = listed + unattributed; on the real driver the unattributed part is not 0 (the
    lab's fake shows 0 unless unlisted_mib_* are set): 26 MiB with 4 processes, 9 with 1."""
    rows = {r.index: r for r in ledger(status_snap)}
    for gpu in status_snap.gpus:
        listed = sum(a.used_mib for a in status_snap.apps_on(gpu.index))
        row = rows[gpu.index]
        assert row.attributed_mib == listed
        assert row.used_mib == listed + row.unattributed_mib
        n = len(status_snap.apps_on(gpu.index))
        assert 0 < row.unattributed_mib <= 3 + 6 * n
    assert all(r.unexpected_mib < 64 for r in rows.values())  # under clean's default tolerance


# --- clean -------------------------------------------------------------------------------------


def test_plan_from_the_real_snapshot(clean_cli, manifest):
    before, plan = plan_of(clean_cli)
    waves = {t.pid: (t.wave, t.family_root) for t in plan.targets}
    engine, stubborn = manifest["engine"], manifest["stubborn"]
    assert waves == {engine: (0, engine), stubborn: (0, stubborn),
                     **{w: (1, engine) for w in manifest["workers"]}}
    assert manifest["trainer"] not in waves and plan.refusal_of(manifest["trainer"]) is None
    # the NVML poller (no CUDA, no memory; real H200) is a GPU client, not a refusal (it holds no memory)
    assert plan.refusal_of(manifest["poller"]) is None
    assert [c.pid for c in plan.clients] == [manifest["poller"]]

    # the request the CLI sent is the one this plan makes
    sent = next(x["request"] for x in clean_cli["agent"] if x["request"].get("mode") == "clean")
    made = to_request(plan, grace_s=sent["grace_s"], timeout_s=sent["timeout_s"], shm=False,
                      reset=False, operator=sent["operator"], lock_path=sent["lock_path"])
    # (recorded before the request named each target's program and owner for the settle
    # window: the identity and order are what the recording can check)
    keys = ("pid", "starttime", "wave")
    assert sorted(tuple(t[k] for k in keys) for t in made["targets"]) == \
        sorted(tuple(t[k] for k in keys) for t in sent["targets"])
    assert made["threshold_mib"] == sent["threshold_mib"] and made["scope"] == sent["scope"]


def test_full_clean_of_the_real_snapshot_leaves_the_nvml_poller_alone(clean_cli, manifest):
    """On the real H200 a full-scope clean signalled the pynvml poller (it died,
    exit -15). Its snapshot has no maps (older agent): the memory evidence alone decides."""
    before, _ = plan_of(clean_cli)
    full = make_plan(before)
    assert full.full_scope and full.target(manifest["poller"]) is None
    assert manifest["poller"] in {c.pid for c in full.clients}
    assert {manifest["engine"], manifest["stubborn"], manifest["trainer"]} <= full.target_pids


def test_clean_document_signals_and_verdict(clean_cli, manifest):
    before, plan = plan_of(clean_cli)
    doc = agent_doc(clean_cli, "clean")
    sigs = [(s["pid"], s["signal"], s["outcome"]) for s in doc["signals"]]
    stubborn = manifest["stubborn"]
    assert (stubborn, "TERM", "sent") in sigs and (stubborn, "KILL", "sent") in sigs
    assert (manifest["engine"], "TERM", "sent") in sigs
    # the workers left with their engine before their own wave came
    assert {(w, "TERM", "gone") for w in manifest["workers"]} <= set(sigs)
    assert doc["memory_wait"]["ok"] is True
    verdict = make_verdict(plan, doc, before)
    post, post_apps = smi("round1-post")
    assert verdict.verdict == "clean"
    assert verdict.left_mib == post[0]["memory_used_mib"]
    assert verdict.freed_mib == smi("round1-pre")[0][0]["memory_used_mib"] - verdict.left_mib
    # the trainer on GPU 1 kept its memory through the clean
    trainer = manifest["trainer"]
    pre_apps = smi("round1-pre")[1]
    assert [a["used_mib"] for a in pre_apps if a["pid"] == trainer] == \
        [a["used_mib"] for a in post_apps if a["pid"] == trainer]
    assert not [a for a in post_apps if a["gpu_uuid"] == post[0]["uuid"]]


def test_clean_json_is_the_core_rendering_of_its_agent_documents(clean_cli, manifest):
    before, plan = plan_of(clean_cli)
    doc = agent_doc(clean_cli, "clean")
    verdict = make_verdict(plan, doc, before)
    result = HostClean(host=HOST, ok=verdict.verdict == "clean", verdict=verdict.verdict,
                       reason=verdict.reason, before=HostResult(host=HOST, ok=True, snapshot=before),
                       plan=plan, agent_doc=doc, after=parse_snapshot(doc["after"]),
                       verdict_detail=verdict.as_dict())
    assert clean_cli["exit_code"] == 0
    assert_recorded_in(_since_issue_10(json.loads(clean_cli["stdout"]), manifest["poller"]),
                       clean_document([result], False))


def _since_issue_10(recorded: dict, poller: int) -> dict:
    """The recorded run predates the GPU-client rule: the NVML poller it refused as "ambiguous" is a GPU
    client now (plan "clients", not "refused"), and the fd note says the true reason."""
    host = recorded["hosts"][0]
    host["refused"] = [r for r in host["refused"] if r["pid"] != poller]
    detail = host["verdict_detail"]
    detail["survivors"] = [s for s in detail["survivors"] if s["pid"] != poller]
    notes = host["plan_notes"]
    old = notes.index("cannot read every process's file descriptors (not root): other users' "
                      "device-file holders may be missing")
    notes[old] = ("cannot read every process's file descriptors (this agent did not say which; "
                  "running as root): device-file holders among them may be missing")
    notes.append("1 GPU client(s) with device files open but no evidence of GPU memory "
                 "(monitors, exporters, nvidia-smi runs) are left alone: %d python3" % poller)
    return recorded


# --- fit ---------------------------------------------------------------------------------------


def _option(argv: list[str], name: str, default: Any = None) -> Any:
    return argv[argv.index(name) + 1] if name in argv else default


@pytest.mark.parametrize("name,exit_code", [("fits", 0), ("too-big", 1), ("trainer-gpu", 1)])
def test_fit_json_is_the_core_arithmetic_on_its_snapshot(name, exit_code):
    cli = load("cli-fit-%s.json" % name)
    argv = cli["argv"]
    need = need_from_options(weights_gib=float(_option(argv, "--weights-gib")),
                             activations_gib=float(_option(argv, "--activations-gib", 0.0)))
    snap = parse_snapshot(agent_doc(cli))
    report = fit_report([HostResult(host=HOST, ok=True, snapshot=snap)], need,
                        gpus=parse_gpus(_option(argv, "--gpus")))
    assert cli["exit_code"] == report.exit_code == exit_code
    assert_recorded_in(json.loads(cli["stdout"]), report.document)


def test_fit_startup_verdicts_match_what_cuda_measured():
    """results: a fresh CUDA process's mem_get_info on each GPU, against fit's arithmetic."""
    results = load("scenario-results.json")
    for case in results["fit"]["cases"]:
        assert case["startup_ok"] == case["real_startup_ok"], case
        assert abs(case["total_gib"] - case["real_total_gib"]) < 0.002, case
        assert abs(case["vllm_free_gib"] - case["real_free_gib"]) < 0.01, case  # context 620 MiB


# --- the lab's fake against the real text --------------------------------------------------------


@pytest.fixture
def fake_root(tmp_path):
    (tmp_path / "procs").mkdir()
    started = []

    def run(config: dict, holders: list[tuple[str, int, int]]) -> str:
        """One sleeping process per holder (argv[0] = its name), registered as fakecuda does."""
        (tmp_path / "config.json").write_text(json.dumps(config))
        for name, gpu, mib in holders:
            p = subprocess.Popen([name, "60"], executable="/bin/sleep")
            started.append(p)
            with open("/proc/%d/stat" % p.pid) as f:
                st = int(f.read().rsplit(")", 1)[1].split()[19])
            rec = {"pid": p.pid, "starttime": st, "alloc": {str(gpu): mib}}
            (tmp_path / "procs" / ("%d.json" % p.pid)).write_text(json.dumps(rec))
        return str(tmp_path)

    yield run
    for p in started:
        p.kill()
        p.wait()


def _fake(root: str, *args: str) -> str:
    env = dict(os.environ, FAKEGPU_ROOT=root)
    return subprocess.run([sys.executable, str(FAKE)] + list(args), capture_output=True, text=True,
                          env=env, check=True).stdout


def test_fake_reproduces_the_real_capture_with_the_measured_overhead(fake_root):
    """The same holders, names and per-process memory as the real round-1 capture: with
    unlisted_mib_base=2 and unlisted_mib_per_process=6 the fake's memory.used is the real one
    within 1 MiB, its process rows are the real rows, and without them it is off by the overhead."""
    real, real_apps = smi("round1-pre")
    uuids = [real[0]["uuid"], real[1]["uuid"]]
    index_of = {g["uuid"]: i for i, g in real.items()}
    holders = [(a["process_name"], index_of[a["gpu_uuid"]], a["used_mib"]) for a in real_apps]
    config = {"gpus": 2, "name": "NVIDIA H200", "total_mib": 143771, "reserved_mib": 616,
              "uuids": uuids, "unlisted_mib_base": 2, "unlisted_mib_per_process": 6}
    root = fake_root(config, holders)
    fields = "--query-gpu=" + ",".join(GPU_FIELDS)
    fake = {g["index"]: g for g in agent.parse_gpu_csv(
        _fake(root, fields, "--format=csv,noheader,nounits"), GPU_FIELDS)}
    for i in real:
        assert abs(fake[i]["memory_used_mib"] - real[i]["memory_used_mib"]) <= 1
        assert fake[i]["memory_free_mib"] + fake[i]["memory_used_mib"] + 616 == 143771
    fake_apps = named_apps(_fake(root, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid",
                                 "--format=csv,noheader,nounits"))
    assert sorted((a["process_name"], a["used_mib"], a["gpu_uuid"]) for a in fake_apps) == \
        sorted((a["process_name"], a["used_mib"], a["gpu_uuid"]) for a in real_apps)
    # the table's process rows, PIDs aside, are the real ones
    def rows(table: str) -> list[str]:
        return [line[:17] + line[33:] for line in table.splitlines()
                if line.startswith("|") and " C " in line and "MiB |" in line]
    assert sorted(rows(_fake(root))) == sorted(rows(text("smi-round1-pre-table.txt")))
    config.update(unlisted_mib_base=0, unlisted_mib_per_process=0)  # the default: exact sums
    (Path(root) / "config.json").write_text(json.dumps(config))
    plain = {g["index"]: g for g in agent.parse_gpu_csv(
        _fake(root, fields, "--format=csv,noheader,nounits"), GPU_FIELDS)}
    assert [real[i]["memory_used_mib"] - plain[i]["memory_used_mib"] for i in (0, 1)] == [26, 9]
