"""Runbook field values: one validator per value type (seconds, MiB, GPU lists, unit names, URLs...).

Internal to gpufleet.runbook (import from there). Each validator takes the raw YAML value
(variables already substituted) and a ``fail`` that raises the one-line ``UsageError`` naming
file, line and step; it returns the typed value or calls ``fail``. A value that came wholly from
a variable is a ``_Templated`` string, so numbers and booleans may be given as ``-e`` text.
"""
from __future__ import annotations

import math
import re
import urllib.parse
from typing import Any, Callable, NoReturn, Optional

from gpufleet.errors import UsageError
from gpufleet.core.gpus import parse_gpu_list
from gpufleet.config.yamlsource import did_you_mean, plain_string
from gpufleet.config.yamlsource import describe as describe_value

MAX_TIMEOUT_S = 86400.0

# systemd unit names: letters, digits, ":-_.\@"; an instance `name@inst.service` is fine.
_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]+\Z")
UNIT_SUFFIXES = ("service", "scope", "target", "socket", "timer", "mount", "slice", "path")

Fail = Callable[[str], NoReturn]


class _Templated(str):
    """A string that came (wholly) from a variable: numbers may then be written as text."""


def _number(value: Any, fail: Fail, what: str, integer: bool = False) -> float:
    if isinstance(value, _Templated):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            fail(f"expected {what}, got {describe_value(str(value))}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not isinstance(value, int)
    ):
        fail(f"expected {what}, got {describe_value(value)}")
    if not math.isfinite(value):
        fail(f"expected {what}, got {describe_value(value)}")
    return value


def _v_timeout(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a positive number of seconds")
    if not 0 < v <= MAX_TIMEOUT_S:
        fail(f"expected a positive number of seconds (at most {int(MAX_TIMEOUT_S)}), got {value!r}")
    return float(v)


def _v_seconds(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a number of seconds >= 0")
    if not 0 <= v <= MAX_TIMEOUT_S:
        fail(f"expected a number of seconds >= 0 (at most {int(MAX_TIMEOUT_S)}), got {value!r}")
    return float(v)


def _v_mib(value: Any, fail: Fail) -> int:
    v = _number(value, fail, "a whole number of MiB >= 0", integer=True)
    if not 0 <= v <= (1 << 30):
        fail(f"expected a whole number of MiB >= 0, got {value!r}")
    return int(v)


def _v_fraction(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a fraction between 0 and 1")
    if not 0 < v <= 1:
        fail(f"expected a fraction 0 < x <= 1, got {value!r}")
    return float(v)


def _v_bool(value: Any, fail: Fail) -> bool:
    if isinstance(value, _Templated) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        fail(f"expected true or false, got {describe_value(value)}")
    return value


def _v_gpus(value: Any, fail: Fail) -> Optional[tuple[int, ...]]:
    """``all`` (None), ``0-3``, ``0,2,5``, an index, or a list of indices."""
    if isinstance(value, bool):
        fail(f"expected a GPU list like 0-3, 0,2,5 or all, got {describe_value(value)}")
    if isinstance(value, int):
        value = str(value)
    if isinstance(value, list):
        if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            fail("expected a GPU list like 0-3, 0,2,5, all, or a list of indices like [0, 1]")
        value = ",".join(str(v) for v in value)
    if not isinstance(value, str):
        fail(f"expected a GPU list like 0-3, 0,2,5 or all, got {describe_value(value)}")
    try:
        return parse_gpu_list(value)
    except UsageError as exc:
        fail(str(exc).replace("--gpus: ", "", 1))


def unit_name(text: str) -> str:
    """``vllm-kimi`` -> ``vllm-kimi.service``; raises ValueError for anything else than a unit."""
    if not text or len(text) > 255 or text.startswith("-") or not _UNIT.match(text):
        raise ValueError(f"invalid unit name {text!r}: letters, digits and ':-_.\\@' "
                         "(not starting with '-')")
    base, dot, suffix = text.rpartition(".")
    if not dot or suffix not in UNIT_SUFFIXES:
        return text + ".service"
    if not base:
        raise ValueError(f"invalid unit name {text!r}")
    return text


def _v_unit(value: Any, fail: Fail) -> str:
    text = plain_string(value, fail, "a systemd unit name")
    try:
        return unit_name(text)
    except ValueError as exc:
        fail(str(exc))


def _v_units(value: Any, fail: Fail, allow_empty: bool = False) -> tuple[str, ...]:
    """A list of unit names, or one string of names separated by commas or spaces (so one
    variable can carry several, or none: ``-e UNITS=``)."""
    if isinstance(value, str):
        value = [v for v in re.split(r"[,\s]+", value) if v]
    if not isinstance(value, list) or (not value and not allow_empty):
        fail(f"expected a list of unit names (e.g. [vllm-minimax]), got {describe_value(value)}")
    out: dict[str, None] = {}
    for i, item in enumerate(value):
        out.setdefault(_v_unit(item, _sub_fail(fail, f"[{i}]")), None)
    return tuple(out)


def _v_globs(value: Any, fail: Fail) -> tuple[str, ...]:
    """Command-line globs never to signal, added to the host's `protect`."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        fail(f"expected a list of glob strings, got {describe_value(value)}")
    return tuple(dict.fromkeys(plain_string(v, _sub_fail(fail, f"[{i}]"), "a glob string")
                               for i, v in enumerate(value)))


_PROGRAM = re.compile(r"[A-Za-z0-9_./+][A-Za-z0-9_./+-]*\Z")


def _v_program(value: Any, fail: Fail) -> str:
    """A command name or absolute path on the host (one argv word, never shell text)."""
    text = plain_string(value, fail, "a program name or absolute path")
    if len(text) > 4096 or not _PROGRAM.match(text) or ("/" in text and not text.startswith("/")):
        fail(f"invalid program {text!r}: a command name or an absolute path "
             "(letters, digits, '/', '.', '_', '+', '-')")
    return text


def _v_url(value: Any, fail: Fail) -> str:
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


def _v_status(value: Any, fail: Fail) -> int:
    v = _number(value, fail, "an HTTP status code", integer=True)
    if not 100 <= v <= 599:
        fail(f"expected an HTTP status code 100-599, got {value!r}")
    return int(v)


def _v_exit_codes(value: Any, fail: Fail) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        fail("expected an exit code or a list of exit codes")
    out = []
    for item in items:
        v = _number(item, fail, "an exit code 0-255 (or a list of them)", integer=True)
        if not 0 <= v <= 255:
            fail(f"expected an exit code 0-255, got {item!r}")
        out.append(int(v))
    return tuple(sorted(set(out)))


def _v_argv(value: Any, fail: Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        fail(f"expected a non-empty list of arguments, got {describe_value(value)}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            fail(f"[{i}]: expected a string argument, got {describe_value(item)}")
        if "\0" in item:
            fail(f"[{i}]: NUL character in argument")
        out.append(str(item))
    if not out[0]:
        fail("the program (first argument) is empty")
    return tuple(out)


def _v_command(value: Any, fail: Fail) -> str:
    if not isinstance(value, str) or not value.strip():
        fail(f"expected a shell command string, got {describe_value(value)}")
    if "\0" in value:
        fail("NUL character in command")
    return value


def _v_dtype(value: Any, fail: Fail) -> str:
    from gpufleet.core.fit import DTYPE_BYTES

    text = plain_string(value, fail, "a dtype").strip().lower()
    if text not in DTYPE_BYTES:
        fail(f"unknown dtype {value!r}{did_you_mean(text, sorted(DTYPE_BYTES))} "
             f"(known: {', '.join(sorted(DTYPE_BYTES))})")
    return text


def _v_params(value: Any, fail: Fail) -> float:
    """A parameter count as `gpufleet fit --params` reads it: 14B, 7b, 500M, 14e9."""
    from gpufleet.core.fit import parse_params

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        fail(f"expected a parameter count like 14B, 7b or 14e9, got {describe_value(value)}")
    try:
        return parse_params(str(value))
    except UsageError as exc:
        fail(str(exc).replace("--params ", "", 1))


def _v_gib(value: Any, fail: Fail) -> float:
    v = _number(value, fail, "a number of GiB >= 0")
    if not 0 <= v <= 1e6:
        fail(f"expected a number of GiB >= 0, got {value!r}")
    return float(v)


def _v_positive_int(value: Any, fail: Fail) -> int:
    v = _number(value, fail, "a whole number >= 1", integer=True)
    if v < 1 or v > 1024:
        fail(f"expected a whole number 1-1024, got {value!r}")
    return int(v)


def _sub_fail(fail: Fail, where: str) -> Fail:
    def inner(message: str) -> NoReturn:
        fail(f"{where}: {message}")

    return inner

