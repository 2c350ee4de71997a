"""The remote work of `gpufleet status`, as the shell commands a script would send instead.

gpufleet's agent (gpufleet/remote/agent.py, snapshot mode) runs, on every host: nvidia-smi
--query-gpu (the same fields), --query-compute-apps, plain nvidia-smi (CUDA version), the
minor numbers (/proc/driver/nvidia/gpus/*/information, else nvidia-smi -q), a scan of
/proc/*/fd for NVIDIA device files, and stat/status/cmdline of every holder and listed app.
SCRIPT does the same with a POSIX shell, find and cat; parse() turns its output into
per-host data like the agent's, so parallel-ssh also pays for parsing on the controller.
"""
from __future__ import annotations

import csv
import io

GPU_FIELDS = ("index,uuid,name,pci.bus_id,memory.used,memory.total,memory.free,"
              "utilization.gpu,driver_version,memory.reserved")

SCRIPT = r"""export LC_ALL=C
S=$(command -v nvidia-smi || command -v /usr/local/nvidia/bin/nvidia-smi || echo /usr/bin/nvidia-smi)
echo @@gpus
$S --query-gpu=%s --format=csv,noheader,nounits
echo @@apps
A=$($S --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits)
echo "$A"
echo @@version
$S | grep -m1 'CUDA Version'
echo @@minors
cat /proc/driver/nvidia/gpus/*/information 2>/dev/null | grep -E 'Bus Location|Device Minor' || $S -q | grep -E '^GPU |Minor Number'
echo @@fds
F=$(find /proc/[0-9]*/fd -maxdepth 1 \( -lname '/dev/nvidia*' -o -lname /dev/dxg \) -printf '%%h %%l\n' 2>/dev/null)
echo "$F"
echo @@procs
for p in $( (echo "$F" | cut -d/ -f3; echo "$A" | cut -d, -f1) | sort -un); do
  echo "pid $p $(cat /proc/$p/stat 2>/dev/null)"
  grep '^Uid' /proc/$p/status 2>/dev/null
  echo "cmd $(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null)"
done
""" % GPU_FIELDS


def _ints(row: dict) -> dict:
    out = {}
    for k, v in row.items():
        v = v.strip()
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = None if v in ("[N/A]", "N/A", "") else v
    return out


def parse(text: str) -> dict:
    """SCRIPT's output -> {"gpus", "apps", "cuda", "holders", "procs"}; raises ValueError."""
    sections: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("@@"):
            cur = line[2:].strip()
            sections[cur] = []
        elif cur is not None and line.strip():
            sections[cur].append(line)
    if "gpus" not in sections or "procs" not in sections:
        raise ValueError("incomplete output")
    gpus = [_ints(dict(zip(GPU_FIELDS.split(","), row)))
            for row in csv.reader(io.StringIO("\n".join(sections["gpus"])))]
    apps = [_ints(dict(zip(("pid", "used_memory", "gpu_uuid"), row)))
            for row in csv.reader(io.StringIO("\n".join(sections["apps"])))]
    cuda = None
    for line in sections.get("version", []):
        if "CUDA Version:" in line:
            cuda = line.split("CUDA Version:")[1].split()[0]
    holders: dict[int, set] = {}
    for line in sections.get("fds", []):
        fd_dir, _, target = line.partition(" ")
        holders.setdefault(int(fd_dir.split("/")[2]), set()).add(target)
    procs: dict[int, dict] = {}
    pid = None
    for line in sections["procs"]:
        if line.startswith("pid "):
            parts = line.split(" ", 2)
            pid = int(parts[1])
            stat = parts[2] if len(parts) > 2 else ""
            if ")" in stat:
                comm = stat[stat.index("(") + 1:stat.rindex(")")]
                rest = stat[stat.rindex(")") + 2:].split()
                procs[pid] = {"comm": comm, "state": rest[0], "ppid": int(rest[1]),
                              "starttime": int(rest[19])}
        elif pid in procs and line.startswith("Uid:"):
            procs[pid]["uid"] = int(line.split()[2])
        elif pid in procs and line.startswith("cmd "):
            procs[pid]["cmdline"] = line[4:].strip()
    return {"gpus": gpus, "apps": apps, "cuda": cuda,
            "holders": {p: sorted(d) for p, d in holders.items()}, "procs": procs}
