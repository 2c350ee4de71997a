"""The fleet.yaml that `gpufleet init` writes: commented, valid as written (pure but for
reading ~/.ssh/config).

An installed gpufleet has no fleet.yaml.example or docs/ beside it, so the file itself says
what each key does. Hosts come from ~/.ssh/config when asked: every concrete ``Host`` alias
(no ``*``, ``?`` or ``!`` pattern), its address the alias itself, so `ssh -G` resolves it at
each run exactly as ``ssh ALIAS`` would; nothing is resolved when the file is written.
"""
from __future__ import annotations

import re
import shlex
from typing import Optional

import yaml

from gpufleet.config.inventory import _NAME_RE
from gpufleet.config.validators import MAX_NAME

HEAD = """\
# gpufleet inventory, written by `gpufleet init`. gpufleet finds it as -i PATH, then
# $GPUFLEET_INVENTORY, then ./fleet.yaml, then ~/.config/gpufleet/fleet.yaml.
# Check it with `gpufleet hosts`; then `gpufleet status --all`.

defaults:                    # every host's settings unless the host sets the key
  connect_timeout: 10        # seconds to establish the SSH connection
  command_timeout: 60        # seconds one gpufleet run may take on the host
  host_key_policy: strict    # unknown host keys are refused (`gpufleet trust HOST` records one);
                             # accept-new records a first-seen key
  # user: root               # ssh's -l (default: ssh_config's, else your login)
  # ssh_persist: 60          # keep each SSH connection 60 s for the next command (the
                             # default; 0: none); `gpufleet disconnect` closes them

hosts:
"""

LOCAL_HOST = """\
  localhost:                 # this machine, without SSH
    connection: local
"""

EXAMPLES = """\
  # One entry per host; the name is what --host, `gpufleet status NAME` and groups use.
  # train-01:
  #   address: 203.0.113.10    # a name, an IP or any ~/.ssh/config alias (as `ssh ADDRESS`)
  #   port: 10978              # ssh's -p
  #   user: ops                # ssh's -l
  #   identity_file: ~/.ssh/id_ed25519_fleet   # ssh's -i
  #   sudo: true               # signalling root's processes, stopping units: sudo -n
  #   protect: ["*train_dflash*"]  # command lines a clean never signals
  #   unattributed_mib: 1680   # MiB per GPU nobody owns here (WSL2 keeps some)
  #   gpus: 8                  # how many GPUs `gpufleet health` expects
  #   tags: [ada, container]   # --tag ada
"""

TAIL = """\

# groups:                    # -g training
#   training: [train-01, train-02]
"""

_PATTERN = re.compile(r"[*?!]")


def ssh_config_aliases(text: str) -> tuple[list[str], list[str], bool]:
    """(concrete Host aliases in order, the ones that cannot be inventory names, whether the
    file has an Include: its files are not read)."""
    aliases: list[str] = []
    unusable: list[str] = []
    include = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = re.split(r"\s*=\s*|\s+", line, maxsplit=1)  # `Host a b` or `Host=a`
        keyword, rest = parts[0].lower(), parts[1] if len(parts) > 1 else ""
        if keyword == "include":
            include = True
        if keyword != "host":
            continue
        try:
            words = shlex.split(rest)
        except ValueError:
            words = rest.split()
        for word in words:
            if _PATTERN.search(word) or word in aliases or word in unusable:
                continue
            (aliases if _usable(word) else unusable).append(word)
    return aliases, unusable, include


def _usable(name: str) -> bool:
    return len(name) <= MAX_NAME and bool(_NAME_RE.match(name))


def _key(name: str) -> str:
    """The name as a YAML key that reads back as this string (``'true'``, ``'007'``)."""
    return name if yaml.safe_load(name) == name else "'" + name + "'"


def starter_inventory(aliases: Optional[list[str]] = None, unusable: tuple[str, ...] = (),
                      include: bool = False) -> str:
    """The commented fleet.yaml: this machine (``connection: local``), or the ssh_config
    aliases as hosts, then commented examples of every common key."""
    if aliases is None:
        hosts = LOCAL_HOST
    else:
        hosts = "  # From ~/.ssh/config: each alias as `ssh ALIAS` reaches it (ssh -G, at each run).\n"
        hosts += "".join(f"  {_key(a)}:\n    address: {_key(a)}\n" for a in aliases)
        if unusable:
            hosts += ("  # Not host names here (letters, digits, . _ - only): "
                      + ", ".join(unusable) + "\n")
        if include:
            hosts += "  # ~/.ssh/config has Include lines: hosts of those files were not read.\n"
    return HEAD + hosts + EXAMPLES + TAIL
