"""Signalling a process only while it is still that process: a piece of the remote agent.

The controller decides what may be signalled (gpufleet/core/policy.py); here are the
last-resort guards (never PID 1, never the agent's own session, never a kernel thread, never
a PID whose start time changed) and the signal itself, sent through a pidfd where the host
has one, so the identity check and the signal reach the same process.
"""
import os
import signal

from .parse import has_exited, is_kernel_thread  # joined
from .procfs import PROC, read_stat  # joined


def refusal(pid, self_pid, ancestors):
    """The agent's last-resort guard; the real policy is controller-side (gpufleet/core/policy.py)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        return "refused: pid <= 1"
    if pid == self_pid or pid in ancestors:
        return "refused: own session"
    return None


def send_signal(pid, starttime, sig, proc=PROC):
    """Signal (pid, starttime) only if it still is that process; returns the outcome.

    With pidfd (Linux 5.1+, Python 3.9+) the identity check and the signal target the same
    process even if the PID is reused in between; otherwise the window is microseconds.
    """
    pidfd = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pidfd = None
    try:
        st = read_stat(pid, proc)
        if st is None:
            return "gone"
        if st["starttime"] != starttime:
            return "pid reused"
        if has_exited(st):
            return "gone"
        if is_kernel_thread(st):
            return "refused: kernel thread"
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "permission denied"
        except OSError as exc:
            return "error: %s" % (exc.strerror or exc)
        return "sent"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def exited(pid, starttime, proc=PROC):
    """Gone, reused, or a zombie (which holds no GPU memory) all count as exited."""
    st = read_stat(pid, proc)
    return st is None or st["starttime"] != starttime or has_exited(st)
