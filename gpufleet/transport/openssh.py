"""OpenSSH's own client as the transport: each run is one ``ssh`` process, argv only.

Internal to gpufleet.transport (sessions come from ``open_session``). Why: ``ssh -G`` already
decides where gpufleet connects; running ``ssh`` itself connects exactly there, does the key
exchange and the channel in C (paramiko's import alone is ~150 ms, its handshake ~20 ms of
Python per host), and one process per host spreads a fleet over every core instead of one
GIL. paramiko (gpufleet.transport.paramikossh) stays the fallback: no ``ssh`` on PATH,
``ssh_client: paramiko``, and hosts reached through ProxyJump / ProxyCommand (OpenSSH would
not pass gpufleet's options to the jump's own ``ssh``, so a hop's host key could not be held
to gpufleet's policy).

What gpufleet asks of ssh, and why (gpufleet.transport.sshtarget builds the argv): never prompt
(BatchMode), public keys only, no pty, no escape character, no forwarding, no master of the
user's own (a user's ControlMaster/ControlPath is never joined: its options are not gpufleet's;
gpufleet's own, kept between commands with ``ssh_persist``, is gpufleet.transport.kept's), host
keys checked strictly against the same files gpufleet reads (gpufleet's accept-new is done here:
a first-seen key is fetched, checked by gpufleet.transport.hostkeys, recorded, then the run is
retried, so a key of another type than the one known is refused as with paramiko), errors only
on stderr.

ssh tells its own failures from the command's by exit status 255 and a line on stderr; those
lines are turned into the same kinds and one-line messages as the paramiko path's, here and
nowhere else (``ssh_failure``). With -v (the logger ``gpufleet.transport``) each run and
resident stream says how its ``ssh`` reached the host: through the kept master (an ``ssh``
joining it), one that becomes it, one of its own past a master that hangs, or plain.
"""
from __future__ import annotations

import base64
import logging
import os
import re
import shlex
import time
from typing import Callable, Optional, Sequence

from gpufleet import errors
from gpufleet.config.inventory import Host
from gpufleet.errors import SshConfigError, TransportError
from gpufleet.transport import sshconfig, sshcontrol
from gpufleet.transport.reply import remote_timeout
from gpufleet.transport.run import RawRun
from gpufleet.transport.session import Session
from gpufleet.transport.sshconfig import log
from gpufleet.transport.sshmaster import Master
from gpufleet.transport.sshtarget import Target, target_for
from gpufleet.transport.stream import ProcessStream, Stream


__all__ = ["OpensshSession", "OpensshStream", "Target", "hostkey_refusal", "open_session",
           "ssh_failure", "target_for"]


# --------------------------------------------------------------------------- ssh's failures


def _key_state(path: str) -> str:
    """"ok", "missing", "locked" (passphrase-protected) or "unreadable", read from the file
    itself (OpenSSH's format names its cipher; PEM says ENCRYPTED) without loading it."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(1 << 16)
    except FileNotFoundError:
        return "missing"
    except OSError:
        return "unreadable"
    if b"ENCRYPTED" in text:
        return "locked"
    body = b"".join(ln.strip() for ln in text.splitlines() if ln and not ln.startswith(b"-"))
    if text.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----"):
        try:
            blob = base64.b64decode(body[:64] + b"=" * (-len(body[:64]) % 4))
        except ValueError:
            return "unreadable"
        magic = b"openssh-key-v1\0"
        if blob.startswith(magic):
            n = int.from_bytes(blob[len(magic):len(magic) + 4], "big")
            cipher = blob[len(magic) + 4:len(magic) + 4 + n]
            return "ok" if cipher == b"none" else "locked"
    return "ok"



_DNS = re.compile(r"Could not resolve hostname (\S+?): (.+?)\.?$")
_CONNECT = re.compile(r"connect to host \S+ port \d+: (.+?)\.?$")
_DENIED = re.compile(r"^\S+: Permission denied \((.+)\)\.?$")
_CLOSED = ("Connection closed by", "Connection reset by", "Broken pipe", "Received disconnect",
           "Connection to ", "client_loop: send disconnect", "Timeout, server")
_CONFIG = ("Bad configuration option", "Bad owner or permissions", "Can't open user config",
           "no argument after keyword", "Unsupported option", "garbage at end of line",
           "command-line")


def _auth_message(target: Target) -> str:
    """The paramiko path's wording: the keys tried, then why others were not."""
    tried, notes = [], []
    for path, explicit in target.keys:
        state = _key_state(path)
        if state == "ok":
            tried.append(path)
        elif state == "missing" and explicit:
            notes.append(f"{path} not found")
        elif state == "locked":
            notes.append(f"{path} is passphrase-protected (load it into ssh-agent)")
        elif state == "unreadable":
            notes.append(f"{path} unreadable")
    if os.environ.get("SSH_AUTH_SOCK"):
        tried.append("agent keys")
    if tried:
        parts = ["tried " + ", ".join(tried)] + notes
    elif notes:
        parts = ["no usable key"] + notes
    else:
        parts = ["no key to try: no identity_file, ssh-agent key or ~/.ssh/id_*"]
    return (f"authentication failed for {target.user}@{target.key_name} ({'; '.join(parts)}); "
            "check user and identity_file")


def _connect_timed_out(target: Target) -> TransportError:
    return TransportError(f"connect to {target.where} timed out after "
                          f"{target.connect_timeout:g}s", kind=errors.TIMEOUT)


def ssh_failure(raw: RawRun, target: Target) -> Optional[TransportError]:
    """ssh's own failure in this run (exit 255 and its line on stderr), with the paramiko
    path's kind and wording; None: the command itself ran (whatever its status)."""
    if raw.timed_out or raw.exit_code != 255:
        return None
    lines = [ln.strip() for ln in raw.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    for line in lines:
        text = line[5:] if line.startswith("ssh: ") else line
        m = _DNS.search(text)
        if m:
            return TransportError(f"cannot resolve {m.group(1)}: {m.group(2)}", kind=errors.DNS)
        m = _CONNECT.search(text)
        if m:
            reason = m.group(1)
            if reason == "Connection refused":
                return TransportError(f"connection refused by {target.where}", kind=errors.REFUSED)
            if "timed out" in reason.lower():
                return _connect_timed_out(target)
            return TransportError(f"cannot connect to {target.where}: {reason}",
                                  kind=errors.NETWORK)
        if "banner exchange" in text or text.startswith("kex_exchange_identification"):
            return TransportError("no SSH banner (not an SSH server, or overloaded)",
                                  kind=errors.BANNER)
        if text == "Host key verification failed.":
            return TransportError(text, kind=errors.HOSTKEY)
        if _DENIED.match(text):
            return TransportError(_auth_message(target), kind=errors.AUTH)
        if any(k in text for k in _CONFIG):
            return SshConfigError(f"ssh refused the config: {text[:200]}")
    for line in lines:
        if line.startswith(_CLOSED):
            return TransportError("the server closed the connection", kind=errors.CLOSED)
    return None


def hostkey_refusal(host: Host, target: Target) -> tuple[Optional[TransportError], bool]:
    """ssh refused the host's key: (gpufleet's own refusal with the key and FILE:LINE, or
    None when accept-new recorded a first-seen key now; whether it was recorded). Fetches the
    key the host presents (paramiko's key exchange: only on this path)."""
    from gpufleet.transport import hostkeys
    from gpufleet.transport.connection import connection_for
    from gpufleet.transport.keyscan import fetch_host_key

    try:
        keytype, _fp, key = fetch_host_key(host)
        conn = connection_for(host)
        files, name = list(conn.known_hosts_files), conn.key_name
        conn.close()
    except TransportError as exc:
        return exc, False
    blob = key.asbytes()
    verdict = hostkeys.check(name, keytype, blob, files)
    if verdict.verdict == hostkeys.UNKNOWN and target.policy == hostkeys.ACCEPT_NEW:
        verdict = hostkeys.record(name, key, hostkeys.gpufleet_known_hosts(), files)
        if verdict.verdict == hostkeys.KNOWN:
            return None, True
    if verdict.verdict == hostkeys.KNOWN:  # ssh and gpufleet disagree: ssh's word stands
        return TransportError(f"ssh refused the host key of {name} that gpufleet knows "
                              f"({keytype})", kind=errors.HOSTKEY), False
    hint = f"run `gpufleet trust {host.name}` or set host_key_policy: accept-new"
    return hostkeys.refusal(name, keytype, blob, verdict, hint), False


# --------------------------------------------------------------------------- the session


class OpensshSession(Session):
    """One ``ssh`` process per run; with ``keep``, a master of gpufleet's own
    (gpufleet.transport.sshmaster) opened by the first run, so the later ones need no
    handshake (a master that died meanwhile: the run connects on its own).

    ``error`` becomes sticky after a connect-time failure when no run has reached the host
    yet, so a runbook's later steps fail at once, as with a session that never connected;
    once a run got through, every run tries afresh (a host that rebooted is reached again).
    """

    def __init__(self, host: Host, target: Optional[Target], error: Optional[TransportError] = None,
                 keep: bool = False):
        super().__init__(host)
        self.target = target
        self._reached = False
        kept_here = target is not None and target.kept is not None
        self._master: Optional[Master] = Master() if keep and not kept_here else None
        self._open_kept = keep and kept_here  # connect() starts the kept master if none
        self._master_tried = False
        if error is not None:
            self.error, self.error_kind = str(error), error.kind

    def _wrap_timeout(self, argv: list[str], timeout: float) -> list[str]:
        return remote_timeout(argv, timeout)

    def _command(self, argv: Sequence[str]) -> list[str]:
        assert self.target is not None
        master = self._master
        ssh = self.target.via(master.path) if master is not None and master.up and master.path \
            else self.target.argv
        return list(ssh) + [_remote_command(argv)]

    def _kept_command(self, argv: Sequence[str]) -> tuple[list[str], str]:
        """The ``ssh`` argv of a run, and how it reaches the host in words (-v): with a kept
        connection, one that joins its master, or becomes it where none is up
        (ControlMaster=auto replaces a stale socket); one on a connection of its own when a
        master holds the socket but does not answer within the connect timeout
        (gpufleet.transport.sshcontrol says why it is asked first)."""
        target = self.target
        assert target is not None
        if target.kept is not None:
            master = sshcontrol.check(target.kept, target.connect_timeout)
            if master.hung:
                return list(target.alone) + [_remote_command(argv)], (
                    f"with an ssh process of its own (the kept master {target.kept} does not "
                    "answer)")
            if master.pid is not None:
                return self._command(argv), (f"through the kept master {target.kept} (its ssh "
                                             f"joins master pid {master.pid}, no handshake)")
            return self._command(argv), (f"with an ssh process that becomes the kept master "
                                         f"{target.kept}")
        through = self._master is not None and self._master.up
        return self._command(argv), "with an ssh process" + (
            " through this command's master" if through else "")

    def _attempt(self, run: Callable[[], RawRun], master: bool = False) -> RawRun:
        """``run`` once (twice when gpufleet's accept-new recorded a first-seen key); ssh's
        own failure raised as the transport's. ``master``: ``run`` opens the master; one
        that timed out is the host's timeout, one that failed otherwise just means no master."""
        assert self.target is not None
        raw = run()
        failure = ssh_failure(raw, self.target)
        if failure is not None and failure.kind == errors.HOSTKEY:
            failure, recorded = hostkey_refusal(self.host, self.target)
            if recorded:
                raw = run()
                failure = ssh_failure(raw, self.target)
        if failure is None and master and raw.timed_out:
            failure = _connect_timed_out(self.target)
        if failure is None:
            if not master or raw.exit_code == 0:
                self._reached = True
            return raw
        if not self._reached:
            self.error, self.error_kind = str(failure), failure.kind
        raise failure

    def _open_master(self) -> RawRun:
        assert self.target is not None and self._master is not None
        bound = self.target.connect_timeout * 2 + 5  # connect, then key exchange and auth
        started = time.monotonic()
        raw = self._master.start(self.target.base, self.target.dest, bound)
        log.debug("%s: master for this command's runs: exit %s after %.3fs",
                  self.host.name, raw.exit_code, time.monotonic() - started)
        return raw

    def _start_kept(self) -> RawRun:
        """``keep`` over ``ssh_persist``: no socket yet, so a first run (``true``) starts the
        kept master now, and an unreachable host is the session's error on open, as with
        gpufleet's own master (a socket there already: the first real run judges it)."""
        assert self.target is not None and self.target.kept is not None
        if os.path.exists(self.target.kept):
            return RawRun(0, b"", b"")
        return super()._run(["true"], b"", self.target.connect_timeout * 2 + 5)

    def connect(self) -> None:
        """Open the master now (``keep``); a failure becomes ``error``, never raised."""
        if (self._master is not None or self._open_kept) and not self._master_tried \
                and self.error is None:
            self._master_tried = True
            started = time.monotonic()
            opener = self._open_master if self._master is not None else self._start_kept
            try:
                self._attempt(opener, master=True)
            except TransportError:
                pass  # recorded in error / error_kind by _attempt
            finally:
                self.connect_seconds = time.monotonic() - started

    def _run(self, argv: Sequence[str], stdin: bytes, timeout: float) -> RawRun:
        self.connect()
        if self.error is not None or self.target is None:
            raise TransportError(self.error or "not connected", kind=self.error_kind or errors.CLOSED)
        return self._attempt(lambda: super(OpensshSession, self)._run(argv, stdin, timeout))

    def _stream(self, argv: Sequence[str], head: bytes, timeout: float,
                as_run: bool = False) -> Stream:
        if self.error is not None or self.target is None:
            raise TransportError(self.error or "not connected", kind=self.error_kind or errors.CLOSED)
        started = time.monotonic()
        command, how = self._kept_command(argv)
        if not as_run:
            log.debug("%s: resident run %s", self.host.name, how)
        return OpensshStream(command, head, self.target, as_run=as_run, host=self.host, how=how,
                             started=started)

    def _first_run(self, start: Callable[[], RawRun]) -> RawRun:
        """A conversation's start is this host's run: ssh's own failures raised with their
        kinds, accept-new's first-seen key recorded and the start retried, as ``_run``."""
        self.connect()
        if self.error is not None or self.target is None:
            raise TransportError(self.error or "not connected", kind=self.error_kind or errors.CLOSED)
        return self._attempt(start)

    def ended_failure(self, raw: RawRun) -> Optional[TransportError]:
        return ssh_failure(raw, self.target) if self.target is not None else None

    def close(self) -> None:
        if self._master is not None:
            self._master.close()


def _remote_command(argv: Sequence[str]) -> str:
    """The one command line the remote shell is given: each word quoted, as data."""
    return " ".join(shlex.quote(a) for a in argv)


class OpensshStream(ProcessStream):
    """A resident run through one ``ssh`` process; ssh's own failure is its end's kind. A
    refused host key is said as a run says it (``hostkey_refusal``: HOST KEY CHANGED with both
    fingerprints, or the key recorded under accept-new), not as ssh's bare "Host key
    verification failed." (`top`, `status --watch`)."""

    def __init__(self, argv: Sequence[str], head: bytes, target: Target, as_run: bool = False,
                 host: Optional[Host] = None, how: str = "", started: Optional[float] = None):
        self.target = target
        self.host = host
        # a conversation's start (as_run) is a run: OpensshSession._attempt records a
        # first-seen key and retries it; only a resident stream (top, --watch) says it here
        self._says_hostkey = host is not None and not as_run
        self._refused: Optional[TransportError] = None  # the host key's verdict, fetched once
        self.how = how  # -v: how its ssh reaches the host (OpensshSession._kept_command)
        self._started = time.monotonic() if started is None else started
        super().__init__(argv, head, as_run=as_run)

    def run_to_end(self, timeout: float) -> RawRun:
        """A one-shot run (Stream.run_to_end); -v says how it went."""
        raw = super().run_to_end(timeout)
        if self.host is not None and log.isEnabledFor(logging.DEBUG):
            log.debug("%s: run %s: exit %s after %.3fs%s", self.host.name, self.how,
                      raw.exit_code, time.monotonic() - self._started,
                      " (timed out)" if raw.timed_out else "")
        return raw

    def _ended_error(self) -> TransportError:
        if self._refused is not None:
            return self._refused
        code = self._exit_code()
        self._drain_err()  # ssh's line may still be unread when its stdout's end was seen
        raw = RawRun(code, b"", bytes(self._err))
        failure = ssh_failure(raw, self.target)
        if failure is not None and failure.kind == errors.HOSTKEY and self._says_hostkey \
                and self.host is not None:
            refusal, recorded = hostkey_refusal(self.host, self.target)
            self._refused = refusal or failure if not recorded else TransportError(
                "first-seen host key recorded (accept-new); reconnecting", kind=errors.CLOSED)
            return self._refused
        if failure is not None:
            return failure
        if code == 255:
            return TransportError("connection lost", kind=errors.CLOSED)
        return super()._ended_error()


def open_session(host: Host, keep: bool = False) -> Optional[Session]:
    """The host's OpenSSH session, or None: use the paramiko path (see the module docstring).
    Never raises for a host: ssh_config errors are the session's ``error``. ``keep``: the
    caller will run several commands (a master is opened by the first)."""
    ssh = sshconfig.ssh_client()
    if ssh is None:
        return OpensshSession(host, None, SshConfigError(
            "ssh_client: openssh, but no ssh client on PATH"))
    try:
        target = target_for(host, ssh)
    except TransportError as exc:
        return OpensshSession(host, None, SshConfigError(f"ssh config: {exc}"))
    if target is None:
        return None
    session = OpensshSession(host, target, keep=keep)
    if keep:  # connect now, as a kept paramiko session does: its failure is ``error`` now
        session.connect()
    return session
