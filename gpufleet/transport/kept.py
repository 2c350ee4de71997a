"""SSH connections kept between commands (``ssh_persist``): where their sockets live, and
how they are listed and closed.

Internal to gpufleet.transport (gpufleet.transport.openssh asks for a host's socket; `gpufleet
disconnect` lists and closes them). With ``ssh_persist: SECONDS`` a host's first ``ssh`` of a
command becomes an OpenSSH master (``ControlMaster=auto``, ``ControlPersist=SECONDS``) that
stays after the command for that long once idle, so the next command's runs skip the TCP
connect, the key exchange and the authentication (gpufleet.transport.mux talks to it). On by
default (60 s, as Ansible's ControlPersist): each is a process left behind the CLI (one per
host, ~5 MB) holding an authenticated connection; ``ssh_persist: 0`` keeps none, and
`gpufleet disconnect` closes them.

The sockets are in one directory of this user's, mode 0700 (``$XDG_RUNTIME_DIR/gpufleet-ssh``,
else ``$XDG_CACHE_HOME/gpufleet/ssh``, else ``~/.cache/gpufleet/ssh``); a directory that is not
private (another owner, group or other access, a symlink) turns the feature off for the run,
with one warning; a directory too long for a socket's path too, said only where the inventory
set ``ssh_persist`` (the default's fallback is quiet: nothing kept, as with 0). A socket's name is a hash of everything that decides where and how its
``ssh`` connects (the whole argv and what ``ssh -G`` resolved): a changed inventory or
ssh_config gives another name, so an old master is never joined for a new destination.
"""
from __future__ import annotations

import dataclasses
import os
import stat
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from gpufleet.errors import TransportError
from gpufleet.transport import mux
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
        _warn(problem)
        return None
    return path


def _warn(problem: str) -> None:
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


@dataclass(frozen=True)
class Kept:
    """One kept connection: the inventory host it is for (None: found in the directory),
    its socket, its master's PID (None: no master answers there), and the label written
    beside it when it was made (the host's name and destination)."""

    host: Optional[str]
    path: str
    pid: Optional[int]
    label: Optional[str] = None

    @property
    def name(self) -> str:
        """How an operator knows it: the inventory host, else its label, else the socket."""
        return self.host or self.label or self.path


def socket_of(host: Any) -> Optional[str]:
    """Where ``host``'s kept connection is (whether or not one is up, whatever its
    ``ssh_persist`` now): None for a host not reached through OpenSSH."""
    from gpufleet.transport import openssh, sshconfig, sshtarget

    ssh = sshconfig.ssh_client()
    if getattr(host, "is_local", False) or ssh is None or not openssh.wanted(host):
        return None
    target = sshtarget.target_for(dataclasses.replace(host, ssh_persist=1.0), ssh)
    return target.kept if target is not None else None


def kept_connections(hosts: Optional[Sequence[Any]] = None) -> list[Kept]:
    """The kept connections of ``hosts`` (None: every socket in the directory)."""
    if hosts is None:
        return [Kept(None, path, mux.alive(path), label_of(path)) for path in sockets()]
    found = []
    for host in hosts:
        try:
            path = socket_of(host)
        except TransportError:  # ssh -G refuses the host now: no socket can be named for it
            continue  # (one kept from before is still closed by a run without a selection)
        if path is not None and os.path.exists(path):
            found.append(Kept(host.name, path, mux.alive(path)))
    return found


def close_kept(path: str) -> Optional[int]:
    """Ask the master at ``path`` to end (gpufleet.transport.mux.terminate); its PID, or None
    when none was there (a stale socket is removed by the refused connect)."""
    return mux.terminate(path)
