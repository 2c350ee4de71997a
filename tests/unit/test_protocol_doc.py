"""docs/protocol.md against the real agent and controller, so the document cannot drift.

The snapshot tables: every key the agent writes is documented, every key documented "always"
(or "NVML", with NVML as the reader) is there, and "NVML" keys are absent when nvidia-smi read
the GPUs. The agent's own snapshot code runs here against the lab's fake libnvidia-ml.so.1 and
fake nvidia-smi, as tests/unit/test_agent_nvml.py does (no lab, no root). The requests table:
every key the controller's request builders send is documented, and every documented key is
one the agent's source reads.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import pytest

from test_agent_nvml import fake_smi, state, via_nvml, via_smi  # noqa: F401 (fixtures)
from test_fake_nvml import SCENARIOS, State

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
SECTION = "## The snapshot reply"
#: tables that describe the elements of another key too (the doc says so under its heading)
SAME_SHAPE = {"graphics_apps[]": "compute_apps[]"}


class Field(NamedTuple):
    name: str
    when: str
    opaque: bool  # a map whose keys are data (readings, indices), not fields
    inline: frozenset[str]  # keys named inline, `{a, b: [int]}`, for an object not tabled


def _inline_keys(*cells: str) -> frozenset[str]:
    for cell in cells:
        found = re.search(r"\{([^{}]*)\}", cell)
        if found:
            return frozenset(part.split(":")[0].strip() for part in found.group(1).split(","))
    return frozenset()


def documented() -> dict[str, dict[str, Field]]:
    """Object path ("snapshot", "facts", "gpus[]", ...) -> its fields, from the tables."""
    text = DOC.read_text()
    body = text[text.index(SECTION) + len(SECTION):]
    body = body[:body.index("\n## ")]
    tables: dict[str, dict[str, Field]] = {}
    current = None
    for line in body.splitlines():
        heading = re.match(r"#### `([^`]+)`", line)
        if heading:
            current = tables.setdefault(heading.group(1), {})
            continue
        if current is None or not line.startswith("| `"):
            continue
        names, kind, when, meaning = [c.strip() for c in line.strip("|").split(" | ", 3)]
        for name in re.findall(r"`([^`]+)`", names):
            current[name] = Field(name, when, kind.startswith("map"),
                                  _inline_keys(kind, meaning))
    for alias, shape in SAME_SHAPE.items():
        tables[alias] = tables[shape]
    return tables


def _path(parent: str, key: str, value: Any) -> str:
    if isinstance(value, list):
        return key + "[]"
    return key + "{}" if parent == "snapshot" and key == "processes" else key


def instances(doc: dict, tables: dict[str, dict[str, Field]]
              ) -> Iterator[tuple[str, str, dict]]:
    """(object path, where, the object) for every object in the snapshot: the document, each
    tabled key's object, each element of a tabled list or map."""
    yield "snapshot", "snapshot", doc
    for key, value in doc.items():
        path = _path("snapshot", key, value)
        if path not in tables:
            continue
        if isinstance(value, dict) and path.endswith("{}"):
            items = list(value.values())
        elif isinstance(value, list):
            items = value
        else:
            items = [value] if isinstance(value, dict) else []
        for i, item in enumerate(items):
            yield path, f"{path} #{i}", item


def problems(doc: dict, nvml: bool) -> list[str]:
    tables = documented()
    out = []
    for path in tables:
        if path != "snapshot" and path not in {_path("snapshot", k, v) for k, v in doc.items()}:
            if tables["snapshot"].get(path.rstrip("[]{}"), Field("", "", False, frozenset())).when \
                    in ("always",) + (("NVML",) if nvml else ()):
                out.append(f"{path}: documented, the agent wrote no such key")
    for path, where, obj in instances(doc, tables):
        fields = tables[path]
        for key, value in obj.items():
            field = fields.get(key)
            if field is None:
                out.append(f"{where}: {key!r} is not documented")
                continue
            nested = value if isinstance(value, dict) else (
                value[0] if isinstance(value, list) and value and isinstance(value[0], dict)
                else None)
            child = _path(path, key, value)
            if nested is None or field.opaque or (path == "snapshot" and child in tables):
                continue
            if not field.inline:
                out.append(f"{where}: {key!r} holds objects the doc neither tables nor names")
            elif set(nested) - field.inline:
                out.append(f"{where}: {key!r} has undocumented {sorted(set(nested) - field.inline)}")
        for field in fields.values():
            wanted = field.when == "always" or (field.when == "NVML" and nvml)
            if wanted and field.name not in obj:
                out.append(f"{where}: {field.name!r} ({field.when}) is missing")
            if field.when == "NVML" and not nvml and field.name in obj:
                out.append(f"{where}: {field.name!r} is NVML's, yet nvidia-smi read the GPUs")
    return out


def test_the_tables_are_read() -> None:
    tables = documented()
    assert {"snapshot", "facts", "gpus[]", "compute_apps[]", "processes{}", "holders[]",
            "mps[]", "kernel_log"} <= set(tables)
    assert tables["gpus[]"]["temperature_c"].when == "NVML"
    assert tables["gpus[]"]["nvml_errors"].opaque
    assert tables["processes{}"]["stuck_threads"].inline == {"tid", "wchan"}


def test_the_checker_sees_drift() -> None:
    doc = {"agent_version": 1, "mode": "snapshot", "surprise": 1, "facts": {"hostname": "h"}}
    found = problems(doc, nvml=False)
    assert "snapshot: 'surprise' is not documented" in found
    assert "snapshot: 'gpus' (always) is missing" in found
    assert "facts #0: 'kernel' (always) is missing" in found


SCENARIO_IDS = ["holders", "zombie_leader"]


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.__name__.strip("_") in SCENARIO_IDS],
                         ids=SCENARIO_IDS)
def test_the_doc_is_what_the_agent_writes(fake_nvml_library: Path, fake_smi: str,  # noqa: F811
                                          state: State, scenario: Any) -> None:  # noqa: F811
    scenario(state)
    nv = via_nvml(fake_nvml_library)
    assert nv["facts"]["gpu_source"] == "nvml" and nv["processes"]
    assert problems(nv, nvml=True) == []
    smi = via_smi(fake_smi)
    assert smi["facts"]["gpu_source"] == "nvidia-smi" and smi["gpus"]
    assert problems(smi, nvml=False) == []


# ------------------------------------------------------------------ requests


def documented_requests() -> set[str]:
    text = DOC.read_text()
    body = text[text.index("## Requests"):]
    body = body[:body.index("\n## ", 1)]
    return {name for line in body.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0])}


def test_every_request_key_the_controller_sends_is_documented_and_read_by_the_agent() -> None:
    from gpufleet.config.inventory import Host
    from gpufleet.core.model import parse_snapshot
    from gpufleet.core.plan import make_plan
    from gpufleet.ops.clean import CleanOptions, clean_request
    from gpufleet.ops.collect import snapshot_request
    from gpufleet.ops.live import watch_request

    host = Host(name="h")
    before = parse_snapshot(__import__("json").loads(
        (DOC.parents[1] / "tests" / "fixtures" / "scenarios" / "unit-vllm.json").read_text()))
    sent = set(snapshot_request(host)) | set(watch_request(host, 2.0, hold_first_s=5.0))
    sent |= set(clean_request(host, make_plan(before, stop_units=True),
                              CleanOptions(release_wait_s=2.0), before))
    sent |= {"stay", "idle_s"}  # a conversation's first snapshot (ops/clean.py, transport/conversation.py)
    documented = documented_requests()
    assert sent - documented == set()
    agent = "".join(p.read_text() for p in (DOC.parents[1] / "gpufleet" / "remote").glob("*.py"))
    assert {k for k in documented if f'"{k}"' not in agent} == set()
