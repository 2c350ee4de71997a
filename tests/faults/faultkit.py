"""Tools of the fault and abuse suite (tests/faults/README.md): run the real CLI, take a census
of a lab host's processes, plant fake commands in a host, drive an interactive run on a pty,
and keep the session-wide counts the suite asserts (hostile inputs tried, wrong kills).

Every test that starts processes takes a census of the host before it acts and proves, after,
that EXACTLY the processes it meant to end are gone (pid + start time): anything else that
disappeared is a wrong kill, counted in LEDGER and failed at once. Nothing here signals a
process by name: only lab hosts' processes by the pid the test itself started or recorded.
"""
from __future__ import annotations

import json
import os
import pty  # noqa: F401  (documents the dependency: os.openpty)
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

GPUFLEET = [sys.executable, "-c", "from gpufleet.cli import main; main()"]
# Variables that would point the CLI at the machine's own files instead of the test's.
_SCRUB = ("GPUFLEET_INVENTORY", "GPUFLEET_AUDIT_LOG", "SSH_AUTH_SOCK", "SSH_AGENT_PID")
AGENT_MARK = "gpufleet-agent"  # in the bootstrap's -c text: the agent's cmdline on a host
PROMPT = "Signal the processes above?"


# --------------------------------------------------------------------------- the ledger


@dataclass
class Ledger:
    """Session-wide counts; tests/faults/conftest.py prints them and asserts wrong_kills == 0."""

    hostile_inputs: int = 0
    hostile_kinds: dict = field(default_factory=dict)
    wrong_kills: int = 0
    wrong: list = field(default_factory=list)
    processes_checked: int = 0
    censuses: int = 0

    def hostile(self, kind: str, n: int = 1) -> None:
        self.hostile_inputs += n
        self.hostile_kinds[kind] = self.hostile_kinds.get(kind, 0) + n


LEDGER = Ledger()


# --------------------------------------------------------------------------- the CLI


@dataclass
class CliRun:
    argv: list
    rc: int
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> dict:
        try:
            return json.loads(self.stdout)
        except ValueError:
            raise AssertionError("stdout is not one JSON document:\n%s" % self) from None

    def host(self, name: str) -> dict:
        found = [h for h in self.json()["hosts"] if h["host"] == name]
        assert len(found) == 1, "host %s appears %d times:\n%s" % (name, len(found), self)
        return found[0]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        return "gpufleet %s -> exit %d after %.2fs\n--- stdout\n%s--- stderr\n%s" % (
            " ".join(self.argv)[:400], self.rc, self.seconds, self.stdout[-6000:],
            self.stderr[-3000:])


def cli_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env["HOME"] = str(home)
    # gpufleet's own colour off (on a pty it paints ERROR and dirty): an escape sequence in
    # what these tests read can then only have come from a hostile process or value
    env["NO_COLOR"] = "1"
    # this checkout first: the CLI runs from HOME, where another installed gpufleet would win
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_cli(home: Path, inventory: Optional[Path], *args: Any, timeout: float = 120,
            stdin: str = "") -> CliRun:
    """`gpufleet [-i INVENTORY] ARGS...` as a subprocess, HOME=home, stdin not a terminal."""
    argv = (["-i", str(inventory)] if inventory is not None else []) + [str(a) for a in args]
    started = time.monotonic()
    res = subprocess.run(GPUFLEET + argv, capture_output=True, text=True, env=cli_env(home),
                         timeout=timeout, input=stdin, cwd=str(home))
    return CliRun(argv, res.returncode, res.stdout, res.stderr, time.monotonic() - started)


def start_cli(home: Path, inventory: Optional[Path], *args: Any) -> subprocess.Popen:
    """The CLI in the background (to interrupt it, or to race another one)."""
    argv = (["-i", str(inventory)] if inventory is not None else []) + [str(a) for a in args]
    proc = subprocess.Popen(GPUFLEET + argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True, env=cli_env(home),
                            cwd=str(home))
    proc.argv = argv  # type: ignore[attr-defined]
    proc.t0 = time.monotonic()  # type: ignore[attr-defined]
    return proc


def finish_cli(proc: subprocess.Popen, timeout: float = 120) -> CliRun:
    out, err = proc.communicate(timeout=timeout)
    return CliRun(proc.argv, proc.returncode, out, err,  # type: ignore[attr-defined]
                  time.monotonic() - proc.t0)  # type: ignore[attr-defined]


def run_on_pty(home: Path, inventory: Path, *args: Any,
               at_prompt: Optional[Callable[[], None]] = None, answer: str = "y",
               timeout: float = 120) -> CliRun:
    """An operator at a terminal: run the CLI on a pty, wait for the confirmation prompt, call
    ``at_prompt()`` (the world changes while the operator reads the plan), then answer.
    Without ``at_prompt`` no prompt is expected (what a terminal shows, e.g. escapes)."""
    argv = ["-i", str(inventory)] + [str(a) for a in args]
    master, slave = os.openpty()
    started = time.monotonic()
    proc = subprocess.Popen(GPUFLEET + argv, stdin=slave, stdout=slave, stderr=slave,
                            env=cli_env(home), cwd=str(home), start_new_session=True)
    os.close(slave)
    buf = b""
    answered = False
    deadline = started + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("interactive run did not finish:\n%s"
                                     % buf.decode("utf-8", "replace"))
            ready, _, _ = select.select([master], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the other side closed
                    chunk = b""
                if not chunk:
                    break
                buf += chunk
            if at_prompt is not None and not answered and PROMPT.encode() in buf:
                at_prompt()
                os.write(master, answer.encode() + b"\n")
                answered = True
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = buf.decode("utf-8", "replace").replace("\r\n", "\n")
    assert answered or at_prompt is None, "no confirmation prompt:\n" + text
    return CliRun(argv, rc, text, "", time.monotonic() - started)


class TtyCli:
    """The CLI on a pty that is its controlling terminal, as an operator's shell starts it:
    ``ctrl_c`` types Ctrl-C, and the terminal (not the test) sends SIGINT to the CLI's
    foreground process group, exactly as a keyboard would. Output is read as it comes."""

    def __init__(self, home: Path, inventory: Path, *args: Any) -> None:
        import fcntl
        import termios

        def take_terminal() -> None:  # runs in the child, after setsid: the pty is its tty
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.argv = ["-i", str(inventory)] + [str(a) for a in args]
        self.master, slave = os.openpty()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(GPUFLEET + self.argv, stdin=slave, stdout=slave,
                                     stderr=slave, env=cli_env(home), cwd=str(home),
                                     start_new_session=True, preexec_fn=take_terminal)
        os.close(slave)
        self.buf = b""
        self.closed = False

    @property
    def text(self) -> str:
        return self.buf.decode("utf-8", "replace").replace("\r\n", "\n")

    def _pump(self, wait: float) -> None:
        if self.closed:
            time.sleep(wait)
            return
        ready, _, _ = select.select([self.master], [], [], wait)
        if ready:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                chunk = b""
            if chunk:
                self.buf += chunk
            else:
                self.closed = True

    def wait_text(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text:
            if time.monotonic() > deadline or (self.closed and self.proc.poll() is not None):
                raise AssertionError("no %r on the terminal:\n%s" % (text, self.text))
            self._pump(0.2)

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def finish(self, timeout: float = 60.0) -> CliRun:
        deadline = time.monotonic() + timeout
        try:
            while not (self.closed and self.proc.poll() is not None):
                if time.monotonic() > deadline:
                    raise AssertionError("the CLI did not end:\n%s" % self.text)
                self._pump(0.2)
            rc = self.proc.wait(timeout=5)
        finally:
            os.close(self.master)
            if self.proc.poll() is None:
                self.proc.kill()  # the CLI this test started, by its pid
                self.proc.wait()
        return CliRun(self.argv, rc, self.text, "", time.monotonic() - self.started)


def assert_no_traceback(run: CliRun) -> None:
    assert "Traceback" not in run.output, str(run)


def assert_one_line_error(run: CliRun, *fragments: str) -> str:
    assert run.rc == 2, str(run)
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpufleet: error: "), str(run)
    for fragment in fragments:
        assert fragment in lines[0], str(run)
    assert_no_traceback(run)
    return lines[0]


def read_jsonl(path: Path) -> list:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def audit_log(home: Path) -> list:
    """The signal lines of the controller's audit log under this HOME."""
    return [r for r in audit_records(home) if r.get("event") != "verdict"]


def audit_verdicts(home: Path) -> list:
    """(host, verdict) of the verdict lines of the controller's audit log under this HOME."""
    return [(r["host"], r["verdict"]) for r in audit_records(home) if r.get("event") == "verdict"]


def audit_records(home: Path) -> list:
    return read_jsonl(home / ".local" / "state" / "gpufleet" / "audit.jsonl")


def agent_audit(host: Any, home: str = "/root") -> list:
    """The host-side audit the agent keeps (records survive a dropped session)."""
    return read_jsonl(host.path(home + "/.local/state/gpufleet/agent-audit.jsonl"))


def signals(records: Iterable[Mapping], pid: Optional[int] = None) -> list:
    """(pid, signal, outcome) of audit records or a clean document's `signals` (an audit
    log's verdict lines are not signals)."""
    return [(r["pid"], r["signal"], r["outcome"]) for r in records
            if r.get("event") != "verdict" and (pid is None or r["pid"] == pid)]


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll for lab set-up or a remote effect (never a timing assertion)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0fs waiting for %s" % (timeout, what))
        time.sleep(0.02)


# --------------------------------------------------------------------------- host processes


def _stat(host: Any, pid: int) -> Optional[dict]:
    try:
        data = host.path("/proc/%d/stat" % pid).read_bytes().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    right = data.rindex(")")
    rest = data[right + 2:].split()
    return {"comm": data[data.index("(") + 1:right], "state": rest[0], "ppid": int(rest[1]),
            "starttime": int(rest[19])}


def listener_pid(host: Any) -> int:
    return int(host.path("/run/gflab/sshd.pid").read_text().split()[0])


def _cmdline(host: Any, pid: int) -> bytes:
    try:
        return host.path("/proc/%d/cmdline" % pid).read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


def _transient(host: Any, pid: int, st: Mapping, listener: int) -> bool:
    """SSH sessions (sshd children, their shells) and agents come and go on their own."""
    if pid != listener and st["comm"].startswith("sshd"):
        return True
    return AGENT_MARK.encode() in _cmdline(host, pid)


def census(host: Any) -> dict:
    """{pid: starttime} of the host's long-lived processes (zombies and sessions left out)."""
    listener = listener_pid(host)
    out = {}
    for entry in host.path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        st = _stat(host, pid)
        if st is None or st["state"] in ("Z", "X"):
            continue
        if _transient(host, pid, st, listener):
            continue
        out[pid] = st["starttime"]
    LEDGER.censuses += 1
    return out


def sessions(host: Any) -> list:
    """Pids of SSH session processes and agents still on the host."""
    listener = listener_pid(host)
    found = []
    for entry in host.path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(host, int(entry.name))
            if st and st["state"] not in ("Z", "X") and _transient(host, int(entry.name), st,
                                                                      listener):
                found.append(int(entry.name))
    return found


def settle(host: Any, timeout: float = 30.0) -> None:
    """Wait until no agent is left on the host (they end on their own, kept connection or
    not), then close the SSH connections the test's commands kept (``ssh_persist``, on by
    default: a kept master's session stays on the host by design; each asked to end through
    its socket, as `gpufleet disconnect` does), and wait until no SSH session is left."""
    wait_for(lambda: not agents_left(host), timeout, "agents on %s to end" % host.name)
    from gpufleet.transport import close_kept, kept_connections

    for found in kept_connections():  # this test's: its own XDG_RUNTIME_DIR (tests/conftest.py)
        close_kept(found.path)
    wait_for(lambda: not sessions(host), timeout, "SSH sessions and agents on %s to end"
             % host.name)


def assert_gone_exactly(host: Any, before: Mapping[int, int], gone: Iterable[int] = ()) -> None:
    """Every process of the census ``before`` is still there (same start time) except exactly
    ``gone``. A process missing that was not in ``gone`` is a WRONG KILL."""
    expected = set(int(p) for p in gone)
    settle(host)
    missing = set()
    for pid, start in before.items():
        st = _stat(host, pid)
        if st is None or st["starttime"] != start or st["state"] in ("Z", "X"):
            missing.add(pid)
    LEDGER.processes_checked += len(before)
    wrong = sorted(missing - expected)
    if wrong:
        LEDGER.wrong_kills += len(wrong)
        LEDGER.wrong.append((host.name, wrong))
    assert not wrong, "WRONG KILL on %s: %s ended and must not have" % (host.name, wrong)
    survivors = sorted(expected - missing)
    assert not survivors, "%s: %s should have ended and are alive" % (host.name, survivors)


def agents_left(host: Any) -> list:
    """Agent processes still running on the host."""
    return [p for p in sessions(host) if AGENT_MARK.encode() in _cmdline(host, p)]


def agents_waiting(host: Any) -> list:
    """Agents that answered and wait for their conversation's next request (the stay mode of
    `clean`): a thread other than the main one is blocked in read(2) on stdin, as
    /proc/PID/task/TID/syscall shows it ("0 0x0 ...": x86_64's read, fd 0)."""
    waiting = []
    for pid in agents_left(host):
        try:
            tasks = [t for t in host.path("/proc/%d/task" % pid).iterdir() if t.name != str(pid)]
            calls = [(t / "syscall").read_text().split()[:2] for t in tasks]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if ["0", "0x0"] in calls:
            waiting.append(pid)
    return waiting


def session_processes(host: Any) -> list:
    """The host's sshd processes serving connections (not the listener), found by parentage."""
    listener = listener_pid(host)
    kids = []
    for entry in host.path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(host, int(entry.name))
            if st and st["ppid"] == listener and st["state"] not in ("Z", "X"):
                kids.append(int(entry.name))
    return kids


# --------------------------------------------------------------------------- planting commands


def real_python() -> str:
    """An interpreter every host user can run, by absolute path (as the lab's fake driver)."""
    return os.path.realpath(shutil.which("python3", path="/usr/bin:/bin") or sys.executable)


def install_bins(host: Any, files: Mapping[str, str], directory: str = "/usr/local/bin") -> None:
    """Shadow commands on the host's session PATH: an overlay on ``directory`` mounted inside
    the host's own mount namespace (the real disk and other hosts never see it)."""
    tag = uuid.uuid4().hex[:8]
    base = "/run/gflab/faults-%s" % tag
    upper = host.path(base + "/u")
    upper.mkdir(parents=True)
    host.path(base + "/w").mkdir()
    for name, text in files.items():
        (upper / name).write_text(text)
        os.chmod(upper / name, 0o755)
    res = host.exec(["mount", "-t", "overlay", "gf-faults-" + tag, "-o",
                     "lowerdir=%s,upperdir=%s/u,workdir=%s/w" % (directory, base, base),
                     directory])
    assert res.returncode == 0, "overlay on %s in %s: %s" % (directory, host.name, res.stderr)


def write_host_file(host: Any, inner: str, text: str, mode: int = 0o755) -> str:
    path = host.path(inner)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return inner


OLD_PYTHON = r'''
"""A stand-in for an old interpreter: the real one with sys.version_info of VERSION. As
Python 2, sys.stdin is a 'file' object without .buffer (what breaks a Python 3 program)."""
import sys
version = tuple(int(x) for x in sys.argv[1].split("."))
args = sys.argv[2:]
if args[:1] in (["--version"], ["-V"]):
    sys.stderr.write("Python %s\n" % sys.argv[1])
    sys.exit(0)
while args[:1] and args[0] in ("-S", "-E", "-s"):  # options 2.7 and 3.5 have too (the
    args = args[1:]  # agent is started with them: gpufleet.remote.PYTHON_FLAGS); the stand-in
    # itself already runs with -S -E
if args[:1] != ["-c"] or len(args) < 2:
    sys.stderr.write("old-python stand-in: only -c is supported\n")
    sys.exit(2)


class VersionInfo(tuple):
    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])
    micro = property(lambda self: self[2])


sys.version_info = VersionInfo(version + ("final", 0))
sys.version = "%s (default, old)" % sys.argv[1]
if version[0] == 2:
    class file(object):
        def __init__(self, f):
            self._f = f

        def read(self, *a):
            return self._f.read(*a)

    sys.stdin = file(sys.stdin)
sys.argv = ["-c"] + args[2:]
exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
'''


def old_python_script(version: str) -> str:
    """/usr/local/bin/python3 text that behaves as Python ``version`` (see OLD_PYTHON)."""
    return '#!/bin/sh\nexec %s -S -E /run/gflab/old_python.py %s "$@"\n' % (real_python(),
                                                                           version)


def install_old_python(host: Any, version: str) -> None:
    write_host_file(host, "/run/gflab/old_python.py", OLD_PYTHON, 0o644)
    install_bins(host, {"python3": old_python_script(version)})


FAKE_SUDO = r'''#!/bin/sh
# sudo for a user without NOPASSWD rights, as sudo 1.9 answers: with -n it never prompts.
for a in "$@"; do
  case "$a" in
    -n|--non-interactive) echo "sudo: a password is required" >&2; exit 1 ;;
    --) break ;;
  esac
done
if [ -r /dev/tty ] && : 2>/dev/null </dev/tty; then
  printf '[sudo] password for %s: ' "$(id -un)" >/dev/tty
  read -r _ </dev/tty
  echo "sudo: 1 incorrect password attempt" >&2
  exit 1
fi
echo "sudo: a terminal is required to read the password; either use the -S option to read from standard input or configure an askpass helper" >&2
echo "sudo: a password is required" >&2
exit 1
'''


# --------------------------------------------------------------------------- reusing a pid

REUSE = r'''
import os, sys
target = int(sys.argv[1])
argv = sys.argv[2:]
for attempt in range(200):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(target - 1))
    pid = os.fork()
    if pid == 0:
        if os.getpid() != target:
            os._exit(3)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.execv(argv[0], argv)
    if pid == target:
        print(pid)
        sys.exit(0)
    os.waitpid(pid, 0)
sys.exit("pid %d not reused after 200 forks" % target)
'''


def reuse_pid(host: Any, pid: int, argv: Sequence[str]) -> int:
    """Start ``argv`` in the host AS ``pid`` (which must be free): ns_last_pid, then fork."""
    res = host.exec([real_python(), "-c", REUSE, str(pid)] + list(argv), timeout=30)
    assert res.returncode == 0 and res.stdout.strip() == str(pid), res.stderr
    return pid


def starttime(host: Any, pid: int) -> Optional[int]:
    st = _stat(host, pid)
    return st["starttime"] if st else None


# --------------------------------------------------------------------------- canaries


class Canary:
    """A file name that must never appear: any payload that runs writes it."""

    def __init__(self, root: Path):
        self.token = "gf-canary-" + uuid.uuid4().hex[:10]
        self.root = root  # a local directory the commands run in

    @property
    def path(self) -> str:
        return "/tmp/" + self.token

    def payloads(self) -> list:
        """Shell-, quote- and format-string payloads that create the canary if ever run."""
        c = self.path
        return [
            "$(touch %s)" % c,
            "`touch %s`" % c,
            "; touch %s" % c,
            "| touch %s" % c,
            "&& touch %s #" % c,
            "' ; touch %s ; '" % c,
            '" ; touch %s ; "' % c,
            "$(touch${IFS}%s)" % c,
            "x\ntouch %s\n" % c,
            "{{ X }} %%s %%n {0} ${HOME} * ? [a] %s" % c,
        ]

    def places(self, hosts: Sequence[Any] = ()) -> list:
        local = [Path("/tmp"), self.root, Path.cwd(), Path(os.environ.get("HOME", "/root"))]
        inner = ["/tmp", "/root", "/home/gflabuser", "/"]
        return local + [h.path(p) for h in hosts for p in inner]

    def found(self, hosts: Sequence[Any] = ()) -> list:
        hits = []
        for d in self.places(hosts):
            try:
                hits += [str(p) for p in Path(d).iterdir() if p.name == self.token]
            except OSError:
                continue
        return hits


def kill_pid_group(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """Signal a CLI process this test started (by its pid)."""
    os.kill(proc.pid, sig)
