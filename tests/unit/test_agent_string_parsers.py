"""The agent's hot parsers read text with string tests instead of regular expressions (a one-shot
snapshot must not import re: ~5 ms of every host's start). Each is checked here against the
pattern it replaced, kept below as the oracle, on recorded shapes and on many generated strings
built from the patterns' own pieces (seeded: the same strings every run)."""
from __future__ import annotations

import random
import re
from typing import Callable, Optional

import pytest

from gpufleet.remote import parse

# The patterns the agent used before (gpufleet/remote/parse.py), verbatim.
DEVICE_RE = re.compile(
    r"^/dev/(?:nvidia[0-9]+|nvidiactl|nvidia-uvm|nvidia-uvm-tools|nvidia-caps/[^/]+|dxg)$"
)
GPU_DEVICE_RE = re.compile(r"^/dev/nvidia([0-9]+)$")
BUS_RE = re.compile(r"^\s*([0-9A-Fa-f]+):([0-9A-Fa-f]+):([0-9A-Fa-f]+)\.([0-9A-Fa-f]+)\s*$")
INT_RE = re.compile(r"^(-?[0-9]+)(?:\s*(?:MiB|%))?$")
CONTAINER_PATTERNS = (
    (re.compile(r"docker-([0-9a-f]{12,})\.scope"), "docker"),
    (re.compile(r"/docker/([0-9a-f]{12,})"), "docker"),
    (re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,})"), "podman"),
    (re.compile(r"cri-containerd-([0-9a-f]{12,})\.scope"), "containerd"),
    (re.compile(r"/containerd/([^/]+)"), "containerd"),
    (re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,})\.scope"), "crio"),
    (re.compile(r"/lxc\.payload[./]([^/]+)"), "lxc"),
    (re.compile(r"/lxc/([^/]+)"), "lxc"),
)
HEX64_RE = re.compile(r"([0-9a-f]{64})")


def old_container_of(path: str) -> Optional[str]:
    if not path:
        return None
    if "kubepods" in path:
        m = HEX64_RE.search(path.rsplit("/", 1)[-1]) or HEX64_RE.search(path)
        return "k8s:" + m.group(1)[:12] if m else "kubepods"
    for regex, kind in CONTAINER_PATTERNS:
        m = regex.search(path)
        if m:
            ident = m.group(1)
            return kind + ":" + (ident if kind == "lxc" else ident[:12])
    return None


def old_bus(value: str) -> Optional[str]:
    m = BUS_RE.match(value) if value else None
    if not m:
        return None
    d, b, s, f = (int(g, 16) for g in m.groups())
    return "%04x:%02x:%02x.%x" % (d, b, s, f)


def old_int(value: str) -> object:
    v = parse.na(value)
    if v is None:
        return None
    m = INT_RE.match(v)
    return int(m.group(1)) if m else "error"


def new_int(value: str) -> object:
    try:
        return parse.parse_int(value)
    except parse.ParseError:
        return "error"


def strings(pieces: list[str], count: int, seed: int, most: int = 6) -> list[str]:
    rnd = random.Random(seed)
    return ["".join(rnd.choice(pieces) for _ in range(rnd.randint(0, most))) for _ in range(count)]


HEX12 = "0123456789ab"
LONG_HEX = "0123456789abcdef" * 4  # 64
CGROUP_PIECES = ["/", "docker-", "/docker/", "libpod-", "libpod-conmon-", "conmon-", "crio-",
                 "crio-conmon-", "cri-containerd-", "/containerd/", "/lxc.payload", ".", "/lxc/",
                 ".scope", "kubepods", "system.slice", HEX12, HEX12 + "cd", "abc", "XYZ", "-",
                 LONG_HEX, LONG_HEX[:63], "g", "web", "0"]
RECORDED_CGROUPS = [
    "/system.slice/docker-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope",
    "/docker/0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "/machine.slice/libpod-conmon-0123456789abcdef.scope",
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/"
    "cri-containerd-" + LONG_HEX + ".scope",
    "/kubepods/besteffort/pod1/" + LONG_HEX,
    "/kubepods/besteffort/pod1",
    "/system.slice/containerd.service/k8s.io/abc",
    "/containerd/default/web",
    "/lxc.payload.web/system.slice",
    "/lxc/web",
    "/user.slice/user-1000.slice/session-2.scope",
    "/docker-123.scope",
    "",
]


def mismatches(new: Callable[[str], object], old: Callable[[str], object],
               values: list[str]) -> list[tuple[str, object, object]]:
    return [(v, new(v), old(v)) for v in values if new(v) != old(v)]


@pytest.mark.parametrize("path", RECORDED_CGROUPS)
def test_container_of_names_what_the_patterns_named(path: str) -> None:
    assert parse.container_of(path) == old_container_of(path)


def where_a_runtime_names(path: str) -> Optional[str]:
    """The old patterns, applied where only a runtime (root) makes cgroups."""
    if not path:
        return None
    if path.lstrip("/").split("/", 1)[0] in ("kubepods", "kubepods.slice"):
        return old_container_of(path)
    part = parse.runtime_part(path)
    for regex, kind in CONTAINER_PATTERNS:
        m = regex.search(part)
        if m:
            ident = m.group(1)
            return kind + ":" + (ident if kind == "lxc" else ident[:12])
    return None


def test_generated_cgroups_name_the_same_containers() -> None:
    """Read only where a runtime makes cgroups (parse.runtime_part), the container is what the
    patterns named there; elsewhere in the path (a user's own subtree) it is no container.
    Not vacuous: the generated strings reach every kind (and none)."""
    values = strings(CGROUP_PIECES, 20000, 1)

    assert mismatches(parse.container_of, where_a_runtime_names, values) == []
    assert sum(1 for v in values if parse.container_of(v)) > 1000
    kinds = {(old_container_of(p) or "none").split(":")[0] for p in values}
    assert kinds >= {"docker", "podman", "containerd", "crio", "lxc", "k8s", "kubepods", "none"}


DEVICE_PIECES = ["/dev/", "/dev/nvidia", "nvidia", "ctl", "-uvm", "-tools", "-caps/", "caps",
                 "/", "0", "12", "dxg", "x", "\u0663", " ", "-"]


@pytest.mark.parametrize("path", ["/dev/nvidia0", "/dev/nvidia17", "/dev/nvidiactl",
                                  "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                  "/dev/nvidia-caps/nvidia-cap1", "/dev/dxg", "/dev/nvidia",
                                  "/dev/nvidia-caps/", "/dev/nvidia-caps/a/b", "/dev/nvidia0x",
                                  "/dev/nvidia\u0663", "/dev/null", "/dev/shm/nvidia0"])
def test_device_files_are_the_ones_the_pattern_matched(path: str) -> None:
    assert parse.is_device_path(path) == bool(DEVICE_RE.match(path))
    assert parse.gpu_minor(path) == old_minor(path)


def old_minor(path: str) -> Optional[int]:
    m = GPU_DEVICE_RE.match(path)
    return int(m.group(1)) if m else None


def test_generated_paths_are_device_files_as_before() -> None:
    values = strings(DEVICE_PIECES, 20000, 2, most=4)
    assert mismatches(parse.is_device_path, lambda p: bool(DEVICE_RE.match(p)), values) == []
    assert mismatches(parse.gpu_minor, old_minor, values) == []
    assert sum(1 for v in values if DEVICE_RE.match(v)) > 100
    assert sum(1 for v in values if GPU_DEVICE_RE.match(v)) > 20


def test_a_name_with_a_newline_is_not_a_device_file() -> None:
    """The one place the patterns were looser: ``$`` matched before a final newline, so a file
    named "/dev/nvidia0\\n" (not the device) matched. The string tests refuse it."""
    assert DEVICE_RE.match("/dev/nvidia0\n") and not parse.is_device_path("/dev/nvidia0\n")
    assert parse.gpu_minor("/dev/nvidia0\n") is None


BUS_PIECES = ["0000", "00000000", ":", ".", "18", "00", "0", "a", "F", " ", "\t", "g", "-", "x"]


@pytest.mark.parametrize("value", ["00000000:00:06.0", "0000:18:00.0", " 0000:AB:1f.7 ",
                                   "00000000:00:06", "0000:18:00.0.1", "", "GPU 0000:18:00.0"])
def test_bus_ids_normalise_as_the_pattern_did(value: str) -> None:
    assert parse.normalize_bus_id(value) == old_bus(value)


def bus_like(count: int, seed: int) -> list[str]:
    """Bus-id shaped strings, each part or separator sometimes wrong."""
    rnd = random.Random(seed)
    parts = ["0000", "00000000", "18", "00", "0", "a", "F", "1f", "g", "", "0x", "\u0663"]
    seps = [":", ":", ":", ".", " ", ""]
    pad = ["", "", " ", "\t", "\n", "x"]
    out = []
    for _ in range(count):
        p = [rnd.choice(parts) for _ in range(4)]
        s = [rnd.choice(seps), rnd.choice(seps), rnd.choice([".", ".", ":", ""])]
        out.append(rnd.choice(pad) + p[0] + s[0] + p[1] + s[1] + p[2] + s[2] + p[3]
                   + rnd.choice(pad))
    return out


def test_generated_bus_ids_normalise_as_before() -> None:
    values = bus_like(20000, 3) + strings(BUS_PIECES, 5000, 3, most=8)
    assert mismatches(parse.normalize_bus_id, old_bus, values) == []
    assert sum(1 for v in values if old_bus(v)) > 20


INT_PIECES = ["-", "0", "12", "7", " ", "MiB", "%", "Mi", "B", "[N/A]", "N/A", "x", ".", "\u0663"]


@pytest.mark.parametrize("value", ["81559", "81559 MiB", "81559MiB", "35 %", "-1", "12 W",
                                   "[N/A]", "N/A", "", "  7  ", "1.5", "- 1"])
def test_numbers_read_as_the_pattern_read_them(value: str) -> None:
    assert new_int(value) == old_int(value)


def test_generated_numbers_read_as_before() -> None:
    values = strings(INT_PIECES, 20000, 4, most=5)
    assert mismatches(new_int, old_int, values) == []
    assert sum(1 for v in values if isinstance(old_int(v), int)) > 500


JSON_DOCS: list[object] = [
    {"mode": "snapshot", "deadline_s": 58.0, "nvidia_smi": None, "stay": True, "x": [1, -2, 3.5]},
    {"s": "é \u2603 \"q\" \\ \n\t\u0001", "nested": {"a": [{}, [], ""]}, "big": 2 ** 70},
    {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf")}, [], "text", 7, None, True,
]


@pytest.mark.parametrize("doc", JSON_DOCS, ids=range(len(JSON_DOCS)))
def test_json_through_the_c_half_is_json(doc: object) -> None:
    import json

    assert parse.json_dumps(doc) == json.dumps(doc)
    assert parse.json_dumps(doc, compact=True) == json.dumps(doc, separators=(",", ":"))
    text = json.dumps(doc)
    assert repr(parse.json_loads(text)) == repr(json.loads(text))  # nan == nan by repr
    assert repr(parse.json_loads(text.encode())) == repr(json.loads(text))
    assert repr(parse.json_loads(" \n" + text + "\t\r\n")) == repr(json.loads(text))


@pytest.mark.parametrize("text", ["", "{", '{"a": 1} x', '{"a": 1}{}', "nope", '{"a": }', "[1,]"])
def test_json_that_is_not_one_document_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse.json_loads(text)


def test_an_object_json_cannot_write_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        parse.json_dumps({"x": object()})


