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


def test_last_cleans_reads_the_last_verdict_per_host_and_counts(tmp_path) -> None:
    path = str(tmp_path / "audit.jsonl")
    sig = audit.signal_records("a", "op", [{"pid": 5, "signal": "TERM", "outcome": "sent"}], {})
    audit.append(path, [audit.verdict_record("a", "op", "clean", None, 0, when=1_800_000_000.25)])
    audit.append(path, sig)
    audit.append(path, [audit.verdict_record("b", "op", "unreachable", "refused", 0, when=1_800_000_100.0)])
    audit.append(path, [audit.verdict_record("a", "op", "dirty", "GPU 0 still 700MiB", 1,
                                             when=1_800_000_200.5)])
    with open(path, "a") as fh:  # a torn line and a foreign one are skipped, never an error
        fh.write('{"event": "verdict", "host": "a", "verd\n{"event": "verdict", "host": 3}\n')
    got = audit.last_cleans(path)
    assert got["a"].verdict == "dirty" and abs(got["a"].time - 1_800_000_200.5) < 1e-6
    assert got["a"].counts == {"clean": 1, "dirty": 1}
    assert (got["b"].verdict, got["b"].time, got["b"].counts) == ("unreachable", 1_800_000_100.0,
                                                                   {"unreachable": 1})
    assert set(got) == {"a", "b"}


def test_last_cleans_of_a_missing_log_is_none(tmp_path) -> None:
    assert audit.last_cleans(str(tmp_path / "nope.jsonl")) == {}


def test_last_cleans_reads_only_the_tail_of_a_huge_log(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "audit.jsonl")
    audit.append(path, [audit.verdict_record("old", "op", "clean", None, 0, when=1.0)])
    audit.append(path, [{"pid": i, "cmdline": "x" * 200} for i in range(50)])
    audit.append(path, [audit.verdict_record("new", "op", "clean", None, 0, when=2.0)])
    monkeypatch.setattr(audit, "READ_TAIL_BYTES", 2000)
    assert set(audit.last_cleans(path)) == {"new"}
