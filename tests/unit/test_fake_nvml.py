"""The lab's fake libnvidia-ml.so.1 (tests/lab/fakenvml/fakenvml.c) against NVML's ABI and the
fake nvidia-smi.

The library is loaded with ctypes, through struct layouts transcribed HERE from NVIDIA's nvml.h
(github.com/NVIDIA/go-nvml pkg/nvml/nvml.h), independently of the C source, so a layout slip on
either side shows. Both fakes read the same state (a temporary FAKEGPU_ROOT; holders are real
processes of this machine registered as fakecuda.py registers them) and must report the same
numbers. No lab, no root needed.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

FAKE_SMI = Path(__file__).resolve().parents[1] / "lab" / "fake_nvidia_smi.py"
MIB = 1024 * 1024
NOT_AVAILABLE_ULL = 2**64 - 1  # nvml.h NVML_VALUE_NOT_AVAILABLE (-1) in an unsigned long long

# nvml.h return codes (enum nvmlReturn_enum)
SUCCESS, UNINITIALIZED, INVALID_ARGUMENT, NOT_SUPPORTED = 0, 1, 2, 3
INSUFFICIENT_SIZE, DRIVER_NOT_LOADED, GPU_IS_LOST = 7, 9, 15
LIB_RM_VERSION_MISMATCH, ARGUMENT_VERSION_MISMATCH, UNKNOWN = 18, 25, 999


# --- nvml.h, transcribed -----------------------------------------------------------------------


class PciInfo(ctypes.Structure):  # nvml.h: struct nvmlPciInfo_st (nvmlPciInfo_t)
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),  # NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),  # NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
    ]


class Memory(ctypes.Structure):  # nvml.h: struct nvmlMemory_st (nvmlMemory_t)
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class MemoryV2(ctypes.Structure):  # nvml.h: struct nvmlMemory_v2_st (nvmlMemory_v2_t)
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


# nvml.h: #define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2) = sizeof | 2 << 24
MEMORY_V2 = ctypes.sizeof(MemoryV2) | 2 << 24


class ProcessInfoV1(ctypes.Structure):  # nvml.h: struct nvmlProcessInfo_v1_st
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class ProcessInfo(ctypes.Structure):  # nvml.h: struct nvmlProcessInfo_v2_st (= nvmlProcessInfo_t)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class Utilization(ctypes.Structure):  # nvml.h: struct nvmlUtilization_st
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


Device = ctypes.c_void_p  # nvml.h: typedef struct { struct nvmlDevice_st* handle; } nvmlDevice_t

EXPORTS = {
    "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString",
    "nvmlSystemGetDriverVersion", "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetPersistenceMode", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth",
}


class NVML:
    """Thin ctypes calls, as an NVML client makes them."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.nvmlErrorString.restype = ctypes.c_char_p

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    def handle(self, index: int) -> Device:
        dev = Device()
        rc = self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(dev))
        assert rc == SUCCESS, rc
        return dev

    def count(self) -> int:
        n = ctypes.c_uint()
        assert self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == SUCCESS
        return n.value

    def string(self, fn: str, dev: Device, size: int = 96) -> str:
        buf = ctypes.create_string_buffer(size)
        rc = getattr(self.lib, fn)(dev, buf, ctypes.c_uint(size))
        assert rc == SUCCESS, (fn, rc)
        return buf.value.decode()

    def memory_v2(self, dev: Device) -> MemoryV2:
        mem = MemoryV2(version=MEMORY_V2)
        rc = self.lib.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(mem))
        assert rc == SUCCESS, rc
        return mem

    def processes(self, dev: Device, fn: str = "nvmlDeviceGetComputeRunningProcesses_v3",
                  struct: Any = ProcessInfo) -> list:
        n = ctypes.c_uint(0)
        rc = getattr(self.lib, fn)(dev, ctypes.byref(n), None)
        if rc == SUCCESS:
            return []
        assert rc == INSUFFICIENT_SIZE, rc
        infos = (struct * n.value)()
        rc = getattr(self.lib, fn)(dev, ctypes.byref(n), infos)
        assert rc == SUCCESS, rc
        return list(infos[: n.value])

    def uint(self, fn: str, dev: Device, *args: Any) -> int:
        out = ctypes.c_uint()
        rc = getattr(self.lib, fn)(dev, *args, ctypes.byref(out))
        assert rc == SUCCESS, (fn, rc)
        return out.value

    def query(self) -> dict:
        """What an agent reads: every GPU's identity, memory, processes, sensors."""
        assert self.lib.nvmlInit_v2() == SUCCESS
        try:
            version = ctypes.create_string_buffer(80)
            assert self.lib.nvmlSystemGetDriverVersion(version, ctypes.c_uint(80)) == SUCCESS
            cuda = ctypes.c_int()
            assert self.lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == SUCCESS
            gpus = []
            for i in range(self.count()):
                dev = self.handle(i)
                mem = self.memory_v2(dev)
                for field in ("total", "reserved", "free", "used"):
                    assert getattr(mem, field) % MIB == 0, field
                pci = PciInfo()
                assert self.lib.nvmlDeviceGetPciInfo_v3(dev, ctypes.byref(pci)) == SUCCESS
                util = Utilization()
                assert self.lib.nvmlDeviceGetUtilizationRates(dev, ctypes.byref(util)) == SUCCESS
                gpus.append({
                    "index": i,
                    "uuid": self.string("nvmlDeviceGetUUID", dev),
                    "name": self.string("nvmlDeviceGetName", dev),
                    "bus_id": pci.busId.decode(),
                    "minor": self.uint("nvmlDeviceGetMinorNumber", dev),
                    "used": mem.used // MIB, "total": mem.total // MIB,
                    "reserved": mem.reserved // MIB, "free": mem.free // MIB,
                    "util": util.gpu,
                    "temp": self.uint("nvmlDeviceGetTemperature", dev, ctypes.c_int(0)),
                    "power_w": self.uint("nvmlDeviceGetPowerUsage", dev) / 1000.0,
                    "apps": [(p.pid, None if p.usedGpuMemory == NOT_AVAILABLE_ULL else p.usedGpuMemory / MIB)
                             for p in self.processes(dev)],
                })
            return {"driver": version.value.decode(), "cuda": cuda.value, "gpus": gpus}
        finally:
            assert self.lib.nvmlShutdown() == SUCCESS


# --- the shared state ----------------------------------------------------------------------------


def stat_starttime(pid: int) -> int:
    data = Path("/proc/%d/stat" % pid).read_text()
    return int(data[data.rindex(")") + 2 :].split()[19])


class State:
    """A FAKEGPU_ROOT both fakes read; holders are `sleep` processes of this machine."""

    def __init__(self, root: Path):
        self.root = root
        (root / "procs").mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.config()

    def config(self, **changes: Any) -> None:
        path = self.root / "config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        cfg.update(changes)
        tmp = self.root / "config.json.tmp"
        tmp.write_text(json.dumps(cfg))
        os.rename(tmp, path)

    def holder(self, alloc: dict, argv: Optional[list[str]] = None, **extra: Any
               ) -> subprocess.Popen:
        p = subprocess.Popen(argv or ["sleep", "120"])
        self.procs.append(p)
        rec = dict({"pid": p.pid, "starttime": stat_starttime(p.pid), "alloc": alloc}, **extra)
        (self.root / "procs" / ("%d.json" % p.pid)).write_text(json.dumps(rec))
        return p

    def smi(self, *args: str) -> str:
        env = dict(os.environ, FAKEGPU_ROOT=str(self.root))
        res = subprocess.run([sys.executable, str(FAKE_SMI), *args], capture_output=True, text=True,
                             timeout=30, env=env)
        assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
        return res.stdout

    def smi_query(self) -> dict:
        """The same facts through the fake nvidia-smi (query-gpu, compute-apps, -q, the table)."""
        fields = "index,uuid,name,pci.bus_id,memory.used,memory.total,memory.reserved,memory.free,utilization.gpu,temperature.gpu"
        gpus: list[dict[str, Any]] = []
        for line in self.smi("--query-gpu=" + fields, "--format=csv,noheader,nounits").splitlines():
            v = [x.strip() for x in line.split(",")]
            gpus.append({"index": int(v[0]), "uuid": v[1], "name": v[2], "bus_id": v[3],
                         "used": int(v[4]), "total": int(v[5]), "reserved": int(v[6]),
                         "free": int(v[7]), "util": int(v[8]), "temp": int(v[9]), "apps": []})
        by_uuid = {g["uuid"]: g for g in gpus}
        apps = self.smi("--query-compute-apps=gpu_uuid,pid,used_gpu_memory", "--format=csv,noheader,nounits")
        for line in apps.splitlines():
            uuid, pid, used = [x.strip() for x in line.split(",")]
            by_uuid[uuid]["apps"].append((int(pid), None if used == "[N/A]" else float(used)))
        minors = [int(m) for m in re.findall(r"Minor Number\s+: (\d+)", self.smi("-q"))]
        table = self.smi()
        powers = [float(w) for w in re.findall(r"(\d+)W /", table)]
        for g, minor, power in zip(gpus, minors, powers):
            g["minor"] = minor
            g["power_w"] = power
        head = re.search(r"Driver Version: (\S+)\s+CUDA Version: (\d+)\.(\d+)", table)
        assert head
        return {"driver": head.group(1), "cuda": int(head.group(2)) * 1000 + int(head.group(3)) * 10,
                "gpus": gpus}

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def nvml(fake_nvml_library: Path) -> NVML:
    return NVML(fake_nvml_library)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKEGPU_ROOT", str(tmp_path))  # the library reads getenv at every call
    s = State(tmp_path)
    yield s
    s.close()


def kill(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


# --- both fakes, same numbers --------------------------------------------------------------------


def _idle(s: State) -> None:
    pass  # an empty config.json: both fakes' defaults


def _holders(s: State) -> None:
    s.config(gpus=3, name="NVIDIA H200", total_mib=143771, reserved_mib=[615, 616, 616])
    s.holder({"0": 20480})
    s.holder({"0": 1024, "2": 716})
    s.holder({"1": 0})  # a CUDA context without memory: not listed


def _dead_within_delay(s: State) -> None:
    s.config(gpus=2, release_delay_s=60)
    s.holder({"1": 3000})
    kill(s.holder({"1": 5000, "0": 100}))


def _dead_past_delay(s: State) -> None:
    s.config(gpus=2, release_delay_s=0.0)
    s.holder({"0": 700})
    kill(s.holder({"1": 5000}))


def _zombie(s: State) -> None:
    s.config(gpus=1)
    z = s.holder({"0": 6000})
    z.kill()
    time.sleep(0.1)  # unreaped: a zombie holds nothing (recorded)


# The H200 probe's part D (tests/fixtures/real-h200/clean-cases/probe-1.log): the main thread
# calls pthread_exit while another thread runs on.
ZOMBIE_LEADER = ("import ctypes, threading, time\n"
                 "threading.Thread(target=time.sleep, args=(120,)).start()\n"
                 "ctypes.CDLL(None).pthread_exit(None)\n")


def _zombie_leader(s: State) -> None:
    s.config(gpus=2)
    p = s.holder({"1": 5638}, argv=[sys.executable, "-c", ZOMBIE_LEADER])
    deadline = time.monotonic() + 10
    while Path("/proc/%d/stat" % p.pid).read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the leader never became a zombie"
        time.sleep(0.01)


def _ghost(s: State) -> None:
    s.config(gpus=2, ghost_mib={"1": 1680})
    s.holder({"1": 500})


def _wsl2(s: State) -> None:
    s.config(gpus=1, wsl2=True, name="NVIDIA GeForce RTX 4090", total_mib=24564, ghost_mib={"0": 900})
    s.holder({"0": 2048})


def _hidden(s: State) -> None:
    s.config(gpus=2, hidden_pids=True)
    s.holder({"0": 4096, "1": 128})


def _unlisted_and_touch(s: State) -> None:
    s.config(gpus=3, unlisted_mib_base=3, unlisted_mib_per_process=6, touch_mib=4)
    s.holder({"0": 1000}, visible=[0, 1])
    s.holder({"0": 2000})


def _explicit_and_clamped(s: State) -> None:
    s.config(gpus=2, uuids=["GPU-aaaaaaaa-1111-2222-3333-444444444444", "GPU-bbbbbbbb-1111-2222-3333-444444444444"],
             bus_ids=["00000000:1B:00.0", "00000000:9A:00.0"], minors=[3, 1], total_mib=[8192, 16384],
             utilization={"0": 97}, temp_c=61, power_w=412, driver="575.57.08", cuda="12.9",
             name=["NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"])
    s.holder({"0": 9000})  # more than fits: used is clamped at total - reserved


def _mps(s: State, server_only: bool = False) -> subprocess.Popen:
    """A CUDA MPS server (66 MiB, recorded) and two clients; returns the server."""
    s.config(gpus=2, mps_server_only=server_only, unlisted_mib_base=3, unlisted_mib_per_process=6)
    server = s.holder({"0": 66, "1": 66})
    s.holder({"0": 3588}, mps_server=server.pid)
    s.holder({"0": 1000, "1": 500}, mps_server=server.pid)
    return server


def _mps_server_only(s: State) -> None:
    _mps(s, server_only=True)


SCENARIOS = [_idle, _holders, _dead_within_delay, _dead_past_delay, _zombie, _zombie_leader,
             _ghost, _wsl2, _hidden, _unlisted_and_touch, _explicit_and_clamped, _mps,
             _mps_server_only]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[f.__name__.strip("_") for f in SCENARIOS])
def test_nvml_and_nvidia_smi_report_the_same(nvml: NVML, state: State, scenario) -> None:
    scenario(state)
    first = nvml.query()
    smi = state.smi_query()
    assert first == smi
    assert nvml.query() == first  # and reading again changes nothing


def test_zombie_leader_with_a_live_thread_still_holds(nvml: NVML, state: State) -> None:
    """Recorded on the H200: NVML listed the zombie leader with its memory (probe-1.log D)."""
    _zombie_leader(state)
    gpus = nvml.query()["gpus"]
    assert [g["used"] for g in gpus] == [0, 5638]
    assert [pid for pid, _ in gpus[1]["apps"]] == [state.procs[-1].pid]


def test_holders_scenario_is_not_trivial(nvml: NVML, state: State) -> None:
    _holders(state)
    gpus = nvml.query()["gpus"]
    assert [g["used"] for g in gpus] == [21504, 0, 716]
    assert [len(g["apps"]) for g in gpus] == [2, 0, 1]
    assert gpus[0]["apps"][0][1] in (20480, 1024)


def test_mps_clients_are_listed_as_themselves_or_in_their_servers_row(nvml: NVML, state: State
                                                                       ) -> None:
    """Recorded on the H200: NVML lists the server (66 MiB) and each client; where NVML lists
    only the server (mps_server_only), its row is the sum, and memory.used is the same."""
    server = _mps(state)
    gpus = nvml.query()["gpus"]
    assert [len(g["apps"]) for g in gpus] == [3, 2]
    used = [g["used"] for g in gpus]
    state.config(mps_server_only=True)
    gpus = nvml.query()["gpus"]
    assert [g["apps"] for g in gpus] == [[(server.pid, 66 + 3588 + 1000)], [(server.pid, 566)]]
    assert [g["used"] for g in gpus] == used  # how NVML lists is no memory


def test_release_delay_is_counted_from_the_first_sighting_by_either_fake(nvml: NVML, state: State) -> None:
    state.config(gpus=1, release_delay_s=30)
    p = state.holder({"0": 5000})
    kill(p)
    dead = state.root / "procs" / ("%d.dead" % p.pid)
    assert nvml.query()["gpus"][0]["used"] == 5000  # the library saw the death first...
    first_seen = float(dead.read_text())
    assert abs(first_seen - time.time()) < 5
    assert state.smi_query()["gpus"][0]["used"] == 5000  # ...and nvidia-smi keeps its time
    assert float(dead.read_text()) == first_seen
    # A death first seen long ago (by either fake) is past the delay for both.
    dead.write_text("%.6f\n" % (time.time() - 100))
    assert nvml.query()["gpus"][0]["used"] == 0
    assert not dead.exists() and not (state.root / "procs" / ("%d.json" % p.pid)).exists()
    q = state.holder({"0": 700})
    kill(q)
    assert state.smi_query()["gpus"][0]["used"] == 700  # nvidia-smi first, this time
    (state.root / "procs" / ("%d.dead" % q.pid)).write_text("%.6f\n" % (time.time() - 100))
    assert state.smi_query()["gpus"][0]["used"] == 0
    assert nvml.query()["gpus"][0]["used"] == 0


# --- the ABI ---------------------------------------------------------------------------------------


def test_exports_exactly_the_agent_functions(fake_nvml_library: Path) -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed")
    out = subprocess.run([nm, "-D", "--defined-only", str(fake_nvml_library)], capture_output=True,
                         text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if " T " in line}
    assert exported == EXPORTS
    soname = subprocess.run(["objdump", "-p", str(fake_nvml_library)], capture_output=True, text=True).stdout
    assert re.search(r"SONAME\s+libnvidia-ml\.so\.1", soname)


def test_struct_sizes_match_nvml_h() -> None:
    # A mistake in the transcription above would make every comparison meaningless.
    assert (ctypes.sizeof(PciInfo), ctypes.sizeof(MemoryV2), ctypes.sizeof(ProcessInfoV1),
            ctypes.sizeof(ProcessInfo)) == (68, 40, 16, 24)
    assert MEMORY_V2 == 0x02000028


def test_memory_v2_checks_the_struct_version(nvml: NVML, state: State) -> None:
    assert nvml.nvmlInit_v2() == SUCCESS
    dev = nvml.handle(0)
    for wrong in (0, 2 << 24, ctypes.sizeof(MemoryV2), ctypes.sizeof(MemoryV2) | 1 << 24):
        mem = MemoryV2(version=wrong)
        assert nvml.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(mem)) == ARGUMENT_VERSION_MISMATCH
        assert mem.total == 0
    assert nvml.nvmlDeviceGetMemoryInfo_v2(dev, None) == INVALID_ARGUMENT
    assert nvml.memory_v2(dev).total == 49140 * MIB
    assert nvml.nvmlShutdown() == SUCCESS


def test_memory_v1_counts_the_reservation_as_used(nvml: NVML, state: State) -> None:
    # Recorded on the H200 (probe3): v1 used 615 MiB on an idle GPU, v2 used 0 + reserved 615.
    state.config(gpus=1, total_mib=143771, reserved_mib=615)
    state.holder({"0": 1000})
    assert nvml.nvmlInit_v2() == SUCCESS
    dev = nvml.handle(0)
    v1 = Memory()
    assert nvml.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(v1)) == SUCCESS
    v2 = nvml.memory_v2(dev)
    assert (v1.total, v1.free, v1.used) == (143771 * MIB, v2.free, (1000 + 615) * MIB)
    assert (v2.used, v2.reserved) == (1000 * MIB, 615 * MIB)
    assert v2.total == v2.used + v2.free + v2.reserved
    assert nvml.nvmlShutdown() == SUCCESS


@pytest.mark.parametrize("fn,struct", [
    ("nvmlDeviceGetComputeRunningProcesses_v3", ProcessInfo),
    ("nvmlDeviceGetComputeRunningProcesses_v2", ProcessInfo),
    ("nvmlDeviceGetComputeRunningProcesses", ProcessInfoV1),
])
def test_process_list_sizes_like_the_driver(nvml: NVML, state: State, fn: str, struct: Any) -> None:
    state.config(gpus=2)
    assert nvml.nvmlInit_v2() == SUCCESS
    call = getattr(nvml, fn)
    dev0, dev1 = nvml.handle(0), nvml.handle(1)
    n = ctypes.c_uint(0)
    assert call(dev0, ctypes.byref(n), None) == SUCCESS and n.value == 0  # none: SUCCESS
    a, b = state.holder({"0": 100}), state.holder({"0": 200, "1": 300})
    n = ctypes.c_uint(0)
    assert call(dev0, ctypes.byref(n), None) == INSUFFICIENT_SIZE and n.value == 2
    one = (struct * 1)()
    n = ctypes.c_uint(1)
    assert call(dev0, ctypes.byref(n), one) == INSUFFICIENT_SIZE and n.value == 2
    room = (struct * 5)()
    n = ctypes.c_uint(5)
    assert call(dev0, ctypes.byref(n), room) == SUCCESS and n.value == 2
    got = sorted((p.pid, p.usedGpuMemory // MIB) for p in room[:2])
    assert got == sorted([(a.pid, 100), (b.pid, 200)])
    if struct is ProcessInfo:
        assert {(p.gpuInstanceId, p.computeInstanceId) for p in room[:2]} == {(0xFFFFFFFF, 0xFFFFFFFF)}
    assert call(dev0, None, room) == INVALID_ARGUMENT
    assert [(p.pid, p.usedGpuMemory // MIB) for p in nvml.processes(dev1, fn, struct)] == [(b.pid, 300)]
    n = ctypes.c_uint(0)
    assert nvml.nvmlDeviceGetGraphicsRunningProcesses_v3(dev0, ctypes.byref(n), None) == SUCCESS
    assert n.value == 0
    assert nvml.nvmlShutdown() == SUCCESS


def test_wsl2_per_process_memory_is_not_available(nvml: NVML, state: State) -> None:
    state.config(gpus=1, wsl2=True)
    p = state.holder({"0": 2048})
    assert nvml.nvmlInit_v2() == SUCCESS
    procs = nvml.processes(nvml.handle(0))
    assert [(x.pid, x.usedGpuMemory) for x in procs] == [(p.pid, NOT_AVAILABLE_ULL)]
    assert nvml.memory_v2(nvml.handle(0)).used == 2048 * MIB
    assert nvml.nvmlShutdown() == SUCCESS


def test_init_refcount_and_uninitialized(nvml: NVML, state: State) -> None:
    n = ctypes.c_uint()
    assert nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) == UNINITIALIZED
    assert nvml.nvmlShutdown() == UNINITIALIZED
    assert nvml.nvmlInitWithFlags(ctypes.c_uint(0)) == SUCCESS
    assert nvml.nvmlInit_v2() == SUCCESS
    assert nvml.nvmlShutdown() == SUCCESS
    dev = nvml.handle(0)  # one init left
    assert nvml.nvmlShutdown() == SUCCESS
    buf = ctypes.create_string_buffer(96)
    assert nvml.nvmlDeviceGetUUID(dev, buf, ctypes.c_uint(96)) == UNINITIALIZED


def test_arguments_and_small_buffers(nvml: NVML, state: State) -> None:
    state.config(gpus=2)
    assert nvml.nvmlInit_v2() == SUCCESS
    dev = Device()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(2), ctypes.byref(dev)) == INVALID_ARGUMENT
    assert nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(0), None) == INVALID_ARGUMENT
    dev = nvml.handle(1)
    small = ctypes.create_string_buffer(10)
    assert nvml.nvmlDeviceGetUUID(dev, small, ctypes.c_uint(10)) == INSUFFICIENT_SIZE
    uuid = nvml.string("nvmlDeviceGetUUID", dev, 80)  # NVML_DEVICE_UUID_BUFFER_SIZE
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid)
    assert nvml.nvmlDeviceGetUUID(Device(12345), small, ctypes.c_uint(10)) == INVALID_ARGUMENT
    name = ctypes.create_string_buffer(len("NVIDIA RTX 6000 Ada Generation"))  # no room for the NUL
    assert nvml.nvmlDeviceGetName(dev, name, ctypes.c_uint(len(name))) == INSUFFICIENT_SIZE
    pci = PciInfo()
    assert nvml.nvmlDeviceGetPciInfo_v3(dev, ctypes.byref(pci)) == SUCCESS
    assert (pci.busId, pci.busIdLegacy, pci.domain, pci.bus, pci.device) == (
        b"00000000:00:07.0", b"0000:00:07.0", 0, 0, 7)
    assert nvml.nvmlShutdown() == SUCCESS


def test_recorded_h200_answers(nvml: NVML, state: State) -> None:
    """tests/fixtures/recorded/probe/h200-clients-probe3.log, section 3."""
    assert nvml.nvmlInit_v2() == SUCCESS
    dev = nvml.handle(0)
    u = nvml.uint
    assert u("nvmlDeviceGetPersistenceMode", dev) == 1
    assert (u("nvmlDeviceGetCurrPcieLinkGeneration", dev), u("nvmlDeviceGetCurrPcieLinkWidth", dev),
            u("nvmlDeviceGetMaxPcieLinkGeneration", dev), u("nvmlDeviceGetMaxPcieLinkWidth", dev)) == (5, 16, 5, 16)
    pending = ctypes.c_int(0)
    assert nvml.nvmlDeviceGetRetiredPagesPendingStatus(dev, ctypes.byref(pending)) == NOT_SUPPORTED
    reasons = ctypes.c_ulonglong(99)
    assert nvml.nvmlDeviceGetCurrentClocksEventReasons(dev, ctypes.byref(reasons)) == SUCCESS
    assert reasons.value == 0
    for counter in (0, 1):  # volatile, aggregate
        ecc = ctypes.c_ulonglong(99)
        assert nvml.nvmlDeviceGetTotalEccErrors(dev, ctypes.c_int(1), ctypes.c_int(counter), ctypes.byref(ecc)) == SUCCESS
        assert ecc.value == 0
    rows = [ctypes.c_uint(9) for _ in range(4)]
    assert nvml.nvmlDeviceGetRemappedRows(dev, *[ctypes.byref(r) for r in rows]) == SUCCESS
    assert [r.value for r in rows] == [0, 0, 0, 0]
    cuda = ctypes.c_int()
    assert nvml.nvmlSystemGetCudaDriverVersion(ctypes.byref(cuda)) == SUCCESS and cuda.value == 13000
    assert nvml.nvmlShutdown() == SUCCESS


def test_error_strings(nvml: NVML) -> None:
    assert nvml.nvmlErrorString(DRIVER_NOT_LOADED) == b"Driver Not Loaded"
    assert nvml.nvmlErrorString(LIB_RM_VERSION_MISMATCH) == b"Driver/library version mismatch"
    assert nvml.nvmlErrorString(GPU_IS_LOST) == b"GPU is lost"
    assert nvml.nvmlErrorString(UNKNOWN) == b"Unknown Error"


# --- failure modes -------------------------------------------------------------------------------


def test_broken_driver_fails_init_like_nvidia_smi(nvml: NVML, state: State) -> None:
    state.config(fail=True)
    assert nvml.nvmlInit_v2() == DRIVER_NOT_LOADED
    env = dict(os.environ, FAKEGPU_ROOT=str(state.root))
    smi = subprocess.run([sys.executable, str(FAKE_SMI)], capture_output=True, text=True, env=env, timeout=30)
    assert smi.returncode == DRIVER_NOT_LOADED  # nvidia-smi exits with NVML's return code
    state.config(fail=False, nvml_init_error=LIB_RM_VERSION_MISMATCH)
    assert nvml.nvmlInit_v2() == LIB_RM_VERSION_MISMATCH
    state.config(nvml_init_error=0)
    assert nvml.nvmlInit_v2() == SUCCESS
    dev = nvml.handle(0)
    state.config(fail=True)  # the driver goes away under a client
    assert nvml.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(MemoryV2(version=MEMORY_V2))) == UNKNOWN
    assert nvml.nvmlShutdown() == SUCCESS


def test_lost_gpu(nvml: NVML, state: State) -> None:
    state.config(gpus=2)
    assert nvml.nvmlInit_v2() == SUCCESS
    dev1 = nvml.handle(1)
    state.config(lost=[1])
    assert nvml.count() == 2  # still counted
    dev = Device()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(1), ctypes.byref(dev)) == GPU_IS_LOST
    mem = MemoryV2(version=MEMORY_V2)
    assert nvml.nvmlDeviceGetMemoryInfo_v2(dev1, ctypes.byref(mem)) == GPU_IS_LOST
    n = ctypes.c_uint(0)
    assert nvml.nvmlDeviceGetComputeRunningProcesses_v3(dev1, ctypes.byref(n), None) == GPU_IS_LOST
    buf = ctypes.create_string_buffer(96)
    assert nvml.nvmlDeviceGetUUID(dev1, buf, ctypes.c_uint(96)) == GPU_IS_LOST
    assert nvml.memory_v2(nvml.handle(0)).total == 49140 * MIB  # the other GPU answers
    assert nvml.nvmlShutdown() == SUCCESS


def test_hang_blocks_until_the_driver_answers(nvml: NVML, state: State) -> None:
    state.config(hang=True)
    result: list = []
    t = threading.Thread(target=lambda: result.append(nvml.nvmlInit_v2()), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive() and not result  # blocked
    state.config(hang=False)
    t.join(5)
    assert result == [SUCCESS]
    assert nvml.nvmlShutdown() == SUCCESS


# --- cost ------------------------------------------------------------------------------------------


def _full_query(lib: Any) -> None:
    """init, count, per GPU: handle, memory_v2, processes_v3 (size, then fill), UUID, name, PCI;
    shutdown: what the agent's snapshot reads."""
    lib.nvmlInit_v2()
    n = ctypes.c_uint()
    lib.nvmlDeviceGetCount_v2(ctypes.byref(n))
    buf = ctypes.create_string_buffer(96)
    for i in range(n.value):
        dev = Device()
        lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(dev))
        mem = MemoryV2(version=MEMORY_V2)
        assert lib.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(mem)) == SUCCESS
        count = ctypes.c_uint(0)
        if lib.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(count), None) == INSUFFICIENT_SIZE:
            infos = (ProcessInfo * count.value)()
            lib.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(count), infos)
        lib.nvmlDeviceGetUUID(dev, buf, 96)
        lib.nvmlDeviceGetName(dev, buf, 96)
        lib.nvmlDeviceGetPciInfo_v3(dev, ctypes.byref(PciInfo()))
    lib.nvmlShutdown()


@pytest.mark.parametrize("gpus,holders", [(1, 1), (8, 8)])
def test_full_query_costs_well_under_a_millisecond_per_gpu(nvml: NVML, state: State, gpus: int, holders: int) -> None:
    state.config(gpus=gpus, total_mib=143771, reserved_mib=616)
    for k in range(holders):
        state.holder({str(k % gpus): 1000 + k})
    for _ in range(20):
        _full_query(nvml.lib)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        _full_query(nvml.lib)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    sys.stderr.write("fake NVML full query, %d GPU(s), %d holder(s): median %.1f us, p90 %.1f us\n"
                     % (gpus, holders, median * 1e6, sorted(times)[int(len(times) * 0.9)] * 1e6))
    # Measured here: see tests/lab/README.md. Generous bound for a loaded 2-core machine.
    assert median < 1e-3 * gpus


# --- threads ---------------------------------------------------------------------------------------

THREADS_CHILD = r"""
import ctypes, json, os, sys, threading, time
lib = ctypes.CDLL(sys.argv[1])
root, expected = sys.argv[2], json.loads(sys.argv[3])
MIB, INSUFFICIENT_SIZE = 1024 * 1024, 7

class MemoryV2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

class ProcessInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

wrong, stop = [], time.monotonic() + float(sys.argv[4])

def query():
    assert lib.nvmlInit_v2() == 0
    seen = {}
    for i in range(2):
        dev = ctypes.c_void_p()
        assert lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(dev)) == 0
        mem = MemoryV2(version=ctypes.sizeof(MemoryV2) | 2 << 24)
        assert lib.nvmlDeviceGetMemoryInfo_v2(dev, ctypes.byref(mem)) == 0
        n = ctypes.c_uint(0)
        assert lib.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(n), None) == INSUFFICIENT_SIZE
        infos = (ProcessInfo * n.value)()
        assert lib.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(n), infos) == 0
        seen[str(i)] = [mem.used // MIB, sorted([p.pid, p.usedGpuMemory // MIB] for p in infos[: n.value])]
    assert lib.nvmlShutdown() == 0
    return seen

def reader():
    while time.monotonic() < stop:
        got = query()
        if got != expected:
            wrong.append(got)

def rewriter():  # a new config.json (same values): every reader's next call parses it again
    text = open(os.path.join(root, "config.json")).read()
    while time.monotonic() < stop:
        tmp = os.path.join(root, "config.json.tmp")
        with open(tmp, "w") as f:
            f.write(text + " " * (int(time.monotonic() * 1000) % 7))
        os.rename(tmp, os.path.join(root, "config.json"))

threads = [threading.Thread(target=reader) for _ in range(8)] + [threading.Thread(target=rewriter)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"wrong": len(wrong), "first": wrong[:1]}))
"""


def test_calls_from_many_threads_at_once_see_one_consistent_state(nvml: NVML, state: State,
                                                                  fake_nvml_library: Path) -> None:
    """An NVML client may call from several threads (a pynvml poller beside the main thread);
    the library's parsed config and snapshot cache are shared, so its calls take one lock.
    Run in a child so that a crash (a freed cache read by another thread) fails the test."""
    state.config(gpus=2, total_mib=143771, reserved_mib=616)
    holders = [state.holder({"0": 1000 + k, "1": 500 + k}) for k in range(6)]
    expected = nvml.query()
    want = {str(g["index"]): [g["used"], sorted([pid, int(mib)] for pid, mib in g["apps"])]
            for g in expected["gpus"]}
    assert all(len(v[1]) == len(holders) for v in want.values())
    res = subprocess.run([sys.executable, "-c", THREADS_CHILD, str(fake_nvml_library), str(state.root),
                          json.dumps(want), "3"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, FAKEGPU_ROOT=str(state.root)))
    assert res.returncode == 0, (res.returncode, res.stderr[-2000:])
    assert json.loads(res.stdout) == {"wrong": 0, "first": []}
