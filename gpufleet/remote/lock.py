"""The clean's host lock: a file only the agent's own user could have made, and who holds it.

A piece of the remote agent. A lock that another user can create or open is a lock that user
can flock, holding every clean off ("busy") for good: the lock once lived in world-writable
/tmp and any existing file was taken. So root's lock is ``/run/gpufleet/clean.lock``, another
user's ``<runtime directory>/gpufleet/clean.lock``; the directory is created 0700 when
missing, and the directory and the file are opened without following a symbolic link and
checked by fstat: owned by the agent's euid, writable by nobody else, of the right type. A
lock that fails a check is refused (``LockRefused``) and the clean does nothing. When the lock
is busy, /proc/locks names the process holding it, so the report can say who.
"""
import errno
import os
import stat as stat_mod
import time

from .jobs import read_bytes_bounded, read_text  # joined
from .parse import format_cmdline, parse_status_uid  # joined
from .procfs import PROC, user_name  # joined

ROOT_LOCK = "/run/gpufleet/clean.lock"
#: Under a non-root user's runtime directory ($XDG_RUNTIME_DIR or /run/user/<euid>).
USER_LOCK = "gpufleet/clean.lock"
#: The holder's command line kept in the document (the message shows less).
HOLDER_CMDLINE_MAX = 512


class LockRefused(Exception):
    """The lock's place or file could be another user's: the clean must not use it.
    ``kind``: no_runtime_dir | unsafe_path | unsafe_dir | unsafe_file | os_error."""

    def __init__(self, kind, path, reason):
        Exception.__init__(self, reason)
        self.kind = kind
        self.path = path
        self.reason = reason

    def as_doc(self):
        return {"kind": self.kind, "path": self.path, "reason": self.reason}


def ownership_problem(st, euid, directory):
    """Why a lock directory or file (its lstat or fstat) could be someone else's, or None:
    anyone who owns it or may write it could create, replace or open the lock."""
    mode = st.st_mode
    if stat_mod.S_ISLNK(mode):
        return "is a symbolic link"
    if directory and not stat_mod.S_ISDIR(mode):
        return "is not a directory"
    if not directory and not stat_mod.S_ISREG(mode):
        return "is not a regular file"
    if st.st_uid != euid:
        return "is owned by uid %d, not by the agent's uid %d" % (st.st_uid, euid)
    if mode & 0o022:
        return "is writable by group or others (mode %04o)" % stat_mod.S_IMODE(mode)
    return None


def runtime_dir(euid, environ):
    """A non-root user's runtime directory, checked as the lock's directory is:
    (path, None), or (None, why none is safe)."""
    tried = []
    xdg = environ.get("XDG_RUNTIME_DIR")
    if not xdg:
        tried.append("XDG_RUNTIME_DIR is not set")
    elif not os.path.isabs(xdg):
        tried.append("XDG_RUNTIME_DIR %r is not an absolute path" % xdg)
    for cand in ([xdg] if xdg and os.path.isabs(xdg) else []) + ["/run/user/%d" % euid]:
        try:
            why = ownership_problem(os.lstat(cand), euid, True)
        except OSError as exc:
            why = "cannot be used: %s" % (exc.strerror or exc)
        if why is None:
            return cand, None
        tried.append("%s %s" % (cand, why))
    return None, "no safe runtime directory for uid %d: %s" % (euid, ", ".join(tried))


def default_lock_path(euid, environ):
    """Where this user's lock lives: /run/gpufleet for root, else the runtime directory
    (never /tmp: LockRefused when the user has no safe one)."""
    if euid == 0:
        return ROOT_LOCK
    base, why = runtime_dir(euid, environ)
    if base is None:
        raise LockRefused("no_runtime_dir", None, why)
    return base.rstrip("/") + "/" + USER_LOCK


def _open_failure(path, exc, lstat):
    """An open with O_NOFOLLOW failed: say what is there, a link above all."""
    try:
        if stat_mod.S_ISLNK(lstat().st_mode):
            return "%s is a symbolic link" % path
    except OSError:
        pass
    return "%s cannot be opened: %s" % (path, exc.strerror or exc)


def open_lock_dir(path, euid):
    """A descriptor of the lock's directory (created 0700 when missing), which only euid
    may add entries to; LockRefused when it is a link, another's, or writable by others."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = None
    for _ in range(2):
        try:
            fd = os.open(path, flags)
            break
        except FileNotFoundError:
            try:
                os.mkdir(path, 0o700)  # never follows a link in its last component
            except FileExistsError:
                continue
            except OSError as exc:
                raise LockRefused("os_error", path, "%s cannot be created: %s"
                                  % (path, exc.strerror or exc)) from None
        except OSError as exc:
            raise LockRefused("unsafe_dir", path, _open_failure(path, exc, lambda: os.lstat(path))) from None
    if fd is None:
        raise LockRefused("os_error", path, "%s keeps vanishing" % path)
    why = ownership_problem(os.fstat(fd), euid, True)
    if why is not None:
        os.close(fd)
        raise LockRefused("unsafe_dir", path, "%s %s" % (path, why))
    return fd


def open_lock(path, euid):
    """A descriptor of the lock file, opened (created 0600) in its checked directory without
    following a link, and itself checked by fstat; LockRefused says why not."""
    if not isinstance(path, str) or not os.path.isabs(path) or path.endswith("/"):
        raise LockRefused("unsafe_path", str(path), "lock path %r is not an absolute file path"
                          % (path,))
    parent, name = os.path.split(path)
    dir_fd = open_lock_dir(parent, euid)
    try:
        # O_NONBLOCK: a FIFO put there must not stall the open (fstat refuses it below)
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            raise LockRefused("unsafe_file", path, _open_failure(
                path, exc, lambda: os.stat(name, dir_fd=dir_fd, follow_symlinks=False))) from None
    finally:
        os.close(dir_fd)
    why = ownership_problem(os.fstat(fd), euid, False)
    if why is not None:
        os.close(fd)
        raise LockRefused("unsafe_file", path, "%s %s" % (path, why))
    return fd


def wait_flock(fd, wait_s, poll=0.1, cancel=None):
    """An exclusive flock on fd, polled for up to wait_s: True once taken; False too once
    ``cancel`` (the operator's, remote/main.py CancelWatch) is set."""
    import fcntl  # a clean's only: not loaded by a snapshot's start

    end = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except (OSError, IOError) as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() + poll > end:
            return False
        if cancel is None:
            time.sleep(poll)
        elif cancel.flag.wait(poll):
            return False


def acquire_lock(path, wait_s, poll=0.1, proc=PROC, cancel=None):
    """(fd, None) once the lock at path is taken; (None, holder) when another process held it
    for all of wait_s (``lock_holder``: who); LockRefused when it could be someone else's."""
    fd = open_lock(path, os.geteuid())
    try:
        if wait_flock(fd, wait_s, poll, cancel):
            return fd, None
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None, lock_holder(path, st.st_dev, st.st_ino, proc)


def parse_lock_line(line):
    """One /proc/locks line -> {"type", "access", "pid", "major", "minor", "inode",
    "waiting"}, or None. ``1: FLOCK  ADVISORY  WRITE 4242 00:1a:1234 0 EOF``; a process
    waiting for the lock has ``->`` after the number; major:minor are hex, the inode decimal."""
    parts = line.split()
    waiting = len(parts) > 1 and parts[1] == "->"
    if waiting:
        parts = parts[:1] + parts[2:]
    if len(parts) < 6 or not parts[0].endswith(":"):
        return None
    dev = parts[5].split(":")
    try:
        if len(dev) != 3:
            return None
        return {"type": parts[1], "access": parts[3], "pid": int(parts[4]),
                "major": int(dev[0], 16), "minor": int(dev[1], 16), "inode": int(dev[2]),
                "waiting": waiting}
    except ValueError:
        return None


def lock_holder(path, dev, ino, proc=PROC):
    """Who holds the flock on the file (dev, ino): {"pid", "uid", "user", "cmdline", "open"}
    from /proc/locks and /proc/PID; pid 0 is one this PID namespace cannot see (or gone), and
    ``open`` False a PID that no longer has the file open (it passed the lock on, or exited
    and its PID is another process's). None when /proc/locks names no holder."""
    want = (os.major(dev), os.minor(dev), ino)
    for line in (read_text(proc + "/locks") or "").splitlines():
        lk = parse_lock_line(line)
        if lk is None or lk["type"] != "FLOCK" or lk["waiting"]:
            continue
        if (lk["major"], lk["minor"], lk["inode"]) != want:
            continue
        pid = lk["pid"]
        if pid <= 0:
            return {"pid": 0, "uid": None, "user": None, "cmdline": None, "open": None}
        base = "%s/%d/" % (proc, pid)
        uid = parse_status_uid(read_text(base + "status") or "")
        raw, _ = read_bytes_bounded(base + "cmdline", 1.0, HOLDER_CMDLINE_MAX * 4)
        return {"pid": pid, "uid": uid, "user": user_name(uid),
                "cmdline": format_cmdline(raw)[:HOLDER_CMDLINE_MAX] if raw is not None else None,
                "open": has_open(pid, path, proc)}
    return None


def has_open(pid, path, proc=PROC):
    """Whether PID has path open (its /proc/PID/fd links; readlink only: a stat of a link
    into a hung filesystem could block)."""
    fd_dir = "%s/%d/fd" % (proc, pid)
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    names_of_it = (path, os.path.realpath(path))  # the kernel's name resolves links above it
    for name in names:
        try:
            if os.readlink(fd_dir + "/" + name) in names_of_it:
                return True
        except OSError:
            continue
    return False


def lock_for_clean(req, wait_s, res, proc=PROC, cancel=None):
    """The clean's lock, its outcome in res: "acquired" (the fd returned), "busy" (who holds
    it: ``lock_holder``) or "refused" (why it could be another's: ``lock_refused``, and
    ``error``); None unless acquired, and then nothing may be done."""
    try:
        path = req.get("lock_path") or default_lock_path(os.geteuid(), os.environ)
        res["lock_path"] = path
        try:
            fd, holder = acquire_lock(path, wait_s, proc=proc, cancel=cancel)
        except (OSError, IOError) as exc:  # flock itself failed (ENOLCK, say)
            raise LockRefused("os_error", path, "%s: %s" % (path, exc.strerror or exc)) from None
    except LockRefused as exc:
        res["lock"] = "refused"
        res["lock_refused"] = exc.as_doc()
        res["error"] = "lock refused: %s; nothing was signalled" % exc.reason
        return None
    if fd is None:
        res["lock"] = "busy"
        res["lock_holder"] = holder
        return None
    res["lock"] = "acquired"
    return fd
