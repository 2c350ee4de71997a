"""One family of value validators, shared by the inventory (fleet.yaml) and runbooks (pure).

Each validator takes a raw YAML value and a ``fail`` that raises the caller's one-line
``UsageError`` (naming file, line and key); it returns the typed value or calls ``fail``.
The messages are part of the interface: tests and docs quote them.

A value that came wholly from a runbook variable is a ``Templated`` string, so numbers and
booleans may be given as ``-e`` text; the inventory has no variables, so it never sees one.
``one_message=True`` (the inventory's style) says the whole expectation, limits included, for
every kind of mistake; without it a wrong type and a value out of range read differently.
"""
from __future__ import annotations

import math
import re
import urllib.parse
from typing import Any, Callable, NoReturn, Optional, Sequence

from gpufleet.core.gpus import parse_gpu_list
from gpufleet.errors import UsageError

Fail = Callable[[str], NoReturn]

MAX_SECONDS = 86400.0  # any timeout, grace or wait: a day
MAX_MIB = 1 << 30  # any MiB figure
MAX_NAME = 255
# One command name or path, never shell text: the inventory's `python`, a runbook's `systemctl`.
PROGRAM_WORD = re.compile(r"[A-Za-z0-9_./+][A-Za-z0-9_./+-]*\Z")
# systemd unit names: letters, digits, ":-_.\@"; an instance `name@inst.service` is fine.
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\Z")
UNIT_SUFFIXES = ("service", "scope", "target", "socket", "timer", "mount", "slice", "path")


class Templated(str):
    """A string that came (wholly) from a variable: numbers may then be written as text."""


# --------------------------------------------------------------------------- messages


def describe(value: Any) -> str:
    """A YAML value as an operator reads it in a message: ``the integer 5``, ``a mapping``."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"the boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        if len(value) > 80:
            return f"a string of {len(value)} characters"
        return f"the string {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__} value"


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    import difflib  # an error's suggestion only: not paid by every start

    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def sub_fail(fail: Fail, where: str) -> Fail:
    """``fail`` for an item inside a value: ``[2]: ...``."""
    def inner(message: str) -> NoReturn:
        fail(f"{where}: {message}")

    return inner


def _always(fail: Fail, message: str) -> Fail:
    def inner(_ignored: str) -> NoReturn:
        fail(message)

    return inner


# --------------------------------------------------------------------------- text


def has_control(text: str) -> bool:
    """C0/C1 control characters (NUL, newline, ESC, ...): never valid in an operator's value."""
    return any(ord(c) < 32 or ord(c) == 127 or 0x80 <= ord(c) < 0xA0 for c in text)


def plain_string(value: Any, fail: Fail, what: str = "a string") -> str:
    """A non-empty string without control characters, or ``fail`` says what was expected."""
    if not isinstance(value, str):
        fail(f"expected {what}, got {describe(value)}")
    if value == "":
        fail(f"expected {what}, got an empty string")
    if has_control(value):
        fail(f"control characters (NUL, newline, ...) are not allowed: {value!r}")
    return value


def choice(choices: Sequence[str]) -> Callable[[Any, Fail], str]:
    """One of ``choices``, exactly (``'strict' or 'accept-new'``)."""
    def check(value: Any, fail: Fail) -> str:
        expected = " or ".join(repr(c) for c in choices)
        if not isinstance(value, str):
            fail(f"expected {expected}, got {describe(value)}")
        if value not in choices:
            fail(f"invalid value {value!r}: expected {expected}{did_you_mean(value, choices)}")
        return value

    return check


# --------------------------------------------------------------------------- numbers


def number(value: Any, fail: Fail, what: str, integer: bool = False) -> float:
    """A finite int/float (an int when ``integer``), never a boolean; a ``Templated`` string
    is read as one."""
    if isinstance(value, Templated):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            fail(f"expected {what}, got {describe(str(value))}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not isinstance(value, int)
    ):
        fail(f"expected {what}, got {describe(value)}")
    if not math.isfinite(value):
        fail(f"expected {what}, got {describe(value)}")
    return value


def timeout(value: Any, fail: Fail, one_message: bool = False) -> float:
    """Seconds > 0, at most MAX_SECONDS."""
    limit = f"a positive number of seconds (at most {int(MAX_SECONDS)})"
    if one_message:
        fail = _always(fail, f"expected {limit}, got {describe(value)}")
    v = number(value, fail, "a positive number of seconds")
    if not 0 < v <= MAX_SECONDS:
        fail(f"expected {limit}, got {value!r}")
    return float(v)


def seconds(value: Any, fail: Fail) -> float:
    """Seconds >= 0 (a grace, a poll interval), at most MAX_SECONDS."""
    v = number(value, fail, "a number of seconds >= 0")
    if not 0 <= v <= MAX_SECONDS:
        fail(f"expected a number of seconds >= 0 (at most {int(MAX_SECONDS)}), got {value!r}")
    return float(v)


def mib(value: Any, fail: Fail, one_message: bool = False) -> int:
    """A whole number of MiB, 0 to MAX_MIB."""
    what = "a whole number of MiB >= 0"
    if one_message:
        fail = _always(fail, f"expected {what}, got {describe(value)}")
    v = number(value, fail, what, integer=True)
    if not 0 <= v <= MAX_MIB:
        fail(f"expected {what}, got {value!r}")
    return int(v)


def gpu_count(value: Any, fail: Fail) -> int:
    """How many GPUs a host should have (the health gate's expectation), 0 to 1024."""
    what = "a whole number of GPUs >= 0"
    v = number(value, _always(fail, f"expected {what}, got {describe(value)}"), what,
               integer=True)
    if not 0 <= v <= 1024:
        fail(f"expected {what} (at most 1024), got {value!r}")
    return int(v)


def fraction(value: Any, fail: Fail) -> float:
    """0 < x <= 1."""
    v = number(value, fail, "a fraction between 0 and 1")
    if not 0 < v <= 1:
        fail(f"expected a fraction 0 < x <= 1, got {value!r}")
    return float(v)


def boolean(value: Any, fail: Fail) -> bool:
    """true or false (a ``Templated`` 'true'/'false' too)."""
    if isinstance(value, Templated) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        fail(f"expected true or false, got {describe(value)}")
    return value


def http_status(value: Any, fail: Fail) -> int:
    v = number(value, fail, "an HTTP status code", integer=True)
    if not 100 <= v <= 599:
        fail(f"expected an HTTP status code 100-599, got {value!r}")
    return int(v)


def exit_codes(value: Any, fail: Fail) -> tuple[int, ...]:
    """An exit code or a list of them, 0-255, sorted and unique."""
    items = value if isinstance(value, list) else [value]
    if not items:
        fail("expected an exit code or a list of exit codes")
    out = []
    for item in items:
        v = number(item, fail, "an exit code 0-255 (or a list of them)", integer=True)
        if not 0 <= v <= 255:
            fail(f"expected an exit code 0-255, got {item!r}")
        out.append(int(v))
    return tuple(sorted(set(out)))


# --------------------------------------------------------------------------- GPUs, units, programs


def gpu_list(value: Any, fail: Fail) -> Optional[tuple[int, ...]]:
    """``all`` (None), ``0-3``, ``0,2,5``, an index, or a list of indices."""
    if isinstance(value, bool):
        fail(f"expected a GPU list like 0-3, 0,2,5 or all, got {describe(value)}")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, list):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            fail("expected a GPU list like 0-3, 0,2,5, all, or a list of indices like [0, 1]")
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        fail(f"expected a GPU list like 0-3, 0,2,5 or all, got {describe(value)}")
    try:
        return parse_gpu_list(value)
    except UsageError as exc:
        fail(str(exc).replace("--gpus: ", "", 1))


def unit_name(text: str) -> str:
    """``vllm-kimi`` -> ``vllm-kimi.service``; raises ValueError for anything else than a unit."""
    if not text or len(text) > MAX_NAME or text.startswith("-") or not _UNIT.match(text):
        raise ValueError(f"invalid unit name {text!r}: letters, digits and ':-_.\\@' "
                         "(not starting with '-')")
    base, dot, suffix = text.rpartition(".")
    if not dot or suffix not in UNIT_SUFFIXES:
        return text + ".service"
    if not base:
        raise ValueError(f"invalid unit name {text!r}")
    return text


def unit(value: Any, fail: Fail) -> str:
    text = plain_string(value, fail, "a systemd unit name")
    try:
        return unit_name(text)
    except ValueError as exc:
        fail(str(exc))


def units(value: Any, fail: Fail, allow_empty: bool = False) -> tuple[str, ...]:
    """A list of unit names, or one string of names separated by commas or spaces (so one
    variable can carry several, or none: ``-e UNITS=``)."""
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    if not isinstance(value, list) or (not value and not allow_empty):
        fail(f"expected a list of unit names (e.g. [vllm-minimax]), got {describe(value)}")
    out: dict[str, None] = {}
    for i, item in enumerate(value):
        out.setdefault(unit(item, sub_fail(fail, f"[{i}]")), None)
    return tuple(out)


def globs(value: Any, fail: Fail) -> tuple[str, ...]:
    """Command-line globs (a string or a list of them), unique, in order."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        fail(f"expected a list of glob strings, got {describe(value)}")
    return tuple(dict.fromkeys(plain_string(v, sub_fail(fail, f"[{i}]"), "a glob string")
                               for i, v in enumerate(value)))


def program(value: Any, fail: Fail) -> str:
    """A command name or absolute path on the host (one argv word, never shell text)."""
    text = plain_string(value, fail, "a program name or absolute path")
    if len(text) > 4096 or not PROGRAM_WORD.match(text) or ("/" in text and not text.startswith("/")):
        fail(f"invalid program {text!r}: a command name or an absolute path "
             "(letters, digits, '/', '.', '_', '+', '-')")
    return text


def url(value: Any, fail: Fail) -> str:
    """An http:// or https:// URL with a host (fetched on the host itself)."""
    text = plain_string(value, fail, "an http:// or https:// URL")
    if any(c.isspace() for c in text):
        fail(f"invalid URL {text!r}: no spaces")
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(f"invalid URL {text!r}: expected http://HOST[:PORT]/PATH (fetched on the host)")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        fail(f"invalid URL {text!r}: bad port")
    return text


def argv(value: Any, fail: Fail) -> tuple[str, ...]:
    """A non-empty list of arguments (numbers become text), no NUL, the program not empty."""
    if not isinstance(value, list) or not value:
        fail(f"expected a non-empty list of arguments, got {describe(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            fail(f"[{i}]: expected a string argument, got {describe(item)}")
        if "\0" in item:
            fail(f"[{i}]: NUL character in argument")
        out.append(str(item))
    if not out[0]:
        fail("the program (first argument) is empty")
    return tuple(out)


def exec_prefix(value: Any, fail: Fail) -> tuple[str, ...]:
    """``connection: exec``'s argv prefix: a non-empty list of strings without control
    characters (each is one argument of a local command: never shell text)."""
    if not isinstance(value, list) or not value:
        fail("expected a non-empty list of strings, e.g. [docker, exec, -i, CONTAINER], "
             f"got {describe(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            fail(f"[{i}]: expected a string, got {describe(item)} (quote it: '{item}')")
        if not item or has_control(item):
            fail(f"[{i}]: {'an empty argument' if not item else 'a control character'}"
                 " is not allowed")
    return tuple(value)


def shell_command(value: Any, fail: Fail) -> str:
    """Shell text for ``sh -c`` (variables in it were shlex-quoted at load time)."""
    if not isinstance(value, str) or not value.strip():
        fail(f"expected a shell command string, got {describe(value)}")
    if "\0" in value:
        fail("NUL character in command")
    return value


__all__ = [
    "MAX_MIB", "MAX_NAME", "MAX_SECONDS", "PROGRAM_WORD", "UNIT_SUFFIXES", "Fail", "Templated",
    "argv", "boolean", "choice", "describe", "did_you_mean", "exit_codes", "fraction",
    "globs", "gpu_list", "has_control", "http_status", "mib", "number", "plain_string",
    "program", "seconds", "shell_command", "sub_fail", "timeout", "unit", "unit_name", "units",
    "url",
]
