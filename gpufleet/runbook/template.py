"""Runbook variables: ``{{ NAME }}`` references, their substitution as DATA, and ``-e`` pairs (pure).

Into plain fields a value goes as text (then validated like any typed value); into a
``shell`` step's ``command`` (run by ``sh -c``) as ONE shlex-quoted word, and a reference
inside quotes there is refused (``'{{ X }}'`` would unquote the value).

The steps that run on the controller (``local_http``, ``local_command``) act FOR a host (take
it out of a load balancer), so they may name it: ``{{ HOST }}`` and ``{{ HOST_ADDRESS }}`` are
left in at load time as ``PerHost`` text and filled in once per host at run time, as data
(an argv item stays one argument, no shell is involved).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from gpufleet.config.validators import Fail, Templated, did_you_mean
from gpufleet.config.yamlsource import LineMap, LineSeq
from gpufleet.errors import UsageError

VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
REF = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def references(value: Any) -> list[str]:
    """Every variable name referenced in a (nested) value, in order."""
    if isinstance(value, str):
        return REF.findall(value)
    if isinstance(value, dict):
        return [n for v in value.values() for n in references(v)]
    if isinstance(value, list):
        return [n for v in value for n in references(v)]
    return []


def substitute(value: Any, variables: Mapping[str, str]) -> Any:
    """Replace ``{{ NAME }}`` with the value's text, once (a value is never re-expanded).

    A string that is exactly one reference becomes a ``Templated`` string, so typed fields
    (numbers, booleans) may come from variables. Missing names raise KeyError.
    """
    if isinstance(value, str):
        whole = REF.fullmatch(value.strip()) if value.strip() == value else None
        if whole:
            return Templated(variables[whole.group(1)])
        return REF.sub(lambda m: variables[m.group(1)], value)
    if isinstance(value, dict):
        out = LineMap({k: substitute(v, variables) for k, v in value.items()})
        out.line = getattr(value, "line", 0)
        out.lines = getattr(value, "lines", {})
        return out
    if isinstance(value, list):
        seq = LineSeq(substitute(v, variables) for v in value)
        seq.line = getattr(value, "line", 0)
        seq.lines = getattr(value, "lines", [])
        return seq
    return value


# --------------------------------------------------------------------------- per-host values

PER_HOST = ("HOST", "HOST_ADDRESS")  # filled in for each host, in local_* steps only
SAMPLE_HOST = {"HOST": "example-host", "HOST_ADDRESS": "192.0.2.1"}  # load-time validation


@dataclass(frozen=True)
class PerHost:
    """Text with per-host references: ``parts`` alternate literal text and a PER_HOST name."""

    parts: tuple[str, ...]

    def render(self, host_values: Mapping[str, str]) -> str:
        return "".join(host_values[p] if i % 2 else p for i, p in enumerate(self.parts))


def substitute_per_host(value: Any, variables: Mapping[str, str]) -> Any:
    """``substitute``, but ``{{ HOST }}`` / ``{{ HOST_ADDRESS }}`` stay as ``PerHost`` parts;
    every other value goes in once here, so nothing in a value is ever expanded later."""
    if isinstance(value, str):
        matches = list(REF.finditer(value))
        if not any(m.group(1) in PER_HOST for m in matches):
            return substitute(value, variables)
        parts: list[str] = []
        text, pos = "", 0
        for m in matches:
            text += value[pos:m.start()]
            if m.group(1) in PER_HOST:
                parts += [text, m.group(1)]
                text = ""
            else:
                text += variables[m.group(1)]
            pos = m.end()
        return PerHost(tuple(parts + [text + value[pos:]]))
    if isinstance(value, dict):
        return {k: substitute_per_host(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_per_host(v, variables) for v in value]
    return value


def has_per_host(value: Any) -> bool:
    if isinstance(value, PerHost):
        return True
    if isinstance(value, dict):
        return any(has_per_host(v) for v in value.values())
    if isinstance(value, list):
        return any(has_per_host(v) for v in value)
    return False


def render_per_host(value: Any, host_values: Mapping[str, str]) -> Any:
    """The value with every ``PerHost`` filled in for one host."""
    if isinstance(value, PerHost):
        return value.render(host_values)
    if isinstance(value, dict):
        return {k: render_per_host(v, host_values) for k, v in value.items()}
    if isinstance(value, list):
        return [render_per_host(v, host_values) for v in value]
    return value


@dataclass(frozen=True)
class PerHostField:
    """A step field naming the host: its raw value and its validator, checked again (and
    converted) for each host at run time; at load time it was checked with ``SAMPLE_HOST``."""

    raw: Any
    check: Callable[[Any, Fail], Any]

    def value_for(self, host_values: Mapping[str, str], fail: Fail) -> Any:
        return self.check(render_per_host(self.raw, host_values), fail)


def _quote_context(command: str) -> list[tuple[int, str, str]]:
    """(offset, name, quoting) of each reference in shell text; quoting is '', "'" or '"'.

    A small POSIX sh scanner: enough to know whether a reference sits inside quotes, where a
    shlex-quoted value would come OUT of its quotes.
    """
    refs = {m.start(): m for m in REF.finditer(command)}
    out = []
    state = ""
    i = 0
    while i < len(command):
        if i in refs:
            m = refs[i]
            out.append((i, m.group(1), state))
            i = m.end()
            continue
        c = command[i]
        if state == "'":
            if c == "'":
                state = ""
        elif c == "\\":
            i += 1
        elif state == '"':
            if c == '"':
                state = ""
        elif c in "'\"":
            state = c
        i += 1
    return out


def substitute_shell(command: str, variables: Mapping[str, str], fail: Fail) -> str:
    """``{{ X }}`` -> ``shlex.quote(value)``: always exactly one word of data, never code."""
    for _, name, quoting in _quote_context(command):
        if quoting:
            fail(f"command: {{{{ {name} }}}} is inside {quoting}quotes{quoting}: write it bare, "
                 "it is quoted for you (a quoted value would be unquoted)")
        if name not in variables:
            fail(f"command: undefined variable {name!r}{did_you_mean(name, list(variables))}")
    return REF.sub(lambda m: shlex.quote(variables[m.group(1)]), command)


# --------------------------------------------------------------------------- -e NAME=VALUE


def parse_extra_vars(pairs: Sequence[str]) -> dict[str, str]:
    """``-e KEY=VALUE`` (repeatable) -> dict; the last one for a key wins."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise UsageError(f"-e {pair!r}: expected KEY=VALUE")
        if not VAR_NAME.match(key):
            raise UsageError(f"-e {pair!r}: invalid variable name {key!r} "
                             "(letters, digits and '_', not starting with a digit)")
        if "\0" in value:
            raise UsageError(f"-e {key}: NUL character in value")
        out[key] = value
    return out


__all__ = ["PER_HOST", "REF", "SAMPLE_HOST", "VAR_NAME", "PerHost", "PerHostField", "has_per_host",
           "parse_extra_vars", "references", "render_per_host", "substitute", "substitute_per_host",
           "substitute_shell"]
