"""Which hosts already hold this agent's compiled code: the controller's side of the host cache.

Internal to gpufleet.transport.session. Every one-shot run used to send the whole agent
(~40 KB compressed) although a host whose loader cached it (remote/loader.py) runs that cache
and never reads what was sent: on a 20 ms link those bytes cost the run a round trip or two of
TCP slow start (bench/README.md). So when a host's last document said its cache holds this
agent (``facts.agent_cache`` hit or miss, i.e. written), the next request leaves the source out
(``k`` 0); a host whose cache is gone since then answers ``{"agent_needed": ...}`` without
running anything, and the session sends the whole agent again (one more exec, then
remembered again). Only hosts reached over SSH: a ``connection: local`` host (the Slurm
prolog/epilog on a node) reads the agent from a pipe, and nothing is written for it.

What is remembered cannot make a host run anything it did not check: the host's loader alone
decides what is trusted, and a wrong memory costs one more exec. One small file per host
(the name is a hash of how the host is reached: name, address, port, user, python, sudo,
connection) holding the agent key, under ``$XDG_CACHE_HOME/gpufleet/agents`` (else
``~/.cache/gpufleet/agents``); written by rename, so threads and processes never see half.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Mapping, Optional

from gpufleet.transport.localstate import cache_dir, hashed_name

#: facts.agent_cache states after which the host's cache holds the agent that ran.
HELD = ("hit", "miss")


def directory() -> str:
    return cache_dir("agents")


def _path(host: Any) -> str:
    ident = repr((getattr(host, "name", ""), getattr(host, "connection", "ssh"),
                  getattr(host, "address", None), getattr(host, "port", None),
                  getattr(host, "user", None), getattr(host, "python", "python3"),
                  bool(getattr(host, "sudo", False)))
                 + ((tuple(host.exec),) if getattr(host, "exec", ()) else ()))
    return os.path.join(directory(), hashed_name(ident, 16))


def _remembered(host: Any) -> bool:
    """Hosts reached over SSH whose inventory lets them use their cache: a ``connection:
    local`` host gets the agent through a pipe (nothing to save, no file written for it)."""
    return (getattr(host, "agent_cache", True) is not False
            and getattr(host, "connection", "ssh") != "local")


def holds(host: Any, key: str) -> bool:
    """The host's last document said its cache holds the agent ``key`` (see _remembered)."""
    if not _remembered(host):
        return False
    try:
        with open(_path(host), "r", encoding="ascii") as fh:
            return fh.read(128).strip() == key
    except (OSError, UnicodeDecodeError):
        return False


def _write(host: Any, text: Optional[str]) -> None:
    path = _path(host)
    try:
        if text is None:
            os.unlink(path)
            return
        os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a memory only: without it the next run sends the whole agent


def note(host: Any, key: str, doc: Optional[Mapping[str, Any]], known: bool) -> None:
    """Learn from a document whether the host's cache now holds ``key``; ``known``: what
    ``holds`` said before the run (a file is written only when that changes)."""
    facts = doc.get("facts") if isinstance(doc, Mapping) else None
    state = facts.get("agent_cache") if isinstance(facts, Mapping) else None
    if state is None:
        return  # no snapshot document (a failed run, an old agent): nothing learnt
    if not _remembered(host):
        return
    held = state in HELD
    if held != known:
        _write(host, key if held else None)


def forget(host: Any) -> None:
    _write(host, None)
