"""Which known_hosts files a connection reads, and the names keys are filed under.

Without paramiko (gpufleet.transport.hostkeys, which parses and checks the files, imports it):
the OpenSSH transport (gpufleet.transport.openssh) hands ssh the same files on every run.
Files read, in order: the host's ``known_hosts_file``; ssh_config ``UserKnownHostsFile``
(else ``~/.ssh/known_hosts``, ``~/.ssh/known_hosts2``); ``~/.config/gpufleet/known_hosts``;
ssh_config ``GlobalKnownHostsFile`` (else ``/etc/ssh/ssh_known_hosts``, ``..2``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def gpufleet_known_hosts() -> Path:
    """Where accept-new and `gpufleet trust` record keys (resolved now: tests move HOME)."""
    return Path(os.path.expanduser("~/.config/gpufleet/known_hosts"))


def host_key_name(hostname: str, port: int) -> str:
    """The name OpenSSH files a key under: ``host`` on port 22, else ``[host]:port``."""
    port = int(port)
    return hostname if port == 22 else f"[{hostname}]:{port}"


def _expand(spec: object) -> list[Path]:
    words = spec if isinstance(spec, list) else str(spec).split()
    return [Path(os.path.expanduser(str(w))) for w in words]


def _clean(files: list[Path]) -> list[Path]:
    return [f for f in dict.fromkeys(files) if str(f) != os.devnull]


def user_files(known_hosts_file: Optional[str] = None, ssh_config: Optional[dict] = None
               ) -> list[Path]:
    """The per-user files (all but the global ones), in the order they are read."""
    cfg = ssh_config or {}
    files: list[Path] = []
    if known_hosts_file:
        files.append(Path(os.path.expanduser(known_hosts_file)))
    if cfg.get("userknownhostsfile"):
        files += _expand(cfg["userknownhostsfile"])
    else:
        files += _expand("~/.ssh/known_hosts ~/.ssh/known_hosts2")
    files.append(gpufleet_known_hosts())
    return _clean(files)


def default_files(known_hosts_file: Optional[str] = None, ssh_config: Optional[dict] = None
                  ) -> list[Path]:
    """Every known_hosts file read for one connection (see the module docstring)."""
    cfg = ssh_config or {}
    files = user_files(known_hosts_file, cfg)
    if cfg.get("globalknownhostsfile"):
        files += _expand(cfg["globalknownhostsfile"])
    else:
        files += _expand("/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2")
    return _clean(files)
