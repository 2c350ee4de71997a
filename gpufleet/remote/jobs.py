"""Bounded I/O: child processes that never outlive their bound, reads that cannot hang.

A piece of the remote agent: nvidia-smi can hang in D state when the driver is wedged (then
it cannot even be reaped), and reading /proc/PID/cmdline or maps of a D-state process can
block; everything here gives up in time and says so.
"""
import os
import signal
import threading
import time

from .parse import first_line  # joined

SMI_FALLBACKS = (
    "/usr/bin/nvidia-smi",
    "/usr/local/nvidia/bin/nvidia-smi",
    "/usr/lib/wsl/lib/nvidia-smi",
)


def fmt_seconds(value):
    return "%g" % round(value, 1)


class Deadline(object):
    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def remaining(self):
        return self.end - time.monotonic()


def read_bytes(path, limit=1 << 20):
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except (OSError, IOError):
        return None


def read_text(path, limit=1 << 20):
    data = read_bytes(path, limit)
    return None if data is None else data.decode("utf-8", "replace")


_STUCK_READERS = []  # type: list


def run_bounded(fn, timeout):
    """fn() in a thread of its own, waited for at most ``timeout`` seconds: (True, its value),
    or (False, None) while it has not returned (it is left running: a read blocked in the
    kernel cannot be interrupted; the agent ends with os._exit whatever its threads do). An
    exception in fn is (True, None): callers that need it catch it in fn."""
    job = Background(fn)
    if not job.wait(timeout):
        return (False, None)
    ok, value = job._box[0]
    return (True, value if ok else None)


def start_daemon(name, fn, *args):
    """fn(*args) on a daemon thread: one blocked in the kernel (a read of a D-state process,
    a wedged driver) is left running, and never keeps the agent from ending."""
    thread = threading.Thread(target=fn, args=args, name=name)
    thread.daemon = True
    thread.start()
    return thread


class Background(object):
    """fn() started now in a thread of its own, its value (or its exception) taken later by
    ``result``: the snapshot's /proc scan (reads that wait on the kernel) runs while NVML's
    init and queries wait on the driver (~13 ms of each on a real H200)."""

    def __init__(self, fn):
        self._done = threading.Event()
        self._box = []
        start_daemon("gpufleet-background", self._run, fn)

    def _run(self, fn):
        try:
            self._box.append((True, fn()))
        except BaseException as exc:  # handed to the caller of result()
            self._box.append((False, exc))
        finally:
            self._done.set()

    def wait(self, timeout):
        """Whether fn has returned (or raised) within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def result(self):
        self._done.wait()
        ok, value = self._box[0]
        if not ok:
            raise value
        return value


def read_bytes_bounded(path, timeout, limit=1 << 20):
    """Read in a thread: /proc/PID/cmdline or maps of a D-state process can block on its
    memory lock (the way `ps` hangs on a wedged GPU host). Returns (data, timed_out)."""
    if len(_STUCK_READERS) >= 8:
        return None, True
    finished, data = run_bounded(lambda: read_bytes(path, limit), timeout)
    if not finished:
        _STUCK_READERS.append(path)
        return None, True
    return data, False


class CmdResult(object):
    def __init__(self, rc=None, out="", err="", error=None, timed_out=False, seconds=0.0):
        self.rc = rc
        self.out = out
        self.err = err
        self.error = error
        self.timed_out = timed_out
        self.seconds = seconds


class Job(object):
    """A child process that never outlives its bound: Popen, communicate(timeout), kill.

    Started in its own session so a kill reaches anything it forked; after a kill it is
    waited for only briefly, because a process in D state cannot be reaped.
    """

    def __init__(self, argv, timeout, deadline, name=None):
        self.name = name or os.path.basename(argv[0])
        self.limit = max(0.0, min(timeout, deadline.remaining()))
        self.t0 = time.monotonic()
        self.proc = None
        self.result = None
        if self.limit <= 0:
            self.result = CmdResult(error="deadline reached before %s ran" % self.name,
                                    timed_out=True)
            return
        import subprocess  # here, not at the top: a snapshot through NVML starts nothing (~5 ms)

        env = dict(os.environ)
        env["LC_ALL"] = "C"
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                close_fds=True, start_new_session=True, env=env)
        except (OSError, ValueError) as exc:
            self.result = CmdResult(error="cannot run %s: %s" % (self.name, exc))

    @property
    def pid(self):
        return self.proc.pid if self.proc is not None else None

    def finish(self):
        if self.result is not None:
            return self.result
        import subprocess  # loaded by __init__ (a result without a process returned above)

        p = self.proc
        left = self.limit - (time.monotonic() - self.t0)
        try:
            out, err = p.communicate(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            self.kill()
            self.result = CmdResult(
                error="%s timed out after %ss (driver hung?)" % (self.name, fmt_seconds(self.limit)),
                timed_out=True, seconds=time.monotonic() - self.t0)
            return self.result
        except BaseException:
            self.kill()
            raise
        self.result = CmdResult(
            rc=p.returncode, out=out.decode("utf-8", "replace"),
            err=err.decode("utf-8", "replace"), seconds=time.monotonic() - self.t0)
        return self.result

    def kill(self):
        import subprocess  # loaded by __init__

        p = self.proc
        try:
            os.killpg(p.pid, signal.SIGKILL)  # own session: pgid == pid, not yet reaped
        except OSError:
            try:
                p.kill()
            except OSError:
                pass
        try:
            p.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass  # D state: leave it to init, never wait unboundedly
        for f in (p.stdout, p.stderr):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def run_cmd(argv, timeout, deadline, name=None):
    return Job(argv, timeout, deadline, name).finish()


def which(name, fallbacks):
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d:
            cand = os.path.join(d, name)
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    for cand in fallbacks:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def find_nvidia_smi(requested):
    if requested:
        if os.path.isfile(requested) and os.access(requested, os.X_OK):
            return requested
        return None
    return which("nvidia-smi", SMI_FALLBACKS)


def smi_failure(res):
    """(error, exit_code) of a failed nvidia-smi call, or None when it succeeded."""
    if res.error:
        return res.error, None
    if res.rc != 0:
        return (first_line(res.out, res.err) or "nvidia-smi exited %d" % res.rc), res.rc
    return None
