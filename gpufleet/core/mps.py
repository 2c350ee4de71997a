"""CUDA MPS on a host: its servers' expected memory, its clients, how to stop it (pure).

MPS (the Multi-Process Service) runs a control daemon (``nvidia-cuda-mps-control -d``) that
starts one server per user (``nvidia-cuda-mps-server``); CUDA processes that find the daemon's
pipe become the server's clients. Recorded on an H200 (driver 580.159.04,
tests/fixtures/real-h200/clean-cases/probe-1.log part C): NVML lists the server (type C,
66 MiB) and each client (type M+C, its own memory); the server keeps its 66 MiB while MPS
runs; SIGKILL of a client frees the client's memory at once; ``echo quit |
nvidia-cuda-mps-control`` waits while any client is connected and returns at once with none;
the daemon's children are its servers, the clients are not.

So the daemon and its servers are infrastructure (gpufleet.core.policy protects them on their
executables' evidence, read in gpufleet.core.evidence), the clients are targets like any
process, and the servers' memory is expected on their GPUs while MPS runs
(``expected_server_mib``: the memory ledger, core/ledger.py, and the after-clean threshold
count it). Where NVML lists only the server (some drivers and containers do), its row also
holds its clients' memory; the daemon's own lists (the agent asks it: ``get_server_list``,
``get_client_list``; ``Snapshot.mps``) say who its clients are, taken as a claim: only processes with NVIDIA device files open count (``listed_clients``); the
server's own share is then the measured one (``MEASURED_SERVER_MIB``).
"""
from __future__ import annotations

import shlex
from typing import Optional

from gpufleet.core import evidence
from gpufleet.core.gpus import format_gpu_indices
from gpufleet.core.model import Holder, MpsDaemon, Snapshot

#: An MPS server's own memory on a GPU, with or without clients: 66 MiB on the H200
#: (probe-1.log part C, NVML's row of the server before and after its client's SIGKILL). Used
#: only where NVML counts the clients' memory in the server's row, so its own is not known.
MEASURED_SERVER_MIB = 66

#: Where the daemon and its clients meet when CUDA_MPS_PIPE_DIRECTORY is not set (NVIDIA's
#: MPS documentation).
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"


def daemons(snapshot: Snapshot) -> tuple[int, ...]:
    """PIDs of the MPS control daemons here, on their executables' evidence."""
    return tuple(sorted(p.pid for p in snapshot.processes.values() if evidence.is_mps_daemon(p)))


def servers(snapshot: Snapshot) -> frozenset[int]:
    """PIDs NVML lists that are MPS servers on evidence (evidence.mps_server)."""
    return frozenset(pid for pid in snapshot.listed_pids()
                     if pid in snapshot.processes
                     and evidence.mps_server(snapshot.processes[pid], snapshot.processes))


def _answer(snapshot: Snapshot, daemon: int) -> Optional[MpsDaemon]:
    """The agent's report of this daemon's lists, when the agent asked it."""
    return next((d for d in snapshot.mps if d.pid == daemon), None)


def listed_clients(snapshot: Snapshot) -> dict[int, tuple[int, ...]]:
    """server PID -> its clients as a verified daemon lists them: a server only if it is one
    on evidence (evidence.mps_server), a client only if it has NVIDIA device files open and,
    where its maps are readable, a CUDA context (nvidia-uvm mapped: recorded for the client
    on the H200). The list is the daemon's claim, and a PID can be reused by the time it is
    read: a monitor it names stays a GPU client."""
    holding = {h.pid for h in snapshot.holders
               if evidence.maps_kind(h.mapped, snapshot.facts.wsl2) != evidence.MAPS_CLIENT}
    out: dict[int, tuple[int, ...]] = {}
    for pid in daemons(snapshot):
        answer = _answer(snapshot, pid)
        for server in (answer.servers or ()) if answer is not None else ():
            proc = snapshot.processes.get(server.pid)
            if proc is None or not evidence.mps_server(proc, snapshot.processes):
                continue
            out[server.pid] = tuple(sorted(
                c for c in set(server.clients)
                if c in holding and c in snapshot.processes and c not in (server.pid, pid)))
    return out


def unlisted_clients(snapshot: Snapshot) -> dict[int, int]:
    """client PID -> its server, for the clients NVML does not list (their memory is counted
    in the server's row)."""
    listed = snapshot.listed_pids()
    return {c: server for server, clients in listed_clients(snapshot).items()
            for c in clients if c not in listed}


def expected_servers(snapshot: Snapshot) -> frozenset[int]:
    """The MPS servers NVML lists here: their memory is expected while MPS runs
    (expected_server_mib), so they are no floor of the memory wait (ops/clean.py)."""
    return servers(snapshot)


def expected_server_mib(snapshot: Snapshot) -> dict[int, int]:
    """GPU index -> MiB the MPS servers hold there, expected while MPS runs: a server's row,
    or, where that row also counts clients NVML does not list, at most MEASURED_SERVER_MIB of
    it (its own share cannot be read there; a larger one leaves the clean dirty)."""
    mixed = set(unlisted_clients(snapshot).values())
    out: dict[int, int] = {}
    for pid in expected_servers(snapshot):
        for gpu in snapshot.gpus:
            for app in snapshot.apps_on(gpu.index):
                if app.pid == pid and app.used_mib is not None:
                    own = min(app.used_mib, MEASURED_SERVER_MIB) if pid in mixed else app.used_mib
                    out[gpu.index] = out.get(gpu.index, 0) + own
    return out


def stop_note(snapshot: Snapshot, scope: tuple[int, ...]) -> Optional[str]:
    """What the plan says where MPS runs: what stays and why, and how to stop MPS for the last
    MiB (quit the daemon through its own pipe directory, once its clients are gone)."""
    pids = daemons(snapshot)
    if not pids:
        return None
    expected = expected_server_mib(snapshot)
    held = {i: mib for i, mib in expected.items() if i in scope}
    where = "; ".join(f"{mib} MiB on GPU {i}" for i, mib in sorted(held.items()))
    serving = sorted(servers(snapshot))
    commands = [_quit_command(snapshot, pid) for pid in pids]
    return (
        f"CUDA MPS runs here: control daemon PID {', '.join(map(str, pids))}"
        + (f", server PID {', '.join(map(str, serving))}" if serving else "")
        + ": never signalled; its clients are signalled like any process"
        + (f"; the server's memory is expected ({where})" if where else "")
        + ". To get the last MiB back, stop MPS once its clients are gone (quit waits while "
        "any is connected): " + "; ".join(commands))


def _quit_command(snapshot: Snapshot, daemon: int) -> str:
    """``echo quit | CUDA_MPS_PIPE_DIRECTORY=DIR BINARY``, with the daemon's own pipe
    directory when the agent read and trusted it, and its own binary."""
    proc = snapshot.processes[daemon]
    binary = proc.exe[:-len(" (deleted)")] if proc.exe and proc.exe.endswith(" (deleted)") \
        else (proc.exe or evidence.MPS_CONTROL)
    answer = _answer(snapshot, daemon)
    if answer is not None and answer.pipe_dir is not None and answer.pipe_dir_trusted:
        env = "CUDA_MPS_PIPE_DIRECTORY=" + shlex.quote(answer.pipe_dir) + " "
        tail = ""
    else:
        env = ""
        tail = (" (run with the CUDA_MPS_PIPE_DIRECTORY the daemon was started with; "
                f"default {DEFAULT_PIPE_DIR})")
    return f"echo quit | {env}{shlex.quote(binary)}{tail}"


def client_gpus(snapshot: Snapshot, holder: Holder, server: int) -> tuple[int, ...]:
    """The GPUs an MPS client NVML does not list uses: those of its server's whose
    /dev/nvidiaN it maps (its CUDA context), else every GPU NVML lists the server on."""
    on = snapshot.gpu_indices_of_app(server)
    mapped = snapshot.device_gpu_indices(holder.mapped) if holder.mapped else ()
    return tuple(sorted(set(mapped) & set(on))) or on


def client_reason(server: int, gpus: tuple[int, ...]) -> str:
    """Why an MPS client NVML does not list is a memory holder."""
    return (f"a client of MPS server PID {server} (the MPS daemon's list; NVML counts its "
            f"memory in the server's row on GPU {format_gpu_indices(gpus) or '?'})")
