"""The lab's fake nvidia-smi against the output recorded on real H200 hosts.

Runs the fake directly (no lab, no root): state in a temporary FAKEGPU_ROOT, holders are real
processes of this machine registered the way fakecuda.py registers them.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

FAKE = Path(__file__).resolve().parents[1] / "lab" / "fake_nvidia_smi.py"
H200_UUID = "GPU-b6867955-3f5c-7ad9-b674-7a2248eb9a7f"
TWO_UUIDS = ["GPU-2f2c1bb6-8097-1b4c-7dca-7d0a9443fc53", "GPU-b226c03d-98d5-aaff-f57c-8cd874d83c3e"]
STAMP = re.compile(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}")


# --- recorded output ---------------------------------------------------------------------------


def traced_outputs(log: str) -> list[tuple[str, list[str]]]:
    """Split a `set -x` log into (command, output lines) pairs."""
    out: list[tuple[str, list[str]]] = []
    for line in log.splitlines():
        if line.startswith("+ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line)
    return out


def output_of(log: str, command: str, nth: int = 0) -> list[str]:
    """Output of the nth run of ``command`` in the log."""
    runs = [lines for cmd, lines in traced_outputs(log) if cmd == command]
    if len(runs) <= nth:
        raise AssertionError("command not run %d times in the recorded log: %s" % (nth + 1, command))
    return runs[nth]


@pytest.fixture(scope="module")
def single(recorded_dir: Path) -> str:
    return (recorded_dir / "h200-single-gpu.log").read_text()


@pytest.fixture(scope="module")
def two(recorded_dir: Path) -> str:
    return (recorded_dir / "h200-two-gpus.log").read_text()


# --- running the fake --------------------------------------------------------------------------


class Fake:
    def __init__(self, root: Path, **config):
        self.root = root
        (root / "procs").mkdir(parents=True, exist_ok=True)
        self.config(**config)
        self.procs: list[subprocess.Popen] = []

    def config(self, **changes) -> None:
        path = self.root / "config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        cfg.update(changes)
        path.write_text(json.dumps(cfg))

    def run(self, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
        env = dict(os.environ, FAKEGPU_ROOT=str(self.root))
        return subprocess.run(
            [sys.executable, str(FAKE), *args], capture_output=True, text=True, timeout=timeout, env=env
        )

    def out(self, *args: str) -> str:
        res = self.run(*args)
        assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
        return res.stdout

    def used(self) -> list[int]:
        text = self.out("--query-gpu=memory.used", "--format=csv,noheader,nounits")
        return [int(x) for x in text.split()]

    def python3(self, code: str = "import time; time.sleep(120)") -> subprocess.Popen:
        """A process whose argv[0] is 'python3', like the recorded holders."""
        p = subprocess.Popen(["python3", "-c", code], executable=sys.executable, stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        wait_for(lambda: Path("/proc/%d/cmdline" % p.pid).read_bytes().startswith(b"python3"))
        return p

    def hold(self, pid: int, alloc: dict, starttime: Optional[int] = None) -> None:
        rec = {"pid": pid, "starttime": starttime if starttime is not None else stat_starttime(pid), "alloc": alloc}
        (self.root / "procs" / ("%d.json" % pid)).write_text(json.dumps(rec))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def stat_starttime(pid: int) -> int:
    data = Path("/proc/%d/stat" % pid).read_text()
    return int(data[data.rindex(")") + 2 :].split()[19])


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.01)
    raise AssertionError("condition not reached in %.0fs" % timeout)


@pytest.fixture
def h200(tmp_path: Path):
    """The recorded single-H200 host (reserved 615 MiB: 143771 total - 143156 free at 0 used)."""
    fake = Fake(tmp_path, gpus=1, name="NVIDIA H200", total_mib=143771, reserved_mib=615, uuids=[H200_UUID])
    yield fake
    fake.close()


@pytest.fixture
def h200x2(tmp_path: Path):
    """The recorded two-H200 host (reserved 616 MiB each)."""
    fake = Fake(
        tmp_path, gpus=2, name="NVIDIA H200", total_mib=143771, reserved_mib=616, uuids=TWO_UUIDS
    )
    yield fake
    fake.close()


@pytest.fixture
def ada(tmp_path: Path):
    fake = Fake(tmp_path, gpus=4)
    yield fake
    fake.close()


# --- formats -----------------------------------------------------------------------------------


def test_bare_table_equals_recorded_table(h200, single):
    recorded = output_of(single, "nvidia-smi")
    ours = h200.out().splitlines()
    assert STAMP.match(ours[0]) and ours[0].endswith("       ")
    assert ours[1:] == recorded[1:]
    assert len(ours) == len(recorded)


def test_query_gpu_noheader_nounits_equals_recorded_line(h200, single):
    cmd = "nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,memory.free,utilization.gpu --format=csv,noheader,nounits"
    args = cmd.split()[1:]
    assert h200.out(*args).splitlines() == output_of(single, cmd)


def test_query_gpu_csv_header_and_units_equal_recorded(h200x2, two):
    lines = two.splitlines()
    start = lines.index("index, pci.bus_id, uuid, memory.used [MiB], memory.reserved [MiB], memory.total [MiB]")
    recorded = lines[start : start + 3]
    ours = h200x2.out("--query-gpu=index,pci.bus_id,uuid,memory.used,memory.reserved,memory.total", "--format=csv")
    assert ours.splitlines() == recorded


def test_minor_number_and_bus_id_lines_equal_recorded(h200x2, two):
    recorded = [line for line in two.splitlines() if re.search(r"minor|Bus Id", line, re.I)]
    ours = [line for line in h200x2.out("-q").splitlines() if re.search(r"minor|Bus Id", line, re.I)]
    assert ours == recorded


def test_minor_number_is_not_a_query_field(h200):
    # Recorded: --help-query-gpu has no minor_number; real nvidia-smi refuses unknown fields.
    res = h200.run("--query-gpu=index,minor_number", "--format=csv,noheader")
    assert res.returncode == 2
    # Exact text recorded by this project's probe on an H200 (tests/fixtures/recorded/probe):
    # the message, then an empty line.
    assert res.stdout == 'Field "minor_number" is not a valid field to query.\n\n'


def test_unknown_compute_app_field_is_refused(h200):
    res = h200.run("--query-compute-apps=pid,bogus", "--format=csv")
    assert (res.returncode, res.stdout.splitlines()[0]) == (2, 'Field "bogus" is not a valid field to query.')


def _holders_like_recording(fake: Fake) -> tuple[int, int]:
    """Two python3 holders of 20998 and 5638 MiB, as in h200-single-gpu.log (pids 425, 426)."""
    a = fake.python3()
    b = fake.python3()
    low, high = sorted((a.pid, b.pid))
    fake.hold(low, {"0": 20998})
    fake.hold(high, {"0": 5638})
    return low, high


def test_q_d_pids_equals_recorded_block(h200, single):
    lines = single.splitlines()
    start = lines.index("+ head -40") + 1
    end = lines.index("+ nvidia-smi pmon -c 1")
    recorded = lines[start:end]
    low, high = _holders_like_recording(h200)
    ours = h200.out("-q", "-d", "PIDS")
    ours = ours.replace(": %d\n" % low, ": 425\n").replace(": %d\n" % high, ": 426\n").splitlines()
    stamp = [n for n, line in enumerate(recorded) if line.startswith("Timestamp")]
    assert stamp and ours[stamp[0]].startswith("Timestamp" + " " * 46 + ": ")
    ours[stamp[0]] = recorded[stamp[0]]
    assert ours == recorded


def test_compute_apps_nounits_equal_recorded_rows(h200, single):
    cmd = "nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits"
    assert output_of(single, cmd) == []  # first run: no holders yet
    recorded = output_of(single, cmd, nth=1)  # second run, with the two holders
    assert len(recorded) == 2
    low, high = _holders_like_recording(h200)
    ours = h200.out(*cmd.split()[1:]).splitlines()
    ours = [re.sub(r"^%d," % low, "425,", re.sub(r"^%d," % high, "426,", line)) for line in ours]
    assert sorted(ours) == sorted(recorded)
    assert h200.used() == [20998 + 5638]


def test_compute_apps_with_gpu_bus_id_match_recorded_shape(h200x2, two):
    recorded = [line for line in two.splitlines() if re.match(r"^\d+, python3, \d+, GPU-", line)]
    p = h200x2.python3()
    h200x2.hold(p.pid, {"1": 4614})
    ours = h200x2.out(
        "--query-compute-apps=pid,process_name,used_memory,gpu_uuid,gpu_bus_id", "--format=csv,noheader,nounits"
    ).splitlines()
    assert ours == ["%d, python3, 4614, %s, 00000000:00:07.0" % (p.pid, TWO_UUIDS[1])]
    assert re.sub(r"^\d+", "PID", ours[0]) == re.sub(r"^\d+", "PID", recorded[0])


def test_compute_apps_units_header_and_aliases(ada):
    p = ada.python3()
    ada.hold(p.pid, {"2": 716})
    text = ada.out("--query-compute-apps=pid,name,used_gpu_memory,gpu_uuid", "--format=csv")
    header, row = text.splitlines()
    assert header == "pid, process_name, used_gpu_memory [MiB], gpu_uuid"
    pid, name, used, uuid = row.split(", ")
    assert (int(pid), name, used) == (p.pid, "python3", "716 MiB")
    uuids = ada.out("--query-gpu=uuid", "--format=csv,noheader").split()
    assert uuid == uuids[2]


def test_units_for_memory_and_utilization(ada):
    ada.config(utilization={"1": 35})
    text = ada.out("-i", "1", "--query-gpu=index,memory.free,utilization.gpu", "--format=csv")
    assert text.splitlines() == ["index, memory.free [MiB], utilization.gpu [%]", "1, 48524 MiB, 35 %"]


def test_total_is_used_plus_free_plus_reserved(ada):
    p = ada.python3()
    ada.hold(p.pid, {"0": 1000, "3": 20000})
    ada.config(ghost_mib={"1": 1680})
    rows = ada.out("--query-gpu=memory.used,memory.free,memory.reserved,memory.total", "--format=csv,noheader,nounits")
    used = []
    for line in rows.splitlines():
        u, f, r, t = (int(x) for x in line.split(", "))
        assert u + f + r == t
        used.append(u)
    assert used == [1000, 1680, 0, 20000]


def test_uuids_stable_per_seed_and_distinct(tmp_path):
    a = Fake(tmp_path / "a", gpus=3, seed="host-a")
    b = Fake(tmp_path / "b", gpus=3, seed="host-b")
    ua = a.out("--query-gpu=uuid", "--format=csv,noheader").split()
    assert ua == a.out("--query-gpu=uuid", "--format=csv,noheader").split()
    ub = b.out("--query-gpu=uuid", "--format=csv,noheader").split()
    assert len(set(ua + ub)) == 6
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", u) for u in ua)


def test_minors_can_differ_from_indices(tmp_path):
    fake = Fake(tmp_path, gpus=2, minors=[3, 1])
    minors = [line.split(":")[1].strip() for line in fake.out("-q").splitlines() if "Minor Number" in line]
    assert minors == ["3", "1"]


def test_id_filter_and_missing_gpu(ada):
    assert ada.out("-i", "2", "--query-gpu=index", "--format=csv,noheader").split() == ["2"]
    assert ada.out("--id=1,3", "--query-gpu=index", "--format=csv,noheader").split() == ["1", "3"]
    uuid = ada.out("-i", "3", "--query-gpu=uuid", "--format=csv,noheader").strip()
    assert ada.out("-i", uuid, "--query-gpu=index", "--format=csv,noheader").split() == ["3"]
    res = ada.run("-i", "7", "--query-gpu=index", "--format=csv,noheader")
    assert (res.returncode, res.stdout) == (6, "No devices were found\n")


def test_q_filter_keeps_attached_count(ada):
    text = ada.out("-q", "-i", "2")
    assert re.search(r"^Attached GPUs\s+: 4$", text, re.M)
    assert text.count("\nGPU 0000") == 1 and "GPU 00000000:00:08.0" in text


def test_table_lists_processes_per_gpu(ada):
    p = ada.python3()
    ada.hold(p.pid, {"0": 716, "1": 20998})
    text = ada.out()
    rows = [line for line in text.splitlines() if re.match(r"^\|\s+\d+\s+N/A\s+N/A\s+\d+", line)]
    assert len(rows) == 2
    assert all(len(r) == 91 for r in rows)
    assert rows[0].split()[1:7] == ["0", "N/A", "N/A", str(p.pid), "C", "python3"]
    assert rows[1].split()[-2] == "20998MiB"
    header = next(line for line in text.splitlines() if "Process name" in line)
    for row in rows:  # right edges of GPU, PID, Type and GPU Memory line up with the header
        for col, word in ((header.index("GPU") + 3, row.split()[1]), (header.index("PID") + 3, str(p.pid)),
                          (header.index("Type") + 4, "C"), (header.index("Memory") + 6, row.split()[-2])):
            assert row[col - len(word) : col] == word
    assert "No running processes found" not in text
    assert " 716MiB /  49140MiB " in text


def test_missing_format_is_an_error(ada):
    res = ada.run("--query-gpu=index")
    assert res.returncode == 2


# --- memory accounting -------------------------------------------------------------------------


def test_live_holder_counts_and_killed_holder_is_released(ada):
    p = ada.python3()
    ada.hold(p.pid, {"1": 716})
    assert ada.used() == [0, 716, 0, 0]
    p.kill()
    p.wait()
    assert ada.used() == [0, 0, 0, 0]
    assert not (ada.root / "procs" / ("%d.json" % p.pid)).exists()


def test_release_delay_keeps_memory_after_death(ada):
    delay = 2.0
    ada.config(release_delay_s=delay)
    p = ada.python3()
    ada.hold(p.pid, {"0": 5000})
    p.kill()
    p.wait()
    t0 = time.monotonic()
    assert ada.used()[0] == 5000  # the driver has not released it yet
    # The death time is shared with the fake libnvidia-ml.so.1: procs/<pid>.dead, seconds.
    dead = ada.root / "procs" / ("%d.dead" % p.pid)
    assert abs(float(dead.read_text()) - time.time()) < 10
    # A dead process is no longer a compute app even while its memory is still counted.
    assert ada.out("--query-compute-apps=pid", "--format=csv,noheader") == ""
    wait_for(lambda: ada.used()[0] == 0, timeout=delay + 10)
    assert time.monotonic() - t0 >= delay - 0.2
    assert not (ada.root / "procs" / ("%d.json" % p.pid)).exists()
    assert not dead.exists()


def test_zombie_holds_no_memory(ada):
    # Recorded: a child that allocated 6 GiB and exited unreaped (state Z): the GPU showed 0.
    parent = ada.python3("import os,time\npid=os.fork()\nif pid==0:\n    time.sleep(0.3); os._exit(0)\nprint(pid, flush=True); time.sleep(120)")
    child = int(parent.stdout.readline())
    ada.hold(child, {"0": 6144})
    assert ada.used()[0] == 6144
    wait_for(lambda: Path("/proc/%d/stat" % child).read_text().rsplit(")", 1)[1].split()[0] == "Z")
    assert ada.used()[0] == 0


def test_pid_reuse_does_not_count(ada):
    p = ada.python3()
    ada.hold(p.pid, {"0": 100}, starttime=stat_starttime(p.pid) + 1)
    assert ada.used()[0] == 0


def test_process_name_is_argv0_after_prctl_rename(ada):
    # Recorded: after prctl(PR_SET_NAME, "VLLM::Worker"), nvidia-smi still shows python3.
    code = (
        "import ctypes,time\nctypes.CDLL(None).prctl(15, b'VLLM::Worker', 0, 0, 0)\n"
        "print('ready', flush=True); time.sleep(120)"
    )
    p = ada.python3(code)
    assert p.stdout.readline().strip() == "ready"
    assert Path("/proc/%d/comm" % p.pid).read_text().strip() == "VLLM::Worker"
    ada.hold(p.pid, {"0": 10})
    assert ada.out("--query-compute-apps=process_name", "--format=csv,noheader").split() == ["python3"]


def test_process_name_is_argv0_verbatim(ada):
    # Recorded (probe): a holder started as /opt/torch/.venv/bin/python3 is listed by that path.
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    ada.procs.append(p)
    wait_for(lambda: Path("/proc/%d/cmdline" % p.pid).read_bytes().startswith(sys.executable.encode()))
    ada.hold(p.pid, {"0": 10})
    assert ada.out("--query-compute-apps=process_name", "--format=csv,noheader").strip() == sys.executable


def test_touch_mib_on_visible_gpus_without_allocation(ada):
    ada.config(touch_mib=4)
    p = ada.python3()
    rec = {"pid": p.pid, "starttime": stat_starttime(p.pid), "alloc": {"1": 4614}, "visible": [0, 1, 2, 3]}
    (ada.root / "procs" / ("%d.json" % p.pid)).write_text(json.dumps(rec))
    q = ada.python3()
    rec = {"pid": q.pid, "starttime": stat_starttime(q.pid), "alloc": {"1": 4614}, "visible": [1]}
    (ada.root / "procs" / ("%d.json" % q.pid)).write_text(json.dumps(rec))
    assert ada.used() == [4, 9228, 4, 4]  # 4 MiB once per touched GPU, not per process
    assert ada.out("--query-compute-apps=pid", "--format=csv,noheader").split() == sorted([str(p.pid), str(q.pid)], key=int)
    p.kill()
    p.wait()
    assert ada.used() == [0, 4614, 0, 0]


def test_hidden_pids_list_nothing_but_memory_counts(ada):
    ada.config(hidden_pids=True)
    p = ada.python3()
    ada.hold(p.pid, {"0": 716})
    assert ada.out("--query-compute-apps=pid,used_memory", "--format=csv,noheader") == ""
    assert ada.used()[0] == 716
    assert "No running processes found" in ada.out()


def test_wsl2_per_process_memory_not_available(ada):
    ada.config(wsl2=True)
    p = ada.python3()
    ada.hold(p.pid, {"0": 716})
    assert ada.out("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits").strip() == "%d, [N/A]" % p.pid
    assert ada.out("--query-compute-apps=used_memory", "--format=csv").splitlines() == ["used_gpu_memory [MiB]", "[N/A]"]
    assert ada.used()[0] == 716


# --- failure modes -----------------------------------------------------------------------------


def test_fail_mode(ada):
    ada.config(fail=True)
    res = ada.run("--query-gpu=index", "--format=csv")
    assert res.returncode == 9
    assert res.stdout.strip() == (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running."
    )


def test_hang_mode_never_answers(ada):
    ada.config(hang=True)
    with pytest.raises(subprocess.TimeoutExpired):
        ada.run("--query-gpu=index", "--format=csv", timeout=1.5)


def test_garbage_mode_breaks_the_csv(ada):
    good = ada.out("--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits")
    ada.config(garbage=True)
    bad = ada.out("--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits")
    assert bad != good
    assert not all(re.fullmatch(r"\d+, GPU-[0-9a-f-]{36}, \d+, \d+", line) for line in bad.splitlines())


# --- reset -------------------------------------------------------------------------------------


def test_reset_refused_while_in_use(ada):
    p = ada.python3()
    ada.hold(p.pid, {"1": 716})
    res = ada.run("--gpu-reset", "-i", "1")
    assert res.returncode == 255
    assert res.stdout.splitlines()[:2] == [
        "The following GPUs could not be reset:",
        "  GPU 00000000:00:07.0: In use by another client",
    ]
    assert "1 device is currently being used by one or more other processes" in res.stdout
    assert not (ada.root / "resets.jsonl").exists()


def test_reset_of_idle_gpu_succeeds_and_clears_ghost(ada):
    if os.geteuid() != 0:
        pytest.skip("a reset needs root, like the real driver")
    ada.config(ghost_mib={"2": 1680, "3": 4})
    res = ada.run("-r", "-i", "2")
    assert res.returncode == 0
    assert res.stdout == "GPU 00000000:00:08.0 was successfully reset.\nAll done.\n"
    resets = [json.loads(x) for x in (ada.root / "resets.jsonl").read_text().splitlines()]
    assert [r["index"] for r in resets] == [2]
    assert ada.used() == [0, 0, 0, 4]


def test_process_killed_by_signal_is_gone_from_list(ada):
    p = ada.python3()
    ada.hold(p.pid, {"0": 300})
    assert ada.out("--query-compute-apps=pid", "--format=csv,noheader").split() == [str(p.pid)]
    os.kill(p.pid, signal.SIGTERM)
    p.wait()
    assert ada.out("--query-compute-apps=pid", "--format=csv,noheader").split() == []


# --- process names as the real nvidia-smi prints them (probe 4) --------------------------------

PROBE4 = Path(__file__).resolve().parents[1] / "fixtures" / "recorded" / "probe" / "h200-names-probe4.log"
PROBE4_UUID = "GPU-ad473a14-ed2a-c923-1574-31ee551488a3"
# argv[0] and listed MiB of the six CUDA processes of probe 4, in PID order (490 ... 508)
PROBE4_PROCS = [("x, 1\n2, 3 MiB, GPU-00000000-0000-0000-0000-000000000000", 774),
                ("/opt/torch/.venv/bin/python3", 646), ("plain-name", 582), ("a,b\nc", 550),
                ("n" * 32, 534), ("m" * 33, 526)]
PROBE4_PIDS = [490, 496, 499, 502, 505, 508]


def probe4_block(title: str) -> list[str]:
    """The lines recorded under ``== title`` in probe 4 (each line of the log is a repr())."""
    import ast

    lines = PROBE4.read_text().splitlines()
    start = lines.index("== " + title) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("== "))
    return [ast.literal_eval(line) for line in lines[start:end]]


@pytest.fixture
def probe4_host(tmp_path: Path):
    """The probe's GPU and processes: real processes of this machine with the probe's argv[0]
    (commas, a newline, 32 and 33 characters), holding the probe's memory. Yields {our pid:
    the probe's pid}."""
    fake = Fake(tmp_path, gpus=1, name="NVIDIA H200", total_mib=143771, reserved_mib=616,
                uuids=[PROBE4_UUID])
    pids = {}
    for (argv0, mib), real in zip(PROBE4_PROCS, PROBE4_PIDS):
        p = subprocess.Popen([argv0, "-c", "import time; time.sleep(120)"], executable=sys.executable)
        fake.procs.append(p)
        cmdline, want = Path("/proc/%d/cmdline" % p.pid), argv0.encode()
        wait_for(lambda: cmdline.read_bytes().startswith(want))  # noqa: B023 (used at once)
        fake.hold(p.pid, {"0": mib})
        pids[p.pid] = real
    assert sorted(pids) == list(pids), "PIDs out of order (wrapped): run again"
    fake.pids = pids
    yield fake
    fake.close()


def _as_probe(text: str, pids: dict) -> str:
    for ours, real in pids.items():
        text = re.sub(r"(^|\n)%d, " % ours, r"\g<1>%d, " % real, text)
    return text


@pytest.mark.parametrize("fmt", ["csv,noheader", "csv,noheader,nounits"])
def test_process_names_in_csv_as_recorded_commas_as_question_marks(probe4_host, fmt):
    """Recorded: in CSV, nvidia-smi prints a name's commas as '?' and its newlines verbatim."""
    query = "--query-compute-apps=pid,process_name,used_memory,gpu_uuid"
    (recorded,) = probe4_block("nvidia-smi %s --format=%s (repr)" % (query, fmt))
    assert _as_probe(probe4_host.out(query, "--format=" + fmt), probe4_host.pids) == recorded


def test_process_names_in_the_table_as_recorded(probe4_host):
    """Recorded: the table prints commas and newlines verbatim and cuts a name longer than 32
    characters to '...' and its last 29."""
    def rows(lines: list[str]) -> list[str]:  # the processes, PID column blanked
        start = next(i for i, line in enumerate(lines) if "Process name" in line) + 3
        return [line[:17] + " " * 16 + line[33:] if line.startswith("|    0   N/A") else line
                for line in lines[start:-1]]
    recorded = probe4_block("nvidia-smi (bare table, repr of each line)")
    assert rows(probe4_host.out().splitlines()) == rows(recorded)


def test_process_names_in_q_as_recorded(probe4_host):
    """Recorded: -q prints the name verbatim, commas and newlines included."""
    recorded = probe4_block("nvidia-smi -q -d PIDS (repr of each line)")
    ours = probe4_host.out("-q", "-d", "PIDS").splitlines()
    start = ours.index("    Processes")
    ours = [re.sub(r": (\d+)$", lambda m: ": %d" % probe4_host.pids.get(int(m.group(1)), int(m.group(1))), line)
            if "Process ID" in line else line for line in ours[start:]]
    assert ours == recorded[recorded.index("    Processes"):]
