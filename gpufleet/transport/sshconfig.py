"""Where ``ssh ALIAS`` would connect: ssh_config resolved by OpenSSH itself (``ssh -G``).

Internal to gpufleet.transport.connection. gpufleet must never reach a host other than the one the
operator's ``ssh ALIAS`` reaches, and ssh_config has more rules than any re-implementation
keeps up with (Include, Match host/originalhost/user/exec/final, tokens, first value wins,
canonicalisation). So the ``ssh`` client is asked: ``ssh -G [-F FILE] [-p PORT] [-l USER] --
ALIAS`` (an argv, never a shell; ``-p``/``-l`` only when the inventory sets port/user, as on
ssh's command line), and its ``key value`` lines are read. One run per (alias, port, user)
per process. ``ssh -G`` runs ``Match exec`` commands, exactly as ``ssh ALIAS`` does.

Without an ``ssh`` client on PATH, paramiko's SSHConfig parser is used instead; it has no
``Include`` and its ``Match`` differs from OpenSSH's, so when the config files use either, a
one-time warning on stderr names them.

ssh reads ``~/.ssh/config`` of the account (getpwuid), not ``$HOME``; gpufleet's files live
under ``$HOME``. When the two differ (``sudo -E``, tests), ``$HOME/.ssh/config`` is given to
ssh as ``-F`` (``-F none`` when it does not exist): then, as with ``ssh -F``,
/etc/ssh/ssh_config is not read.
"""
from __future__ import annotations

import getpass
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from gpufleet.errors import SshConfigError, first_line

SSH_G_TIMEOUT_S = 15.0  # Match exec commands run inside ssh -G; a hung one must not hang us
USER_CONFIG = "~/.ssh/config"
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
# Keys handed on (paramiko/fabric spelling: lowercase); everything else ssh -G prints is unused.
_SINGLE = ("hostname", "user", "port", "proxyjump", "proxycommand", "connecttimeout",
           "stricthostkeychecking", "identitiesonly", "hostkeyalias")
_LISTS = ("userknownhostsfile", "globalknownhostsfile")
_NOISE = ("Pseudo-terminal will not be allocated",)
#: -v (gpufleet.cli.enable_verbose): where each host connects and what it cost, on stderr
log = logging.getLogger("gpufleet.transport")


@dataclass(frozen=True)
class Resolved:
    """One alias's destination and settings, lowercase keys as paramiko's SSHConfigDict."""

    alias: str
    values: dict = field(hash=False, compare=False)
    via: str  # "ssh -G" or "paramiko"


_UNSAFE = re.compile(r"[\s\x00-\x1f\x7f@]")


def check_alias(alias: str) -> str:
    """The alias, if ssh can only take it as a host name (never an option or user@host)."""
    if not alias or alias.startswith("-") or _UNSAFE.search(alias) or len(alias) > 1024:
        raise SshConfigError(f"invalid ssh host name {alias!r}: it must not be empty, start "
                             "with '-', or hold '@', spaces or control characters")
    return alias


# --------------------------------------------------------------------------- which config


def _config_arg() -> Optional[str]:
    """``-F`` value so ssh reads ``$HOME/.ssh/config``, or None when ssh reads it anyway."""
    home = os.path.expanduser("~")
    try:
        account = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        account = ""
    if account and os.path.realpath(home) == os.path.realpath(account):
        return None
    path = os.path.join(home, ".ssh", "config")
    return path if os.path.isfile(path) else "none"


def _stamp(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_mtime_ns, st.st_size)


# --------------------------------------------------------------------------- ssh -G


def _run_ssh_g(ssh: str, args: list[str], alias: str) -> dict[str, list[str]]:
    """``ssh -G ARGS`` -> key -> values in output order; SshConfigError when ssh refuses."""
    argv = [ssh, "-G", *args]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise SshConfigError(f"cannot run {ssh} -G: {exc.strerror or exc}") from None
    try:
        out, err = proc.communicate(timeout=SSH_G_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # ssh and the Match exec commands it started
        except OSError:
            pass
        proc.communicate()
        raise SshConfigError(f"ssh -G {alias} did not finish within {SSH_G_TIMEOUT_S:g}s "
                             "(a Match exec command that hangs?)") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in err.decode("utf-8", "replace").splitlines()
                 if ln.strip() and not ln.startswith(_NOISE)]
        why = lines[0][:300] if lines else f"exit status {proc.returncode}"
        raise SshConfigError(f"ssh -G {alias} failed: {why}")
    found: dict[str, list[str]] = {}
    for line in out.decode("utf-8", "replace").splitlines():
        key, _sep, value = line.strip().partition(" ")
        if key:
            found.setdefault(key.lower(), []).append(value.strip())
    return found


_defaults_lock = threading.Lock()
_defaults: dict[str, "_Defaults"] = {}


class _Defaults:
    """One ``ssh -G`` of ssh's built-in defaults, run in its own thread from the first
    resolution on, so that it overlaps that host's own ``ssh -G`` instead of following it
    (~5 ms of every run's first host)."""

    def __init__(self, ssh: str):
        self._done = threading.Event()
        self._box: list = []
        threading.Thread(target=self._run, args=(ssh,), name="gpufleet-ssh-defaults",
                         daemon=True).start()

    def _run(self, ssh: str) -> None:
        try:
            self._box.append(_run_ssh_g(ssh, ["-F", "none", "--", "gpufleet-defaults.invalid"],
                                        "(defaults)"))
        except BaseException as exc:
            self._box.append(exc)
        finally:
            self._done.set()

    def result(self) -> dict[str, list[str]]:
        self._done.wait()
        outcome = self._box[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def _start_defaults(ssh: str) -> "_Defaults":
    """What this ssh prints with no config at all: tells its defaults from configured values.
    Asked once per process (each of 32 hosts' threads running its own cost a 32-host run a
    dozen extra ``ssh -G``); a failed one is asked again by the next host."""
    with _defaults_lock:
        hit = _defaults.get(ssh)
        if hit is None or (hit._done.is_set() and isinstance(hit._box[0], BaseException)):
            hit = _defaults[ssh] = _Defaults(ssh)
    return hit


def _ssh_defaults(ssh: str) -> dict[str, list[str]]:
    return _start_defaults(ssh).result()


def _expand(text: str, tokens: dict[str, str]) -> str:
    """OpenSSH %-tokens, for the values ssh -G prints unexpanded (IdentityFile, ProxyCommand)."""
    return re.sub(r"%(.)", lambda m: tokens.get(m.group(1), m.group(0)), text)


def _tokens(alias: str, hostname: str, port: str, user: str, jump: str) -> dict[str, str]:
    local = socket.gethostname()
    from hashlib import sha1

    conn_hash = sha1(f"{local}{hostname}{port}{user}{jump}".encode()).hexdigest()
    return {"%": "%", "h": hostname, "p": port, "r": user, "n": alias, "u": getpass.getuser(),
            "d": os.path.expanduser("~"), "i": str(os.getuid()), "l": local,
            "L": local.split(".", 1)[0], "j": jump, "C": conn_hash, "k": alias}


def _from_ssh(ssh: str, alias: str, port: Optional[int], user: Optional[str]) -> dict:
    args: list[str] = []
    cfg = _config_arg()
    if cfg is not None:
        args += ["-F", cfg]
    if port:
        args += ["-p", str(int(port))]
    if user:
        args += ["-l", check_alias(user)]
    pending = _start_defaults(ssh)
    started = time.monotonic()
    found = _run_ssh_g(ssh, args + ["--", alias], alias)
    _log_answer(ssh, args + ["--", alias], found, time.monotonic() - started)
    defaults = pending.result()
    values: dict[str, Any] = {}
    for key in _SINGLE:
        if found.get(key):
            values[key] = found[key][0]
    for key in ("proxyjump", "proxycommand", "connecttimeout", "hostkeyalias"):
        if str(values.get(key, "")).lower() == "none":
            del values[key]
    hostname = values.setdefault("hostname", alias)
    tok = _tokens(alias, hostname, str(values.get("port", "22")), str(values.get("user", "")),
                  str(values.get("proxyjump", "")))
    if values.get("hostkeyalias"):
        tok["k"] = values["hostkeyalias"]
    if "proxycommand" in values:
        values["proxycommand"] = _expand(values["proxycommand"], tok)
    identities = found.get("identityfile", [])
    if identities and identities != defaults.get("identityfile"):
        # configured (not ssh's built-in list): every one, in order; ~ is expanded by sshauth
        values["identityfile"] = [_expand(p, tok) for p in identities]
    for key in _LISTS:
        if found.get(key) and found[key] != defaults.get(key):
            values[key] = " ".join(found[key]).split()
    for key in ("sendenv", "setenv"):  # what a session through a kept master must send too
        if found.get(key):
            values[key] = list(found[key])
    kex = found.get("kexalgorithms")
    if kex and kex != defaults.get("kexalgorithms"):
        values["kexalgorithms"] = kex[0]  # configured: the OpenSSH transport leaves it alone
    elif kex:
        values["kexalgorithms_default"] = kex[0]
    return values


def _log_answer(ssh: str, args: list[str], found: dict[str, list[str]], seconds: float) -> None:
    """-v: what ``ssh -G`` answered that decides the destination (the rest is its defaults)."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    keys = ("hostname", "port", "user", "proxyjump", "proxycommand", "hostkeyalias",
            "identityfile", "userknownhostsfile", "connecttimeout")
    said = ", ".join(f"{k} {' '.join(found[k])}" for k in keys if found.get(k))
    log.debug("%s -G %s answered in %.3fs: %s", ssh, " ".join(args), seconds, said or "nothing")


# --------------------------------------------------------------------------- fallback

_warned = threading.Event()


def _config_files() -> list[str]:
    """The files ssh would read: with $HOME not the account's home, only $HOME's (as -F)."""
    files = [os.path.expanduser(USER_CONFIG)]
    if _config_arg() is None:
        files.append(SYSTEM_CONFIG)
    return [p for p in files if os.path.isfile(p)]


def _unhonoured(paths: list[str]) -> list[str]:
    """``Include (FILE:LINE)``-style notes for the directives paramiko cannot honour."""
    notes: list[str] = []
    for path in paths:
        try:
            with open(path, "r", encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    word = line.strip().split("=", 1)[0].split(None, 1)[0:1]
                    if word and word[0].lower() in ("include", "match"):
                        notes.append(f"{word[0].capitalize()} ({path}:{n})")
        except OSError:
            continue
    return notes


def _warn_fallback(paths: list[str]) -> None:
    notes = _unhonoured(paths)
    if not notes or _warned.is_set():
        return
    _warned.set()
    shown = ", ".join(notes[:4]) + (f" and {len(notes) - 4} more" if len(notes) > 4 else "")
    print("gpufleet: warning: no `ssh` client on PATH: ssh_config is read by paramiko, which "
          f"cannot honour {shown} as OpenSSH does; hosts may resolve other than `ssh ALIAS`; "
          "install the OpenSSH client", file=sys.stderr, flush=True)


def _from_paramiko(alias: str, port: Optional[int], user: Optional[str]) -> dict:
    paths = _config_files()
    _warn_fallback(paths)
    import paramiko  # the fallback only: no ssh client on this machine

    parsed = paramiko.SSHConfig()
    try:
        for path in paths:  # user file first: first value wins across both, as in OpenSSH
            with open(path, "r", encoding="utf-8", errors="replace") as fh:
                parsed.parse(fh)
        found = dict(parsed.lookup(alias))
    except Exception as exc:  # paramiko's parse/Match errors: the host's row, one line
        raise SshConfigError(f"ssh_config for {alias}: {first_line(exc)}") from None
    values = {k: v for k, v in found.items() if k in _SINGLE or k in _LISTS or k == "identityfile"}
    values.setdefault("hostname", alias)
    # -p / -l act as on ssh's command line: they win over the config
    values["port"] = str(int(port)) if port else str(values.get("port") or 22)
    values["user"] = user or values.get("user") or getpass.getuser()
    for key in ("proxyjump", "proxycommand", "connecttimeout"):
        if str(values.get(key, "")).lower() == "none":
            del values[key]
    return values


# --------------------------------------------------------------------------- the entry point

_cache_lock = threading.Lock()
_cache: dict[tuple, tuple[threading.Event, list]] = {}


def ssh_client() -> Optional[str]:
    """The ``ssh`` client on PATH (looked up each time: tests change PATH)."""
    return shutil.which("ssh")


def openssh_wanted(host: Any) -> bool:
    """This SSH host goes through OpenSSH's client unless ``ssh_client: paramiko`` or no
    ``ssh`` on PATH (a ProxyJump / ProxyCommand is decided when its session opens)."""
    choice = getattr(host, "ssh_client", "auto") or "auto"
    return choice != "paramiko" and (choice == "openssh" or ssh_client() is not None)


def resolve(alias: str, port: Optional[int] = None, user: Optional[str] = None) -> Resolved:
    """Where and how ``ssh [-p PORT] [-l USER] ALIAS`` connects; cached per run.

    Raises SshConfigError (ssh -G refused the config, or the alias is not a host name).
    """
    check_alias(alias)
    ssh = ssh_client()
    home_cfg = os.path.expanduser(USER_CONFIG)
    key = (alias, port, user, ssh, home_cfg, _stamp(home_cfg))
    with _cache_lock:
        hit = _cache.get(key)
        owner = hit is None
        entry = _cache[key] = hit if hit is not None else (threading.Event(), [])
    done, box = entry
    if owner:
        try:
            if ssh is not None:
                box.append(Resolved(alias, _from_ssh(ssh, alias, port, user), "ssh -G"))
            else:
                box.append(Resolved(alias, _from_paramiko(alias, port, user), "paramiko"))
        except BaseException as exc:
            box.append(exc)
        finally:
            done.set()
    done.wait()
    outcome = box[0]
    if isinstance(outcome, BaseException):
        if not isinstance(outcome, SshConfigError):
            with _cache_lock:  # not a config verdict (Ctrl-C, ...): the next call tries again
                _cache.pop(key, None)
        raise outcome
    return outcome


def clear_cache() -> None:
    """Forget every resolution (tests; a long-lived process after editing ssh_config)."""
    with _cache_lock:
        _cache.clear()
    with _defaults_lock:
        _defaults.clear()
    _warned.clear()


def host_key_policy(values: dict, default: str) -> str:
    """gpufleet's policy for ssh_config StrictHostKeyChecking (when the inventory sets none).

    ``accept-new`` and ``no``/``off`` record a first-seen key (gpufleet's accept-new: a changed
    key is still refused); ``yes`` and ``ask`` (BatchMode never asks) are strict.
    """
    value = str(values.get("stricthostkeychecking", "")).strip().lower()
    if value in ("accept-new", "no", "off", "false"):
        return "accept-new"
    if value in ("yes", "true", "ask"):
        return "strict"
    return default


def ssh_alias(host: Any) -> str:
    """The name ``ssh`` is given for this host: its inventory ``address``, else its name."""
    return str(getattr(host, "address", None) or host.name)


def settings_value(host: Any, key: str, ssh_value: Any, default: Any) -> Any:
    """A setting the inventory and ssh_config both give: the inventory's when set explicitly
    for the host, else ssh_config's, else the inventory default, else ``default``."""
    if key in getattr(host, "explicit", frozenset()) and getattr(host, key, None) is not None:
        return getattr(host, key)
    if ssh_value is not None:
        return ssh_value
    value = getattr(host, key, None)
    return default if value is None else value
