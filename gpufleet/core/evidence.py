"""What a process's own files prove it is (pure): its executable, the NVIDIA device files it
maps, and so whether it is CUDA MPS's control daemon or one of its servers.

Evidence only, no decision: gpufleet/core/policy.py decides what may be signalled from it
(MPS's daemon and servers never are), gpufleet/core/mps.py reads MPS's clients and memory
from it. Both import this module; neither imports the other's reasons for it.
"""
from __future__ import annotations

import os
import re
from typing import Mapping, Optional

from gpufleet.core.model import ProcessInfo

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_SERVER = "nvidia-cuda-mps-server"

# What a holder's mapped NVIDIA device files say (policy.py's "GPU clients" comment: a CUDA
# context maps /dev/nvidia-uvm; an NVML client, a running nvidia-smi or a cuInit-only process
# does not).
MAPS_CUDA = "cuda"  # maps /dev/nvidia-uvm: a CUDA context
MAPS_CLIENT = "client"  # maps readable, and no nvidia-uvm mapped (nvidiaN alone: cuInit only)
MAPS_UNKNOWN = "unknown"  # not available (older agent, unreadable), or uninformative (WSL2)

_CUDA_MAPS = re.compile(r"^/dev/nvidia-uvm$")


def exe_basename(proc: ProcessInfo) -> Optional[str]:
    """The executable's file name, when that file is root's and no one else may write it (the
    agent's exe evidence); None otherwise or when not known."""
    if not proc.exe_root or not proc.exe:
        return None
    path = proc.exe[:-len(" (deleted)")] if proc.exe.endswith(" (deleted)") else proc.exe
    return os.path.basename(path)


def is_mps_daemon(proc: ProcessInfo) -> bool:
    """The CUDA MPS control daemon on evidence alone: its executable is root's
    nvidia-cuda-mps-control (a name proves nothing here: it may only add protection)."""
    return exe_basename(proc) == MPS_CONTROL


def mps_server(proc: ProcessInfo, processes: Mapping[int, ProcessInfo]) -> bool:
    """A CUDA MPS server on evidence: it runs root's nvidia-cuda-mps-server, or it is a child
    of a verified control daemon (the daemon's only children are its servers; a server runs
    as the user of its first client, so its owner proves nothing)."""
    if exe_basename(proc) == MPS_SERVER:
        return True
    parent = processes.get(proc.ppid) if proc.ppid is not None else None
    return parent is not None and parent.pid != proc.pid and is_mps_daemon(parent)


def maps_kind(mapped: Optional[tuple[str, ...]], wsl2: bool) -> str:
    """What the holder's mapped NVIDIA device files say. On WSL2 a mapping-free holder proves
    nothing (the recordings do not show what CUDA maps there), so it stays unknown."""
    if mapped is None:
        return MAPS_UNKNOWN
    if any(_CUDA_MAPS.match(m) for m in mapped):
        return MAPS_CUDA
    return MAPS_UNKNOWN if wsl2 else MAPS_CLIENT
