"""In the lab: a vLLM family is cleaned as a whole or not at all.

Killing one VLLM::Worker ends its EngineCore (the family root, device files only), and with it
every worker, including those on GPUs outside the scope. A scope that cuts the family signals
none of it and says why; --include-spanning plans the whole family, the EngineCore first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cli_helpers import (
    assert_no_traceback,
    home,  # noqa: F401  (fixture)
    run_gpufleet,
)

FAST = ("--grace", "1", "--timeout", "15")
WORKER_MIB = 3000


def clean(home: Path, inv: Path, *args: str) -> Any:
    return run_gpufleet(home, inv, "clean", "--all", "--audit-log", str(home / "audit.jsonl"), *args)


def test_a_scope_cutting_a_family_signals_nothing_and_says_why(lab: Any, make_host: Any,
                                                               home: Path) -> None:
    host = make_host("tp4-node", gpus=4)
    api = host.spawn_vllm(gpus=[0, 1, 2, 3], mib=WORKER_MIB)
    engine = api.children[0]
    workers = list(engine.children)
    family = [api, engine, *workers]
    inv = lab.inventory_yaml([host])
    why = (f"its family (root PID {engine} VLLM::EngineCore_DP0) also uses GPU 2,3, outside "
           "the scope")

    run = clean(home, inv, "--gpus", "0,1", "--yes", "--json", *FAST)
    assert_no_traceback(run)
    assert run.rc == 1, str(run)  # memory left on the scope: dirty, with the reason
    doc = run.host("tp4-node")
    assert doc["verdict"] == "dirty"
    assert doc["targets"] == [] and doc["signals"] == [], str(run)
    refused = {r["pid"]: r["reason"] for r in doc["refused"]}
    for pid in (engine, workers[0], workers[1]):
        assert refused[pid].startswith(why) and "--include-spanning" in refused[pid], refused
    assert not {workers[2], workers[3]} & set(refused)
    assert all(host.alive(p) for p in family), "a family member died"
    assert all(used >= WORKER_MIB for used in host.gpu_used())

    text = clean(home, inv, "--gpus", "0,1", "--yes", *FAST)
    assert_no_traceback(text)
    assert text.rc == 1 and " dirty " in text.stdout, str(text)
    assert (f"tp4-node: GPU 0: {WORKER_MIB} MiB left (threshold 73): PID {workers[0]} "
            f"VLLM::Worker_TP0 ({WORKER_MIB} MiB) refused: {why}") in text.stdout, text.stdout
    assert all(host.alive(p) for p in family), "a family member died"

    whole = clean(home, inv, "--gpus", "0,1", "--include-spanning", "--dry-run", "--json", *FAST)
    assert whole.rc == 0, str(whole)
    targets = {t["pid"]: t for t in whole.host("tp4-node")["targets"]}
    assert set(targets) == {engine, *workers}
    assert targets[engine]["wave"] == 0 and {targets[w]["wave"] for w in workers} == {1}
    assert all(host.alive(p) for p in family)
