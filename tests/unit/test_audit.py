"""The audit log: one JSON line per attempted signal, appended, never rewritten."""
from __future__ import annotations

import json
import multiprocessing

from gpufleet.ops import audit


def _writer(path: str, n: int) -> None:
    audit.append(path, ({"pid": i, "cmdline": "x" * 3000} for i in range(n)))


def test_records_from_agent_signals(tmp_path) -> None:
    recs = audit.signal_records("train-node", "joel@laptop",
                                [{"pid": 12, "starttime": 99, "signal": "TERM", "outcome": "sent", "t": 1.5}],
                                {12: "VLLM::Worker"}, started_at=1_000_000.0)
    assert recs == [{"time": "1970-01-12T13:46:41.500Z", "operator": "joel@laptop", "host": "train-node",
                     "pid": 12, "starttime": 99, "cmdline": "VLLM::Worker", "signal": "TERM", "outcome": "sent"}]


def test_append_creates_dirs_and_appends(tmp_path) -> None:
    path = str(tmp_path / "a" / "b" / "audit.jsonl")
    assert audit.append(path, [{"pid": 1}]) == 1
    assert audit.append(path, [{"pid": 2}, {"pid": 3}]) == 2
    lines = [json.loads(x) for x in open(path)]
    assert [x["pid"] for x in lines] == [1, 2, 3]


def test_concurrent_writers_never_interleave(tmp_path) -> None:
    path = str(tmp_path / "audit.jsonl")
    procs = [multiprocessing.Process(target=_writer, args=(path, 200)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    lines = open(path).read().splitlines()
    assert len(lines) == 800
    assert all(json.loads(line)["cmdline"] == "x" * 3000 for line in lines)


def test_non_ascii_cmdline_is_escaped(tmp_path) -> None:
    path = str(tmp_path / "audit.jsonl")
    audit.append(path, [{"cmdline": "trainer \udcff; rm -rf / \n"}])
    assert json.loads(open(path).read())["cmdline"] == "trainer \udcff; rm -rf / \n"
