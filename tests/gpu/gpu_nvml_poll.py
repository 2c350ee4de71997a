#!/usr/bin/env python3
"""Watch GPU memory through NVML every ~2 ms and print each change (the release-time ruler).

nvidia-smi costs ~25 ms a call; NVML in-process costs well under a millisecond, so this process
times when the driver gives memory back. It prints one JSON line per change of
(memory.used per GPU, PIDs listed per GPU): ``{"t": CLOCK_MONOTONIC seconds, "used": [MiB..],
"pids": [[pid..]..]}``; the first line is ``{"ready": true, ...}``. It runs until stdin closes.

It holds the NVIDIA device files like any monitoring tool (nvtop, dcgm-exporter): the
scenario checks that a clean shows it as a GPU client (it maps no GPU device) and never
signals it.
Uses pynvml (nvidia-ml-py) when present, else libnvidia-ml through ctypes (memory only).
"""
import ctypes
import json
import os
import select
import sys
import time

MIB = 1 << 20


class _Mem2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong),
                ("reserved", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _CtypesNvml(object):
    """The three NVML calls needed, without pynvml: nvmlInit_v2, handle by index, memory v2."""

    method = "ctypes"

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")
        count = ctypes.c_uint()
        self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
        self.handles = []
        for i in range(count.value):
            h = ctypes.c_void_p()
            self.lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
            self.handles.append(h)

    def used_mib(self, i):
        m = _Mem2()
        m.version = ctypes.sizeof(_Mem2) | (2 << 24)
        if self.lib.nvmlDeviceGetMemoryInfo_v2(self.handles[i], ctypes.byref(m)) != 0:
            return None
        return m.used // MIB

    def pids(self, i):
        return None


class _PyNvml(object):
    method = "pynvml"

    def __init__(self):
        import pynvml

        self.n = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
        self.v2 = getattr(pynvml, "nvmlMemory_v2", None)
        try:
            self.used_mib(0)
        except Exception:
            self.v2 = None
            self.method = "pynvml-v1"

    def used_mib(self, i):
        if self.v2 is not None:
            info = self.n.nvmlDeviceGetMemoryInfo(self.handles[i], version=self.v2)
        else:
            info = self.n.nvmlDeviceGetMemoryInfo(self.handles[i])
        return int(info.used) // MIB

    def pids(self, i):
        try:
            procs = self.n.nvmlDeviceGetComputeRunningProcesses(self.handles[i])
        except Exception:
            return None
        return sorted(int(p.pid) for p in procs)


def open_nvml():
    try:
        return _PyNvml()
    except Exception:
        return _CtypesNvml()


def main():
    interval = float(sys.argv[1]) if len(sys.argv) > 1 else 0.002
    nvml = open_nvml()
    count = len(nvml.handles)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "method": nvml.method,
                          "gpus": count}) + "\n")
    out.flush()
    last = None
    while True:
        used = [nvml.used_mib(i) for i in range(count)]
        pids = [nvml.pids(i) for i in range(count)]
        now = time.monotonic()
        state = (used, pids)
        if state != last:
            out.write(json.dumps({"t": round(now, 6), "used": used, "pids": pids}) + "\n")
            out.flush()
            last = state
        r, _, _ = select.select([0], [], [], interval)
        if r and not os.read(0, 4096):
            return


if __name__ == "__main__":
    main()
