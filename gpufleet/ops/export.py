"""`gpufleet export`: one fleet snapshot as Prometheus text, printed or written atomically
for node_exporter's textfile collector.

The file is written to a temporary file in the same directory (named so the collector, which
reads only ``*.prom``, never sees it) and renamed over ``gpufleet.prom``: a reader sees the
old file or the new one, never half of one, and a write that fails leaves the old file as it
was and no temporary file behind.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Optional, Sequence

from gpufleet.config.inventory import Host
from gpufleet.core import health
from gpufleet.core.metrics import ExportOptions, Family, RefreshStats, fleet_families
from gpufleet.core.model import HostResult
from gpufleet.errors import GpufleetError, UsageError
from gpufleet.ops import audit
from gpufleet.ops.collect import snapshot_hosts

TEXTFILE_NAME = "gpufleet.prom"


def check_textfile_dir(path: str) -> str:
    """The directory to write into, checked before any host is contacted (UsageError)."""
    if not path:
        raise UsageError("--textfile: empty directory name")
    if not os.path.exists(path):
        raise UsageError(f"--textfile {path}: no such directory")
    if not os.path.isdir(path):
        raise UsageError(f"--textfile {path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--textfile {path}: directory is not writable")
    return path


def write_textfile(directory: str, data: bytes, name: str = TEXTFILE_NAME) -> str:
    """Write ``data`` to ``directory/name`` atomically (temp file in ``directory`` + rename);
    returns the path. A failure is one line (GpufleetError) and leaves nothing half-written."""
    target = os.path.join(directory, name)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + name + ".", suffix=".tmp")
    except OSError as exc:
        raise GpufleetError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; node_exporter may run as another user
        os.replace(tmp, target)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise GpufleetError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target


def expected_of(hosts: Sequence[Host]) -> dict[str, int]:
    return {h.name: int(h.unattributed_mib or 0) for h in hosts}


def families_for(hosts: Sequence[Host], results: Sequence[HostResult], taken_at: dict[str, float],
                 opts: ExportOptions, audit_log: Optional[str],
                 refresh: Optional[RefreshStats] = None,
                 hostnames: Optional[dict[str, str]] = None) -> list[Family]:
    """The families of these results, with each host's last clean from the audit log and its
    health findings (the same judgement as `gpufleet health`: one rule, core/health)."""
    expected_gpus = {h.name: h.gpus for h in hosts}
    findings = [f for r in results if r.ok and r.snapshot is not None
                for f in health.metric_findings(health.assess_result(r, expected_gpus.get(r.host)))]
    return fleet_families(results, expected_of(hosts), audit.last_cleans(audit_log), opts,
                          taken_at, refresh=refresh, hostnames=hostnames, findings=findings)


def export_once(hosts: Sequence[Host], opts: ExportOptions, audit_log: Optional[str],
                forks: int = 32, seen: Optional[list[HostResult]] = None) -> list[Family]:
    """One snapshot of every host (one exec each, as `status`) as metric families; ``seen``
    gets the results (the CLI's warnings)."""
    taken = time.time()
    results = snapshot_hosts(hosts, forks=forks)
    if seen is not None:
        seen.extend(results)
    return families_for(hosts, results, {h.name: taken for h in hosts}, opts, audit_log)
