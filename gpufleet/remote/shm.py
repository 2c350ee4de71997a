"""Removing what crashed GPU jobs leave in /dev/shm: a piece of the remote agent.

NCCL, PSM, torch and vLLM leave shared-memory files behind when their processes are killed;
they fill a tmpfs that lives as long as the host. Only the known prefixes are touched, only
regular files older than a minimum age, and only those no live process has open or mapped;
a process whose fds or maps cannot be read makes the removal more careful (only the agent's
own user's files), one stuck in the kernel (D state, its maps unreadable in time) stops it.
"""
import os
import re
import stat as stat_mod
import time

from .jobs import read_bytes_bounded  # joined
from .procfs import PROC, read_stat, scan_fds  # joined


SHM_LEFTOVER_RE = re.compile(r"^(?:nccl-|psm_|torch_|vllm)")


def clean_shm(req, res, proc=PROC):
    """Remove known leftovers (NCCL, PSM, torch, vLLM) in /dev/shm that no live process has
    open or mapped. Unreadable fds or maps make it conservative, never bolder."""
    shm_dir = req.get("shm_dir") or "/dev/shm"
    min_age = float(req.get("shm_min_age_s", 10.0))
    prefix = shm_dir.rstrip("/") + "/"
    try:
        names = sorted(n for n in os.listdir(shm_dir) if SHM_LEFTOVER_RE.match(n))
    except OSError as exc:
        res["warnings"].append("shm: cannot list %s: %s" % (shm_dir, exc))
        return
    if not names:
        return
    used, denied = scan_fds(lambda t: _strip_deleted(t) if t.startswith(prefix) else None, (),
                            proc)
    in_use = set()
    for paths in used.values():
        in_use.update(paths)
    if not _shm_mapped(prefix, in_use, denied, res, proc):
        return
    _remove_shm(names, prefix, in_use, denied, min_age, res)


def _strip_deleted(path):
    """A path as /proc shows it, without the " (deleted)" of an unlinked file."""
    return path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path


def _shm_mapped(prefix, in_use, denied, res, proc):
    """Add to in_use the paths under prefix that any process maps (PIDs whose maps are
    unreadable to denied); False (and a warning) when a D-state process's maps could not be
    read in time: then nothing may be removed."""
    try:
        pids = [n for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        pids = []
    for name in pids:
        path = proc + "/" + name + "/maps"
        st = read_stat(int(name), proc)
        if st is not None and st["state"] == "D":
            raw, timed_out = read_bytes_bounded(path, 1.0, 64 << 20)
            if timed_out:
                res["warnings"].append("shm: maps of PID %s unreadable (D state): nothing "
                                       "removed" % name)
                return False
        else:
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except PermissionError:
                denied.append(int(name))
                continue
            except (OSError, IOError):
                continue
        if raw is None:
            continue
        for line in raw.decode("utf-8", "replace").splitlines():
            i = line.find(prefix)
            if i >= 0:
                in_use.add(_strip_deleted(line[i:].rstrip()))
    return True


def _remove_shm(names, prefix, in_use, denied, min_age, res):
    """Unlink the leftovers not in use: regular files older than min_age, and when some
    process could not be seen, only our own."""
    euid = os.geteuid()
    now = time.time()
    for name in names:
        path = prefix + name
        if path in in_use:
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat_mod.S_ISREG(st.st_mode) or now - st.st_mtime < min_age:
            continue
        if denied and st.st_uid != euid:
            continue  # someone we cannot see might use it
        try:
            os.unlink(path)
            res["shm_removed"].append(path)
        except OSError as exc:
            res["warnings"].append("shm: cannot remove %s: %s" % (path, exc.strerror))
