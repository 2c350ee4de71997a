"""Where gpufleet keeps what it remembers on the controller, and how those files are named.

Internal to gpufleet.transport: the hosts known to hold the agent (knownagents) and the kept
SSH connections' sockets (kept) live under one cache directory, ``$XDG_CACHE_HOME/gpufleet``
(else ``~/.cache/gpufleet``), each file named by a hash of what it is about.
"""
from __future__ import annotations

import os


def cache_dir(*parts: str) -> str:
    """``$XDG_CACHE_HOME/gpufleet/PARTS`` (an absolute XDG_CACHE_HOME only, as the XDG spec
    says), else ``~/.cache/gpufleet/PARTS``; not created here."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpufleet", *parts)


def hashed_name(text: str, digest_size: int) -> str:
    """A file name for ``text``: BLAKE2b of its UTF-8, hex."""
    from hashlib import blake2b

    return blake2b(text.encode("utf-8", "surrogateescape"), digest_size=digest_size).hexdigest()
