"""The agent's pure parsers against RECORDED nvidia-smi and /proc output.

Recorded text lives in tests/fixtures/recorded/ (exact copies of line ranges of
tests/fixtures/recorded/logs/*.log, see SOURCES.json there). Where the recorded logs hold no sample
(stat lines, cgroup paths of systemd services, docker, kubepods, sessions; the driver's
/proc information file), the sample below is built from the documented format and says so.
"""
from __future__ import annotations

import ast
import fcntl
import json
import os
from pathlib import Path

import pytest

from gpufleet.remote import agent

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "recorded"
RECORDED_LOGS = FIXTURES / "logs"  # copies of the project's raw H200 logs (README there)

GPU0_UUID = "GPU-b6867955-3f5c-7ad9-b674-7a2248eb9a7f"  # h200-single-gpu.log line 33
GPU1_UUID_TWO = "GPU-b226c03d-98d5-aaff-f57c-8cd874d83c3e"  # h200-two-gpus.log line 11


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


# ------------------------------------------------------------------- fixtures are the logs


def test_fixtures_match_recorded_logs():
    sources = json.loads((FIXTURES / "SOURCES.json").read_text())
    assert len(sources) >= 10
    for name, src in sources.items():
        base = FIXTURES if src.get("in_repo") else RECORDED_LOGS
        lines = (base / src["log"]).read_bytes().split(b"\n")
        expected = b"\n".join(lines[src["first_line"] - 1 : src["last_line"]]) + b"\n"
        assert (FIXTURES / name).read_bytes() == expected, name


# ------------------------------------------------------------------- nvidia-smi CSV


RECORDED_7 = ["index", "uuid", "name", "memory.used", "memory.total", "memory.free",
              "utilization.gpu"]


def test_query_gpu_recorded_row():
    (gpu,) = agent.parse_gpu_csv(fixture("query_gpu_7fields.csv"), RECORDED_7)
    assert gpu == {
        "index": 0, "uuid": GPU0_UUID, "name": "NVIDIA H200", "memory_used_mib": 0,
        "memory_total_mib": 143771, "memory_free_mib": 143156, "utilization_pct": 0,
    }


def test_query_gpu_with_units_and_reserved():
    # recorded with --format=csv (header, units): data rows parse, the header does not
    header, *rows = fixture("query_gpu_csv_units.csv").splitlines()
    fields = ["index", "pci.bus_id", "uuid", "memory.used", "memory.reserved", "memory.total"]
    gpus = agent.parse_gpu_csv("\n".join(rows), fields)
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[1]["pci_bus_id"] == "00000000:00:07.0"
    assert gpus[1]["uuid"] == GPU1_UUID_TWO
    assert [g["memory_reserved_mib"] for g in gpus] == [616, 616]
    assert gpus[0]["memory_total_mib"] == 143771
    with pytest.raises(agent.ParseError):
        agent.parse_gpu_csv(header, fields)


def test_index_used_recorded():
    rows = agent.parse_gpu_csv(fixture("index_used_two.csv"), ["index", "memory.used"])
    assert [(r["index"], r["memory_used_mib"]) for r in rows] == [(0, 4), (1, 9243)]
    rows = agent.parse_gpu_csv(fixture("index_used.csv"), ["index", "memory.used"])
    assert rows == [{"index": 0, "memory_used_mib": 26651}]


def test_not_available_values_become_none():
    # the recorded row with its numbers replaced by nvidia-smi's "not available" spellings
    line = fixture("query_gpu_7fields.csv").strip().split(", ")
    line[3], line[5], line[6] = "[N/A]", "[Not Supported]", "N/A"
    (gpu,) = agent.parse_gpu_csv(", ".join(line), RECORDED_7)
    assert gpu["memory_used_mib"] is None
    assert gpu["memory_free_mib"] is None
    assert gpu["utilization_pct"] is None
    assert gpu["memory_total_mib"] == 143771
    assert agent.na("[GPU requires reset]") is None
    assert agent.na(" NVIDIA H200 ") == "NVIDIA H200"


@pytest.mark.parametrize(
    "text",
    [
        "garbage",
        "0, GPU-b6867955-3f5c-7ad9-b674",  # truncated row
        fixture("query_gpu_7fields.csv")[:40],
        "x, GPU-b6867955-3f5c-7ad9-b674-7a2248eb9a7f, NVIDIA H200, 0, 143771, 143156, 0",
        "0, GPU-b6867955-3f5c-7ad9-b674-7a2248eb9a7f, NVIDIA H200, lots, 143771, 143156, 0",
        "[N/A], GPU-b6867955-3f5c-7ad9-b674-7a2248eb9a7f, NVIDIA H200, 0, 143771, 143156, 0",
        "0, [N/A], NVIDIA H200, 0, 143771, 143156, 0",
        b"\x00\xff\xfe 0, \x80".decode("utf-8", "replace"),
    ],
)
def test_garbage_gpu_rows_raise(text):
    with pytest.raises(agent.ParseError):
        agent.parse_gpu_csv(text, RECORDED_7)


def test_gpu_name_with_comma_keeps_columns():
    line = "0, GPU-x, NVIDIA H200, rev 2, 0, 143771, 143156, 0"
    (gpu,) = agent.parse_gpu_csv(line, RECORDED_7)
    assert gpu["name"] == "NVIDIA H200, rev 2"
    assert gpu["memory_total_mib"] == 143771


PROBE4 = FIXTURES / "probe" / "h200-names-probe4.log"
PROBE4_UUID = "GPU-ad473a14-ed2a-c923-1574-31ee551488a3"
PROBE4_ROWS = [(490, 774), (496, 646), (499, 582), (502, 550), (505, 534), (508, 526)]


def probe4(command: str) -> str:
    """The exact text nvidia-smi printed for ``command`` in probe 4 (a real H200, driver
    580.159.04; the log holds it as repr(), so every byte shows)."""
    lines = PROBE4.read_text().splitlines()
    return ast.literal_eval(lines[lines.index("== nvidia-smi %s (repr)" % command) + 1])


def test_compute_apps_query_asks_for_no_process_name():
    """nvidia-smi prints process_name (anyone's chosen argv[0]) into the CSV: newlines
    verbatim, commas as '?' (probe 4). The agent does not ask for it; names come from /proc."""
    assert agent.APP_FIELDS == ("pid", "used_memory", "gpu_uuid")


@pytest.mark.parametrize("fmt", ["csv,noheader,nounits", "csv,noheader"])
def test_compute_apps_recorded(fmt):
    text = probe4("--query-compute-apps=pid,used_memory,gpu_uuid --format=" + fmt)
    apps, skipped, rejected = agent.parse_apps_csv(text)
    assert (skipped, rejected) == (0, [])
    assert [(a["pid"], a["used_mib"]) for a in apps] == PROBE4_ROWS
    assert {a["gpu_uuid"] for a in apps} == {PROBE4_UUID}
    assert all(sorted(a) == ["gpu_uuid", "pid", "used_mib"] for a in apps)  # no name here
    assert agent.parse_apps_csv("") == ([], 0, [])  # recorded: no processes -> no output


def test_compute_apps_na_memory_and_missing_pid():
    # nvidia-smi's "not available" spellings (WSL2: [N/A] per process), a row without a PID
    apps, skipped, rejected = agent.parse_apps_csv(
        "426, [N/A], %s\n427, [Not Supported], %s\n[N/A], 100, %s\n"
        % (GPU0_UUID, GPU0_UUID, GPU0_UUID))
    assert [(a["pid"], a["used_mib"]) for a in apps] == [(426, None), (427, None)]
    assert (skipped, rejected) == (1, [])


FORGED = [
    # the old query's real output (probe 4): argv[0] "x, 1\n2, 3 MiB, GPU-0...", commas as ?
    probe4("--query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader"),
    # a title forging a whole row where commas are printed verbatim (the lab's fake, before)
    "4242, x, 100, %s\n777, postgres, 3000, %s\n" % (GPU0_UUID, GPU0_UUID),
    # a name with a newline and a row-shaped tail naming PID 777
    "4242, x\n777, 123 MiB, %s, 3000, %s\n" % (GPU0_UUID, GPU0_UUID),
    "4242, x\n777? 123 MiB? %s, 3000 MiB, %s\n" % (GPU0_UUID, GPU0_UUID),
    # a row cut in two: never glued back together
    "4242, 3000\n, %s\n" % GPU0_UUID,
]


@pytest.mark.parametrize("text", FORGED, ids=["recorded-old-query", "commas-verbatim",
                                              "tail-5-fields", "tail-question-marks", "cut"])
def test_forged_multi_line_rows_are_rejected_never_joined(text):
    apps, skipped, rejected = agent.parse_apps_csv(text)
    assert apps == [] and skipped == 0
    assert rejected == [line[:80] for line in text.splitlines() if line.strip()]


def test_a_bad_row_is_rejected_alone():
    good = "426, 5638, %s" % GPU0_UUID
    bad = ["426, python3, 5638, %s" % GPU0_UUID,  # the 4-column layout (recorded shape)
           "x, 5638, %s" % GPU0_UUID, "426, lots, %s" % GPU0_UUID, "426, 5638, [N/A]",
           "426, 5638", "426, 5638, %s, 00000000:00:07.0" % GPU0_UUID, "\x00\x01"]
    apps, skipped, rejected = agent.parse_apps_csv("\n".join([good] + bad + [good]) + "\n")
    assert [(a["pid"], a["used_mib"]) for a in apps] == [(426, 5638), (426, 5638)]
    assert rejected == bad and skipped == 0
    assert agent.parse_apps_csv(fixture("compute_apps.csv"))[2] == \
        fixture("compute_apps.csv").splitlines()  # recorded with process_name: not our query


def test_split_row():
    assert agent.split_row("a, b, c", 3) == ["a", "b", "c"]
    assert agent.split_row("1, x, y, 2, u", 4, 1) == ["1", "x, y", "2", "u"]
    with pytest.raises(agent.ParseError):
        agent.split_row("a, b", 3)
    with pytest.raises(agent.ParseError):
        agent.split_row("a", 4, 1)


# ------------------------------------------------------------------- minor numbers, versions


def test_q_minor_numbers_recorded():
    assert agent.parse_q_minors(fixture("q_minor_bus.txt")) == {
        "0000:00:06.0": 0, "0000:00:07.0": 1}


def test_q_minor_numbers_recorded_with_headers():
    assert agent.parse_q_minors(fixture("q_minor_headers.txt")) == {
        "0000:00:06.0": 0, "0000:00:07.0": 1}


def test_invalid_field_message_recorded():
    m = agent.INVALID_FIELD_RE.search(fixture("invalid_field.txt"))
    assert m and m.group(1) == "bogus.field"


def test_query_gpu_agent_fields_recorded():
    # recorded with the agent's fields of then: the required ones and memory.reserved (the
    # health fields came later, with `gpufleet health`)
    fields = list(agent.GPU_FIELDS) + ["memory.reserved"]
    gpus = agent.parse_gpu_csv(fixture("query_gpu_agent_fields.csv"), fields)
    assert [(g["index"], g["pci_bus_id"], g["memory_reserved_mib"], g["driver_version"])
            for g in gpus] == [(0, "00000000:00:06.0", 616, "580.159.04"),
                               (1, "00000000:00:07.0", 616, "580.159.04")]
    assert gpus[1]["memory_free_mib"] == 143156 and gpus[1]["utilization_pct"] == 0


def test_q_minor_numbers_full_layout():
    # a full `nvidia-smi -q` keeps "Minor Number" under the "GPU 0000...:..." header
    # (header line recorded in q_pids.txt; the rest in the recorded indentation)
    header = fixture("q_pids.txt").splitlines()[8]
    assert header == "GPU 00000000:00:06.0"
    minor1, bus1, minor2, bus2 = fixture("q_minor_bus.txt").splitlines()
    text = "\n".join([
        header, "    Product Name                          : NVIDIA H200", minor2,
        "    PCI", bus1,
        "GPU 00000000:00:07.0", minor1, "    PCI", bus2,
        "GPU 00000000:00:08.0", "    Minor Number                          : N/A",
    ])
    # the header wins over a Bus Id in the same block; N/A minor -> None
    assert agent.parse_q_minors(text) == {
        "0000:00:06.0": 1, "0000:00:07.0": 0, "0000:00:08.0": None}


def test_versions_from_bare_table_and_q():
    assert agent.parse_versions(fixture("bare_table.txt")) == ("580.159.04", "13.0")
    assert agent.parse_versions(fixture("q_pids.txt")) == ("580.159.04", "13.0")
    assert agent.parse_versions("garbage") == (None, None)


def test_normalize_bus_id():
    assert agent.normalize_bus_id("00000000:00:06.0") == "0000:00:06.0"
    assert agent.normalize_bus_id("0000:00:06.0") == "0000:00:06.0"
    assert agent.normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert agent.normalize_bus_id("N/A") is None
    assert agent.normalize_bus_id(None) is None


@pytest.mark.parametrize("value, bus", [
    (" 0000:AB:1f.7 ", "0000:ab:1f.7"),  # spaces around, upper-case hex
    ("0000:18:00.0\n", "0000:18:00.0"),
    ("00000000:00:06", None),  # no function
    ("0000:18:00.0.1", None),
    ("GPU 0000:18:00.0", None),  # a -q header is not a bus id
    ("0000:\u0663:00.0", None),  # a digit of another script is no hex digit
    ("", None),
])
def test_bus_id_edges(value, bus):
    assert agent.normalize_bus_id(value) == bus


@pytest.mark.parametrize("value, number", [
    ("81559", 81559), ("81559 MiB", 81559), ("81559MiB", 81559), ("35 %", 35), ("-1", -1),
    ("  7  ", 7), ("7\n", 7), ("[N/A]", None), ("N/A", None), ("", None),
])
def test_numbers_nvidia_smi_prints(value, number):
    assert agent.parse_int(value) == number


@pytest.mark.parametrize("value", ["12 W", "1.5", "- 1", "\u0663", "0x10", "7 MiB MiB"])
def test_what_is_not_a_number_raises(value):
    with pytest.raises(agent.ParseError):
        agent.parse_int(value)


@pytest.mark.parametrize("path, device, minor", [
    ("/dev/nvidia0", True, 0), ("/dev/nvidia17", True, 17), ("/dev/nvidiactl", True, None),
    ("/dev/nvidia-uvm", True, None), ("/dev/nvidia-uvm-tools", True, None),
    ("/dev/nvidia-caps/nvidia-cap1", True, None), ("/dev/dxg", True, None),
    ("/dev/nvidia", False, None), ("/dev/nvidia-caps/", False, None),
    ("/dev/nvidia-caps/a/b", False, None), ("/dev/nvidia0x", False, None),
    ("/dev/nvidia\u0663", False, None),  # a digit of another script
    ("/dev/null", False, None), ("/dev/shm/nvidia0", False, None),
    # a file named with a final newline is not the device (a pattern's "$" would match)
    ("/dev/nvidia0\n", False, None),
])
def test_device_files(path, device, minor):
    assert agent.is_device_path(path) is device
    assert agent.gpu_minor(path) == minor


def uncat_a(text: str) -> str:
    """Undo `cat -A` (^I = tab, $ = end of line) for the recorded information file."""
    return "".join(line[:-1].replace("^I", "\t") + "\n" for line in text.splitlines())


PROC_INFORMATION = uncat_a(fixture("proc_information_catA.txt"))  # recorded on a real H200


def test_proc_information():
    assert agent.parse_proc_information(PROC_INFORMATION) == ("0000:00:07.0", 1)
    assert agent.parse_proc_information("garbage\n") == (None, None)


def test_gpu_minors_from_fake_proc(tmp_path):
    d = tmp_path / "driver" / "nvidia" / "gpus" / "0000:00:07.0"
    d.mkdir(parents=True)
    (d / "information").write_text(PROC_INFORMATION)
    assert agent.gpu_minors_from_proc(str(tmp_path)) == {"0000:00:07.0": 1}
    assert agent.gpu_minors_from_proc(str(tmp_path / "nope")) == {}


# ------------------------------------------------------------------- /proc/PID files


def stat_line(pid=425, comm="VLLM::Worker", state="S", ppid=412, pgid=412, session=300,
              flags=4194560, starttime=1234567, threads=1):
    """A /proc/PID/stat line in proc(5) layout (52 fields); not recorded, values from the
    recorded ps/status output of PID 425 where there are any."""
    rest = ([state, ppid, pgid, session, 34816, pgid, flags] + [0] * 10 + [threads, 0] +
            [starttime] + [0] * 30)
    return "%d (%s) %s\n" % (pid, comm, " ".join(str(x) for x in rest))


def test_parse_stat_fields():
    st = agent.parse_stat(stat_line())
    assert st == {"pid": 425, "comm": "VLLM::Worker", "state": "S", "ppid": 412, "pgid": 412,
                  "session": 300, "flags": 4194560, "starttime": 1234567, "num_threads": 1}
    assert agent.is_kernel_thread(st) is False


@pytest.mark.parametrize("comm", ["a) (b) c", ") S 1 2 3", "x)", "(", "spaces  in it"])
def test_parse_stat_comm_with_parens_and_spaces(comm):
    st = agent.parse_stat(stat_line(comm=comm, state="D", ppid=7, starttime=99))
    assert st["comm"] == comm
    assert (st["state"], st["ppid"], st["starttime"]) == ("D", 7, 99)


def test_parse_stat_rejects_garbage():
    for bad in ["", "425 VLLM S 1", "425 (x) S 1 2 3", "abc (x) " + "1 " * 50]:
        with pytest.raises(agent.ParseError):
            agent.parse_stat(bad)


def test_has_exited_zombie_leader_with_threads():
    assert agent.has_exited(agent.parse_stat(stat_line(state="Z", threads=1)))
    assert agent.has_exited(agent.parse_stat(stat_line(state="X", threads=1)))
    # leader exited, threads still tearing down (a CUDA process right after SIGTERM)
    assert not agent.has_exited(agent.parse_stat(stat_line(state="Z", threads=5)))
    assert not agent.has_exited(agent.parse_stat(stat_line(state="D", threads=1)))


def test_kernel_thread_flag():
    assert agent.is_kernel_thread(agent.parse_stat(stat_line(flags=0x00208040)))
    assert agent.is_kernel_thread({"pid": 9, "ppid": 2, "flags": None})
    assert not agent.is_kernel_thread({"pid": 9, "ppid": 2, "flags": 0})


def test_status_uid():
    # recorded head of /proc/425/status has no Uid line
    assert agent.parse_status_uid(fixture("proc_status_head.txt")) is None
    assert agent.parse_status_uid(fixture("proc_status_head.txt") +
                                  "Uid:\t1000\t1001\t1001\t1001\n") == 1001


def test_format_cmdline():
    # recorded: /proc/425/cmdline | tr '\\0' ' ' printed "python3 /tmp/hold.py VLLM::Worker 20 "
    raw = b"\0".join([b"python3", b"/tmp/hold.py", b"VLLM::Worker", b"20"]) + b"\0"
    assert agent.format_cmdline(raw) == "python3 /tmp/hold.py VLLM::Worker 20"
    assert agent.format_cmdline(b"\xff\xfeab\0c") == "\ufffd\ufffdab c"
    assert len(agent.format_cmdline(b"x" * 10000)) == agent.CMDLINE_MAX
    assert agent.format_cmdline(b"") == ""


def test_device_targets_recorded():
    targets = [line.split(" -> ")[1] for line in fixture("proc_fd_ls.txt").splitlines()]
    assert len(targets) == 10
    assert all(agent.device_target(t) == t for t in targets)
    for other in ["/dev/null", "/dev/nvidia-modeset", "/dev/nvidiaX", "/dev/nvidia0 (deleted)",
                  "/tmp/dev/nvidia0", "socket:[1234]", "/dev/nvidia-caps/a/b"]:
        assert agent.device_target(other) is None
    assert agent.device_target("/dev/dxg") == "/dev/dxg"


# ------------------------------------------------------------------- cgroups


def test_cgroup_recorded_lines():
    for name in ("cgroup_pid1.txt", "cgroup_self.txt"):
        text = fixture(name)
        path = agent.parse_cgroup(text)
        assert path == text.strip()[3:]
        assert agent.cgroup_units(path) == ([], None)
        assert agent.container_from_cgroup_text(text) is None


# Not recorded: cgroup paths in the formats systemd, docker, kubelet and LXC write. The unit
# is the innermost one the path claims (systemd confirms it on the host: confirm_units).
CGROUP_CASES = [
    ("0::/system.slice/vllm-minimax.service\n", "vllm-minimax.service", None),
    ("0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope", None),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/app-tmux-42.scope\n",
     "user@1000.service", None),
    ("0::/system.slice/docker-4f3a5b6c7d8e9f00112233445566778899aabbccddeeff001122334455667788"
     ".scope\n", "docker-4f3a5b6c7d8e9f00112233445566778899aabbccddeeff001122334455667788.scope",
     "docker:4f3a5b6c7d8e"),
    ("12:pids:/docker/4f3a5b6c7d8e9f00112233445566778899aabbccddeeff001122334455667788\n"
     "1:name=systemd:/docker/4f3a5b6c7d8e9f00112233445566778899aabbccddeeff001122334455667788\n"
     "0::/\n", None, "docker:4f3a5b6c7d8e"),
    ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_5678.slice/"
     "cri-containerd-aabbccddeeff00112233445566778899aabbccddeeff00112233445566778899.scope\n",
     "cri-containerd-aabbccddeeff00112233445566778899aabbccddeeff00112233445566778899.scope",
     "k8s:aabbccddeeff"),
    ("0::/kubepods/besteffort/pod1234-5678\n", None, "kubepods"),
    ("0::/lxc.payload.web01/system.slice/vllm.service\n", "vllm.service", "lxc:web01"),
    ("1:name=systemd:/system.slice/vllm.service\n0::/\n", "vllm.service", None),
]


@pytest.mark.parametrize("text,unit,container", CGROUP_CASES)
def test_cgroup_unit_and_container(text, unit, container):
    claims, _ = agent.cgroup_units(agent.parse_cgroup(text))
    assert (claims[-1][0] if claims else None) == unit
    assert agent.container_from_cgroup_text(text) == container


# A user may create cgroups only below the subtree systemd delegates to it; whatever it names
# there is its own: never a system unit, never a container.
USER_MADE = "/user.slice/user-65534.slice/user@65534.service/"


def test_cgroup_claims_stop_at_the_user_manager():
    claims, user = agent.cgroup_units(USER_MADE + "app.slice/cron.service")
    assert claims == [("user@65534.service",
                       "/user.slice/user-65534.slice/user@65534.service")]
    assert user == ("cron.service", 65534)
    claims, user = agent.cgroup_units("/system.slice/ci.service/payload/cron.service")
    assert claims == [("ci.service", "/system.slice/ci.service"),
                      ("cron.service", "/system.slice/ci.service/payload/cron.service")]
    assert user is None


HEX64 = "0123456789abcdef" * 4


@pytest.mark.parametrize("path, container", [
    ("/system.slice/docker-" + HEX64 + ".scope", "docker:0123456789ab"),
    ("/docker/" + HEX64, "docker:0123456789ab"),
    ("/machine.slice/libpod-conmon-0123456789abcdef.scope", "podman:0123456789ab"),
    ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/"
     "cri-containerd-" + HEX64 + ".scope", "k8s:0123456789ab"),
    ("/kubepods/besteffort/pod1/" + HEX64, "k8s:0123456789ab"),
    ("/kubepods/besteffort/pod1", "kubepods"),
    ("/system.slice/containerd.service/k8s.io/abc", None),
    ("/containerd/default/web", "containerd:default"),
    ("/lxc.payload.web/system.slice", "lxc:web"),
    ("/lxc/web", "lxc:web"),
    ("/user.slice/user-1000.slice/session-2.scope", None),
    ("/docker-123.scope", None),  # an id shorter than 12 hex digits
    ("", None),
])
def test_container_of_cgroup_paths(path, container):
    assert agent.container_of(path) == container


@pytest.mark.parametrize("path", [
    USER_MADE + "app.slice/docker-" + "ab" * 32 + ".scope",
    USER_MADE + "user.slice/docker-" + "ab" * 32 + ".scope",
    USER_MADE + "kubepods.slice/cri-containerd-" + "ab" * 32 + ".scope",
    USER_MADE + "lxc/web",
    "/system.slice/ci.service/docker-" + "ab" * 32 + ".scope",
    "/user.slice/user-65534.slice/session-4.scope/docker/" + "ab" * 32,
])
def test_a_container_name_a_user_could_make_is_no_container(path):
    assert agent.container_of(path) is None


def test_systemctl_show_blocks():
    text = ("Id=cron.service\nControlGroup=/system.slice/cron.service\n\n"
            "Id=gone.service\nControlGroup=\n")
    assert agent.parse_systemctl_show(text) == {"cron.service": "/system.slice/cron.service",
                                                "gone.service": ""}


def test_parse_cgroup_prefers_v2_then_systemd():
    hybrid = "9:name=systemd:/\n4:memory:/process_api/x\n0::/\n"  # this dev machine's shape
    assert agent.parse_cgroup(hybrid) == "/"
    assert agent.parse_cgroup("1:name=systemd:/a.service\n0::/b.service\n") == "/b.service"
    assert agent.parse_cgroup("garbage") is None


# ------------------------------------------------------------------- guards and verdicts


def test_unit_names():
    assert agent.valid_unit("vllm-minimax.service")
    assert agent.valid_unit("user@1000.service")
    assert agent.valid_unit("session-3.scope")
    for bad in ["", "vllm", "-vllm.service", "vllm.service; reboot", "a b.service",
                "$(reboot).service", "../x.service", None, 5, "x" * 300 + ".service"]:
        assert not agent.valid_unit(bad), bad


def test_refusal_guard():
    assert agent.refusal(1, 100, [50, 1]) == "refused: pid <= 1"
    assert agent.refusal(0, 100, []) == "refused: pid <= 1"
    assert agent.refusal(-5, 100, []) == "refused: pid <= 1"
    assert agent.refusal(True, 100, []) == "refused: pid <= 1"
    assert agent.refusal("7", 100, []) == "refused: pid <= 1"
    assert agent.refusal(100, 100, [50]) == "refused: own session"
    assert agent.refusal(50, 100, [50]) == "refused: own session"
    assert agent.refusal(51, 100, [50]) is None


def test_classify_survivor():
    z = agent.classify_survivor("Z", None, 696, "python3", ["sent"])
    assert "zombie" in z and "696" in z and "python3" in z
    d = agent.classify_survivor("D", "uvm_wait", 1, "systemd", ["sent", "sent"])
    assert "uvm_wait" in d and "reset or reboot" in d
    assert "EPERM" in agent.classify_survivor("S", None, 1, "x", ["permission denied"])
    assert agent.classify_survivor("S", None, 1, "x", ["refused: own session"]) == \
        "refused: own session"
    assert "still running" in agent.classify_survivor("R", None, 1, "x", ["sent", "sent"])
    assert "2 thread(s) still tearing down" in agent.classify_survivor(
        "Z", None, 1, "x", ["sent"], threads=3)


def test_reset_refusal():
    assert agent.reset_refusal(True, False, False, []) is None
    assert agent.reset_refusal(False, False, False, []) == "not root"
    assert "container" in agent.reset_refusal(True, True, False, [])
    assert "WSL2" in agent.reset_refusal(True, False, True, [])
    assert agent.reset_refusal(True, False, False, [12, 3]) == "held by PID 3, 12"


# ------------------------------------------------------------------- fake /proc trees


def make_proc(tmp_path, pid, stat, fds=(), comm=None, cmdline=b"", cgroup="0::/\n",
              status="Uid:\t0\t0\t0\t0\n", wchan="0"):
    d = tmp_path / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_text(stat)
    (d / "status").write_text(status)
    (d / "comm").write_text((comm or agent.parse_stat(stat)["comm"]) + "\n")
    (d / "cmdline").write_bytes(cmdline)
    (d / "cgroup").write_text(cgroup)
    (d / "wchan").write_text(wchan)
    for i, target in enumerate(fds):
        os.symlink(target, str(d / "fd" / str(i)))
    return d


def test_scan_fds_fake_proc(tmp_path):
    recorded = [line.split(" -> ")[1] for line in fixture("proc_fd_ls.txt").splitlines()]
    make_proc(tmp_path, 425, stat_line(), ["/dev/null", "pipe:[1]"] + recorded)
    make_proc(tmp_path, 426, stat_line(426, "trainer"), ["/dev/nvidia1", "/dev/nvidiactl"])
    make_proc(tmp_path, 500, stat_line(500, "bash"), ["/dev/pts/0"])
    make_proc(tmp_path, 600, stat_line(600, "self"), ["/dev/nvidia0"])
    (tmp_path / "self").mkdir()
    found, denied = agent.scan_fds(agent.device_target, exclude={600}, proc=str(tmp_path))
    assert denied == []
    assert found == {
        425: {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm",
              "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"},
        426: {"/dev/nvidia1", "/dev/nvidiactl"},
    }


def test_scan_fds_zombie_leader_reads_thread_fds(tmp_path):
    d = make_proc(tmp_path, 700, stat_line(700, "pt_main", state="Z", threads=2))
    (d / "task" / "700").mkdir(parents=True)
    (d / "task" / "701" / "fd").mkdir(parents=True)
    os.symlink("/dev/nvidia0", str(d / "task" / "701" / "fd" / "3"))
    make_proc(tmp_path, 800, stat_line(800, "zombie", state="Z", threads=1))
    found, _ = agent.scan_fds(agent.device_target, proc=str(tmp_path))
    assert found == {700: {"/dev/nvidia0"}}


def test_stuck_thread_fake_proc(tmp_path):
    d = make_proc(tmp_path, 700, stat_line(700, "pt_main", state="Z", threads=3))
    for tid, state, wchan in [(700, "Z", "0"), (701, "S", "futex_wait"),
                              (702, "D", "uvm_va_space_destroy")]:
        (d / "task" / str(tid)).mkdir(parents=True)
        (d / "task" / str(tid) / "stat").write_text(stat_line(tid, "pt_main", state=state))
        (d / "task" / str(tid) / "wchan").write_text(wchan)
    st = agent.read_stat(700, str(tmp_path))
    assert agent.stuck_thread(700, st, str(tmp_path)) == ("D", "uvm_va_space_destroy")
    make_proc(tmp_path, 900, stat_line(900, "busy", state="R"), wchan="0")
    assert agent.stuck_thread(900, agent.read_stat(900, str(tmp_path)), str(tmp_path)) == \
        ("R", None)


def test_process_entry_fake_proc(tmp_path):
    svc = "0::/system.slice/vllm-minimax.service\n"
    make_proc(tmp_path, 425, stat_line(comm="a) b", session=300), comm="a) b",
              cmdline=b"python3\0/tmp/hold.py\0VLLM::Worker\0" b"20\0", cgroup=svc,
              status=fixture("proc_status_head.txt") + "Uid:\t0\t0\t0\t0\n", wchan="futex_wait")
    make_proc(tmp_path, 77, stat_line(77, "sshd", session=300))
    ctx = {"self_pid": 88, "ancestors": [77, 1], "session": 300, "warnings": []}
    e = agent.process_entry(425, ctx, str(tmp_path))
    assert e["comm"] == "a) b" and e["state"] == "S" and e["ppid"] == 412
    assert e["starttime"] == 1234567 and e["session"] == 300 and e["pgid"] == 412
    assert e["uid"] == 0 and e["user"] == "root"
    assert e["cmdline"].startswith("python3 /tmp/hold.py VLLM::Worker")
    assert e["unit"] is None and e["container"] is None  # until systemd confirms it
    assert e["unit_claims"] == [("vllm-minimax.service", "/system.slice/vllm-minimax.service")]
    assert e["cgroup"] == "/system.slice/vllm-minimax.service"
    assert e["wchan"] == "futex_wait" and e["kernel_thread"] is False
    assert e["relation"] == "session"
    assert agent.process_entry(77, ctx, str(tmp_path))["relation"] == "ancestor"
    assert agent.process_entry(77, ctx, str(tmp_path))["wchan"] is None
    assert agent.process_entry(999, ctx, str(tmp_path)) is None  # vanished: skipped


def test_ancestors_fake_proc(tmp_path):
    make_proc(tmp_path, 30, stat_line(30, "python3", ppid=20))
    make_proc(tmp_path, 20, stat_line(20, "sudo", ppid=10))
    make_proc(tmp_path, 10, stat_line(10, "sshd", ppid=1))
    make_proc(tmp_path, 1, stat_line(1, "systemd", ppid=0))
    assert agent.ancestors_of(30, str(tmp_path)) == [20, 10, 1]


# ------------------------------------------------------------------- request, lock


def test_parse_request_defaults_and_errors():
    req = agent.parse_request(b'{"mode": "clean", "targets": []}')
    assert (req["deadline_s"], req["grace_s"], req["timeout_s"], req["poll_s"]) == \
        (55.0, 10.0, 60.0, 0.1)
    assert agent.parse_request(b"")["mode"] == "snapshot"
    for bad in [b"[1]", b'{"mode": "rm"}', b'{"deadline_s": "x"}', b'{"deadline_s": -1}',
                b'{"mode": "clean", "targets": 5}', b'{"nvidia_smi": 3}', b"{nope",
                b"{", b'{"a": 1} x', b'{"a": 1}{}', b'{"a": }', b"[1,]", b"\xff{}"]:
        with pytest.raises(ValueError):
            agent.parse_request(bad)


def test_lock_busy_names_its_holder_then_is_acquired(tmp_path):
    path = str(tmp_path / "lock")
    fd, holder = agent.acquire_lock(path, 0.0)
    assert fd is not None and holder is None
    try:
        busy, holder = agent.acquire_lock(path, 0.25)  # another open file description
        assert busy is None
        assert holder["pid"] == os.getpid() and holder["uid"] == os.geteuid()
        assert holder["open"] is True and holder["cmdline"]
    finally:
        os.close(fd)
    fd2, holder = agent.acquire_lock(path, 0.0)
    assert fd2 is not None and holder is None
    with open(path) as other:
        with pytest.raises(OSError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd2)


def test_denied_warning_names_whose_files_could_not_be_read(tmp_path) -> None:
    for pid, comm in ((1, "docker-init"), (77, "sshd")):
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "comm").write_text(comm + "\n")
    text = agent.denied_warning([1, 77], proc=str(tmp_path))
    assert text.startswith("cannot read the open files of 2 process(es): 1 (docker-init), 77 (sshd)")
    many = agent.denied_warning(list(range(1, 9)), proc=str(tmp_path))
    assert "and 3 more" in many


SYSTEMD = """#!/bin/sh
# systemd's answer: cron.service and user@65534.service run where systemd put them
for a in "$@"; do
  case "$a" in
    cron.service) printf 'Id=cron.service\\nControlGroup=/system.slice/cron.service\\n\\n';;
    user@65534.service) printf 'Id=%s\\nControlGroup=%s\\n\\n' "$a" \\
        /user.slice/user-65534.slice/user@65534.service;;
    *.service|*.scope) printf 'Id=%s\\nControlGroup=\\n\\n' "$a";;
  esac
done
"""


def test_confirm_units_trusts_systemd_not_the_path(tmp_path):
    systemctl = tmp_path / "systemctl"
    systemctl.write_text(SYSTEMD)
    systemctl.chmod(0o755)
    procs = {}
    for pid, path in [(1, "/system.slice/cron.service"),
                      (2, USER_MADE + "app.slice/cron.service"),
                      (3, "/system.slice/ci.service/payload/cron.service"),
                      (4, "/user.slice/user-1000.slice/session-2.scope")]:
        procs[str(pid)] = {"pid": pid, "cgroup": path, "unit": None,
                           "unit_claims": agent.cgroup_units(path)[0],
                           "user_unit": None, "user_unit_uid": None}
    warnings = []
    agent.confirm_units(procs, {"systemctl": str(systemctl)}, agent.Deadline(10), warnings)
    got = {int(k): (e["unit"], e["user_unit"], e["user_unit_uid"]) for k, e in procs.items()}
    assert got == {1: ("cron.service", None, None),
                   2: ("user@65534.service", "cron.service", 65534),
                   3: (None, None, None),  # ci.service is not running; cron.service is elsewhere
                   4: (None, None, None)}
    assert warnings == [] and all("unit_claims" not in e for e in procs.values())
    agent.confirm_units(procs | {"5": {"pid": 5, "cgroup": "/system.slice/x.service",
                                       "unit_claims": [("x.service", "/system.slice/x.service")]}},
                        {"systemctl": str(tmp_path / "missing")}, agent.Deadline(10), warnings)
    assert len(warnings) == 1 and "could not confirm" in warnings[0]


DOCKER = """#!/bin/sh
# the runtime's own answer: inspect --format '{{.HostConfig.RestartPolicy.Name}} {{.Name}}' -- ID
case "$5" in
  0123456789ab) echo always /vllm-a;;
  0000000000aa) echo no /eval;;
  *) echo "Error: No such object: $5" >&2; exit 1;;
esac
"""


def test_a_containers_restart_policy_and_name_are_the_runtimes_answer(tmp_path):
    docker = tmp_path / "docker"
    docker.write_text(DOCKER)
    docker.chmod(0o755)
    procs = {"1": {"pid": 1, "container": "docker:0123456789ab"},
             "2": {"pid": 2, "container": "docker:0123456789ab"},
             "3": {"pid": 3, "container": "docker:0000000000aa"},
             "4": {"pid": 4, "container": "docker:ffffffffffff"},
             "5": {"pid": 5, "container": "lxc:web"},
             "6": {"pid": 6, "container": None}}
    warnings = []
    agent.container_restarts(procs, {"container_cli": {"docker": str(docker)}},
                             agent.Deadline(10), warnings)
    got = {int(k): (e.get("container_restart", "-"), e.get("container_name", "-"))
           for k, e in procs.items()}
    assert got == {1: ("always", "vllm-a"), 2: ("always", "vllm-a"), 3: ("no", "eval"),
                   4: (None, None), 5: ("-", "-"), 6: ("-", "-")}
    assert len(warnings) == 1 and "No such object" in warnings[0]
