"""Host key policies: ``strict`` and ``accept-new``; a CHANGED key is always refused.

paramiko and fabric accept unknown host keys silently by default (fabric puts AutoAddPolicy on
its client and on every ProxyJump gateway); gpufleet signals processes on the hosts it reaches,
so it must know it reached the right machine. This module reads OpenSSH known_hosts files
itself (keeping FILE:LINE for messages; hashed ``|1|`` entries, ``[host]:port`` names,
wildcard/negated patterns and ``@revoked`` lines handled), decides, and records first-seen
keys for ``accept-new`` in ``~/.config/gpufleet/known_hosts`` (which both policies read back,
so ``gpufleet trust HOST`` works under ``strict`` too).

Files read, in order: the host's ``known_hosts_file``; ssh_config ``UserKnownHostsFile``
(else ``~/.ssh/known_hosts``, ``~/.ssh/known_hosts2``); ``~/.config/gpufleet/known_hosts``;
ssh_config ``GlobalKnownHostsFile`` (else ``/etc/ssh/ssh_known_hosts``, ``..2``).
"""
from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import paramiko
from paramiko.hostkeys import HostKeys

from gpufleet.errors import GpufleetError, HostKeyError
from gpufleet.transport.knownfiles import (  # noqa: F401 - re-exported
    default_files,
    gpufleet_known_hosts,
    host_key_name,
    user_files,
)

STRICT = "strict"
ACCEPT_NEW = "accept-new"
POLICIES = (STRICT, ACCEPT_NEW)

# Verdicts of check()
KNOWN = "known"
UNKNOWN = "unknown"
CHANGED = "changed"
OTHER_TYPE = "other-type"  # only keys of other types are known: refused like a change
REVOKED = "revoked"


def fingerprint_blob(blob: bytes) -> str:
    """``SHA256:...`` exactly as OpenSSH prints it (base64, no padding)."""
    digest = hashlib.sha256(blob).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def fingerprint(key: paramiko.PKey) -> str:
    return fingerprint_blob(key.asbytes())


@dataclass(frozen=True)
class KnownKey:
    """One known_hosts line; ``blob`` is compared, so key types paramiko can't parse still count."""

    path: str
    line: int
    patterns: tuple[str, ...]
    keytype: str
    blob: bytes
    marker: Optional[str] = None  # None, "revoked" or "cert-authority"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def fingerprint(self) -> str:
        return fingerprint_blob(self.blob)

    def pkey(self) -> Optional[paramiko.PKey]:
        try:
            return paramiko.PKey.from_type_string(self.keytype, self.blob)
        except Exception:  # unknown to paramiko (sk-*, dss in new paramiko): compare blobs only
            return None


def _parse_line(path: str, lineno: int, raw: str) -> Optional[KnownKey]:
    line = raw.strip()
    if not line or line.startswith("#"):
        return None
    fields = line.split()
    marker = None
    if fields[0].startswith("@"):
        marker = fields[0][1:]
        fields = fields[1:]
    if len(fields) < 3:
        return None
    try:
        blob = base64.b64decode(fields[2], validate=True)
    except (ValueError, TypeError):
        return None
    return KnownKey(path, lineno, tuple(fields[0].split(",")), fields[1], blob, marker)


_cache_lock = threading.Lock()
_cache: dict[str, tuple[tuple[int, int], tuple[KnownKey, ...]]] = {}


def read_known_hosts(path: Path) -> tuple[KnownKey, ...]:
    """Entries of one file (cached by mtime and size: one parse per file per run)."""
    spath = str(path)
    try:
        st = os.stat(spath)
    except OSError:
        return ()
    stamp = (st.st_mtime_ns, st.st_size)
    with _cache_lock:
        hit = _cache.get(spath)
        if hit and hit[0] == stamp:
            return hit[1]
    try:
        with open(spath, "r", encoding="utf-8", errors="replace") as fh:
            entries = tuple(
                e for e in (_parse_line(spath, n, raw) for n, raw in enumerate(fh, 1)) if e
            )
    except OSError:
        return ()
    with _cache_lock:
        _cache[spath] = (stamp, entries)
    return entries


def _pattern_hit(name: str, pattern: str) -> bool:
    if pattern.startswith("|1|"):
        try:
            return HostKeys.hash_host(name, pattern) == pattern
        except Exception:
            return False
    if "*" not in pattern and "?" not in pattern:
        return name.lower() == pattern.lower()  # "[host]:port" is literal, not a glob class
    return _glob(pattern).fullmatch(name.lower()) is not None


def _glob(pattern: str) -> "re.Pattern[str]":
    """OpenSSH patterns know only ``*`` and ``?`` (fnmatch would read ``[..]`` as a class)."""
    parts = ("." if ch == "?" else ".*" if ch == "*" else re.escape(ch) for ch in pattern.lower())
    return re.compile("".join(parts))


def matches(name: str, patterns: Iterable[str]) -> bool:
    """OpenSSH semantics: any negated (``!pat``) hit excludes; else any plain hit includes."""
    hit = False
    for pattern in patterns:
        if pattern.startswith("!"):
            if _pattern_hit(name, pattern[1:]):
                return False
        elif not hit and _pattern_hit(name, pattern):
            hit = True
    return hit


def lookup(name: str, files: Sequence[Path]) -> list[KnownKey]:
    """Every entry (any marker) of ``files`` whose host patterns match ``name``."""
    out: list[KnownKey] = []
    for path in files:
        out.extend(e for e in read_known_hosts(path) if matches(name, e.patterns))
    return out


@dataclass(frozen=True)
class Verdict:
    verdict: str
    entry: Optional[KnownKey] = None  # the matching (KNOWN) or conflicting entry


def check(name: str, keytype: str, blob: bytes, files: Sequence[Path]) -> Verdict:
    """What the known_hosts files say about ``name`` presenting this key."""
    entries = lookup(name, files)
    for e in entries:
        if e.marker == "revoked" and e.blob == blob:
            return Verdict(REVOKED, e)
    plain = [e for e in entries if e.marker is None]
    same_type = [e for e in plain if e.keytype == keytype]
    for e in same_type:
        if e.blob == blob:
            return Verdict(KNOWN, e)
    if same_type:
        return Verdict(CHANGED, same_type[0])
    if plain:
        return Verdict(OTHER_TYPE, plain[0])
    return Verdict(UNKNOWN)


def known_keys(name: str, files: Sequence[Path]) -> list[KnownKey]:
    """Usable (unmarked, not revoked) keys for ``name``: preloaded so the server offers a known type."""
    entries = lookup(name, files)
    revoked = {e.blob for e in entries if e.marker == "revoked"}
    return [e for e in entries if e.marker is None and e.blob not in revoked]


def refusal(name: str, keytype: str, blob: bytes, verdict: Verdict, hint: str = "") -> HostKeyError:
    """The operator-facing error for a key that is not accepted."""
    fp = fingerprint_blob(blob)
    e = verdict.entry
    if e is None:  # only UNKNOWN comes without an entry
        verdict = Verdict(UNKNOWN)
    if verdict.verdict == REVOKED and e is not None:
        msg = f"REVOKED host key for {name} ({keytype} {fp}), revoked at {e.where}; refusing"
    elif verdict.verdict in (CHANGED, OTHER_TYPE) and e is not None:
        known = f"{e.keytype} {e.fingerprint}"
        msg = (
            f"HOST KEY CHANGED for {name}: it now presents {keytype} {fp}, {e.where} has {known}; "
            f"possible man-in-the-middle; remove the old key from {e.where} if the change is expected"
        )
    else:
        msg = f"unknown host key for {name} ({keytype} {fp}); verify it, then " + (
            hint or "add it to ~/.ssh/known_hosts or set host_key_policy: accept-new"
        )
    return HostKeyError(msg, verdict.verdict, keytype, fp)


_record_lock = threading.Lock()


def record(name: str, key: paramiko.PKey, path: Path, files: Sequence[Path] = ()) -> Verdict:
    """Append ``name``'s key to ``path`` unless already there; re-checked under a lock.

    Many threads (and gpufleet processes) may meet the same new host at once, e.g. a shared
    ProxyJump bastion; the first records it, the rest find it KNOWN (or CHANGED if the key
    they saw differs: then nothing is written and the caller refuses).
    """
    path = Path(path)
    blob = key.asbytes()
    check_files = list(dict.fromkeys([*files, path]))
    with _record_lock:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(str(path), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with _cache_lock:
                _cache.pop(str(path), None)
            verdict = check(name, key.get_name(), blob, check_files)
            if verdict.verdict != UNKNOWN:
                return verdict
            size = os.fstat(fd).st_size
            prefix = b""
            if size:
                os.lseek(fd, size - 1, os.SEEK_SET)
                if os.read(fd, 1) != b"\n":
                    prefix = b"\n"
            line = f"{name} {key.get_name()} {key.get_base64()}\n".encode("ascii")
            os.write(fd, prefix + line)
            with _cache_lock:
                _cache.pop(str(path), None)
            return Verdict(KNOWN, None)
        finally:
            os.close(fd)


class HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Replaces paramiko/fabric's AutoAddPolicy on the client and on every gateway hop.

    paramiko calls this only when no key was preloaded for the name (a mismatch with a
    preloaded key raises BadHostKeyException, which the transport turns into :func:`refusal`
    via :func:`check`). So here the key is new or revoked, or was recorded meanwhile by a
    concurrent accept-new; :meth:`verify` re-checks everything, whatever paramiko assumed.
    """

    def __init__(self, policy: str, files: Sequence[Path], record_path: Optional[Path] = None,
                 hint: str = "", name: Optional[str] = None):
        if policy not in POLICIES:
            raise GpufleetError(f"unknown host_key_policy {policy!r}")
        self.policy = policy
        self.files = list(files)
        self.record_path = Path(record_path) if record_path else gpufleet_known_hosts()
        self.hint = hint
        self.name = name  # ssh_config HostKeyAlias: checked under it, not paramiko's name

    def verify(self, name: str, key: paramiko.PKey) -> None:
        """Accept (return) or raise HostKeyError: the whole policy in one place."""
        blob = key.asbytes()
        verdict = check(name, key.get_name(), blob, self.files)
        if verdict.verdict == UNKNOWN and self.policy == ACCEPT_NEW:
            verdict = record(name, key, self.record_path, self.files)
        if verdict.verdict != KNOWN:
            raise refusal(name, key.get_name(), blob, verdict, self.hint)

    def missing_host_key(self, client, hostname, key):  # paramiko's interface
        self.verify(self.name or hostname, key)
