"""Which hosts and GPUs a command acts on (pure: no I/O).

A selector that matches nothing is an error, not an empty run: ``gpufleet clean -H trian``
must say "did you mean 'train-01'?" instead of quietly cleaning nothing (or everything).
"""
from __future__ import annotations

import difflib
import fnmatch
import re
from typing import Iterable, Optional, Sequence

from gpufleet.errors import UsageError
from gpufleet.config.inventory import Host, Inventory

MAX_GPU_INDEX = 1023  # bounds `0-99999999` before it is expanded


def _split(values: Optional[Iterable[str]]) -> list[str]:
    """Flags are repeatable and also take comma lists: ``-H a -H b`` == ``-H a,b``."""
    out: list[str] = []
    if isinstance(values, str):
        values = [values]
    for value in values or ():
        for part in str(value).split(","):
            part = part.strip()
            if not part:
                raise UsageError(f"empty name in {value!r}")
            out.append(part)
    return out


def _suggest(word: str, inventory: Inventory, flag: str) -> str:
    """A did-you-mean over host, group and tag names, with the flag that would fit."""
    names: dict[str, tuple[str, str]] = {}
    for h in inventory.hosts:
        names.setdefault(h.name.lower(), ("--host", h.name))
    for g in inventory.groups:
        names.setdefault(g.lower(), ("--group", g))
    for t in inventory.tags:
        names.setdefault(t.lower(), ("--tag", t))
    lowered = word.lower()
    if lowered in names:
        right_flag, name = names[lowered]
        if right_flag != flag:
            return f" (did you mean {right_flag} {name}?)"
        return f" (did you mean {name!r}?)"
    match = difflib.get_close_matches(lowered, list(names), n=1, cutoff=0.6)
    if not match:
        return ""
    right_flag, name = names[match[0]]
    if right_flag != flag:
        return f" (did you mean {right_flag} {name}?)"
    return f" (did you mean {name!r}?)"


def select(
    inventory: Inventory,
    hosts: Sequence[str] = (),
    groups: Sequence[str] = (),
    tags: Sequence[str] = (),
    all_: bool = False,
) -> list[Host]:
    """Hosts matching any criterion (a union), in inventory order.

    ``hosts`` are fnmatch globs on host names (case-sensitive); ``groups`` and ``tags`` are
    exact names. No criteria at all selects every host. Every glob, group and tag must
    match at least one host, even with ``all_``: a typo is reported, never ignored.
    """
    host_globs, group_names, tag_names = _split(hosts), _split(groups), _split(tags)
    chosen: set[str] = set()
    for pattern in host_globs:
        matched = [h.name for h in inventory.hosts if fnmatch.fnmatchcase(h.name, pattern)]
        if not matched:
            raise UsageError(f"no host matches {pattern!r}"
                             f"{_suggest(pattern, inventory, '--host')}")
        chosen.update(matched)
    for name in group_names:
        if name not in inventory.groups:
            raise UsageError(f"unknown group {name!r}{_suggest(name, inventory, '--group')}")
        members = inventory.groups[name]
        if not members:
            raise UsageError(f"group {name!r} has no hosts")
        chosen.update(members)
    for tag in tag_names:
        matched = [h.name for h in inventory.hosts if tag in h.tags]
        if not matched:
            raise UsageError(f"no host has tag {tag!r}{_suggest(tag, inventory, '--tag')}")
        chosen.update(matched)
    if all_ or not (host_globs or group_names or tag_names):
        return list(inventory.hosts)
    return [h for h in inventory.hosts if h.name in chosen]


_GPU_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?\Z")


def format_gpu_list(indices: Iterable[int]) -> str:
    """Compact ranges: ``[0, 1, 2, 3, 5]`` -> ``"0-3,5"`` (the syntax ``--gpus`` reads)."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_gpu_list(
    text: str,
    available: Optional[Iterable[int]] = None,
    host: Optional[str] = None,
) -> Optional[tuple[int, ...]]:
    """Parse ``--gpus``: ``all`` -> None (every GPU); ``0-3``, ``0,2,5``, ``0-1,4`` -> sorted
    unique indices. With ``available`` (the host's nvidia-smi indices), an index the host does
    not have is an error naming ``host``.
    """
    if not isinstance(text, str):
        raise UsageError(f"--gpus: expected text like 0-3, 0,2,5 or all, got {text!r}")
    stripped = text.strip()
    if stripped.lower() == "all":
        return None
    if not stripped:
        raise UsageError("--gpus: empty GPU list (use e.g. 0-3, 0,2,5 or all)")
    found: set[int] = set()
    for part in stripped.split(","):
        item = part.strip()
        m = _GPU_ITEM.match(item)
        if not m:
            raise UsageError(f"--gpus: invalid GPU list {text!r} at {item!r} "
                             "(use e.g. 0-3, 0,2,5, 0-1,4 or all)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise UsageError(f"--gpus: reversed range {item!r} (write {hi}-{lo})")
        if hi > MAX_GPU_INDEX:
            raise UsageError(f"--gpus: GPU index {hi} is too large (at most {MAX_GPU_INDEX})")
        found.update(range(lo, hi + 1))
    result = tuple(sorted(found))
    if available is not None:
        have = set(available)
        where = f" on {host}" if host else ""
        has = f"has {format_gpu_list(have)}" if have else "has no GPUs"
        for index in result:
            if index not in have:
                raise UsageError(f"GPU {index} does not exist{where} ({has})")
    return result
