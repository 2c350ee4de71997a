"""A clean that cannot change anything does not wait, and its dirty reason is one short line
per GPU that names what holds the memory, never a GPU client (the real CLI over real SSH).

Which case waited: the memory wait ended early only when every GPU left over its threshold
held memory that nvidia-smi lists for processes the plan does not signal (the refused family
of test_family_lab: 1 s). Memory no listed process explains -- a driver's, another PID
namespace's (container hosts, whose holders are device-file holders only), WSL2's -- made the
agent wait its whole --timeout although nothing it signalled could free it (13 s with
--timeout 12; 52.9 s with the default timeout)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_helpers import (
    assert_no_traceback,
    home,  # noqa: F401  (fixture)
    run_gpufleet,
)

TIMEOUT = ("--grace", "1", "--timeout", "30")
LINE_MAX = 300  # a reason line per GPU, not one 700-character line


def clean(home: Path, inv: Path, *args: str) -> Any:
    return run_gpufleet(home, inv, "clean", "--all", "--audit-log", str(home / "audit.jsonl"), *args)


def reason_lines(text: str, host: str) -> list[str]:
    """The text output's reason lines of one host (``HOST: ...`` after the table)."""
    return [line[len(host) + 2:] for line in text.splitlines() if line.startswith(host + ": ")]


def test_memory_no_process_explains_is_dirty_at_once_and_never_blamed_on_the_monitor(
        lab: Any, make_host: Any, home: Path) -> None:
    host = make_host("ghost-node", gpus=2, ghost_mib={0: 5000})
    monitor = host.spawn_monitor(title="nvtop")
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--yes", "--json", *TIMEOUT)
    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    doc = run.host("ghost-node")
    assert doc["verdict"] == "dirty" and doc["targets"] == [] and doc["signals"] == []
    assert [c["pid"] for c in doc["clients"]] == [monitor]
    assert doc["seconds"] < 10, doc["seconds"]  # --timeout is 30: no blind wait
    lines = doc["reason"].splitlines()
    assert lines[0].startswith("GPU 0: 5000 MiB left (threshold 64): 5000 MiB no process here "
                               "explains"), lines
    assert "the driver" in lines[0] and "another PID namespace" in lines[0], lines
    assert not any(line.startswith("GPU 1") for line in lines), lines  # GPU 1 is fine
    for line in lines:
        assert str(monitor) not in line and "nvtop" not in line, line
        assert len(line) <= LINE_MAX, line
    assert host.alive(monitor)

    text = clean(home, inv, "--yes", *TIMEOUT)
    assert text.rc == 1, str(text)
    shown = reason_lines(text.stdout, "ghost-node")
    assert shown == lines, text.stdout


def test_refused_family_on_a_container_host_does_not_wait_and_says_why_per_gpu(
        lab: Any, make_host: Any, home: Path) -> None:
    """nvidia-smi lists nobody (the host's holders are in another PID namespace): the family
    on GPUs 0-3 is refused for a clean of 0-1, so nothing is signalled -- and the clean used
    to wait its whole timeout for memory only those holders could free."""
    host = make_host("pod-node", gpus=4, hidden_pids=True)
    api = host.spawn_vllm(gpus=[0, 1, 2, 3], mib=3000)
    engine = api.children[0]
    workers = list(engine.children)
    monitor = host.spawn_monitor(title="nvtop")
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--gpus", "0-1", "--yes", "--json", *TIMEOUT)
    assert_no_traceback(run)
    assert run.rc == 1, str(run)
    doc = run.host("pod-node")
    assert doc["verdict"] == "dirty" and doc["targets"] == [] and doc["signals"] == []
    assert doc["seconds"] < 10, doc["seconds"]
    refused = {r["pid"] for r in doc["refused"]}
    assert {engine, *workers} <= refused, doc["refused"]
    lines = doc["reason"].splitlines()
    gpu_lines = [line for line in lines if line.startswith("GPU ")]
    assert [line.split(":")[0] for line in gpu_lines] == ["GPU 0", "GPU 1"], lines
    for line in gpu_lines:
        assert line.split(":")[1].strip().startswith("3000 MiB left"), line
        assert "refused: ambiguous" in line, line  # each refused holder with its reason
        assert str(monitor) not in line and "nvtop" not in line, line
        assert len(line) <= LINE_MAX, line
    assert all(host.alive(p) for p in (api, engine, *workers, monitor))
    assert host.gpu_used() == [3000] * 4


def test_refused_family_reason_is_a_line_per_gpu(lab: Any, make_host: Any, home: Path) -> None:
    """The family case that never waited (nvidia-smi lists the refused workers): still one
    line per GPU, each naming its worker and the refusal, in the text output too."""
    host = make_host("train-node", gpus=4)
    api = host.spawn_vllm(gpus=[0, 1, 2, 3], mib=3000)
    engine = api.children[0]
    workers = list(engine.children)
    monitor = host.spawn_monitor(title="nvtop")
    inv = lab.inventory_yaml([host])

    run = clean(home, inv, "--host", "train-node", "--gpus", "0-1", "--yes", *TIMEOUT)
    assert_no_traceback(run)
    assert run.rc == 1 and run.seconds < 10, str(run)
    lines = reason_lines(run.stdout, "train-node")
    gpu_lines = [line for line in lines if line.startswith("GPU ")]
    assert len(gpu_lines) == 2, run.stdout
    why = "refused: its family (root PID %d VLLM::EngineCore_DP0) also uses GPU 2,3" % engine
    for n, line in enumerate(gpu_lines):
        assert line.startswith("GPU %d: 3000 MiB left (threshold 73): PID %d "
                               "VLLM::Worker_TP%d (3000 MiB)" % (n, workers[n], n)), line
        assert why in line and "--include-spanning" in line, line
        assert str(monitor) not in line and len(line) <= LINE_MAX, line
    assert all(host.alive(p) for p in (api, engine, *workers, monitor))
