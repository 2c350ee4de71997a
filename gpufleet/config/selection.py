"""Which hosts and GPUs a command acts on (pure: no I/O).

A selector that matches nothing is an error, not an empty run: ``gpufleet clean -H trian``
must say "did you mean 'train-01'?" instead of quietly cleaning nothing (or everything).
"""
from __future__ import annotations

import fnmatch
import re
from typing import Iterable, Optional, Sequence

from gpufleet.config.inventory import Host, Inventory
from gpufleet.core.gpus import MAX_GPU_INDEX, parse_gpu_list
from gpufleet.core.gpus import format_gpu_ranges as format_gpu_list
from gpufleet.errors import UsageError

# GPU lists are parsed and formatted in gpufleet.core.gpus; these names stay importable here
# for callers the refactor has not reached yet (ops/clean.py, cli/clean_cmd.py).
__all__ = ["MAX_GPU_INDEX", "expand_host_range", "format_gpu_list", "is_host_range", "named",
           "parse_gpu_list", "require_selection", "select", "selection_flags"]


# A Slurm/ClusterShell host range: brackets holding only digits, commas and dashes
# (``node[01-32]``, ``node[01-04,08]``). fnmatch's classes (``node[ab]``) stay globs.
_RANGE = re.compile(r"\[[0-9][0-9,-]*\]")


def is_host_range(text: str) -> bool:
    return bool(_RANGE.search(text))


def expand_host_range(text: str) -> list[str]:
    """``node[01-04,08]`` -> node01..node04, node08, by ClusterShell's NodeSet (the syntax
    Slurm's scontrol and sinfo print); a malformed range is a usage error."""
    from ClusterShell.NodeSet import NodeSet, NodeSetException  # type: ignore[import-untyped]

    try:
        return list(NodeSet(text))
    except (NodeSetException, ValueError) as exc:
        raise UsageError(f"bad host range {text!r}: {exc}") from None


def _split_outside_brackets(value: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in value:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _split(values: Optional[Iterable[str]]) -> list[str]:
    """Flags are repeatable and also take comma lists: ``-H a -H b`` == ``-H a,b``; commas
    inside a host range's brackets (``node[01-04,08]``) belong to the range."""
    out: list[str] = []
    if isinstance(values, str):
        values = [values]
    for value in values or ():
        for part in _split_outside_brackets(str(value)):
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
    import difflib  # an error's suggestion only: not paid by every start

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

    ``hosts`` are fnmatch globs on host names (case-sensitive) or Slurm host ranges
    (``node[01-32]``: every host named must exist); ``groups`` and ``tags`` are
    exact names. No criteria at all selects every host (for commands that only look; those
    that change hosts call ``require_selection`` first). Every glob, group and tag must
    match at least one host, even with ``all_``: a typo is reported, never ignored.
    """
    host_globs, group_names, tag_names = _split(hosts), _split(groups), _split(tags)
    chosen: set[str] = set()
    names = {h.name for h in inventory.hosts}
    for pattern in host_globs:
        if is_host_range(pattern) and not any(c in pattern for c in "*?"):
            missing = [n for n in expand_host_range(pattern) if n not in names]
            if missing:
                raise UsageError(f"no host {missing[0]!r} (from {pattern!r})"
                                 f"{_suggest(missing[0], inventory, '--host')}"
                                 + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
            chosen.update(expand_host_range(pattern))
            continue
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


def named(hosts: Sequence[str] = (), groups: Sequence[str] = (), tags: Sequence[str] = (),
          all_: bool = False) -> bool:
    """Whether the command line names its hosts (any of --host, -g, --tag, --all)."""
    return bool(hosts or groups or tags or all_)


def selection_flags(implicit: bool = False) -> str:
    """How to name hosts, for the line that refuses a command without them; ``implicit``:
    no inventory, this machine is the only host."""
    if implicit:
        return "--host localhost or --all (no inventory: this machine only)"
    return "--host NAME, -g GROUP, --tag TAG or --all"


def require_selection(
    what: str,
    hosts: Sequence[str] = (),
    groups: Sequence[str] = (),
    tags: Sequence[str] = (),
    all_: bool = False,
    implicit: bool = False,
) -> None:
    """A command that signals or changes hosts acts only on hosts named on its command line:
    "every host" by default is right for looking, and wrong for `clean --yes` typed in the
    wrong shell (it ends a trainer nobody meant). ``what`` opens the one-line error
    ("clean changes hosts")."""
    if not named(hosts, groups, tags, all_):
        raise UsageError(f"{what}: name them with {selection_flags(implicit)}")
