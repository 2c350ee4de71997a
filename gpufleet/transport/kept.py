"""SSH connections kept between commands (``ssh_persist``): where their sockets live, and the
label beside each that names its host.

Internal to gpufleet.transport (gpufleet.transport.sshtarget asks for a host's socket and
writes its label; gpufleet.transport.keptlist lists and closes them for `gpufleet
disconnect`). With ``ssh_persist: SECONDS`` a host's first ``ssh`` of a command becomes an
OpenSSH master (``ControlMaster=auto``, ``ControlPersist=SECONDS``) that stays after the
command for that long once idle, so the next command's runs skip the TCP connect, the key
exchange and the authentication (each run's own ``ssh -S`` joins it:
gpufleet.transport.openssh). On by default (60 s, as Ansible's ControlPersist): each is a
process left behind the CLI (one per host, ~5 MB) holding an authenticated connection;
``ssh_persist: 0`` keeps none, and `gpufleet disconnect` closes them.

The sockets are in one directory of this user's, mode 0700 (``$XDG_RUNTIME_DIR/gpufleet-ssh``,
else ``$XDG_CACHE_HOME/gpufleet/ssh``, else ``~/.cache/gpufleet/ssh``); a directory that is not
private (another owner, group or other access, a symlink) turns the feature off for the run,
with one warning; a directory too long for a socket's path too, said only where the inventory
set ``ssh_persist`` (the default's fallback is quiet: nothing kept, as with 0). A socket's name is a hash of everything that decides where and how its
``ssh`` connects (the whole argv and what ``ssh -G`` resolved): a changed inventory or
ssh_config gives another name, so an old master is never joined for a new destination.
"""
from __future__ import annotations

import os
import stat
import sys
import threading
from typing import Optional, Sequence

from gpufleet.transport.localstate import cache_dir, hashed_name

SOCKET_MAX = 100  # sun_path is 108 bytes; a longer directory means no kept connections
NAME_BYTES = 8  # 16 hex characters

_warned = threading.Event()


def directory() -> str:
    """Where the sockets are (created on first use)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR") or ""
    if os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "gpufleet-ssh")
    return cache_dir("ssh")


def private_problem(path: str) -> Optional[str]:
    """Why ``path`` may not hold the sockets (None: it may): a master's socket lets whoever
    can reach it run commands on the host as us, and a socket someone else put there would
    receive our commands."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"{path} is mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def _ready_directory(quiet_long: bool = False) -> Optional[str]:
    """The directory, created 0700 when absent; None (warned once) when it cannot be used
    (``quiet_long``: not warned when it is only too long)."""
    path = directory()
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError:
        pass
    problem = private_problem(path)
    if problem is None and len(os.path.join(path, "x" * 2 * NAME_BYTES).encode()) > SOCKET_MAX:
        if quiet_long:
            return None
        problem = f"{path} is too long for a socket path"
    if problem is not None:
        warn_off(problem)
        return None
    return path


def warn_off(problem: str) -> None:
    """Say once per run why kept connections are off (sshtarget too: a socket path ssh would
    expand)."""
    if _warned.is_set():
        return
    _warned.set()
    print(f"gpufleet: warning: ssh_persist is off for this run: {problem}", file=sys.stderr)


def socket_for(identity: Sequence[str], quiet_long: bool = False) -> Optional[str]:
    """The socket of the connection ``identity`` describes (the ssh argv and its resolved
    destination), or None: no kept connections in this run (see _ready_directory)."""
    path = _ready_directory(quiet_long)
    if path is None:
        return None
    return os.path.join(path, hashed_name("\0".join(identity), NAME_BYTES))


def sockets() -> list[str]:
    """Every socket in the directory (kept connections, live or stale)."""
    path = directory()
    if private_problem(path) is not None:
        return []
    found = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        try:
            if stat.S_ISSOCK(os.lstat(full).st_mode):
                found.append(full)
        except OSError:
            continue
    return found


LABEL = ".host"  # beside each socket: who it reaches, as "NAME (user@host:port)"


def write_label(path: str, text: str) -> None:
    """Say beside the socket ``path`` which host it reaches: a socket's name is a hash, and
    `gpufleet disconnect` without a selection (no inventory needed) must still name hosts.
    Best effort, rewritten only when it changed (the directory is private: ours, 0700)."""
    label = path + LABEL
    try:
        with open(label, encoding="utf-8") as fh:
            if fh.read() == text:
                return
    except OSError:
        pass
    try:
        with open(label + ".new", "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(label + ".new", label)
    except OSError:
        pass


def label_of(path: str) -> Optional[str]:
    """What ``write_label`` said of the socket ``path`` (None: nothing, e.g. an older
    gpufleet's socket)."""
    try:
        with open(path + LABEL, encoding="utf-8", errors="replace") as fh:
            text = fh.read(300).strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else None


def prune_labels() -> None:
    """Remove the labels whose socket is gone (its master ended, or it was closed)."""
    path = directory()
    if private_problem(path) is not None:
        return
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.endswith(LABEL) and not os.path.exists(full[: -len(LABEL)]):
            try:
                os.unlink(full)
            except OSError:
                pass
