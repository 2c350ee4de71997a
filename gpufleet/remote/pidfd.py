"""The clean's exit wait: until its targets exit, woken by the kernel where it can be.

A piece of the remote agent. Linux 5.3+ gives a pidfd, a descriptor that becomes readable
when its process exits: one poll(2) over them returns the moment a target is gone, where
polling /proc every ``poll_s`` would add up to that much to every clean. Python before 3.9
has no os.pidfd_open, so the syscall is made through ctypes where its number is known; a
kernel or a seccomp filter that refuses it, an unknown architecture, or a fake /proc (tests)
fall back to polling, and the clean document's ``exit_wait`` says which way each target went.
"""
import errno
import os
import time

from .procfs import PROC  # joined
from .signals import exited  # joined


#: pidfd_open(2)'s number where os.pidfd_open (3.9+) is missing: 434 on every architecture
#: below (x86_64 and i386: arch/x86/entry/syscalls/syscall_{64,32}.tbl; arm64, riscv and
#: loongarch: include/uapi/asm-generic/unistd.h; arm, powerpc, s390: their syscall.tbl; the
#: same number on this machine's asm/unistd_64.h). Elsewhere (mips, alpha, x32): polling.
PIDFD_OPEN_NR = {"x86_64": 434, "i386": 434, "i486": 434, "i586": 434, "i686": 434,
                 "aarch64": 434, "armv6l": 434, "armv7l": 434, "armv8l": 434, "ppc64le": 434,
                 "ppc64": 434, "ppc": 434, "s390x": 434, "riscv64": 434, "loongarch64": 434}


#: "off": why pidfd_open proved unusable on this host (ENOSYS: kernel older than 5.3; EPERM:
#: a seccomp filter), so every later wait polls; "syscall": the ctypes fallback, once.
PIDFD_STATE = {"off": None, "syscall": None}


def _pidfd_syscall():
    """libc's syscall(2) through ctypes, or None (no ctypes, unknown architecture)."""
    if PIDFD_STATE["syscall"] is None:
        fn = False
        nr = PIDFD_OPEN_NR.get(os.uname()[4])
        if nr is not None:
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                raw = libc.syscall
                raw.restype = ctypes.c_long

                def fn(pid, _nr=nr, _raw=raw, _ct=ctypes):
                    fd = _raw(_ct.c_long(_nr), _ct.c_int(pid), _ct.c_uint(0))
                    if fd < 0:
                        err = _ct.get_errno()
                        raise OSError(err, os.strerror(err))
                    return int(fd)
            except (ImportError, OSError, AttributeError):
                fn = False
        PIDFD_STATE["syscall"] = fn
    return PIDFD_STATE["syscall"] or None


def pidfd_open(pid):
    """A pidfd (a descriptor that becomes readable when the process exits) or OSError."""
    if PIDFD_STATE["off"]:
        raise OSError(errno.ENOSYS, PIDFD_STATE["off"])
    if hasattr(os, "pidfd_open"):
        return os.pidfd_open(pid)
    fn = _pidfd_syscall()
    if fn is None:
        raise OSError(errno.ENOSYS, "no os.pidfd_open and no syscall(2) for this architecture")
    return fn(pid)


def exit_watch(t, proc=PROC, allow_pidfd=True):
    """("gone", None) | ("fd", pidfd) | ("poll", why) for one target of the exit wait.

    The pidfd is opened only after the identity check, and the identity is checked again once
    the descriptor pins the pid: had the pid been reused in between, the descriptor would
    watch another process. Only the real /proc's pids can have a pidfd (tests pass a fake).
    """
    if exited(t["pid"], t["starttime"], proc):
        return "gone", None
    if proc != PROC:
        return "poll", "not the real /proc"
    if not allow_pidfd:
        return "poll", "pidfd disabled by the request"
    try:
        fd = pidfd_open(t["pid"])
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return "gone", None
        why = "pidfd_open: %s" % (exc.strerror or exc)
        if exc.errno in (errno.ENOSYS, errno.EPERM) and not PIDFD_STATE["off"]:
            PIDFD_STATE["off"] = why  # the same answer for every pid of this host
        return "poll", why
    if exited(t["pid"], t["starttime"], proc):
        os.close(fd)
        return "gone", None
    return "fd", fd


def wait_exit(targets, seconds, poll, deadline, proc=PROC, stats=None, allow_pidfd=True,
              wake=None):
    """Until every (pid, starttime) exited or seconds passed; returns those still there.

    Event-driven where the kernel has pidfds (Linux 5.3+): one poll(2) over a pidfd per target
    returns the moment one exits (a zombie whose threads are all gone counts, as in
    ``exited``); targets without one (old kernel, seccomp, fake /proc) are polled every
    ``poll`` s as before (``allow_pidfd=False``: all of them, the request's ``"pidfd": false``).
    ``stats`` counts each way: {"pidfd", "polled", "reason"} (the clean document's exit_wait).
    ``wake``: a descriptor that ends the wait once readable (the operator's cancel).
    """
    end = min(time.monotonic() + seconds, deadline.end)
    stats = stats if stats is not None else {}
    watched, polled = {}, []
    import select  # a clean's only: not loaded by a snapshot's start

    poller = select.poll()
    if wake is not None:
        poller.register(wake, select.POLLIN)
    try:
        for t in targets:
            how, what = exit_watch(t, proc, allow_pidfd)
            if how == "fd":
                watched[what] = t
                poller.register(what, select.POLLIN)
            elif how == "poll":
                polled.append(t)
                stats["reason"] = stats.get("reason") or what
        stats["pidfd"] = stats.get("pidfd", 0) + len(watched)
        stats["polled"] = stats.get("polled", 0) + len(polled)
        while True:
            polled = [t for t in polled if not exited(t["pid"], t["starttime"], proc)]
            now = time.monotonic()
            if (not watched and not polled) or now >= end:
                return [t for t in list(watched.values()) + polled
                        if not exited(t["pid"], t["starttime"], proc)]
            wait = min(poll, end - now) if polled else end - now
            for fd, _event in poller.poll(max(1, int(wait * 1000 + 0.999))):
                if fd == wake:
                    end = now  # cancelled: who is still there, at once
                    continue
                t = watched.pop(fd, None)
                poller.unregister(fd)
                os.close(fd)
                if t is not None and not exited(t["pid"], t["starttime"], proc):
                    polled.append(t)  # readable, yet /proc disagrees: do not spin on it
    finally:
        for fd in watched:
            os.close(fd)
