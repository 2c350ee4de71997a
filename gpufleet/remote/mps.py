"""CUDA MPS: ask each verified control daemon which servers it runs and who their clients are.

A piece of the remote agent. Where NVML lists only the MPS server (some drivers and
containers do), its row holds its clients' memory too, and only the daemon knows who they
are. The daemon is asked through its OWN binary (/proc/PID/exe: root's
nvidia-cuda-mps-control, checked on the open file), with its own pipe directory
(CUDA_MPS_PIPE_DIRECTORY in /proc/PID/environ, default /tmp/nvidia-mps), and the answer is a
claim: the directory is used only when no one but the daemon's user (and root) could have made
or changed it (a user could pre-create /tmp/nvidia-mps and answer on its pipe), and the
controller counts a listed client only when it has NVIDIA device files open (core/mps.py).
Recorded answers (tests/fixtures/real-h200/clean-cases/probe-1.log part C): get_server_list
'908\\n', get_client_list 908 '891\\n', rc 0, nothing on stderr; and the same answers from the
daemon's binary run as /proc/self/fd/N with the pipe directory given through /proc/PID/root
(probe-mps-agent.log). The daemon listens on a socket there (``control``): a path longer than
a socket's (107 bytes) fails, as a value like any other failure.
"""
import os
import signal
import stat

from .jobs import read_bytes  # joined
from .procfs import PROC, read_stat  # joined

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
MPS_ASK_TIMEOUT_S = 2.0
MPS_MAX_SERVERS = 8
MPS_ENV_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def mps_daemons(processes):
    """PIDs of the process entries whose executable is root's nvidia-cuda-mps-control."""
    out = []
    for entry in processes.values():
        exe = entry.get("exe") or ""
        if exe.endswith(" (deleted)"):
            exe = exe[:-len(" (deleted)")]
        if entry.get("exe_root") and os.path.basename(exe) == MPS_CONTROL:
            out.append(entry["pid"])
    return sorted(out)


def mps_report(processes, deadline, proc=PROC):
    """The document's ``mps``: one entry per verified daemon (docs/protocol.md)."""
    return [mps_ask_daemon(pid, processes[str(pid)], deadline, proc)
            for pid in mps_daemons(processes)]


def mps_ask_daemon(pid, entry, deadline, proc=PROC):
    """{pid, pipe_dir, pipe_dir_trusted, servers, error} for one daemon."""
    out = {"pid": pid, "pipe_dir": None, "pipe_dir_trusted": False, "servers": None,
           "error": None}
    pipe_dir = mps_pipe_dir(pid, proc)
    if pipe_dir is None:
        out["error"] = "its environment is not readable"
        return out
    out["pipe_dir"] = pipe_dir
    uid = entry.get("uid")
    root = "%s/%d/root" % (proc, pid)  # the daemon's own view of its files
    why = mps_dir_problem(root, pipe_dir, uid) if uid is not None else "its owner is not known"
    if why is not None:
        out["error"] = "pipe directory %s not trusted: %s" % (pipe_dir, why)
        return out
    out["pipe_dir_trusted"] = True
    out["servers"], out["error"] = mps_lists(pid, entry.get("starttime"), root + pipe_dir,
                                             deadline, proc)
    return out


def mps_pipe_dir(pid, proc=PROC):
    """CUDA_MPS_PIPE_DIRECTORY from the daemon's environment, else the default; None when
    its environment cannot be read."""
    raw = read_bytes("%s/%d/environ" % (proc, pid))
    if raw is None:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
            value = item[len(b"CUDA_MPS_PIPE_DIRECTORY="):].decode("utf-8", "replace")
            if value:
                return value
    return MPS_DEFAULT_PIPE_DIR


def mps_dir_problem(root, pipe_dir, uid):
    """None when only ``uid`` and root could have made ``pipe_dir`` (seen under ``root``) and
    can change it: a directory itself (no link), ``uid``'s, that group and others cannot
    write, below directories that are root's or ``uid``'s and that others cannot write (unless
    sticky, like /tmp). Else why not."""
    if not pipe_dir.startswith("/") or os.path.normpath(pipe_dir) != pipe_dir.rstrip("/") \
            or pipe_dir.startswith("//"):
        return "not a plain absolute path"
    try:
        st = os.lstat(root + pipe_dir)
    except OSError as exc:
        return "cannot stat it (%s)" % (exc.strerror or exc)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory (a link?)"
    if st.st_uid != uid:
        return "owned by uid %d, not the daemon's uid %d" % (st.st_uid, uid)
    if st.st_mode & 0o022:
        return "group or others may write it (mode %o)" % stat.S_IMODE(st.st_mode)
    parent = os.path.dirname(pipe_dir.rstrip("/"))
    while True:
        try:
            pst = os.stat(root + parent)
        except OSError as exc:
            return "cannot stat %s (%s)" % (parent, exc.strerror or exc)
        if pst.st_uid not in (0, uid) or (pst.st_mode & 0o022 and not pst.st_mode & 0o1000):
            return "%s may be changed by another user" % parent
        if parent == "/":
            return None
        parent = os.path.dirname(parent)


def mps_lists(pid, starttime, pipe_dir, deadline, proc=PROC):
    """(servers, error): get_server_list, then get_client_list of each server, asked of the
    daemon's own binary; (None, why) when it cannot be asked or does not answer."""
    try:
        fd = os.open("%s/%d/exe" % (proc, pid), os.O_RDONLY)
    except OSError as exc:
        return None, "cannot open its executable (%s)" % (exc.strerror or exc)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return None, "its executable is not root's"
        now = read_stat(pid, proc)
        if now is None or now["starttime"] != starttime:
            return None, "the daemon exited"
        answer, error = mps_run(fd, pipe_dir, "get_server_list", deadline)
        servers = []
        for server in (answer or [])[:MPS_MAX_SERVERS]:
            clients, error = mps_run(fd, pipe_dir, "get_client_list %d" % server, deadline)
            if error is not None:
                break
            servers.append({"pid": server, "clients": clients})
        return (None if error is not None else servers), error
    finally:
        os.close(fd)


def mps_run(fd, pipe_dir, command, deadline):
    """(PIDs, error) of one command given to the control binary open on ``fd`` (run as
    /proc/self/fd/FD: the very file checked), bounded in time."""
    import subprocess

    limit = min(MPS_ASK_TIMEOUT_S, deadline.remaining() - 1.0)
    if limit <= 0:
        return None, "no time left to ask it"
    env = {"PATH": MPS_ENV_PATH, "LC_ALL": "C", "CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
    try:
        p = subprocess.Popen([MPS_CONTROL], executable="/proc/self/fd/%d" % fd, pass_fds=(fd,),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, cwd="/", close_fds=True,
                             start_new_session=True)
    except (OSError, ValueError) as exc:
        return None, "cannot run it: %s" % exc
    try:
        out, err = p.communicate((command + "\n").encode(), timeout=limit)
    except subprocess.TimeoutExpired:
        mps_kill(p)
        return None, "%s: no answer within %gs" % (command, limit)
    if p.returncode != 0:
        line = (err or out).decode("utf-8", "replace").strip().splitlines()
        return None, "%s: exit %d%s" % (command, p.returncode, (": " + line[0][:200]) if line else "")
    return mps_pids(out.decode("utf-8", "replace"), command)


def mps_pids(text, command):
    """(PIDs, None) from an answer of one PID a line, or (None, why) for anything else."""
    pids = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.isdigit():
            return None, "%s: unexpected answer %r" % (command, line[:80])
        pids.append(int(line))
    return pids, None


def mps_kill(p):
    """End a control client that does not answer (its own session), never waiting long."""
    import subprocess

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        p.wait(timeout=0.2)
    except subprocess.TimeoutExpired:
        pass
