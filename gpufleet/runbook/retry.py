"""The retry file of a runbook, like Ansible's ``.retry``: the hosts its last run failed or
never ran, one name a line, for ``gpufleet run RUNBOOK --retry``.

It lives at ``~/.local/state/gpufleet/retry/STEM.hosts`` (STEM: the runbook file's name without
``.yaml``), beside the audit log. Every real run of the runbook rewrites it: with the hosts to
retry, or removes it when every host ran ok, so it always describes the last run. Writing it
never fails a run (a read-only home is one warning line on stderr).
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from gpufleet.errors import UsageError

RETRY_DIR = "~/.local/state/gpufleet/retry"
MAX_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\Z")  # an inventory host name


def retry_path(runbook_path: str) -> Path:
    stem = Path(runbook_path).name
    for suffix in (".yaml", ".yml"):
        stem = stem.removesuffix(suffix)
    return Path(os.path.expanduser(RETRY_DIR)) / f"{stem or 'runbook'}.hosts"


def read_retry(path: Path) -> list[str]:
    """The host names in a retry file; a missing, empty or malformed file is a usage error."""
    try:
        data = path.read_bytes()[:MAX_BYTES].decode("utf-8")
    except FileNotFoundError:
        raise UsageError(f"--retry: no retry file {path}: the last run of this runbook left no host "
                         "to retry (or it never ran as this user)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--retry: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    names: list[str] = []
    for n, line in enumerate(data.splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not _NAME.match(text):
            raise UsageError(f"{path}:{n}: not a host name: {text[:80]!r}")
        if text not in names:
            names.append(text)
    if not names:
        raise UsageError(f"--retry: {path} names no host")
    return names


def write_retry(path: Path, hosts: Sequence[str], runbook_source: str) -> Optional[str]:
    """Write the hosts to retry (atomically), or remove the file when there are none.
    Returns a one-line warning when the file could not be written or removed, else None."""
    try:
        if not hosts:
            path.unlink(missing_ok=True)
            return None
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text = f"# gpufleet run {runbook_source}: failed or not run\n" + "".join(f"{h}\n" for h in hosts)
        fd, tmp = tempfile.mkstemp(prefix=".retry-", dir=str(path.parent))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        return f"retry file {path} not written: {exc.strerror or exc}"
    return None


__all__ = ["RETRY_DIR", "read_retry", "retry_path", "write_retry"]
