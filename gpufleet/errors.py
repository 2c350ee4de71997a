"""Errors that reach the operator as one line and a documented exit code (see README).

The one hierarchy; nothing else in gpufleet defines an exception class (the agent, which runs
alone on the host, is the exception: it is standard library only)::

    GpufleetError                 exit 1 unless said otherwise
      UsageError                  exit 2: bad command line, inventory or runbook
        InventoryError            the inventory (fleet.yaml) is wrong
        LoadError                 YAML that cannot be read (the line is known)
        SlurmConfigError          the job environment Slurm gave is unusable (the node's
                                  configuration is at fault: gres.conf, SLURM_JOB_GPUS, users)
      TransportError              a host could not be reached or run the command; ``kind``
        HostKeyError              kind "hostkey": a host key gpufleet will not accept
        SshConfigError            kind "sshconfig": ssh_config gives the alias no destination
        AuthFailed                kind "auth": no key was accepted
      AgentError                  kind "agent": the agent ran but its output is unusable
        SnapshotError             its snapshot document is malformed
      StepFailed                  a runbook step's own failure

A host's failure is a value (gpufleet.core.results) carrying one of the kinds below; verdicts
("unreachable") and exit codes are decided from kinds, never by reading messages.
"""
from __future__ import annotations

from typing import Optional, Sequence

EXIT_OK = 0
EXIT_FAILED = 1  # some host failed, is dirty, or the model does not fit
EXIT_USAGE = 2  # bad command line, inventory or runbook; nothing was done
EXIT_INTERRUPTED = 130  # Ctrl-C: what was done is printed

# --------------------------------------------------------------------------- failure kinds
# What the transport tells apart (transport.connection.transport_error, transport.session).
REFUSED = "refused"  # TCP connect refused (nothing listens)
TIMEOUT = "timeout"  # DNS lookup or TCP connect did not finish within connect_timeout
DNS = "dns"  # the name does not resolve
NETWORK = "network"  # another connect-time OS error (no route, network unreachable)
PROXY = "proxy"  # a ProxyJump hop could not open the channel to the host
CLOSED = "closed"  # the server closed the connection, or it was lost mid-run
BANNER = "banner"  # no SSH banner (not an SSH server, or overloaded)
HANDSHAKE = "handshake"  # the SSH key exchange did not complete
HOSTKEY = "hostkey"  # host key unknown (strict), changed, or revoked
AUTH = "auth"  # no key accepted; gpufleet never prompts
SSHCONFIG = "sshconfig"  # ssh_config cannot be applied (ssh -G refused it, bad alias, loop)
SSH = "ssh"  # another SSH protocol error
COMMAND = "command"  # connected, but the command failed or ran past its timeout (python3
#                      missing, sudo wants a password, an exit status, the command timeout)
AGENT = "agent"  # the agent ran but its output is unusable (not JSON, wrong version)
USAGE = "usage"  # the operator's input does not fit this host (--gpus 9 on an 8-GPU host)
BUSY = "busy"  # another gpufleet clean holds the host's lock
INTERRUPTED = "interrupted"  # Ctrl-C: not started, or no longer waited for
INTERNAL = "internal"  # anything else that broke (a bug): still one row, never a traceback

KINDS = (REFUSED, TIMEOUT, DNS, NETWORK, PROXY, CLOSED, BANNER, HANDSHAKE, HOSTKEY, AUTH,
         SSHCONFIG, SSH, COMMAND, AGENT, USAGE, BUSY, INTERRUPTED, INTERNAL)
# The host could not be reached at all: `clean` calls its verdict "unreachable".
UNREACHABLE_KINDS = frozenset({REFUSED, TIMEOUT, DNS, NETWORK, PROXY, CLOSED})


class GpufleetError(Exception):
    """An error with the exit code the CLI turns it into, and the kind of failure it is.

    ``more``: further error lines (one per host, say); ``notes``: lines said after them. The
    CLI prints ``gpufleet: error: LINE`` for the message and each of ``more``, then
    ``gpufleet: NOTE`` for each note (:func:`lines`).
    """

    exit_code = EXIT_FAILED
    kind = INTERNAL

    def __init__(self, message: str, exit_code: Optional[int] = None, *,
                 more: Sequence[str] = (), notes: Sequence[str] = ()):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
        self.more = tuple(more)
        self.notes = tuple(notes)


class UsageError(GpufleetError):
    """Bad input: command line, inventory, runbook. Exit 2, nothing signalled."""

    exit_code = EXIT_USAGE
    kind = USAGE


class InventoryError(UsageError):
    """The inventory cannot be used (exit 2)."""


class LoadError(UsageError):
    """YAML that cannot be loaded; ``line`` is where (config.yamlsource adds the file)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


class SlurmConfigError(UsageError):
    """The Slurm job's environment cannot be acted on (a malformed SLURM_JOB_GPUS, a GPU the
    node lacks, an unknown SLURM_JOB_UID): nothing is signalled, exit 2, and the line says
    that the configuration, not the job, is at fault (Slurm then drains the node)."""

    AT_FAULT = "the node's Slurm configuration is at fault (gres.conf, slurm.conf, users)"

    def __init__(self, message: str):
        super().__init__(f"{message}; nothing signalled: {self.AT_FAULT}")


class TransportError(GpufleetError):
    """A host could not run the command; the message is one short line for the host's row.

    ``kind``: one of the kinds above; ``stdout``/``stderr``: what the command printed, when
    it ran at all.
    """

    def __init__(self, message: str, stdout: bytes = b"", stderr: bytes = b"",
                 kind: str = SSH):
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr
        self.kind = kind


class HostKeyError(TransportError):
    """A host key gpufleet will not accept; the message says why and what to do."""

    def __init__(self, message: str, verdict: str, keytype: str = "", fingerprint: str = ""):
        super().__init__(message, kind=HOSTKEY)
        self.verdict = verdict
        self.keytype = keytype
        self.fingerprint = fingerprint


class SshConfigError(TransportError):
    """ssh_config cannot give this alias a destination; one line, for the host's row."""

    def __init__(self, message: str):
        super().__init__(message, kind=SSHCONFIG)


class AuthFailed(TransportError):
    """No key was accepted: raised inside paramiko's auth call with the keys tried as its
    message; the connection raises it again with user@host added."""

    def __init__(self, message: str):
        super().__init__(message, kind=AUTH)


class AgentError(GpufleetError):
    """The agent ran (or tried to) and gave nothing usable."""

    kind = AGENT


class SnapshotError(AgentError, ValueError):
    """The agent's snapshot document is malformed (a ValueError too, as it always was)."""


class StepFailed(GpufleetError):
    """A runbook step's own failure, with the one-line reason shown to the operator."""

    kind = COMMAND


# --------------------------------------------------------------------------- one line


def one_line(text: str) -> str:
    """Any message as ONE line: runs of whitespace (newlines too) become one space."""
    return " ".join(str(text).split())


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text, or its type name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def kind_of(exc: BaseException) -> str:
    """The failure kind an exception stands for (INTERNAL for anything not gpufleet's)."""
    if isinstance(exc, GpufleetError):
        return exc.kind
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    return INTERNAL


def lines(exc: BaseException) -> list[str]:
    """What the CLI prints on stderr for an error that ends a command (one line each)."""
    out = [f"gpufleet: error: {exc}"]
    if isinstance(exc, GpufleetError):
        out += [f"gpufleet: error: {m}" for m in exc.more]
        out += [f"gpufleet: {n}" for n in exc.notes]
    return out


def describe(exc: BaseException) -> str:
    """The one line an operator sees for ``exc``: gpufleet's own errors as they say it,
    anything else (a bug) with its type name first, so it is never taken for a host's reply."""
    if isinstance(exc, GpufleetError):
        return first_line(exc)
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
